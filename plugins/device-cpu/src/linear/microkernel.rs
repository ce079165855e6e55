//! The register-blocked microkernel: up to [`MR`] tokens by the [`NR`] outputs of one packed tile, one fused multiply-add per token, output and `k`, in `k` order.
//!
//! Every output element of one K block gets exactly `acc = 0; for k in 0..kc { acc =
//! fma(x[k], w[k], acc) }`, then `out = acc` for the first block and `out = out + acc` for the
//! others. Which token of the group, which lane and which kernel computes it changes nothing:
//! an FMA is one correctly rounded operation, in a vector lane or in `f32::mul_add` alike, and
//! so is the add.

use super::tile::NR;

/// Tokens per microkernel call: 12 accumulators, two weight vectors and one broadcast fill 15
/// of the 16 ymm registers, and 12 independent FMA chains cover the FMA latency.
pub const MR: usize = 6;

/// The instruction set the kernels run on, chosen once per launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX2 and FMA, with F16C for widening f16.
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    Portable,
}

impl Isa {
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            return Isa::Avx2Fma;
        }
        Isa::Portable
    }
}

/// One microkernel call: `out[m][j] (+)= Σ_k x[m][k] · tile[k][j]` for `m < tokens`,
/// `j < NR`, the sum taken in `k` order.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// Tokens in the group, `1..=MR`.
    pub tokens: usize,
    /// `k` steps: rows of the tile and elements read from each token row of `x`.
    pub kc: usize,
    /// The packed tile, `kc * NR` f32s.
    pub tile: *const f32,
    /// Element `k0` of the group's first token row.
    pub x: *const f32,
    pub x_stride: usize,
    /// Element `[t, n0]` of the output block, `NR` wide per token.
    pub out: *mut f32,
    pub out_stride: usize,
    /// Overwrite `out` (the first K block) rather than add to the sums of earlier blocks.
    pub first: bool,
}

/// # Safety
/// `call.tokens` is in `1..=MR`; the tile holds `kc * NR` f32s; for every `m < tokens`,
/// `x + m * x_stride` has `kc` readable f32s and `out + m * out_stride` has `NR` f32s that no
/// other thread touches during the call; `isa` is supported by this CPU ([`Isa::detect`]).
pub unsafe fn run(isa: Isa, call: &Call) {
    macro_rules! by_tokens {
        ($kernel:ident) => {
            match call.tokens {
                1 => $kernel::<1>(call),
                2 => $kernel::<2>(call),
                3 => $kernel::<3>(call),
                4 => $kernel::<4>(call),
                5 => $kernel::<5>(call),
                6 => $kernel::<6>(call),
                other => unreachable!("a microkernel call for {other} tokens"),
            }
        };
    }
    const _: () = assert!(MR == 6, "`run` dispatches on 1..=6 tokens");
    // SAFETY: the caller's contract.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => by_tokens!(avx2_fma),
            Isa::Portable => by_tokens!(portable),
        }
    }
}

/// # Safety
/// As [`run`].
unsafe fn portable<const M: usize>(call: &Call) {
    let mut acc = [[0.0f32; NR]; M];
    // SAFETY (all blocks): the bounds of [`run`]'s contract.
    let tile = unsafe { std::slice::from_raw_parts(call.tile, call.kc * NR) };
    for (k, w) in tile.chunks_exact(NR).enumerate() {
        for (m, lanes) in acc.iter_mut().enumerate() {
            let x = unsafe { *call.x.add(m * call.x_stride + k) };
            for (lane, &w) in lanes.iter_mut().zip(w) {
                *lane = x.mul_add(w, *lane);
            }
        }
    }
    for (m, lanes) in acc.iter().enumerate() {
        let out = unsafe { std::slice::from_raw_parts_mut(call.out.add(m * call.out_stride), NR) };
        for (out, &sum) in out.iter_mut().zip(lanes) {
            *out = if call.first { sum } else { *out + sum };
        }
    }
}

/// Lanes 0..8 of each token's sums in `low`, 8..16 in `high`.
///
/// # Safety
/// As [`run`], and the CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_fma<const M: usize>(call: &Call) {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps,
        _mm256_storeu_ps,
    };
    let (mut low, mut high) = ([_mm256_setzero_ps(); M], [_mm256_setzero_ps(); M]);
    // SAFETY (all blocks): the bounds of [`run`]'s contract.
    unsafe {
        let (mut w, mut x) = (call.tile, call.x);
        for _ in 0..call.kc {
            let (w_low, w_high) = (_mm256_loadu_ps(w), _mm256_loadu_ps(w.add(8)));
            for m in 0..M {
                let x_m = _mm256_broadcast_ss(&*x.add(m * call.x_stride));
                low[m] = _mm256_fmadd_ps(x_m, w_low, low[m]);
                high[m] = _mm256_fmadd_ps(x_m, w_high, high[m]);
            }
            w = w.add(NR);
            x = x.add(1);
        }
        for m in 0..M {
            let out = call.out.add(m * call.out_stride);
            if !call.first {
                low[m] = _mm256_add_ps(_mm256_loadu_ps(out), low[m]);
                high[m] = _mm256_add_ps(_mm256_loadu_ps(out.add(8)), high[m]);
            }
            _mm256_storeu_ps(out, low[m]);
            _mm256_storeu_ps(out.add(8), high[m]);
        }
    }
}
