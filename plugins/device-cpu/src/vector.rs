//! Row and vector primitives the kernels' inner loops run: the f32 dot product, `y += a·x`, and (in `avx512` and `avx2`) lane sums and `exp`.
//!
//! Each has a portable body that LLVM vectorizes for the baseline target (SSE2 on x86-64) and,
//! on x86-64 CPUs with AVX2, an AVX2 version picked at run time, so a library built for any
//! x86-64 still uses 256-bit vectors: intrinsics for the dot product (the auto-vectorizer
//! handles its reduction poorly), the portable body recompiled for axpy. The AVX2 dot product
//! keeps the portable body's 16 partial sums, in the same order and without fused
//! multiply-add, so results do not depend on the CPU.

use crate::isa::Isa;
#[cfg(target_arch = "x86_64")]
use crate::isa::IsaLevel;

/// Independent partial sums per dot product: enough to keep the vector units busy and to
/// vectorize at all (a single running sum must be evaluated in order).
const LANES: usize = 16;

/// `Σ a[i]·b[i]` over the common length.
#[inline]
pub fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.has(IsaLevel::Avx2) {
        // SAFETY: the level has AVX2 (checked just above).
        return unsafe { x86::dot_avx2(a, b) };
    }
    let _ = isa;
    dot_portable(a, b)
}

/// `y[i] += alpha · x[i]` over the common length.
#[inline]
pub fn axpy(isa: Isa, y: &mut [f32], alpha: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.has(IsaLevel::Avx2) {
        // SAFETY: the level has AVX2 (checked just above).
        return unsafe { x86::axpy_avx2(y, alpha, x) };
    }
    let _ = isa;
    axpy_portable(y, alpha, x)
}

/// The shared body: `LANES` partial sums, then a pairwise reduction.
#[inline(always)]
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let len = a.len().min(b.len());
    let (a_chunks, a_tail) = a[..len].as_chunks::<LANES>();
    let (b_chunks, b_tail) = b[..len].as_chunks::<LANES>();
    let mut partial = [0.0f32; LANES];
    for (a, b) in a_chunks.iter().zip(b_chunks) {
        for (sum, (&a, &b)) in partial.iter_mut().zip(a.iter().zip(b)) {
            *sum += a * b;
        }
    }
    finish_dot(partial, a_tail, b_tail)
}

/// Adds the elements past the last whole chunk to the first partial sums, then reduces
/// pairwise, so the last additions combine sums of similar size.
///
/// Not inlined: inlined, the reduction's lane pattern leads LLVM's SLP vectorizer to shuffle
/// the partial sums inside the main loop, which then runs at scalar speed.
#[inline(never)]
fn finish_dot(mut partial: [f32; LANES], a_tail: &[f32], b_tail: &[f32]) -> f32 {
    for (lane, (&a, &b)) in a_tail.iter().zip(b_tail).enumerate() {
        partial[lane] += a * b;
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for lane in 0..width {
            partial[lane] += partial[lane + width];
        }
    }
    partial[0]
}

#[inline(always)]
fn axpy_portable(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 versions of the portable bodies. The dot product keeps lanes 0..8 of the partial
    //! sums in `low` and lanes 8..16 in `high`, updated in the portable body's order, then
    //! finishes with the same scalar tail and reduction.

    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };

    use super::{LANES, finish_dot};

    #[target_feature(enable = "avx2")]
    pub fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let len = a.len().min(b.len());
        let (a_chunks, a_tail) = a[..len].as_chunks::<LANES>();
        let (b_chunks, b_tail) = b[..len].as_chunks::<LANES>();
        let (mut low, mut high) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (a, b) in a_chunks.iter().zip(b_chunks) {
            // SAFETY: every load reads 8 elements inside one 16-element chunk, unaligned.
            unsafe {
                let (a_low, a_high) = (
                    _mm256_loadu_ps(a.as_ptr()),
                    _mm256_loadu_ps(a[8..].as_ptr()),
                );
                let (b_low, b_high) = (
                    _mm256_loadu_ps(b.as_ptr()),
                    _mm256_loadu_ps(b[8..].as_ptr()),
                );
                low = _mm256_add_ps(low, _mm256_mul_ps(a_low, b_low));
                high = _mm256_add_ps(high, _mm256_mul_ps(a_high, b_high));
            }
        }
        let mut partial = [0.0f32; LANES];
        // SAFETY: `partial` has room for two 8-lane stores.
        unsafe {
            _mm256_storeu_ps(partial.as_mut_ptr(), low);
            _mm256_storeu_ps(partial.as_mut_ptr().add(8), high);
        }
        finish_dot(partial, a_tail, b_tail)
    }

    #[target_feature(enable = "avx2")]
    pub fn axpy_avx2(y: &mut [f32], alpha: f32, x: &[f32]) {
        super::axpy_portable(y, alpha, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_level_gives_the_portable_results() {
        for isa in Isa::every() {
            for len in [0, 1, 15, 16, 17, 100, 1027] {
                let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
                let b: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
                assert_eq!(dot(isa, &a, &b), dot_portable(&a, &b), "{isa:?} {len}");
                let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| f64::from(x * y)).sum();
                assert!((f64::from(dot(isa, &a, &b)) - exact).abs() < 1e-4, "{len}");

                let (mut y, mut y_portable) = (b.clone(), b.clone());
                axpy(isa, &mut y, 0.5, &a);
                axpy_portable(&mut y_portable, 0.5, &a);
                assert_eq!(y, y_portable, "{isa:?} {len}");
            }
        }
    }

    #[test]
    fn integer_sums_are_exact() {
        for isa in Isa::every() {
            for len in [0usize, 1, 15, 16, 17, 100] {
                let a: Vec<f32> = (0..len).map(|i| i as f32).collect();
                let expected = (len * len.saturating_sub(1)) as f32;
                assert_eq!(dot(isa, &a, &vec![2.0; len]), expected, "{isa:?} {len}");
            }
        }
    }
}
