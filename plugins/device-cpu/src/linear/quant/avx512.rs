//! The quantized dot products of [`super::dots`] on AVX-512 VNNI, 64 products at a time with `vpdpbusd`: groups of 16 interleaved rows of any block-quantized type against up to 8 tokens, one i32 lane per row.
//!
//! `vpdpbusd` adds the four products of unsigned weight bytes and signed activation bytes into
//! each i32 lane. A group tile takes 64 bytes of interleaved weights (four values of each of
//! 16 rows) against each token's four activation bytes, broadcast, so no lane ever needs a
//! horizontal sum. The 32-value blocks join the digits in the lane ([`group`]); the K-quants
//! ([`q4_k_group`], [`q6_k_group`]) sum each sub-block apart, multiply it by the rows' scales
//! (unpacked for 16 rows at once) and keep one sum per digit, as `dots` defines. With one
//! activation digit (`TWO` false) the second digit is zero and its products are skipped: the
//! sums they would add are zero. Every integer
//! equals the portable one and the float operations are those of `dots`, lane by lane, so the
//! result has the same bits.
//!
//! A block of weights is loaded and unpacked once for all the tokens of a tile: the group
//! streams from memory once, and every token meets it in registers.

use std::arch::x86_64::{
    __m512, __m512i, _mm256_loadu_si256, _mm512_add_epi32, _mm512_add_ps, _mm512_and_si512,
    _mm512_andnot_si512, _mm512_cvtepi8_epi16, _mm512_cvtepi32_ps, _mm512_cvtph_ps,
    _mm512_dpbusd_epi32, _mm512_dpwssd_epi32, _mm512_loadu_si512, _mm512_mul_ps,
    _mm512_mullo_epi32, _mm512_or_si512, _mm512_set1_epi8, _mm512_set1_epi32, _mm512_set1_ps,
    _mm512_setzero_ps, _mm512_setzero_si512, _mm512_slli_epi32, _mm512_srai_epi32,
    _mm512_srli_epi16, _mm512_srli_epi32, _mm512_srlv_epi32, _mm512_storeu_ps, _mm512_sub_epi32,
    _mm512_sub_ps, _mm512_ternarylogic_epi32,
};

use plughost_device_abi::DType;

use super::activations::{K_PAIRS, Q8Tile};
use super::dots::{Q4_K_BYTES, Q6_K_BYTES};
use super::interleaved::{GROUP, Q6_K_SUB_BLOCK, check_group, prefetch_ahead, q6_k_at};

/// The 64 bytes at `p`.
///
/// # Safety
/// `p` starts 64 readable bytes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load64(p: *const u8) -> __m512i {
    // SAFETY: the caller's contract; unaligned loads are allowed.
    unsafe { _mm512_loadu_si512(p.cast()) }
}

/// The 16 f16 at `p`, widened.
///
/// # Safety
/// `p` starts 32 readable bytes.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
unsafe fn halves16(p: *const u8) -> __m512 {
    // SAFETY: the caller's contract.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
}

/// The i32 at `p`, broadcast to every lane.
///
/// # Safety
/// `p` starts 4 readable bytes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn broadcast(p: *const i8) -> __m512i {
    // SAFETY: the caller's contract.
    _mm512_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
}

/// `acc + (d · s) · (256 · h + l)` lane by lane, as `dots::scaled_digits`.
#[inline]
#[target_feature(enable = "avx512f")]
fn add_digits(acc: __m512, ds: __m512, h: __m512i, l: __m512i) -> __m512 {
    let joined = _mm512_add_ps(
        _mm512_mul_ps(_mm512_set1_ps(256.0), _mm512_cvtepi32_ps(h)),
        _mm512_cvtepi32_ps(l),
    );
    _mm512_add_ps(acc, _mm512_mul_ps(ds, joined))
}

/// The sums of `M` tokens' digits over one sub-block against the weight operands `weights`
/// (four values of each row each): `vpdpbusd` from 0, the tile's digits of 32-value chunk
/// `chunk` from quad `quad`, each times the rows' scales `scale`, added to `h` and `l` (`l`
/// left as it is without `TWO`).
///
/// # Safety
/// The tile's digits hold chunk `chunk`'s quads `quad..quad + N` for `M` tokens.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn sub_block<const M: usize, const N: usize, const TWO: bool>(
    activations: *const i8,
    (chunk, quad): (usize, usize),
    weights: &[__m512i; N],
    scale: __m512i,
    h: &mut [__m512i; M],
    l: &mut [__m512i; M],
) {
    for t in 0..M {
        let (mut sh, mut sl) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        for (q, &w) in weights.iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe {
                let at = activations.add((chunk * 8 + quad + q) * 8 * M + 4 * t);
                if TWO {
                    sh = _mm512_dpbusd_epi32(sh, w, broadcast(at));
                    sl = _mm512_dpbusd_epi32(sl, w, broadcast(at.add(4 * M)));
                } else if q.is_multiple_of(2) {
                    sh = _mm512_dpbusd_epi32(sh, w, broadcast(at));
                } else {
                    // Two chains, so that one token's products do not wait on each other.
                    sl = _mm512_dpbusd_epi32(sl, w, broadcast(at));
                }
            }
        }
        if TWO {
            h[t] = _mm512_add_epi32(h[t], _mm512_mullo_epi32(sh, scale));
            l[t] = _mm512_add_epi32(l[t], _mm512_mullo_epi32(sl, scale));
        } else {
            let sum = _mm512_add_epi32(sh, sl);
            h[t] = _mm512_add_epi32(h[t], _mm512_mullo_epi32(sum, scale));
        }
    }
}

/// `Σ_k pairs[k] · tile pairs from `at + k`` in i16 pairs (`vpdpwssd`) for one digit.
///
/// # Safety
/// `at` starts `N` readable i32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn pair_sums<const N: usize>(pairs: &[__m512i; N], at: *const i32) -> __m512i {
    let mut sum = _mm512_setzero_si512();
    for (k, &p) in pairs.iter().enumerate() {
        // SAFETY: the caller's contract.
        let words = _mm512_set1_epi32(unsafe { at.add(k).read() });
        sum = _mm512_dpwssd_epi32(sum, p, words);
    }
    sum
}

/// One group of 16 interleaved Q4_K rows against the `M` tokens of `tile`: the 16 outputs of
/// each token, what [`super::dots::dot_row`] gives, with the same bits.
///
/// Per block, the three words of packed scales and minima of the 16 rows unpack as
/// `dots::q4_k_scales_mins` unpacks one row's, a lane per row; each sub-block's eight
/// operands of nibbles meet each token's digits, and its sums take the rows' scales. The
/// minima meet the tokens' sub-block sums in i16 pairs (`vpdpwssd`). With `AHEAD` it asks
/// for each line [`prefetch_ahead`]'s distance on as it first reads one (see
/// [`super::super::RowPrefetch`]), with the same bits.
///
/// # Safety
/// The CPU has AVX-512 F, BW, DQ, VL and VNNI, and AVX2 and F16C (the `avx512_vnni` level).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,f16c")]
pub unsafe fn q4_k_group<const M: usize, const TWO: bool, const AHEAD: bool>(
    group: &[u8],
    tile: Q8Tile<'_>,
) -> [[f32; 16]; M] {
    let blocks = check_group(DType::Q4_K, group, &tile, M);
    let activations = tile.digits.as_ptr();
    let nibbles = _mm512_set1_epi8(0x0F);
    let [low_6, low_4, low_2, byte, words] =
        [0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303, 0xff, 0x00ff_00ff].map(|v| _mm512_set1_epi32(v));
    let mut acc = [_mm512_setzero_ps(); M];
    for b in 0..blocks {
        // SAFETY: `check_group` checked the group holds `blocks` whole blocks, so their
        // fields and values lie inside it, and the tile's digits, scales and pairs cover them.
        unsafe {
            let base = group.as_ptr().add(b * GROUP * Q4_K_BYTES);
            // The scales and minima; each line of nibbles below as it is first read.
            if AHEAD {
                prefetch_ahead(base, 256);
            }
            let (a, m, c) = (
                load64(base.add(64)),
                load64(base.add(128)),
                load64(base.add(192)),
            );
            let high_bits = |w: __m512i| {
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(w), low_2))
            };
            let scales = [
                _mm512_and_si512(a, low_6),
                _mm512_or_si512(_mm512_and_si512(c, low_4), high_bits(a)),
            ];
            let minima = [
                _mm512_and_si512(m, low_6),
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi32::<4>(c), low_4),
                    high_bits(m),
                ),
            ];
            let (mut h, mut l) = ([_mm512_setzero_si512(); M], [_mm512_setzero_si512(); M]);
            for j in 0..8 {
                let shift = _mm512_set1_epi32(8 * (j as i32 % 4));
                let scale = _mm512_and_si512(_mm512_srlv_epi32(scales[j / 4], shift), byte);
                let quads = base.add(256 + 64 * 8 * (j / 2));
                let weights: [__m512i; 8] = std::array::from_fn(|i| {
                    if AHEAD && j % 2 == 0 {
                        prefetch_ahead(quads.add(64 * i), 64);
                    }
                    let w = load64(quads.add(64 * i));
                    if j % 2 == 0 {
                        _mm512_and_si512(w, nibbles)
                    } else {
                        _mm512_and_si512(_mm512_srli_epi16::<4>(w), nibbles)
                    }
                });
                let at = (8 * b + j, 0);
                sub_block::<M, 8, TWO>(activations, at, &weights, scale, &mut h, &mut l);
            }
            // Minima (0, 2), (1, 3), (4, 6), (5, 7) in i16 pairs, the tile's order.
            let pairs = [
                _mm512_and_si512(minima[0], words),
                _mm512_and_si512(_mm512_srli_epi32::<8>(minima[0]), words),
                _mm512_and_si512(minima[1], words),
                _mm512_and_si512(_mm512_srli_epi32::<8>(minima[1]), words),
            ];
            let (d, dmin) = (halves16(base), halves16(base.add(32)));
            for t in 0..M {
                let at = b * M + t;
                let words = tile.pairs.as_ptr().add(at * K_PAIRS);
                let mut minimum = _mm512_slli_epi32::<8>(pair_sums(&pairs, words));
                if TWO {
                    minimum = _mm512_add_epi32(minimum, pair_sums(&pairs, words.add(4)));
                }
                let s = _mm512_set1_ps(*tile.scales.get_unchecked(at));
                acc[t] = add_digits(acc[t], _mm512_mul_ps(d, s), h[t], l[t]);
                acc[t] = _mm512_sub_ps(
                    acc[t],
                    _mm512_mul_ps(_mm512_mul_ps(dmin, s), _mm512_cvtepi32_ps(minimum)),
                );
            }
        }
    }
    store(acc)
}

/// One group of 16 interleaved Q6_K rows against the `M` tokens of `tile`, as
/// [`q4_k_group`]: each sub-block's four operands of 6-bit values come from its three quads
/// (the low six bits of each, and the fourth from their top two bits), as the group keeps
/// them; the values' `- 32` is taken off after the scales, as the rows' scale pairs times the
/// tokens' sub-block sums (`vpdpwssd`), times 32.
///
/// # Safety
/// The CPU has AVX-512 F, BW, DQ, VL and VNNI, and AVX2 and F16C (the `avx512_vnni` level).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,f16c")]
pub unsafe fn q6_k_group<const M: usize, const TWO: bool, const AHEAD: bool>(
    group: &[u8],
    tile: Q8Tile<'_>,
) -> [[f32; 16]; M] {
    let blocks = check_group(DType::Q6_K, group, &tile, M);
    let activations = tile.digits.as_ptr();
    let [six_bits, nibbles, bits_01] = [0x3F, 0x0F, 0x03].map(|v| _mm512_set1_epi8(v));
    let mut acc = [_mm512_setzero_ps(); M];
    for b in 0..blocks {
        // SAFETY: as in `q4_k_group`.
        unsafe {
            let base = group.as_ptr().add(b * GROUP * Q6_K_BYTES);
            let [scales, values, d] = q6_k_at(b).map(|at| base.add(at));
            // The scales and `d` (at either end); each line of values below as first read.
            if AHEAD {
                prefetch_ahead(base, 5 * 64);
            }
            let pairs: [__m512i; 8] = std::array::from_fn(|p| {
                _mm512_cvtepi8_epi16(_mm256_loadu_si256(scales.add(32 * p).cast()))
            });
            let scale = |j: usize| {
                let pair = pairs[j / 2];
                if j.is_multiple_of(2) {
                    _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(pair))
                } else {
                    _mm512_srai_epi32::<16>(pair)
                }
            };
            let (mut h, mut l) = ([_mm512_setzero_si512(); M], [_mm512_setzero_si512(); M]);
            for j in 0..16 {
                let quads = values.add(Q6_K_SUB_BLOCK * j);
                if AHEAD {
                    prefetch_ahead(quads, Q6_K_SUB_BLOCK);
                }
                let [x, y, z] = [0, 1, 2].map(|k| load64(quads.add(64 * k)));
                // The fourth quad's bits: 0–1 from `x`'s top and 2–3 from `y`'s (one bit
                // select), then 4–5 from `z`'s, whose top bits masked first leave the shift
                // nothing from the next byte: `(low & 0x0F) | high`.
                let low = _mm512_ternarylogic_epi32::<0xCA>(
                    bits_01,
                    _mm512_srli_epi16::<6>(x),
                    _mm512_srli_epi16::<4>(y),
                );
                let high = _mm512_srli_epi16::<2>(_mm512_andnot_si512(six_bits, z));
                let fourth = _mm512_ternarylogic_epi32::<0xEC>(low, high, nibbles);
                let operands = [
                    _mm512_and_si512(x, six_bits),
                    _mm512_and_si512(y, six_bits),
                    _mm512_and_si512(z, six_bits),
                    fourth,
                ];
                let chunk = (8 * b + j / 2, 4 * (j % 2));
                sub_block::<M, 4, TWO>(activations, chunk, &operands, scale(j), &mut h, &mut l);
            }
            let d = halves16(d);
            for t in 0..M {
                let at = b * M + t;
                let words = tile.pairs.as_ptr().add(at * K_PAIRS + 8);
                let h = _mm512_sub_epi32(h[t], _mm512_slli_epi32::<5>(pair_sums(&pairs, words)));
                let l = if TWO {
                    _mm512_sub_epi32(
                        l[t],
                        _mm512_slli_epi32::<5>(pair_sums(&pairs, words.add(8))),
                    )
                } else {
                    l[t]
                };
                let s = _mm512_set1_ps(*tile.scales.get_unchecked(at));
                acc[t] = add_digits(acc[t], _mm512_mul_ps(d, s), h, l);
            }
        }
    }
    store(acc)
}

/// Each token's 16 lanes, one per row.
#[inline]
#[target_feature(enable = "avx512f")]
fn store<const M: usize>(acc: [__m512; M]) -> [[f32; 16]; M] {
    let mut out = [[0.0; 16]; M];
    for t in 0..M {
        // SAFETY: a row of `out` holds 16 f32, one register's worth.
        unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
    }
    out
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
/// one add for all 16 rows (Q4_1's minimum as many again). `AHEAD` as in [`q4_k_group`].
///
/// # Safety
/// The CPU has AVX-512 F, BW, DQ, VL and VNNI, and AVX2 and F16C (the `avx512_vnni` level).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,f16c")]
pub unsafe fn group<const M: usize, const FORMAT: u8, const TWO: bool, const AHEAD: bool>(
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
            // Weights for values `4q..4q + 4` and `4r..4r + 4` of each row, against the
            // tokens' digits. With one digit, quad `q` goes to `high` and `r` to `low`: two
            // chains, so that one token's products do not wait on each other. Which chain a
            // quad joins is fixed here, not by a quad index at run time: a loop that chose
            // it at run time kept the chains in memory rather than in registers.
            let mut dot_pair = |(q, w): (usize, __m512i), (r, v): (usize, __m512i)| {
                for t in 0..M {
                    let digits = |quad: usize| activations.add((b * 8 + quad) * 8 * M + 4 * t);
                    let (at, next) = (digits(q), digits(r));
                    if TWO {
                        high[t] = _mm512_dpbusd_epi32(high[t], w, broadcast(at));
                        low[t] = _mm512_dpbusd_epi32(low[t], w, broadcast(at.add(4 * M)));
                        high[t] = _mm512_dpbusd_epi32(high[t], v, broadcast(next));
                        low[t] = _mm512_dpbusd_epi32(low[t], v, broadcast(next.add(4 * M)));
                    } else {
                        high[t] = _mm512_dpbusd_epi32(high[t], w, broadcast(at));
                        low[t] = _mm512_dpbusd_epi32(low[t], v, broadcast(next));
                    }
                }
            };
            if FORMAT == 0 {
                let quad = |q: usize| {
                    if AHEAD {
                        prefetch_ahead(base.add(quads + 64 * q), 64);
                    }
                    (q, _mm512_loadu_si512(base.add(quads + 64 * q).cast()))
                };
                for q in (0..8).step_by(2) {
                    dot_pair(quad(q), quad(q + 1));
                }
            } else {
                // The Q4 types' scales' line, then each line of values as it is read.
                if AHEAD {
                    prefetch_ahead(base.add(scales), 64);
                }
                for q in 0..4 {
                    if AHEAD {
                        prefetch_ahead(base.add(quads + 64 * q), 64);
                    }
                    let w = _mm512_loadu_si512(base.add(quads + 64 * q).cast());
                    let low_nibbles = _mm512_and_si512(w, nibbles);
                    let high_nibbles = _mm512_and_si512(_mm512_srli_epi16::<4>(w), nibbles);
                    dot_pair((q, low_nibbles), (q + 4, high_nibbles));
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
                let joined = if TWO {
                    _mm512_add_epi32(_mm512_slli_epi32::<8>(high[t]), low[t])
                } else {
                    _mm512_slli_epi32::<8>(_mm512_add_epi32(high[t], low[t]))
                };
                let ints = _mm512_sub_epi32(joined, _mm512_set1_epi32(offset));
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
