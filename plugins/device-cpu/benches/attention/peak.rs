//! The machine's arithmetic rate: tight loops of independent `vdpbf16ps` (bf16 pairs) or f32 FMAs on every thread, the ceiling prefill attention is measured against.

use std::hint::black_box;
use std::time::Instant;

/// Independent accumulators per loop: more than latency times throughput, so the loop waits
/// on the execution ports, not on one dependency chain.
#[cfg(target_arch = "x86_64")]
const CHAINS: usize = 16;

/// Instructions per accumulator per call: long enough that the call's overhead vanishes.
#[cfg(target_arch = "x86_64")]
const ROUNDS: u64 = 1 << 16;

/// Which products the rate counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Products {
    /// `vdpbf16ps` on 512-bit vectors: 32 bf16 pairs, 64 flops per instruction.
    Bf16,
    /// f32 FMAs on the widest vectors the CPU has (16 or 8 lanes, 2 flops each).
    F32,
}

impl Products {
    /// Flops per instruction and the loop that runs `ROUNDS * CHAINS` of them, where the CPU
    /// has the instructions.
    #[cfg(target_arch = "x86_64")]
    fn kernel(self) -> Option<(f64, fn() -> f32)> {
        match self {
            Products::Bf16 if std::is_x86_feature_detected!("avx512bf16") => {
                Some((64.0, bf16_loop_checked))
            }
            Products::Bf16 => None,
            Products::F32 if std::is_x86_feature_detected!("avx512f") => {
                Some((32.0, f32_loop_512_checked))
            }
            Products::F32
                if std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma") =>
            {
                Some((16.0, f32_loop_256_checked))
            }
            Products::F32 => None,
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn kernel(self) -> Option<(f64, fn() -> f32)> {
        None
    }

    /// The best of `passes` passes of the loop on `threads` threads at once, in flops per
    /// second; `None` where the CPU lacks the instructions.
    pub fn rate(self, threads: usize, passes: usize) -> Option<f64> {
        let (flops_per_instruction, kernel) = self.kernel()?;
        let calls = 8;
        let mut best: f64 = 0.0;
        for _ in 0..passes {
            let start = Instant::now();
            std::thread::scope(|scope| {
                for _ in 0..threads {
                    scope.spawn(move || {
                        for _ in 0..calls {
                            black_box(kernel());
                        }
                    });
                }
            });
            let instructions = (threads * calls) as f64 * instructions_per_call();
            best = best.max(instructions * flops_per_instruction / start.elapsed().as_secs_f64());
        }
        Some(best)
    }
}

#[cfg(target_arch = "x86_64")]
fn instructions_per_call() -> f64 {
    (ROUNDS * CHAINS as u64) as f64
}

#[cfg(not(target_arch = "x86_64"))]
fn instructions_per_call() -> f64 {
    0.0
}

#[cfg(target_arch = "x86_64")]
fn bf16_loop_checked() -> f32 {
    // SAFETY: chosen by `Products::kernel` only where the CPU has AVX-512 BF16.
    unsafe { bf16_loop() }
}

#[cfg(target_arch = "x86_64")]
fn f32_loop_512_checked() -> f32 {
    // SAFETY: chosen by `Products::kernel` only where the CPU has AVX-512 F.
    unsafe { f32_loop_512() }
}

#[cfg(target_arch = "x86_64")]
fn f32_loop_256_checked() -> f32 {
    // SAFETY: chosen by `Products::kernel` only where the CPU has AVX2 and FMA.
    unsafe { f32_loop_256() }
}

/// # Safety
/// The CPU has AVX-512 F and BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn bf16_loop() -> f32 {
    use std::arch::x86_64::{
        __m512bh, _mm512_cvtne2ps_pbh, _mm512_dpbf16_ps, _mm512_reduce_add_ps, _mm512_set1_ps,
        _mm512_setzero_ps,
    };
    let a: __m512bh = _mm512_cvtne2ps_pbh(
        _mm512_set1_ps(black_box(1e-3)),
        _mm512_set1_ps(black_box(1e-3)),
    );
    let b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(black_box(1.0)), _mm512_set1_ps(1.0));
    let mut acc = [_mm512_setzero_ps(); CHAINS];
    for _ in 0..ROUNDS {
        for acc in &mut acc {
            *acc = _mm512_dpbf16_ps(*acc, a, b);
        }
    }
    acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
}

/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn f32_loop_512() -> f32 {
    use std::arch::x86_64::{_mm512_fmadd_ps, _mm512_reduce_add_ps, _mm512_set1_ps};
    let (a, b) = (
        _mm512_set1_ps(black_box(1e-3)),
        _mm512_set1_ps(black_box(1.0)),
    );
    let mut acc = [_mm512_set1_ps(0.0); CHAINS];
    for _ in 0..ROUNDS {
        for acc in &mut acc {
            *acc = _mm512_fmadd_ps(a, b, *acc);
        }
    }
    acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
}

/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn f32_loop_256() -> f32 {
    use std::arch::x86_64::{_mm256_fmadd_ps, _mm256_set1_ps, _mm256_storeu_ps};
    let (a, b) = (
        _mm256_set1_ps(black_box(1e-3)),
        _mm256_set1_ps(black_box(1.0)),
    );
    let mut acc = [_mm256_set1_ps(0.0); CHAINS];
    for _ in 0..ROUNDS {
        for acc in &mut acc {
            *acc = _mm256_fmadd_ps(a, b, *acc);
        }
    }
    let mut lanes = [0.0f32; 8];
    let mut total = 0.0;
    for v in acc {
        // SAFETY: `lanes` holds 8 f32s.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        total += lanes.iter().sum::<f32>();
    }
    total
}
