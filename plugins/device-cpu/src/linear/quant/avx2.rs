//! The quantized dot products of [`super::dots`] on AVX2, four-product sums from `vpmaddubsw` + `vpmaddwd`: groups of 16 interleaved rows of any block-quantized type in two halves of eight, one lane per row, against up to 8 tokens.
//!
//! `vpmaddubsw` multiplies unsigned bytes by signed bytes and adds neighbours into i16 with
//! saturation; no sum here can saturate: nibbles (at most 15) and 6-bit values (at most 63)
//! times activations in `-127..=127` give at most `2 · 63 · 127`, and a signed weight byte
//! (Q8_0, in [`group`]) is made unsigned by moving its sign onto the activation
//! (`vpsignb`), at most `2 · 128 · 127`. `vpmaddwd` then adds pairs into i32, by ones or by
//! the K-quants' sub-block scales, and the sums are joined or kept per digit as `dots` says.
//! With one activation digit (`TWO` false) the second is zero and its products are skipped.
//! Every integer equals the portable one, and the float operations are those of `dots`, lane
//! by lane, so the result has the same bits.
//!
//! A block of weights is loaded and unpacked once for all the tokens of a tile: the group
//! streams from memory once, and each token meets it in registers.

use std::arch::x86_64::{
    __m256, __m256i, _mm_loadu_si128, _mm256_add_epi16, _mm256_add_epi32, _mm256_add_ps,
    _mm256_and_si256, _mm256_blend_epi16, _mm256_cvtepi8_epi16, _mm256_cvtepi32_ps,
    _mm256_cvtph_ps, _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_mul_ps,
    _mm256_or_si256, _mm256_set1_epi8, _mm256_set1_epi16, _mm256_set1_epi32, _mm256_set1_ps,
    _mm256_setzero_ps, _mm256_setzero_si256, _mm256_sign_epi8, _mm256_slli_epi32,
    _mm256_srli_epi16, _mm256_srli_epi32, _mm256_srlv_epi32, _mm256_storeu_ps, _mm256_sub_epi32,
    _mm256_sub_ps, _mm256_xor_si256,
};

use plughost_device_abi::DType;

use super::activations::{K_PAIRS, Q8Tile};
use super::dots::{Q4_K_BYTES, Q6_K_BYTES};
use super::interleaved::{GROUP, Q6_K_SUB_BLOCK, check_group, prefetch_ahead, q6_k_at};

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

/// The eight f16 at `p`, widened.
///
/// # Safety
/// `p` starts 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn halves8(p: *const u8) -> __m256 {
    // SAFETY: the caller's contract.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
}

/// `acc + (d · s) · (256 · h + l)` lane by lane, as `dots::scaled_digits`.
#[inline]
#[target_feature(enable = "avx2")]
fn add_digits(acc: __m256, ds: __m256, h: __m256i, l: __m256i) -> __m256 {
    let joined = _mm256_add_ps(
        _mm256_mul_ps(_mm256_set1_ps(256.0), _mm256_cvtepi32_ps(h)),
        _mm256_cvtepi32_ps(l),
    );
    _mm256_add_ps(acc, _mm256_mul_ps(ds, joined))
}

/// `Σ_k pairs[k] · the i16 pair words from `at + k`` (`vpmaddwd`) for one digit.
///
/// # Safety
/// `at` starts `N` readable i32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pair_sums<const N: usize>(pairs: &[__m256i; N], at: *const i32) -> __m256i {
    let mut sum = _mm256_setzero_si256();
    for (k, &p) in pairs.iter().enumerate() {
        // SAFETY: the caller's contract.
        let words = _mm256_set1_epi32(unsafe { at.add(k).read() });
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, words));
    }
    sum
}

/// The four activation bytes at `at` in every lane.
///
/// # Safety
/// `activations + at` starts four readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn broadcast_digits(activations: *const i8, at: usize) -> __m256i {
    // SAFETY: the caller's contract.
    _mm256_set1_epi32(unsafe { (activations.add(at) as *const i32).read_unaligned() })
}

/// `pairs` added in i16 to the run's `sum`, or starting it (`first`).
#[inline]
#[target_feature(enable = "avx2")]
fn add_in_run(first: bool, sum: __m256i, pairs: __m256i) -> __m256i {
    if first {
        pairs
    } else {
        _mm256_add_epi16(sum, pairs)
    }
}

/// Whether quad `q` of `N` ends a run of `RUN`: the i16 sums go to i32 after it.
const fn run_ends<const N: usize, const RUN: usize>(q: usize) -> bool {
    q % RUN == RUN - 1 || q == N - 1
}

/// Each token's digit sums over one sub-block against the weight operands `weights` (four
/// values of each of eight rows each): the tile's digits of 32-value chunk `chunk` from quad
/// `quad`, the `vpmaddubsw` pairs of `RUN` quads at a time added in i16, then times `scale`
/// (the rows' scale in both i16 of a lane) by `vpmaddwd`, added to `h[t][half]` and
/// `l[t][half]` (`l` left as it is without `TWO`).
///
/// Adding in i16 first spares a `vpmaddwd` per quad, and these are what bounds the tile on a
/// core with one vector multiplier; the integers are the same, as long as `RUN` pairs cannot
/// leave i16, which the callers assert for their weights' largest value.
///
/// # Safety
/// The tile's digits hold chunk `chunk`'s quads `quad..quad + N` for `M` tokens.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn sub_block<
    const M: usize,
    const N: usize,
    const RUN: usize,
    const H: usize,
    const TWO: bool,
>(
    activations: *const i8,
    (chunk, quad, half): (usize, usize, usize),
    weights: &[__m256i; N],
    scale: __m256i,
    [h, l]: [&mut [[__m256i; H]; M]; 2],
) {
    for t in 0..M {
        let (mut high, mut low) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for (q, &w) in weights.iter().enumerate() {
            let at = (chunk * 8 + quad + q) * 8 * M + 4 * t;
            // SAFETY: the caller's contract: both digits' four bytes lie in the tile.
            let digits = |at: usize| unsafe { broadcast_digits(activations, at) };
            let first = q % RUN == 0;
            high = add_in_run(first, high, _mm256_maddubs_epi16(w, digits(at)));
            if TWO {
                low = add_in_run(first, low, _mm256_maddubs_epi16(w, digits(at + 4 * M)));
            }
            if run_ends::<N, RUN>(q) {
                h[t][half] = _mm256_add_epi32(h[t][half], _mm256_madd_epi16(high, scale));
                if TWO {
                    l[t][half] = _mm256_add_epi32(l[t][half], _mm256_madd_epi16(low, scale));
                }
            }
        }
    }
}

/// [`sub_block`] for one token and every half at once: each quad's activation digits are
/// broadcast once and meet the weights of all `H` halves (`weight(q, half)`), where
/// [`sub_block`] broadcasts them again for every half. The same integers in the same order per
/// half, so the same bits.
///
/// # Safety
/// As [`sub_block`] for a tile of one token, chunk `chunk` from quad 0.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn one_token_sub_block<const N: usize, const RUN: usize, const H: usize, const TWO: bool>(
    activations: *const i8,
    chunk: usize,
    weight: impl Fn(usize, usize) -> __m256i,
    scale: &[__m256i; H],
    [h, l]: [&mut [__m256i; H]; 2],
) {
    let (mut high, mut low) = ([_mm256_setzero_si256(); H], [_mm256_setzero_si256(); H]);
    for q in 0..N {
        let at = (chunk * 8 + q) * 8;
        // SAFETY: the caller's contract: both digits' four bytes lie in the tile.
        let digits_high = unsafe { broadcast_digits(activations, at) };
        // SAFETY: as above; read only with a second digit.
        let digits_low = TWO.then(|| unsafe { broadcast_digits(activations, at + 4) });
        let first = q % RUN == 0;
        for (half, (high, low)) in high.iter_mut().zip(&mut low).enumerate() {
            let w = weight(q, half);
            *high = add_in_run(first, *high, _mm256_maddubs_epi16(w, digits_high));
            if let Some(digits) = digits_low {
                *low = add_in_run(first, *low, _mm256_maddubs_epi16(w, digits));
            }
        }
        if run_ends::<N, RUN>(q) {
            for half in 0..H {
                h[half] = _mm256_add_epi32(h[half], _mm256_madd_epi16(high[half], scale[half]));
                if TWO {
                    l[half] = _mm256_add_epi32(l[half], _mm256_madd_epi16(low[half], scale[half]));
                }
            }
        }
    }
}

/// The `vpmaddubsw` pairs that [`sub_block`] may add in i16 for weights up to `largest`:
/// each pair is at most `2 · largest · 127`.
const fn run_fits(run: usize, largest: usize) -> bool {
    run * 2 * largest * 127 <= i16::MAX as usize
}

/// Q4_K's nibbles: a sub-block's eight quads in one run.
const Q4_K_RUN: usize = 8;
/// Q6_K's 6-bit values: two quads per run.
const Q6_K_RUN: usize = 2;
const _: () = assert!(run_fits(Q4_K_RUN, 15) && run_fits(Q6_K_RUN, 63));

/// A K-quant's group tile, `$name`, from its halves function `$halves`: both halves of
/// eight rows in one pass for one or two tokens (the group streams once), one half at a time
/// for more (the accumulators fill the 16 registers), as [`group`] does.
macro_rules! k_group {
    ($name:ident, $dtype:expr, $halves:ident) => {
        #[doc = concat!("[`super::avx512::", stringify!($name), "`] on AVX2, in halves of eight rows.")]
        ///
        /// # Safety
        /// The CPU has AVX2, FMA and F16C (the `avx2` level).
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $name<const M: usize, const TWO: bool, const AHEAD: bool>(
            group: &[u8],
            tile: Q8Tile<'_>,
        ) -> [[f32; 16]; M] {
            let blocks = check_group($dtype, group, &tile, M);
            let mut out = [[0.0; 16]; M];
            // SAFETY: `check_group` checked the group and the tile, for `blocks` blocks.
            unsafe {
                if M <= 2 {
                    $halves::<M, 2, TWO, AHEAD>((group, blocks), tile, 0, &mut out);
                } else {
                    $halves::<M, 1, TWO, AHEAD>((group, blocks), tile, 0, &mut out);
                    $halves::<M, 1, TWO, AHEAD>((group, blocks), tile, 1, &mut out);
                }
            }
            out
        }
    };
}

k_group!(q4_k_group, DType::Q4_K, q4_k_halves);
k_group!(q6_k_group, DType::Q6_K, q6_k_halves);

/// Halves `h0..h0 + H` of [`q4_k_group`]: outputs `8 · h0..8 · (h0 + H)` of each token.
///
/// # Safety
/// As [`q4_k_group`], with `group` holding `blocks` whole blocks and `tile` covering them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_halves<const M: usize, const H: usize, const TWO: bool, const AHEAD: bool>(
    (group, blocks): (&[u8], usize),
    tile: Q8Tile<'_>,
    h0: usize,
    out: &mut [[f32; 16]; M],
) {
    let activations = tile.digits.as_ptr();
    let nibbles = _mm256_set1_epi8(0x0F);
    let [low_6, low_4, low_2, byte, words] =
        [0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303, 0xff, 0x00ff_00ff].map(|v| _mm256_set1_epi32(v));
    let mut acc = [[_mm256_setzero_ps(); H]; M];
    for b in 0..blocks {
        // SAFETY: the group holds `blocks` whole blocks, so their fields and values lie inside
        // it, and the tile's digits, scales and pairs cover them.
        unsafe {
            let base = group.as_ptr().add(b * GROUP * Q4_K_BYTES);
            // The first half's pass asks for the lines (`AHEAD`): the scales and minima here,
            // each line of nibbles as it is first read.
            let first_pass = AHEAD && h0 == 0;
            if first_pass {
                prefetch_ahead(base, 256);
            }
            let (mut h, mut l) = (
                [[_mm256_setzero_si256(); H]; M],
                [[_mm256_setzero_si256(); H]; M],
            );
            let mut scales = [[_mm256_setzero_si256(); 2]; H];
            let mut minima = [[_mm256_setzero_si256(); 2]; H];
            for half in 0..H {
                let rows = 32 * (h0 + half);
                let word = |at: usize| load32(base.add(at + rows));
                let (a, m, c) = (word(64), word(128), word(192));
                let high_bits = |w: __m256i| {
                    _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(w), low_2))
                };
                scales[half] = [
                    _mm256_and_si256(a, low_6),
                    _mm256_or_si256(_mm256_and_si256(c, low_4), high_bits(a)),
                ];
                minima[half] = [
                    _mm256_and_si256(m, low_6),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi32::<4>(c), low_4),
                        high_bits(m),
                    ),
                ];
            }
            // Sub-block `j`'s scale of each row of half `half`, in both i16 of its lane.
            let scale = |half: usize, j: usize| {
                let shift = _mm256_set1_epi32(8 * (j as i32 % 4));
                let scale = _mm256_and_si256(_mm256_srlv_epi32(scales[half][j / 4], shift), byte);
                _mm256_or_si256(scale, _mm256_slli_epi32::<16>(scale))
            };
            // Values `4i..4i + 4` of sub-block `j` of the rows of half `half`: the low nibbles
            // of the sub-block pair's bytes for an even `j`, the high ones for an odd.
            let quads = |half: usize, j: usize| base.add(256 + 64 * 8 * (j / 2) + 32 * (h0 + half));
            let nibbles_of = |half: usize, j: usize, i: usize| {
                let w = load32(quads(half, j).add(64 * i));
                if j.is_multiple_of(2) {
                    _mm256_and_si256(w, nibbles)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(w), nibbles)
                }
            };
            if M == 1 {
                // A decode: each activation quad, broadcast once, meets both halves.
                for j in 0..8 {
                    if first_pass && j % 2 == 0 {
                        for i in 0..8 {
                            prefetch_ahead(quads(0, j).add(64 * i), 64);
                        }
                    }
                    let scales: [__m256i; H] = std::array::from_fn(|half| scale(half, j));
                    one_token_sub_block::<8, Q4_K_RUN, H, TWO>(
                        activations,
                        8 * b + j,
                        |i, half| nibbles_of(half, j, i),
                        &scales,
                        [&mut h[0], &mut l[0]],
                    );
                }
            } else {
                for half in 0..H {
                    for j in 0..8 {
                        let weights: [__m256i; 8] = std::array::from_fn(|i| {
                            if first_pass && half == 0 && j % 2 == 0 {
                                prefetch_ahead(quads(0, j).add(64 * i), 64);
                            }
                            nibbles_of(half, j, i)
                        });
                        sub_block::<M, 8, Q4_K_RUN, H, TWO>(
                            activations,
                            (8 * b + j, 0, half),
                            &weights,
                            scale(half, j),
                            [&mut h, &mut l],
                        );
                    }
                }
            }
            for (half, &[low, high]) in minima.iter().enumerate() {
                // Minima (0, 2), (1, 3), (4, 6), (5, 7) in i16 pairs, the tile's order.
                let pairs = [
                    _mm256_and_si256(low, words),
                    _mm256_and_si256(_mm256_srli_epi32::<8>(low), words),
                    _mm256_and_si256(high, words),
                    _mm256_and_si256(_mm256_srli_epi32::<8>(high), words),
                ];
                let fields = 16 * (h0 + half);
                let (d, dmin) = (halves8(base.add(fields)), halves8(base.add(32 + fields)));
                for t in 0..M {
                    let at = b * M + t;
                    let words = tile.pairs.as_ptr().add(at * K_PAIRS);
                    let mut minimum = _mm256_slli_epi32::<8>(pair_sums(&pairs, words));
                    if TWO {
                        minimum = _mm256_add_epi32(minimum, pair_sums(&pairs, words.add(4)));
                    }
                    let s = _mm256_set1_ps(*tile.scales.get_unchecked(at));
                    let lane =
                        add_digits(acc[t][half], _mm256_mul_ps(d, s), h[t][half], l[t][half]);
                    acc[t][half] = _mm256_sub_ps(
                        lane,
                        _mm256_mul_ps(_mm256_mul_ps(dmin, s), _mm256_cvtepi32_ps(minimum)),
                    );
                }
            }
        }
    }
    store(&acc, h0, out);
}

/// Halves `h0..h0 + H` of [`q6_k_group`]: outputs `8 · h0..8 · (h0 + H)` of each token.
///
/// # Safety
/// As [`q6_k_group`], with `group` holding `blocks` whole blocks and `tile` covering them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_halves<const M: usize, const H: usize, const TWO: bool, const AHEAD: bool>(
    (group, blocks): (&[u8], usize),
    tile: Q8Tile<'_>,
    h0: usize,
    out: &mut [[f32; 16]; M],
) {
    let activations = tile.digits.as_ptr();
    let [six_bits, bits_01, bits_23, bits_45] =
        [0x3F, 0x03, 0x0C, 0x30].map(|v| _mm256_set1_epi8(v));
    let mut acc = [[_mm256_setzero_ps(); H]; M];
    for b in 0..blocks {
        // SAFETY: as in `q4_k_halves`.
        unsafe {
            let base = group.as_ptr().add(b * GROUP * Q6_K_BYTES);
            let [scales, values, d] = q6_k_at(b).map(|at| base.add(at));
            // The first half's pass asks for the lines (`AHEAD`).
            let first_pass = AHEAD && h0 == 0;
            if first_pass {
                prefetch_ahead(base, 5 * 64);
            }
            let (mut h, mut l) = (
                [[_mm256_setzero_si256(); H]; M],
                [[_mm256_setzero_si256(); H]; M],
            );
            for half in 0..H {
                let rows = 32 * (h0 + half);
                let pair = |p: usize| {
                    let at = scales.add(32 * p + 16 * (h0 + half));
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(at.cast()))
                };
                let pairs: [__m256i; 8] = std::array::from_fn(pair);
                for j in 0..16 {
                    // The row's scale of sub-block `j` in both i16 of its lane.
                    let pair = pairs[j / 2];
                    let scale = if j % 2 == 0 {
                        _mm256_blend_epi16::<0xAA>(pair, _mm256_slli_epi32::<16>(pair))
                    } else {
                        _mm256_blend_epi16::<0xAA>(_mm256_srli_epi32::<16>(pair), pair)
                    };
                    let quads = values.add(Q6_K_SUB_BLOCK * j + rows);
                    if first_pass && half == 0 {
                        prefetch_ahead(values.add(Q6_K_SUB_BLOCK * j), Q6_K_SUB_BLOCK);
                    }
                    let [x, y, z] = [0, 1, 2].map(|k| load32(quads.add(64 * k)));
                    // The fourth quad's bits: 0–1 from `x`'s top, 2–3 from `y`'s, 4–5 from
                    // `z`'s; the masks drop what the 16-bit shifts bring from the next byte.
                    let fourth = _mm256_or_si256(
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<6>(x), bits_01),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(y), bits_23),
                        ),
                        _mm256_and_si256(_mm256_srli_epi16::<2>(z), bits_45),
                    );
                    let operands = [
                        _mm256_and_si256(x, six_bits),
                        _mm256_and_si256(y, six_bits),
                        _mm256_and_si256(z, six_bits),
                        fourth,
                    ];
                    let at = (8 * b + j / 2, 4 * (j % 2), half);
                    sub_block::<M, 4, Q6_K_RUN, H, TWO>(
                        activations,
                        at,
                        &operands,
                        scale,
                        [&mut h, &mut l],
                    );
                }
                let d = halves8(d.add(16 * (h0 + half)));
                for t in 0..M {
                    let at = b * M + t;
                    let words = tile.pairs.as_ptr().add(at * K_PAIRS + 8);
                    let offset = |words| _mm256_slli_epi32::<5>(pair_sums(&pairs, words));
                    let high = _mm256_sub_epi32(h[t][half], offset(words));
                    let low = if TWO {
                        _mm256_sub_epi32(l[t][half], offset(words.add(8)))
                    } else {
                        l[t][half]
                    };
                    let s = _mm256_set1_ps(*tile.scales.get_unchecked(at));
                    acc[t][half] = add_digits(acc[t][half], _mm256_mul_ps(d, s), high, low);
                }
            }
        }
    }
    store(&acc, h0, out);
}

/// Halves `h0..h0 + H` of each token's lanes into `out`.
#[inline]
#[target_feature(enable = "avx2")]
fn store<const M: usize, const H: usize>(
    acc: &[[__m256; H]; M],
    h0: usize,
    out: &mut [[f32; 16]; M],
) {
    for (out, acc) in out.iter_mut().zip(acc) {
        for (h, acc) in acc.iter().enumerate() {
            // SAFETY: eight outputs of a row of `out` hold one register's worth.
            unsafe { _mm256_storeu_ps(out[8 * (h0 + h)..].as_mut_ptr(), *acc) };
        }
    }
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
pub unsafe fn group<const M: usize, const FORMAT: u8, const TWO: bool, const AHEAD: bool>(
    group: &[u8],
    tile: Q8Tile<'_>,
) -> [[f32; 16]; M] {
    let dtype = super::interleaved::format_type(FORMAT);
    let blocks = super::interleaved::check_group(dtype, group, &tile, M);
    let mut out = [[0.0; 16]; M];
    // SAFETY: `check_group` checked the group and the tile, for `blocks` blocks.
    unsafe {
        if M <= 2 {
            halves::<M, FORMAT, 2, TWO, AHEAD>((group, blocks), tile, 0, &mut out);
        } else {
            halves::<M, FORMAT, 1, TWO, AHEAD>((group, blocks), tile, 0, &mut out);
            halves::<M, FORMAT, 1, TWO, AHEAD>((group, blocks), tile, 1, &mut out);
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
unsafe fn halves<
    const M: usize,
    const FORMAT: u8,
    const H: usize,
    const TWO: bool,
    const AHEAD: bool,
>(
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
                    let digit = |at: *const i8| {
                        let digits = _mm256_set1_epi32((at as *const i32).read_unaligned());
                        if FORMAT == 0 {
                            _mm256_sign_epi8(digits, signs)
                        } else {
                            digits
                        }
                    };
                    let high = _mm256_maddubs_epi16(magnitude, digit(at));
                    ints[h] = _mm256_add_epi32(ints[h], _mm256_madd_epi16(high, first));
                    if TWO {
                        let low = _mm256_maddubs_epi16(magnitude, digit(at.add(4 * M)));
                        ints[h] = _mm256_add_epi32(ints[h], _mm256_madd_epi16(low, ones));
                    }
                }
            };
            // The first half's pass asks for the block's lines (its scales, then its values),
            // before it reads them (`AHEAD`).
            if AHEAD && h0 == 0 {
                prefetch_ahead(base.add(scales), 64);
                for q in 0..[8, 4, 4][usize::from(FORMAT)] {
                    prefetch_ahead(base.add(quads + 64 * q), 64);
                }
            }
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
    store(&acc, h0, out);
}
