//! The quantized dot products of [`super::dots`] on AVX-512 VNNI, 64 products at a time with `vpdpbusd`: groups of 16 Q8_0, Q4_0 or Q4_1 rows against up to 8 tokens, one lane per row; the K-quants one weight row against a tile of tokens, the 16 lanes of `dots` in one register.
//!
//! `vpdpbusd` adds the four products of unsigned weight bytes and signed activation bytes into
//! each i32 lane. The group tile ([`group`]) takes 64 bytes of interleaved weights (four
//! values of each of 16 rows) against each token's four activation bytes, broadcast. The
//! K-quant row tiles take the four-product sums of `dots`, two 32-value chunks of a block at
//! once, in the lane order `dots` defines; the first digit's sums, shifted left by 8, seed the
//! second digit's `vpdpbusd`, which joins them as `dots` does. The K-quants' sub-block scales multiply the lanes in i32.
//! Every integer equals the portable one and the float operations are those of `dots`, lane by
//! lane, so the result has the same bits.
//!
//! A weight block is loaded and unpacked once for all the tokens of a tile: the row streams
//! from memory once, and every token meets it in registers.

use std::arch::x86_64::{
    __m256i, __m512, __m512i, _mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32, _mm_loadu_si128,
    _mm256_and_si256, _mm256_loadu_si256, _mm256_set1_epi8, _mm256_set1_epi16, _mm256_srli_epi16,
    _mm512_add_epi32, _mm512_add_ps, _mm512_and_si512, _mm512_broadcast_i64x4,
    _mm512_castsi256_si512, _mm512_cvtepi8_epi32, _mm512_cvtepi32_ps, _mm512_cvtepu8_epi32,
    _mm512_cvtph_ps, _mm512_dpbusd_epi32, _mm512_inserti64x4, _mm512_loadu_si512, _mm512_mul_ps,
    _mm512_mullo_epi32, _mm512_or_si512, _mm512_permutexvar_epi32, _mm512_set1_epi8,
    _mm512_set1_epi32, _mm512_set1_ps, _mm512_setr_epi32, _mm512_setzero_ps, _mm512_setzero_si512,
    _mm512_slli_epi16, _mm512_slli_epi32, _mm512_srli_epi16, _mm512_srlv_epi16, _mm512_storeu_ps,
    _mm512_sub_epi32,
};

use plughost_device_abi::DType;

use super::activations::{Q8Row, Q8Tile};
use super::dots::{
    Q4_K_BYTES, Q6_K_BYTES, Sums, q4_k_scales_mins, q4_k_tail, q6_k_tail, scaled_tail,
};

/// The 64 activations of one digit from value `at`.
#[inline]
#[target_feature(enable = "avx512f")]
fn digits(digits: &[i8], at: usize) -> __m512i {
    let digits = &digits[at..at + 64];
    // SAFETY: the slice holds 64 bytes; unaligned loads are allowed.
    unsafe { _mm512_loadu_si512(digits.as_ptr().cast()) }
}

/// 32 bytes of `bytes` from `at`.
#[inline]
#[target_feature(enable = "avx2")]
fn bytes_32(bytes: &[u8], at: usize) -> __m256i {
    let bytes = &bytes[at..at + 32];
    // SAFETY: the slice holds 32 bytes; unaligned loads are allowed.
    unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
}

/// The f16 at `bytes[at..at + 2]`.
#[inline]
fn f16_bits(bytes: &[u8], at: usize) -> u32 {
    u32::from(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// An f16 given by its bits, widened with F16C.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
fn half_f32(bits: u32) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// `256 · high + low` from the weights `w` and both digits, as `dots::join`: the first digit's
/// four-product sums, shifted, seed the second's.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn joined(w: __m512i, high: __m512i, low: __m512i) -> __m512i {
    let high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, high);
    _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(high), w, low)
}

/// `lane += (d · s) · ints`, lane by lane, as `dots::scaled`.
#[inline]
#[target_feature(enable = "avx512f")]
fn accumulate(lane: __m512, d: __m512, s: __m512, ints: __m512i) -> __m512 {
    _mm512_add_ps(
        lane,
        _mm512_mul_ps(_mm512_mul_ps(d, s), _mm512_cvtepi32_ps(ints)),
    )
}

/// The result of each token: its lanes and its tail, through [`Sums::finish`].
#[inline]
#[target_feature(enable = "avx512f")]
fn finish<const M: usize>(lanes: [__m512; M], tails: [f32; M]) -> [f32; M] {
    let mut out = [0.0; M];
    for t in 0..M {
        let mut sums = Sums {
            tail: tails[t],
            ..Sums::default()
        };
        // SAFETY: `lanes` holds 16 f32, one register's worth.
        unsafe { _mm512_storeu_ps(sums.lanes.as_mut_ptr(), lanes[t]) };
        out[t] = sums.finish();
    }
    out
}

/// `w` (one row of whole `dtype` blocks) against each of `xs` (activations of the same
/// length): what [`super::dots::dot_row`] gives for each, with the same bits.
///
/// # Safety
/// The CPU has AVX-512 F, BW, DQ, VL and VNNI, and AVX2 and F16C (the `avx512_vnni` level).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,f16c")]
pub unsafe fn tile<const M: usize>(dtype: DType, w: &[u8], xs: &[Q8Row<'_>; M]) -> [f32; M] {
    super::dots::check_rows(dtype, w, xs);
    super::tile_by_type!(self, dtype, w, xs)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,f16c")]
fn q4_k<const M: usize>(w: &[u8], xs: &[Q8Row<'_>; M]) -> [f32; M] {
    let mut lanes = [_mm512_setzero_ps(); M];
    let mut tails = [0.0f32; M];
    let mask = _mm256_set1_epi8(0x0F);
    for (b, block) in w.chunks_exact(Q4_K_BYTES).enumerate() {
        let (scales, mins) = q4_k_scales_mins(block);
        let mut wide = [0u8; 16];
        wide[..8].copy_from_slice(&scales);
        // SAFETY: `wide` holds 16 bytes.
        let scales = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(wide.as_ptr().cast()) });
        let mut ints = [_mm512_setzero_si512(); M];
        for c in 0..4 {
            let bytes = bytes_32(block, 16 + 32 * c);
            // Sub-block 2c in lanes 0..8 (the low nibbles), 2c + 1 in lanes 8..16.
            let values = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_and_si256(bytes, mask)),
                _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), mask),
            );
            let (j, k) = (2 * c as i32, 2 * c as i32 + 1);
            let index = _mm512_setr_epi32(j, j, j, j, j, j, j, j, k, k, k, k, k, k, k, k);
            let scale = _mm512_permutexvar_epi32(index, scales);
            for t in 0..M {
                let at = 256 * b + 64 * c;
                let p = joined(values, digits(xs[t].high, at), digits(xs[t].low, at));
                ints[t] = _mm512_add_epi32(ints[t], _mm512_mullo_epi32(p, scale));
            }
        }
        let (d, dmin) = (half_f32(f16_bits(block, 0)), half_f32(f16_bits(block, 2)));
        for t in 0..M {
            let s = xs[t].scales[b];
            lanes[t] = accumulate(lanes[t], _mm512_set1_ps(d), _mm512_set1_ps(s), ints[t]);
            tails[t] += scaled_tail(dmin, s, q4_k_tail(&mins, &xs[t], b));
        }
    }
    finish(lanes, tails)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,f16c")]
fn q6_k<const M: usize>(w: &[u8], xs: &[Q8Row<'_>; M]) -> [f32; M] {
    let mut lanes = [_mm512_setzero_ps(); M];
    let mut tails = [0.0f32; M];
    let mask = _mm512_set1_epi8(0x0F);
    let three = _mm512_set1_epi8(3);
    for (b, block) in w.chunks_exact(Q6_K_BYTES).enumerate() {
        let scales = &block[192..208];
        // SAFETY: the slice holds 16 bytes.
        let scales = _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(scales.as_ptr().cast()) });
        let d = _mm512_set1_ps(half_f32(f16_bits(block, 208)));
        for half in 0..2 {
            let low_bits = &block[64 * half..64 * half + 64];
            // SAFETY: the slice holds 64 bytes.
            let ql = unsafe { _mm512_loadu_si512(low_bits.as_ptr().cast()) };
            let qh = _mm512_broadcast_i64x4(bytes_32(block, 128 + 32 * half));
            let mut ints = [_mm512_setzero_si512(); M];
            for pair in 0..2 {
                // Chunks c and c + 1 (values 32c..32c + 64): the low nibbles of `ql` for the
                // first pair, the high ones for the second; bits 4·pair and 4·pair + 2 of `qh`.
                let c = 4 * half + 2 * pair;
                let low = if pair == 0 {
                    _mm512_and_si512(ql, mask)
                } else {
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql), mask)
                };
                let shift = 4 * pair as i16;
                let shifts = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_set1_epi16(shift)),
                    _mm256_set1_epi16(shift + 2),
                );
                let high = _mm512_and_si512(_mm512_srlv_epi16(qh, shifts), three);
                let values = _mm512_or_si512(low, _mm512_slli_epi16::<4>(high));
                // Lanes 4i..4i + 4 take sub-block 2c + i's scale.
                let s = 2 * c as i32;
                let (s1, s2, s3) = (s + 1, s + 2, s + 3);
                let index =
                    _mm512_setr_epi32(s, s, s, s, s1, s1, s1, s1, s2, s2, s2, s2, s3, s3, s3, s3);
                let scale = _mm512_permutexvar_epi32(index, scales);
                for t in 0..M {
                    let at = 256 * b + 32 * c;
                    let p = joined(values, digits(xs[t].high, at), digits(xs[t].low, at));
                    ints[t] = _mm512_add_epi32(ints[t], _mm512_mullo_epi32(p, scale));
                }
            }
            for t in 0..M {
                lanes[t] = accumulate(lanes[t], d, _mm512_set1_ps(xs[t].scales[b]), ints[t]);
            }
        }
        let d = half_f32(f16_bits(block, 208));
        for t in 0..M {
            tails[t] += scaled_tail(d, xs[t].scales[b], q6_k_tail(block, &xs[t], b));
        }
    }
    finish(lanes, tails)
}

/// One group of 16 interleaved rows of `FORMAT`'s type (see `interleaved`: Q8_0 0, Q4_0 1,
/// Q4_1 2) against the `M` tokens of `tile`: the 16 outputs of each token, what
/// [`super::dots::dot_row`] gives, with the same bits.
///
/// Per block, each 64-byte operand of weights (four values of each row: Q8_0's quads, or a
/// Q4 quad's low or high nibbles) meets each token's four activation bytes of each digit,
/// broadcast: `vpdpbusd` sums the four products into the row's lane. Joined, and less what
/// the weights' offset added (Q8_0's `128 ·`, Q4_0's `8 ·` the token's block sum), a lane
/// holds the row's exact block integer; the scales then take one multiply, one multiply and
/// one add for all 16 rows (Q4_1's minimum as many again).
///
/// # Safety
/// The CPU has AVX-512 F, BW, DQ, VL and VNNI, and AVX2 and F16C (the `avx512_vnni` level).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,f16c")]
pub unsafe fn group<const M: usize, const FORMAT: u8>(
    group: &[u8],
    tile: Q8Tile<'_>,
) -> [[f32; 16]; M] {
    let dtype = super::interleaved::format_type(FORMAT);
    let blocks = super::interleaved::check_group(dtype, group, &tile, M);
    let activations = tile.digits.as_ptr();
    let base = group.as_ptr();
    let nibbles = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); M];
    for b in 0..blocks {
        let ([scales, minima], quads) = super::interleaved::block_at(dtype, b, blocks);
        // SAFETY: `check_group` checked the group holds `blocks` whole blocks, so their
        // fields and values lie inside it, and the tile's digits, scales and sums cover them.
        unsafe {
            let mut high = [_mm512_setzero_si512(); M];
            let mut low = [_mm512_setzero_si512(); M];
            // Weights for values `4q..4q + 4` of each row, against the tokens' digits.
            let mut dot = |q: usize, w: __m512i| {
                for t in 0..M {
                    let at = activations.add((b * 8 + q) * 8 * M + 4 * t);
                    let h = (at as *const i32).read_unaligned();
                    let l = (at.add(4 * M) as *const i32).read_unaligned();
                    high[t] = _mm512_dpbusd_epi32(high[t], w, _mm512_set1_epi32(h));
                    low[t] = _mm512_dpbusd_epi32(low[t], w, _mm512_set1_epi32(l));
                }
            };
            if FORMAT == 0 {
                for q in 0..8 {
                    dot(q, _mm512_loadu_si512(base.add(quads + 64 * q).cast()));
                }
            } else {
                for q in 0..4 {
                    let w = _mm512_loadu_si512(base.add(quads + 64 * q).cast());
                    dot(q, _mm512_and_si512(w, nibbles));
                    dot(q + 4, _mm512_and_si512(_mm512_srli_epi16::<4>(w), nibbles));
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(scales).cast()));
            let m = if FORMAT == 2 {
                _mm512_cvtph_ps(_mm256_loadu_si256(base.add(minima).cast()))
            } else {
                _mm512_setzero_ps()
            };
            for t in 0..M {
                let sum = *tile.sums.get_unchecked(b * M + t);
                let offset = [128, 8, 0][usize::from(FORMAT)] * sum;
                let ints = _mm512_sub_epi32(
                    _mm512_add_epi32(_mm512_slli_epi32::<8>(high[t]), low[t]),
                    _mm512_set1_epi32(offset),
                );
                let s = _mm512_set1_ps(*tile.scales.get_unchecked(b * M + t));
                acc[t] = _mm512_add_ps(
                    acc[t],
                    _mm512_mul_ps(_mm512_mul_ps(d, s), _mm512_cvtepi32_ps(ints)),
                );
                if FORMAT == 2 {
                    let sums = _mm512_set1_ps(sum as f32);
                    acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(m, s), sums));
                }
            }
        }
    }
    let mut out = [[0.0; 16]; M];
    for t in 0..M {
        // SAFETY: a row of `out` holds 16 f32, one register's worth.
        unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
    }
    out
}
