//! The machine's arithmetic rate: tight loops of independent `vdpbf16ps` (bf16 pairs) or f32 FMAs on every thread, the ceiling prefill attention is measured against.

#[cfg(target_arch = "x86_64")]
use std::hint::black_box;
use std::time::Instant;

/// Independent accumulators per loop (`chains!` writes them out): more than latency times
/// throughput, so the loop waits on the execution ports, not on one dependency chain.
#[cfg(target_arch = "x86_64")]
const CHAINS: usize = 12;

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
    fn kernel(self) -> Option<(f64, fn())> {
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
    fn kernel(self) -> Option<(f64, fn())> {
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
                            kernel();
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

/// Never reached: no loop runs where `Products::kernel` finds none.
#[cfg(not(target_arch = "x86_64"))]
fn instructions_per_call() -> f64 {
    0.0
}

#[cfg(target_arch = "x86_64")]
fn bf16_loop_checked() {
    // SAFETY: chosen by `Products::kernel` only where the CPU has AVX-512 BF16.
    unsafe { bf16_loop() }
}

#[cfg(target_arch = "x86_64")]
fn f32_loop_512_checked() {
    // SAFETY: chosen by `Products::kernel` only where the CPU has AVX-512 F.
    unsafe { f32_loop_512() }
}

#[cfg(target_arch = "x86_64")]
fn f32_loop_256_checked() {
    // SAFETY: chosen by `Products::kernel` only where the CPU has AVX2 and FMA.
    unsafe { f32_loop_256() }
}

/// The loop every rate runs: `ROUNDS` times `CHAINS` independent instructions `op` (an
/// Intel-syntax mnemonic taking `acc, a, b`) over accumulators `zmm0`..`zmm11` or
/// `ymm0`..`ymm11` (`reg`, of register class `class`), cleared first; in assembly, so the
/// compiler can neither shuffle the accumulators through memory nor drop the work.
#[cfg(target_arch = "x86_64")]
macro_rules! chains {
    ($op:literal, $reg:literal, $class:ident, $a:expr, $b:expr) => {
        // SAFETY: only registers the block names as clobbered are written; no memory is
        // touched; the caller's target features cover the instructions.
        unsafe {
            std::arch::asm!(
                concat!("vxorps ", $reg, "0, ", $reg, "0, ", $reg, "0"),
                concat!("vxorps ", $reg, "1, ", $reg, "1, ", $reg, "1"),
                concat!("vxorps ", $reg, "2, ", $reg, "2, ", $reg, "2"),
                concat!("vxorps ", $reg, "3, ", $reg, "3, ", $reg, "3"),
                concat!("vxorps ", $reg, "4, ", $reg, "4, ", $reg, "4"),
                concat!("vxorps ", $reg, "5, ", $reg, "5, ", $reg, "5"),
                concat!("vxorps ", $reg, "6, ", $reg, "6, ", $reg, "6"),
                concat!("vxorps ", $reg, "7, ", $reg, "7, ", $reg, "7"),
                concat!("vxorps ", $reg, "8, ", $reg, "8, ", $reg, "8"),
                concat!("vxorps ", $reg, "9, ", $reg, "9, ", $reg, "9"),
                concat!("vxorps ", $reg, "10, ", $reg, "10, ", $reg, "10"),
                concat!("vxorps ", $reg, "11, ", $reg, "11, ", $reg, "11"),
                "2:",
                concat!($op, " ", $reg, "0, {a}, {b}"),
                concat!($op, " ", $reg, "1, {a}, {b}"),
                concat!($op, " ", $reg, "2, {a}, {b}"),
                concat!($op, " ", $reg, "3, {a}, {b}"),
                concat!($op, " ", $reg, "4, {a}, {b}"),
                concat!($op, " ", $reg, "5, {a}, {b}"),
                concat!($op, " ", $reg, "6, {a}, {b}"),
                concat!($op, " ", $reg, "7, {a}, {b}"),
                concat!($op, " ", $reg, "8, {a}, {b}"),
                concat!($op, " ", $reg, "9, {a}, {b}"),
                concat!($op, " ", $reg, "10, {a}, {b}"),
                concat!($op, " ", $reg, "11, {a}, {b}"),
                "dec {n}",
                "jnz 2b",
                n = inout(reg) ROUNDS => _,
                a = in($class) $a,
                b = in($class) $b,
                out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
                out("xmm4") _, out("xmm5") _, out("xmm6") _, out("xmm7") _,
                out("xmm8") _, out("xmm9") _, out("xmm10") _, out("xmm11") _,
                options(nomem, nostack),
            )
        }
    };
}

/// # Safety
/// The CPU has AVX-512 F and BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn bf16_loop() {
    use std::arch::x86_64::_mm512_set1_ps;
    let (a, b) = (_mm512_set1_ps(black_box(1e-3)), _mm512_set1_ps(1.0));
    chains!("vdpbf16ps", "zmm", zmm_reg, a, b);
}

/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn f32_loop_512() {
    use std::arch::x86_64::_mm512_set1_ps;
    let (a, b) = (_mm512_set1_ps(black_box(1e-3)), _mm512_set1_ps(1.0));
    chains!("vfmadd231ps", "zmm", zmm_reg, a, b);
}

/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn f32_loop_256() {
    use std::arch::x86_64::_mm256_set1_ps;
    let (a, b) = (_mm256_set1_ps(black_box(1e-3)), _mm256_set1_ps(1.0));
    chains!("vfmadd231ps", "ymm", ymm_reg, a, b);
}
