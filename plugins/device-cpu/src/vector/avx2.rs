//! AVX2 building blocks the kernels share: `exp` over eight lanes.

use std::arch::x86_64::{
    __m256, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT, _mm256_add_epi32, _mm256_castsi256_ps,
    _mm256_cvtps_epi32, _mm256_fmadd_ps, _mm256_max_ps, _mm256_min_ps, _mm256_mul_ps,
    _mm256_round_ps, _mm256_set1_epi32, _mm256_set1_ps, _mm256_slli_epi32,
};

/// `exp(x)` for 8 lanes, within 2 ulp on `[-87, 88]` and the value at the nearer end outside
/// it (no infinities, no denormals): `2^n · p(r)` with `x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub fn exp(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.0),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    // ln 2 in two parts, so `n · ln2_hi` is exact.
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693_359_4), x);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.121_944_4e-4), r);
    // Taylor coefficients 1/k! up to k = 6.
    let mut p = _mm256_set1_ps(1.0 / 720.0);
    for coefficient in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(coefficient));
    }
    // 2^n for -126 ≤ n ≤ 127: n + 127 in the exponent field.
    let biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::{Isa, IsaLevel};
    use std::arch::x86_64::_mm256_loadu_ps;

    #[test]
    fn exp_is_close_over_its_range() {
        if !Isa::detect().has(IsaLevel::Avx2) {
            return;
        }
        let xs: [f32; 8] = [0.0, -0.3, -1.0, -5.5, -20.25, -60.0, -86.9, 88.0];
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        let got: [f32; 8] = unsafe { std::mem::transmute(exp(_mm256_loadu_ps(xs.as_ptr()))) };
        for (x, got) in xs.iter().zip(got) {
            let want = f64::from(*x).exp();
            assert!(
                (f64::from(got) - want).abs() <= 4.0 * f64::from(f32::EPSILON) * want,
                "exp({x}) = {got}, expected {want}"
            );
        }
    }
}
