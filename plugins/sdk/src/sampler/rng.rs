//! A sequence's random numbers: a stream that is a pure function of (seed, position).
//!
//! The stream is keyed by the sequence's position instead of being advanced call by call, so
//! a request gets the same numbers whatever batch, row or step it lands in, and a replay with
//! the same seed gives the same tokens. A sampler that draws only from [`RowRng`] is
//! reproducible without trying; the host's `wasi:random` is not tied to a row and must not be
//! used for that.

/// SplitMix64's increment (the golden ratio in 64 bits).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijection on `u64` with full avalanche.
const fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The random stream of one sequence at one position (SplitMix64 from a keyed start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowRng {
    state: u64,
}

impl RowRng {
    pub fn new(seed: u64, position: u32) -> RowRng {
        // Mixing the position first spreads it over all 64 bits, so seed and position cannot
        // cancel each other; `mix` is a bijection, so two seeds at one position always start
        // two different streams.
        RowRng {
            state: seed ^ mix(u64::from(position).wrapping_add(GAMMA)),
        }
    }

    /// The stream's next draw.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Uniform {
        self.state = self.state.wrapping_add(GAMMA);
        Uniform {
            bits: mix(self.state),
        }
    }
}

/// One uniform draw, read at the precision the caller needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uniform {
    bits: u64,
}

impl Uniform {
    /// The first draw of `(seed, position)`'s stream: what a sampler that needs one number per
    /// token uses.
    pub fn new(seed: u64, position: u32) -> Uniform {
        RowRng::new(seed, position).next()
    }

    /// The draw in [0, 1) with 24 bits, each value exact in `f32` (so never 1.0).
    pub fn as_f32(self) -> f32 {
        (self.bits >> 40) as f32 / (1u64 << 24) as f32
    }

    /// The draw in [0, 1) with 53 bits.
    pub fn as_f64(self) -> f64 {
        (self.bits >> 11) as f64 / (1u64 << 53) as f64
    }

    /// All 64 bits.
    pub fn as_u64(self) -> u64 {
        self.bits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_stay_in_the_unit_interval() {
        for (seed, position) in [(0, 0), (u64::MAX, u32::MAX), (42, 7), (1 << 63, 1)] {
            let u = Uniform::new(seed, position);
            assert!((0.0..1.0).contains(&u.as_f32()), "{seed} {position}");
            assert!((0.0..1.0).contains(&u.as_f64()), "{seed} {position}");
        }
    }

    #[test]
    fn draws_depend_on_seed_and_position_only() {
        assert_eq!(Uniform::new(7, 3), Uniform::new(7, 3));
        assert_ne!(Uniform::new(7, 3), Uniform::new(8, 3));
        assert_ne!(Uniform::new(7, 3), Uniform::new(7, 4));
        let mut a = RowRng::new(7, 3);
        let mut b = RowRng::new(7, 3);
        let first = a.next();
        assert_eq!(first, b.next());
        assert_ne!(first, a.next(), "a stream moves on");
    }

    #[test]
    fn the_first_draw_is_splitmix64_of_the_keyed_start() {
        // SplitMix64 seeded with 0 first outputs 0xE220A8397B1DCDAF (its published sequence).
        assert_eq!(mix(GAMMA), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn draws_are_roughly_uniform() {
        let mut counts = [0u32; 10];
        for position in 0..10_000 {
            let bucket = (Uniform::new(1234, position).as_f64() * 10.0) as usize;
            counts[bucket] += 1;
        }
        for count in counts {
            assert!((900..1100).contains(&count), "{counts:?}");
        }
        let mut rng = RowRng::new(99, 0);
        let mut counts = [0u32; 10];
        for _ in 0..10_000 {
            counts[(rng.next().as_f64() * 10.0) as usize] += 1;
        }
        for count in counts {
            assert!((900..1100).contains(&count), "{counts:?}");
        }
    }
}
