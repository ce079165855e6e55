//! The quantized dot products of [`super::dots`] on AVX2, four-product sums from `vpmaddubsw` + `vpmaddwd`: groups of 16 Q8_0, Q4_0 or Q4_1 rows in two halves of eight, one lane per row, against up to 4 tokens; the K-quants one weight row against a tile of tokens, the lanes of `dots` in two registers.
//!
//! `vpmaddubsw` multiplies unsigned bytes by signed bytes and adds neighbours into i16 with
//! saturation; no sum here can saturate: nibbles (at most 15) and 6-bit values (at most 63)
//! times activations in `-127..=127` give at most `2 · 63 · 127`, and a signed weight byte
//! (Q8_0, in [`group`]) is made unsigned by moving its sign onto the activation
//! (`vpsignb`), at most `2 · 128 · 127`. `vpmaddwd` then adds pairs into i32, by ones or by
//! the K-quants' sub-block scales, and the two digits' sums are joined as `dots` joins them.
//! Every integer equals the portable one, and the float operations are those of `dots`, lane
//! by lane, so the result has the same bits.
//!
//! A weight block is loaded and unpacked once for all the tokens of a tile: the row streams
//! from memory once, and each token meets it in registers.

use std::arch::x86_64::{
    __m256, __m256i, _mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32, _mm_loadu_si128,
    _mm_set1_epi16, _mm256_add_epi32, _mm256_add_ps, _mm256_and_si256, _mm256_cvtepi32_ps,
    _mm256_cvtph_ps, _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_mul_ps,
    _mm256_or_si256, _mm256_set_m128i, _mm256_set1_epi8, _mm256_set1_epi16, _mm256_set1_epi32,
    _mm256_set1_ps, _mm256_setzero_ps, _mm256_setzero_si256, _mm256_sign_epi8, _mm256_slli_epi16,
    _mm256_slli_epi32, _mm256_srli_epi16, _mm256_storeu_ps, _mm256_sub_epi32, _mm256_xor_si256,
};

use plughost_device_abi::DType;

use super::activations::{Q8Row, Q8Tile};
use super::dots::{
    LANES, Q4_K_BYTES, Q6_K_BYTES, Sums, q4_k_scales_mins, q4_k_tail, q6_k_tail, scaled_tail,
};

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

/// The 32 activations of one digit from value `at`.
#[inline]
#[target_feature(enable = "avx2")]
fn digits(digits: &[i8], at: usize) -> __m256i {
    let digits = &digits[at..at + 32];
    // SAFETY: the slice holds 32 bytes.
    unsafe { load32(digits.as_ptr()) }
}

/// The f16 at `bytes[at..at + 2]`, widened with F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn f16(bytes: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([bytes[at], bytes[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// `256 · high + low`, lane by lane, as `dots::join`.
#[inline]
#[target_feature(enable = "avx2")]
fn join(high: __m256i, low: __m256i) -> __m256i {
    _mm256_add_epi32(_mm256_slli_epi32::<8>(high), low)
}

/// The four-product sums of unsigned `a` and signed `b`, each times `scale` (i16 pairs).
#[inline]
#[target_feature(enable = "avx2")]
fn fours(a: __m256i, b: __m256i, scale: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), scale)
}

/// `lane += (d · s) · ints`, lane by lane, as `dots::scaled`.
#[inline]
#[target_feature(enable = "avx2")]
fn accumulate(lane: __m256, d: f32, s: f32, ints: __m256i) -> __m256 {
    let ds = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_set1_ps(s));
    _mm256_add_ps(lane, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(ints)))
}

/// The result of each token: its two registers of lanes and its tail, through
/// [`Sums::finish`].
#[inline]
#[target_feature(enable = "avx2")]
fn finish<const M: usize>(lanes: [[__m256; 2]; M], tails: [f32; M]) -> [f32; M] {
    let mut out = [0.0; M];
    for t in 0..M {
        let mut sums = Sums {
            lanes: [0.0; LANES],
            tail: tails[t],
        };
        // SAFETY: `lanes` holds 16 f32, two registers' worth.
        unsafe {
            _mm256_storeu_ps(sums.lanes.as_mut_ptr(), lanes[t][0]);
            _mm256_storeu_ps(sums.lanes[8..].as_mut_ptr(), lanes[t][1]);
        }
        out[t] = sums.finish();
    }
    out
}

/// `w` (one row of whole `dtype` blocks) against each of `xs` (activations of the same
/// length): what [`super::dots::dot_row`] gives for each, with the same bits.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (the `avx2` level).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile<const M: usize>(dtype: DType, w: &[u8], xs: &[Q8Row<'_>; M]) -> [f32; M] {
    super::dots::check_rows(dtype, w, xs);
    super::tile_by_type!(self, dtype, w, xs)
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q4_k<const M: usize>(w: &[u8], xs: &[Q8Row<'_>; M]) -> [f32; M] {
    let mut lanes = [[_mm256_setzero_ps(); 2]; M];
    let mut tails = [0.0f32; M];
    let mask = _mm256_set1_epi8(0x0F);
    for (b, block) in w.chunks_exact(Q4_K_BYTES).enumerate() {
        let (scales, mins) = q4_k_scales_mins(block);
        let mut ints = [[_mm256_setzero_si256(); 2]; M];
        for c in 0..4 {
            // SAFETY: a Q4_K block holds 128 bytes of nibbles from byte 16.
            let bytes = unsafe { load32(block[16 + 32 * c..16 + 32 * c + 32].as_ptr()) };
            let values = [
                _mm256_and_si256(bytes, mask),
                _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), mask),
            ];
            for h in 0..2 {
                let j = 2 * c + h;
                let scale = _mm256_set1_epi16(i16::from(scales[j]));
                for t in 0..M {
                    let at = 256 * b + 32 * j;
                    let (high, low) = (digits(xs[t].high, at), digits(xs[t].low, at));
                    let p = join(fours(values[h], high, scale), fours(values[h], low, scale));
                    ints[t][h] = _mm256_add_epi32(ints[t][h], p);
                }
            }
        }
        let (d, dmin) = (f16(block, 0), f16(block, 2));
        for t in 0..M {
            let s = xs[t].scales[b];
            for h in 0..2 {
                lanes[t][h] = accumulate(lanes[t][h], d, s, ints[t][h]);
            }
            tails[t] += scaled_tail(dmin, s, q4_k_tail(&mins, &xs[t], b));
        }
    }
    finish(lanes, tails)
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q6_k<const M: usize>(w: &[u8], xs: &[Q8Row<'_>; M]) -> [f32; M] {
    let mut lanes = [[_mm256_setzero_ps(); 2]; M];
    let mut tails = [0.0f32; M];
    let mask = _mm256_set1_epi8(0x0F);
    for (b, block) in w.chunks_exact(Q6_K_BYTES).enumerate() {
        let d = f16(block, 208);
        for half in 0..2 {
            let mut ints = [[_mm256_setzero_si256(); 2]; M];
            let qh = 128 + 32 * half;
            // SAFETY: a Q6_K block holds 64 bytes of high bits from byte 128.
            let qh = unsafe { load32(block[qh..qh + 32].as_ptr()) };
            for part in 0..4 {
                let c = 4 * half + part;
                let ql = 64 * half + 32 * (part % 2);
                // SAFETY: a Q6_K block holds 128 bytes of low bits.
                let ql = unsafe { load32(block[ql..ql + 32].as_ptr()) };
                let low = if part < 2 {
                    _mm256_and_si256(ql, mask)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql), mask)
                };
                let shifted = match part {
                    0 => qh,
                    1 => _mm256_srli_epi16::<2>(qh),
                    2 => _mm256_srli_epi16::<4>(qh),
                    _ => _mm256_srli_epi16::<6>(qh),
                };
                let high = _mm256_and_si256(shifted, _mm256_set1_epi8(3));
                let values = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
                // Lanes 0..4 take sub-block 2c's scale, lanes 4..8 sub-block 2c + 1's.
                let scale = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(block[192 + 2 * c + 1] as i8)),
                    _mm_set1_epi16(i16::from(block[192 + 2 * c] as i8)),
                );
                for t in 0..M {
                    let at = 256 * b + 32 * c;
                    let (x_high, x_low) = (digits(xs[t].high, at), digits(xs[t].low, at));
                    let p = join(fours(values, x_high, scale), fours(values, x_low, scale));
                    ints[t][c % 2] = _mm256_add_epi32(ints[t][c % 2], p);
                }
            }
            for t in 0..M {
                for h in 0..2 {
                    lanes[t][h] = accumulate(lanes[t][h], d, xs[t].scales[b], ints[t][h]);
                }
            }
        }
        for t in 0..M {
            tails[t] += scaled_tail(d, xs[t].scales[b], q6_k_tail(block, &xs[t], b));
        }
    }
    finish(lanes, tails)
}

/// [`super::avx512::group`] on AVX2: the 16 outputs of each of the `M` tokens of `tile`
/// against a group of `FORMAT`'s type, with the bits of [`super::dots::dot_row`].
///
/// Each 64-byte operand is read as two halves of eight rows: for one or two tokens both
/// halves in one pass (the group streams once), for more one half at a time over all the
/// blocks (the accumulators fill the 16 registers). Q8_0's weights get their sign back (the
/// arrangement stores `w + 128`) and go in as magnitudes, their signs moved onto each token's
/// four broadcast activation bytes; nibbles go in as they are. The `vpmaddubsw` pairs (at
/// most `2 · 128 · 127`) are added by `vpmaddwd` into the row's lane, the first digit's times
/// 256, which joins the digits as `dots` does; Q4_0 then subtracts `8 ·` the token's block sum
/// for its `q - 8`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (the `avx2` level).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn group<const M: usize, const FORMAT: u8>(
    group: &[u8],
    tile: Q8Tile<'_>,
) -> [[f32; 16]; M] {
    let dtype = super::interleaved::format_type(FORMAT);
    let blocks = super::interleaved::check_group(dtype, group, &tile, M);
    let mut out = [[0.0; 16]; M];
    // SAFETY: `check_group` checked the group and the tile, for `blocks` blocks.
    unsafe {
        if M <= 2 {
            halves::<M, FORMAT, 2>((group, blocks), tile, 0, &mut out);
        } else {
            halves::<M, FORMAT, 1>((group, blocks), tile, 0, &mut out);
            halves::<M, FORMAT, 1>((group, blocks), tile, 1, &mut out);
        }
    }
    out
}

/// Halves `h0..h0 + H` of [`group`]: outputs `8 · h0..8 · (h0 + H)` of each token.
///
/// # Safety
/// As [`group`], with `group` holding `blocks` whole blocks and `tile` covering them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves<const M: usize, const FORMAT: u8, const H: usize>(
    (group, blocks): (&[u8], usize),
    tile: Q8Tile<'_>,
    h0: usize,
    out: &mut [[f32; 16]; M],
) {
    let dtype = super::interleaved::format_type(FORMAT);
    let activations = tile.digits.as_ptr();
    let base = group.as_ptr();
    let flip = _mm256_set1_epi8(-128);
    let nibbles = _mm256_set1_epi8(0x0F);
    let (ones, first) = (_mm256_set1_epi16(1), _mm256_set1_epi16(256));
    let mut acc = [[_mm256_setzero_ps(); H]; M];
    for b in 0..blocks {
        let ([scales, minima], quads) = super::interleaved::block_at(dtype, b, blocks);
        // SAFETY: the group holds `blocks` whole blocks, so their fields and values lie inside
        // it, and the tile's digits, scales and sums cover them.
        unsafe {
            let mut ints = [[_mm256_setzero_si256(); H]; M];
            // Weights for values `4q..4q + 4` of the eight rows of half `h` (`signs`: where to
            // negate the activations), against the tokens' digits.
            let mut dot = |q: usize, h: usize, magnitude: __m256i, signs: __m256i| {
                for (t, ints) in ints.iter_mut().enumerate() {
                    let at = activations.add((b * 8 + q) * 8 * M + 4 * t);
                    let mut high = _mm256_set1_epi32((at as *const i32).read_unaligned());
                    let mut low = _mm256_set1_epi32((at.add(4 * M) as *const i32).read_unaligned());
                    if FORMAT == 0 {
                        high = _mm256_sign_epi8(high, signs);
                        low = _mm256_sign_epi8(low, signs);
                    }
                    let high = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, high), first);
                    let low = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, low), ones);
                    ints[h] = _mm256_add_epi32(ints[h], _mm256_add_epi32(high, low));
                }
            };
            for h in 0..H {
                let half = 32 * (h0 + h);
                if FORMAT == 0 {
                    for q in 0..8 {
                        let w = _mm256_xor_si256(load32(base.add(quads + 64 * q + half)), flip);
                        dot(q, h, _mm256_sign_epi8(w, w), w);
                    }
                } else {
                    for q in 0..4 {
                        let w = load32(base.add(quads + 64 * q + half));
                        dot(q, h, _mm256_and_si256(w, nibbles), w);
                        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(w), nibbles);
                        dot(q + 4, h, high, w);
                    }
                }
            }
            for h in 0..H {
                let field = |at: usize| {
                    _mm256_cvtph_ps(_mm_loadu_si128(base.add(at + 16 * (h0 + h)).cast()))
                };
                let d = field(scales);
                for t in 0..M {
                    let sum = *tile.sums.get_unchecked(b * M + t);
                    let ints = if FORMAT == 1 {
                        _mm256_sub_epi32(ints[t][h], _mm256_set1_epi32(8 * sum))
                    } else {
                        ints[t][h]
                    };
                    let s = _mm256_set1_ps(*tile.scales.get_unchecked(b * M + t));
                    let lane = &mut acc[t][h];
                    *lane = _mm256_add_ps(
                        *lane,
                        _mm256_mul_ps(_mm256_mul_ps(d, s), _mm256_cvtepi32_ps(ints)),
                    );
                    if FORMAT == 2 {
                        let m = field(minima);
                        let sums = _mm256_set1_ps(sum as f32);
                        *lane = _mm256_add_ps(*lane, _mm256_mul_ps(_mm256_mul_ps(m, s), sums));
                    }
                }
            }
        }
    }
    for (out, acc) in out.iter_mut().zip(&acc) {
        for (h, acc) in acc.iter().enumerate() {
            // SAFETY: eight outputs of a row of `out` hold one register's worth.
            unsafe { _mm256_storeu_ps(out[8 * (h0 + h)..].as_mut_ptr(), *acc) };
        }
    }
}
