//! AVX-512 building blocks the kernels share: one vector's lanes summed, and `exp`.
//!
//! Each sums or evaluates in one fixed order, so results never depend on where a value sits
//! in a batch.

use std::arch::x86_64::{
    __m512, _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_movehl_ps, _mm_shuffle_ps, _mm256_add_ps,
    _mm256_castps256_ps128, _mm256_extractf128_ps, _mm512_castps512_ps256, _mm512_extractf32x8_ps,
    _mm512_fmadd_ps, _mm512_max_ps, _mm512_mul_ps, _mm512_roundscale_ps, _mm512_scalef_ps,
    _mm512_set1_ps,
};

/// The 16 lanes of `v` added as `((l + l⊕8) + (l + l⊕4)) …`: halves, then quarters, then
/// pairs, always the same tree.
///
/// # Safety
/// The CPU has AVX-512 F and DQ (isa level `avx512`).
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
pub fn reduce(v: __m512) -> f32 {
    let eight = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
    let four = _mm_add_ps(
        _mm256_castps256_ps128(eight),
        _mm256_extractf128_ps::<1>(eight),
    );
    let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps::<1>(two, two)))
}

/// `exp(x)` for 16 lanes, within 2 ulp for `x` in [-87, 88] (scores minus their maximum,
/// SiLU's `-g`), the value at -87 below and infinity above: `2^n · p(r)` with `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`.
///
/// # Safety
/// The CPU has AVX-512 F and DQ (isa level `avx512`).
#[inline]
#[target_feature(enable = "avx512f")]
pub fn exp(x: __m512) -> __m512 {
    let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
    let n = _mm512_roundscale_ps::<0>(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)));
    // ln 2 in two parts, so `n · ln2_hi` is exact.
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693_359_4), x);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.121_944_4e-4), r);
    // Taylor coefficients 1/k! up to k = 6.
    let mut p = _mm512_set1_ps(1.0 / 720.0);
    for coefficient in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(coefficient));
    }
    _mm512_scalef_ps(p, n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::{Isa, IsaLevel};
    use crate::test_support::noise;
    use std::arch::x86_64::_mm512_loadu_ps;

    #[test]
    fn exp_is_close() {
        if !Isa::detect().has(IsaLevel::Avx512) {
            return;
        }
        let xs: [f32; 16] = std::array::from_fn(|i| -(i as f32) * 5.7 - noise(9, i).abs());
        // SAFETY: the CPU has AVX-512 (checked above).
        let got: [f32; 16] = unsafe { std::mem::transmute(exp(_mm512_loadu_ps(xs.as_ptr()))) };
        for (x, got) in xs.iter().zip(got) {
            let want = f64::from(*x).exp();
            assert!(
                (f64::from(got) - want).abs() <= 4.0 * f64::from(f32::EPSILON) * want,
                "exp({x}) = {got}, expected {want}"
            );
        }
    }
}
