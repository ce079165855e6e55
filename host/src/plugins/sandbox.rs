//! What a plugin's WASI sees of the world: random streams restarted from a fixed seed at every
//! call, and clocks that stand still.
//!
//! Tokens must depend only on a request and the deployment, so nothing a plugin can read may
//! vary between runs. `wasi:random` serves a whole batch in one call and cannot be tied to a
//! row, so it is one fixed stream per call: a plugin that draws from it gets the same numbers
//! for the same call, whatever ran before. A sampler's per-row randomness comes from the
//! request's seed and position (the SDK's `RowRng`), not from here. The system's entropy and
//! its clocks are never handed to a plugin; time a policy needs comes in its inputs.

use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand_wasi::rngs::StdRng;
use rand_wasi::{SeedableRng, TryRng};
use wasmtime_wasi::{HostMonotonicClock, HostWallClock, WasiCtx};

/// The seed of every call's stream (and what `wasi:random/insecure-seed` returns).
const CALL_SEED: u64 = 0x706c_7567_686f_7374;

/// A WASI context with the standard error inherited (plugins log there), deterministic
/// randomness and still clocks; and the handle that restarts its random streams.
pub(crate) fn deterministic_wasi() -> (WasiCtx, CallRandom) {
    let random = CallRandom::new();
    let ctx = WasiCtx::builder()
        .inherit_stderr()
        .secure_random(random.clone())
        .insecure_random(random.insecure())
        .insecure_random_seed(u128::from(CALL_SEED))
        .wall_clock(StillClock)
        .monotonic_clock(StillClock)
        .build();
    (ctx, random)
}

/// The random streams of one store; [`CallRandom::restart`] at the start of every call.
#[derive(Clone)]
pub(crate) struct CallRandom {
    stream: Arc<Mutex<StdRng>>,
    /// `wasi:random/insecure` draws from its own stream, so mixing the two interfaces within a
    /// call does not shift either.
    insecure: Arc<Mutex<StdRng>>,
}

impl CallRandom {
    fn new() -> CallRandom {
        CallRandom {
            stream: Arc::new(Mutex::new(StdRng::seed_from_u64(CALL_SEED))),
            insecure: Arc::new(Mutex::new(StdRng::seed_from_u64(!CALL_SEED))),
        }
    }

    fn insecure(&self) -> CallRandom {
        CallRandom {
            stream: self.insecure.clone(),
            insecure: self.stream.clone(),
        }
    }

    /// Puts both streams back at their start.
    pub(crate) fn restart(&self) {
        *self.stream.lock().unwrap_or_else(PoisonError::into_inner) =
            StdRng::seed_from_u64(CALL_SEED);
        *self.insecure.lock().unwrap_or_else(PoisonError::into_inner) =
            StdRng::seed_from_u64(!CALL_SEED);
    }

    fn with<R>(&mut self, draw: impl FnOnce(&mut StdRng) -> R) -> R {
        draw(&mut self.stream.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl TryRng for CallRandom {
    type Error = Infallible;

    fn try_next_u32(&mut self) -> Result<u32, Infallible> {
        self.with(|rng| rng.try_next_u32())
    }

    fn try_next_u64(&mut self) -> Result<u64, Infallible> {
        self.with(|rng| rng.try_next_u64())
    }

    fn try_fill_bytes(&mut self, dst: &mut [u8]) -> Result<(), Infallible> {
        self.with(|rng| rng.try_fill_bytes(dst))
    }
}

/// Wall and monotonic time for plugins: the Unix epoch, and zero, always.
struct StillClock;

impl HostWallClock for StillClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl HostMonotonicClock for StillClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }

    fn now(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use rand_wasi::Rng;

    use super::*;

    #[test]
    fn every_call_draws_the_same_numbers() {
        let (_ctx, random) = deterministic_wasi();
        let mut stream = random.clone();
        let first: Vec<u64> = (0..4).map(|_| stream.next_u64()).collect();
        let later: Vec<u64> = (0..4).map(|_| stream.next_u64()).collect();
        assert_ne!(first, later, "a stream moves on within a call");
        random.restart();
        let again: Vec<u64> = (0..4).map(|_| stream.next_u64()).collect();
        assert_eq!(first, again, "a restarted stream repeats itself");
        let mut insecure = random.insecure();
        assert_ne!(
            insecure.next_u64(),
            first[0],
            "the two interfaces have their own streams"
        );
    }
}
