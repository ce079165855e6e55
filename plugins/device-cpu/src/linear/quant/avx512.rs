//! The quantized dot products of [`super::dots`] on AVX-512 VNNI, 64 products at a time with `vpdpbusd`: Q8_0 groups of 16 rows against up to 8 tokens, one lane per row; the other types one weight row against a tile of tokens, the 16 lanes of `dots` in one register.
//!
//! `vpdpbusd` adds the four products of unsigned weight bytes and signed activation bytes into
//! each i32 lane. The Q8_0 group tile ([`q8_0_group`]) takes 64 bytes of interleaved weights
//! (four values of each of 16 rows) against each token's four activation bytes, broadcast.
//! The row tiles take the four-product sums of `dots`, for two 32-value blocks (Q4_0, Q4_1)
//! or two 32-value chunks of a K-quant block at once, in the lane order `dots` defines. The
//! first digit's sums, shifted left by 8, seed the second digit's `vpdpbusd`, which joins them
//! as `dots` does. Signed weights (Q4_0's `q - 8`) go in as their magnitude, their
//! sign moved onto the activations. The K-quants' sub-block scales multiply the lanes in i32.
//! Every integer equals the portable one and the float operations are those of `dots`, lane by
//! lane, so the result has the same bits.
//!
//! A weight block is loaded and unpacked once for all the tokens of a tile: the row streams
//! from memory once, and every token meets it in registers.

use std::arch::x86_64::{
    __m256i, __m512, __m512i, _mm_castsi128_ps, _mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32,
    _mm_loadl_epi64, _mm_loadu_si128, _mm_srli_epi16, _mm256_and_si256, _mm256_loadu_si256,
    _mm256_set_m128i, _mm256_set1_epi8, _mm256_set1_epi16, _mm256_srli_epi16, _mm256_sub_epi8,
    _mm512_abs_epi8, _mm512_add_epi32, _mm512_add_ps, _mm512_and_si512, _mm512_broadcast_i64x4,
    _mm512_castps128_ps512, _mm512_castsi256_si512, _mm512_cvtepi8_epi32, _mm512_cvtepi32_ps,
    _mm512_cvtepu8_epi32, _mm512_cvtph_ps, _mm512_dpbusd_epi32, _mm512_inserti64x4,
    _mm512_loadu_si512, _mm512_mask_mov_ps, _mm512_mask_sub_epi8, _mm512_movepi8_mask,
    _mm512_mul_ps, _mm512_mullo_epi32, _mm512_or_si512, _mm512_permutexvar_epi32,
    _mm512_permutexvar_ps, _mm512_set1_epi8, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setr_epi32,
    _mm512_setzero_ps, _mm512_setzero_si512, _mm512_slli_epi16, _mm512_slli_epi32,
    _mm512_srli_epi16, _mm512_srlv_epi16, _mm512_storeu_ps, _mm512_sub_epi32,
    _mm512_zextsi256_si512,
};

use plughost_device_abi::DType;

use super::activations::{Q8Row, Q8Tile};
use super::dots::{
    Q4_K_BYTES, Q6_K_BYTES, Sums, block_bytes, q4_k_scales_mins, q4_k_tail, q6_k_tail, scaled_tail,
};

/// The 64 activations of one digit from value `at`.
#[inline]
#[target_feature(enable = "avx512f")]
fn digits(digits: &[i8], at: usize) -> __m512i {
    let digits = &digits[at..at + 64];
    // SAFETY: the slice holds 64 bytes; unaligned loads are allowed.
    unsafe { _mm512_loadu_si512(digits.as_ptr().cast()) }
}

/// The 32 activations of one digit from value `at`, in lanes 0..8 (the rest zero).
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn digits_32(digits: &[i8], at: usize) -> __m512i {
    let digits = &digits[at..at + 32];
    // SAFETY: the slice holds 32 bytes; unaligned loads are allowed.
    _mm512_zextsi256_si512(unsafe { _mm256_loadu_si256(digits.as_ptr().cast()) })
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

/// Lanes `0..8` from element 0 of `pair`, lanes `8..16` from element 1.
#[inline]
#[target_feature(enable = "avx512f")]
fn halves(pair: __m512) -> __m512 {
    _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        pair,
    )
}

/// `scales[b]` in lanes 0..8 and `scales[b + 1]` in lanes 8..16.
#[inline]
#[target_feature(enable = "avx512f")]
fn scale_pair(scales: &[f32], b: usize) -> __m512 {
    let pair = &scales[b..b + 2];
    // SAFETY: the slice holds 8 bytes.
    let pair = unsafe { _mm_loadl_epi64(pair.as_ptr().cast()) };
    halves(_mm512_castps128_ps512(_mm_castsi128_ps(pair)))
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
fn finish<const M: usize>(dtype: DType, lanes: [__m512; M], tails: [f32; M]) -> [f32; M] {
    let mut out = [0.0; M];
    for t in 0..M {
        let mut sums = Sums {
            tail: tails[t],
            ..Sums::default()
        };
        // SAFETY: `lanes` holds 16 f32, one register's worth.
        unsafe { _mm512_storeu_ps(sums.lanes.as_mut_ptr(), lanes[t]) };
        out[t] = sums.finish(dtype);
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

/// The 32 values of a block in value order: Q4_0's (`FORMAT` 1, as `q - 8`) or Q4_1's (2)
/// nibbles.
#[inline]
#[target_feature(enable = "avx2")]
fn values_32<const FORMAT: u8>(block: &[u8]) -> __m256i {
    let qs = if FORMAT == 1 {
        &block[2..18]
    } else {
        &block[4..20]
    };
    // SAFETY: the slice holds the block's 16 bytes of nibbles.
    let bytes = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(bytes), bytes);
    let nibbles = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
    if FORMAT == 1 {
        _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8))
    } else {
        nibbles
    }
}

/// Two blocks' weights in one register (`first` in lanes 0..8) as unsigned bytes, with the
/// mask of the negative ones (none for Q4_1).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2")]
fn weight_pair<const FORMAT: u8>(first: &[u8], second: &[u8]) -> (__m512i, u64) {
    let weights = _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(values_32::<FORMAT>(first)),
        values_32::<FORMAT>(second),
    );
    if FORMAT == 2 {
        (weights, 0)
    } else {
        (_mm512_abs_epi8(weights), _mm512_movepi8_mask(weights))
    }
}

/// `x` with its signs flipped where `negative` says.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn signed(x: __m512i, negative: u64) -> __m512i {
    _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x)
}

/// Q4_0 (`FORMAT` 1) or Q4_1 (2).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,f16c")]
fn blocks_32<const M: usize, const FORMAT: u8>(w: &[u8], xs: &[Q8Row<'_>; M]) -> [f32; M] {
    let dtype = if FORMAT == 1 {
        DType::Q4_0
    } else {
        DType::Q4_1
    };
    let mut lanes = [_mm512_setzero_ps(); M];
    let bytes = block_bytes(dtype);
    let blocks = w.len() / bytes;
    for b in (0..blocks & !1).step_by(2) {
        let (first, second) = (&w[b * bytes..], &w[(b + 1) * bytes..]);
        let (weights, negative) = weight_pair::<FORMAT>(first, second);
        let d = f16_bits(first, 0) | f16_bits(second, 0) << 16;
        let d = halves(_mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(
            d as i32,
        ))));
        let minima = f16_bits(first, 2) | f16_bits(second, 2) << 16;
        let minima = halves(_mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(
            minima as i32,
        ))));
        for t in 0..M {
            let x = &xs[t];
            let (high, low) = (digits(x.high, 32 * b), digits(x.low, 32 * b));
            let s = scale_pair(x.scales, b);
            lanes[t] =
                block_pair::<FORMAT>(lanes[t], (weights, negative), (d, minima), s, high, low);
        }
    }
    // An odd last block fills lanes 0..8 alone; lanes 8..16 belong to odd blocks.
    if blocks % 2 == 1 {
        let b = blocks - 1;
        let block = &w[b * bytes..];
        let (weights, negative) = weight_pair::<FORMAT>(block, block);
        let d = _mm512_set1_ps(half_f32(f16_bits(block, 0)));
        let minimum = _mm512_set1_ps(half_f32(f16_bits(block, 2)));
        for t in 0..M {
            let x = &xs[t];
            let (high, low) = (digits_32(x.high, 32 * b), digits_32(x.low, 32 * b));
            let s = _mm512_set1_ps(x.scales[b]);
            let next =
                block_pair::<FORMAT>(lanes[t], (weights, negative), (d, minimum), s, high, low);
            lanes[t] = _mm512_mask_mov_ps(lanes[t], 0x00FF, next);
        }
    }
    finish(dtype, lanes, [0.0; M])
}

/// One token's lanes after a pair of blocks: `lane += (d · s) · ints`, and for Q4_1 then
/// `lane += (m · s) · sums` with the activations' own four-value sums, as `dots` does.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn block_pair<const FORMAT: u8>(
    lane: __m512,
    (weights, negative): (__m512i, u64),
    (d, minimum): (__m512, __m512),
    s: __m512,
    high: __m512i,
    low: __m512i,
) -> __m512 {
    let ints = joined(weights, signed(high, negative), signed(low, negative));
    let lane = accumulate(lane, d, s, ints);
    if FORMAT == 2 {
        let sums = joined(_mm512_set1_epi8(1), high, low);
        accumulate(lane, minimum, s, sums)
    } else {
        lane
    }
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
    finish(DType::Q4_K, lanes, tails)
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
    finish(DType::Q6_K, lanes, tails)
}

/// One group of 16 interleaved Q8_0 rows (see `interleaved`) against the `M` tokens of
/// `tile`: the 16 outputs of each token, what [`super::dots::dot_row`] gives, with the same bits.
///
/// Per block, each 64-byte quad of weights (four values of each row, offset by 128) meets
/// each token's four activation bytes of each digit, broadcast: `vpdpbusd` sums the four
/// products into the row's lane. Joined and less `128 ·` the activations' block sum, a lane
/// holds the row's exact block integer; the scales then take one multiply, one multiply and
/// one add for all 16 rows.
///
/// # Safety
/// The CPU has AVX-512 F, BW, DQ, VL and VNNI, and AVX2 and F16C (the `avx512_vnni` level).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,f16c")]
pub unsafe fn q8_0_group<const M: usize>(group: &[u8], tile: Q8Tile<'_>) -> [[f32; 16]; M] {
    let blocks = super::interleaved::check_group(group, &tile, M);
    let activations = tile.digits.as_ptr();
    let mut acc = [_mm512_setzero_ps(); M];
    let base = group.as_ptr();
    for b in 0..blocks {
        let (scales, quads) = super::interleaved::block_at(b, blocks);
        // SAFETY: `check_group` checked the group holds `blocks` whole blocks, so their 16
        // scales and 512 value bytes lie inside it, and every token's digits, scales and sums
        // cover them.
        unsafe {
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(base.add(scales).cast()));
            let mut high = [_mm512_setzero_si512(); M];
            let mut low = [_mm512_setzero_si512(); M];
            for q in 0..8 {
                let w = _mm512_loadu_si512(base.add(quads + 64 * q).cast());
                for t in 0..M {
                    let at = activations.add((b * 8 + q) * 8 * M + 4 * t);
                    let h = (at as *const i32).read_unaligned();
                    let l = (at.add(4 * M) as *const i32).read_unaligned();
                    high[t] = _mm512_dpbusd_epi32(high[t], w, _mm512_set1_epi32(h));
                    low[t] = _mm512_dpbusd_epi32(low[t], w, _mm512_set1_epi32(l));
                }
            }
            for t in 0..M {
                let offset = *tile.offsets.get_unchecked(b * M + t);
                let ints = _mm512_sub_epi32(
                    _mm512_add_epi32(_mm512_slli_epi32::<8>(high[t]), low[t]),
                    _mm512_set1_epi32(offset),
                );
                let s = _mm512_set1_ps(*tile.scales.get_unchecked(b * M + t));
                acc[t] = _mm512_add_ps(
                    acc[t],
                    _mm512_mul_ps(_mm512_mul_ps(d, s), _mm512_cvtepi32_ps(ints)),
                );
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
