//! The integer sums of [`super::dots`] on AVX2: 32 products at a time with `vpmaddubsw`, pairs widened to i32 with `vpmaddwd`.
//!
//! `vpmaddubsw` multiplies unsigned bytes by signed bytes and adds neighbours into i16 with
//! saturation; no sum here can saturate: nibbles (at most 15) and 6-bit values (at most 63)
//! times activations in `-127..=127` give at most `2 · 63 · 127`, and a signed weight byte is
//! made unsigned by moving its sign onto the activation (`vpsignb`), at most `2 · 128 · 127`.
//! Every result is an exact integer, so it equals the portable one.

use std::arch::x86_64::{
    __m128i, __m256i, _mm_add_epi32, _mm_cvtsi128_si32, _mm_hadd_epi32, _mm_loadu_si128,
    _mm_srli_epi16, _mm256_and_si256, _mm256_castsi256_si128, _mm256_extracti128_si256,
    _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_or_si256, _mm256_set_m128i,
    _mm256_set1_epi8, _mm256_set1_epi16, _mm256_sign_epi8, _mm256_slli_epi16, _mm256_srli_epi16,
};

use plughost_device_abi::DType;

use super::activations::Q8Row;
use super::dots::{BlockInts, Q8_0_BYTES, dot_row};

/// [`dot_row`] with the AVX2 integer sums.
///
/// # Safety
/// The CPU has AVX2; `w` and `x` hold whole blocks of the same number of values.
#[target_feature(enable = "avx2")]
pub unsafe fn dot_row_avx2(dtype: DType, w: &[u8], x: Q8Row<'_>) -> f32 {
    dot_row::<Avx2>(dtype, w, x)
}

struct Avx2;

/// The eight i32 lanes of `v` added.
#[inline]
#[target_feature(enable = "avx2")]
fn sum_lanes(v: __m256i) -> i32 {
    sum_lanes_128(_mm_add_epi32(
        _mm256_castsi256_si128(v),
        _mm256_extracti128_si256::<1>(v),
    ))
}

#[inline]
#[target_feature(enable = "avx2")]
fn sum_lanes_128(v: __m128i) -> i32 {
    let v = _mm_hadd_epi32(v, v);
    _mm_cvtsi128_si32(_mm_hadd_epi32(v, v))
}

/// Unsigned bytes `a` times signed bytes `b`, each four neighbours summed into an i32 lane.
#[inline]
#[target_feature(enable = "avx2")]
fn products_u8_i8(a: __m256i, b: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
}

/// 32 bytes at `p`.
///
/// # Safety
/// `p` starts 32 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load32<T>(p: *const T) -> __m256i {
    // SAFETY: the caller's contract; unaligned loads are allowed.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// Every caller below passes slices the row loop cut to whole blocks (checked by
/// [`super::check_lengths`] before any row runs), so each load stays inside its slice; the
/// asserts make a violated assumption a panic, never a read out of bounds.
impl BlockInts for Avx2 {
    #[inline(always)]
    fn q8_0(block: &[u8], x: &[i8]) -> i32 {
        assert!(block.len() >= Q8_0_BYTES && x.len() >= 32);
        // SAFETY: AVX2 is present (this impl is only reached from `dot_row_avx2`); the assert
        // above keeps both 32-byte loads in bounds.
        unsafe {
            let w = load32(block[2..].as_ptr());
            let x = load32(x.as_ptr());
            sum_lanes(products_u8_i8(
                _mm256_sign_epi8(w, w),
                _mm256_sign_epi8(x, w),
            ))
        }
    }

    #[inline(always)]
    fn q4(qs: &[u8], x: &[i8]) -> i32 {
        assert!(qs.len() >= 16 && x.len() >= 32);
        // SAFETY: as in `q8_0`: AVX2 is present and the loads are in bounds.
        unsafe {
            let bytes = _mm_loadu_si128(qs.as_ptr().cast());
            let both = _mm256_set_m128i(_mm_srli_epi16::<4>(bytes), bytes);
            let nibbles = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
            sum_lanes(products_u8_i8(nibbles, load32(x.as_ptr())))
        }
    }

    #[inline(always)]
    fn q4_k(qs: &[u8], x: &[i8]) -> [i32; 8] {
        assert!(qs.len() >= 128 && x.len() >= 256);
        let mut out = [0i32; 8];
        for c in 0..4 {
            // SAFETY: as in `q8_0`: AVX2 is present and the loads are in bounds.
            unsafe {
                let bytes = load32(qs[32 * c..].as_ptr());
                let mask = _mm256_set1_epi8(0x0F);
                let low = _mm256_and_si256(bytes, mask);
                let high = _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), mask);
                out[2 * c] = sum_lanes(products_u8_i8(low, load32(x[64 * c..].as_ptr())));
                out[2 * c + 1] = sum_lanes(products_u8_i8(high, load32(x[64 * c + 32..].as_ptr())));
            }
        }
        out
    }

    #[inline(always)]
    fn q6_k(block: &[u8], x: &[i8]) -> [i32; 16] {
        assert!(block.len() >= 192 && x.len() >= 256);
        let mut out = [0i32; 16];
        for half in 0..2 {
            for g in 0..4 {
                // Values `32g..32g + 32` of this half: low or high nibbles of the first or
                // second 32 bytes of `ql`, and bits `2g, 2g + 1` of `qh`.
                let ql = 64 * half + 32 * (g % 2);
                let qh = 128 + 32 * half;
                let k = 128 * half + 32 * g;
                // SAFETY: as in `q8_0`: AVX2 is present and the loads are in bounds.
                let lanes = unsafe {
                    let mask = _mm256_set1_epi8(0x0F);
                    let ql = load32(block[ql..].as_ptr());
                    let low = if g < 2 {
                        _mm256_and_si256(ql, mask)
                    } else {
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql), mask)
                    };
                    let qh = load32(block[qh..].as_ptr());
                    let shifted = match g {
                        0 => qh,
                        1 => _mm256_srli_epi16::<2>(qh),
                        2 => _mm256_srli_epi16::<4>(qh),
                        _ => _mm256_srli_epi16::<6>(qh),
                    };
                    let high = _mm256_and_si256(shifted, _mm256_set1_epi8(3));
                    let values = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
                    products_u8_i8(values, load32(x[k..].as_ptr()))
                };
                // Lanes 0..4 hold values 0..16 of the 32, lanes 4..8 values 16..32.
                // SAFETY: AVX2 is present.
                let (first, second) = unsafe {
                    (
                        sum_lanes_128(_mm256_castsi256_si128(lanes)),
                        sum_lanes_128(_mm256_extracti128_si256::<1>(lanes)),
                    )
                };
                out[8 * half + 2 * g] = first;
                out[8 * half + 2 * g + 1] = second;
            }
        }
        out
    }
}
