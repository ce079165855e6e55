//! Activation rows quantized to int8 for the integer dot products with block-quantized weights ([`Q8Rows`]): in llama.cpp's `q8_0` and `q8_K` blocks, optionally with a second int8 digit for the residual.
//!
//! A row of `K` f32 values is cut into blocks of 32 (for Q8_0, Q4_0 and Q4_1 weights) or 256
//! (for the K-quants): each block gets the step `d = max|x| / 127` and values
//! `q = round(x / d)` in `-127..=127`, so `x ≈ d * q`, as llama.cpp quantizes activations.
//! Then the residual `x - d * q` (at most `d / 2`) is quantized with the step `d / 256` into a
//! second digit `q'`, so `x ≈ (d / 256) · (256 q + q')`: the activations keep some 15 bits
//! instead of 8. Both digits meet the weights in int8 dot products, and the kernels join the
//! two sums in integers (`256 · high + low`), so one scale, `d / 256`, applies to both. One
//! digit alone moves the logits enough to flip near-ties of a small model (SmolLM2-135M's answer
//! to "What is the capital of France?" among them); two keep them where f32 activations put
//! them. The second digit doubles the integer products, so it is a choice
//! ([`ActivationDigits`]): with one digit the second is zero everywhere, the definition of the
//! dot product stays the same, and the tiles skip the zero digit's products.
//!
//! Each run of 16 values also keeps the joined sum of its digits, `Σ 256 q + q'`, which the
//! weight formats with an offset (Q4_0's `- 8`, Q4_1's and Q4_K's minimum, Q6_K's `- 32`)
//! multiply once instead of per element. A row's values depend on that row alone, which is what
//! keeps a token's outputs the same in any batch.

use smallvec::SmallVec;

use crate::isa::Isa;
#[cfg(target_arch = "x86_64")]
use crate::isa::IsaLevel;

/// Values per running sum.
pub const SUM_SPAN: usize = 16;
/// Blocks whose steps [`Q8RowsSpan::fill`] computes together.
const STEP_BATCH: usize = 16;
/// The largest block: the K-quants' 256.
const MAX_BLOCK: usize = 256;
/// The second digit's step is the first's divided by this.
pub const DIGIT: f32 = 256.0;

/// How many int8 digits each quantized activation keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationDigits {
    /// `round(x / d)` alone, llama.cpp's arithmetic: half the integer products of two digits,
    /// so prefill and batched decode multiply at twice the rate.
    One,
    /// The value and its residual, some 15 bits: the products of f32 activations to within
    /// f32 rounding, near-ties included.
    #[default]
    Two,
}

impl ActivationDigits {
    /// 1 or 2, as the option spells it.
    pub fn count(self) -> u8 {
        match self {
            ActivationDigits::One => 1,
            ActivationDigits::Two => 2,
        }
    }
}

impl std::str::FromStr for ActivationDigits {
    type Err = String;

    fn from_str(text: &str) -> Result<ActivationDigits, String> {
        match text {
            "1" => Ok(ActivationDigits::One),
            "2" => Ok(ActivationDigits::Two),
            other => Err(format!("`{other}` is neither `1` nor `2`")),
        }
    }
}

/// `T` rows of `K` activations quantized in blocks of `block` values, in one or two int8
/// digits (the second zero with one).
#[derive(Debug, Default)]
pub struct Q8Rows {
    digits: ActivationDigits,
    block: usize,
    inner: usize,
    high: Vec<i8>,
    low: Vec<i8>,
    /// `d / 256` per block.
    scales: Vec<f32>,
    /// `Σ 256 q + q'` per 16 values.
    sums: Vec<i32>,
}

/// One quantized row: both digits of value `k`, the scale of block `k / block`, the joined
/// sum of span `k / 16`.
#[derive(Clone, Copy, Debug)]
pub struct Q8Row<'a> {
    pub high: &'a [i8],
    pub low: &'a [i8],
    pub scales: &'a [f32],
    pub sums: &'a [i32],
}

/// Adding and subtracting 1.5 · 2^23 rounds an f32 of magnitude below 2^22 to the nearest
/// integer, ties to even, in two plain additions (no libm call, and vectorizable).
const ROUNDING: f32 = 12_582_912.0;

/// The largest `|v|` of `values`, NaN ignored (0 for none), as `f32::max` takes it.
///
/// Taken on the bits: those of `|v|` order as `|v|` does, and a NaN's (above infinity's)
/// count as 0. Integer maxima vectorize; float ones, which must mind NaN, stayed a chain of
/// scalar maxima that was most of a 32-value block's time.
#[inline(always)]
fn max_magnitude(values: &[f32]) -> f32 {
    const INFINITY: u32 = 0x7F80_0000;
    let magnitude = |v: &f32| {
        let bits = v.to_bits() & 0x7FFF_FFFF;
        if bits > INFINITY { 0 } else { bits }
    };
    let mut lanes = [0u32; 16];
    let mut chunks = values.chunks_exact(16);
    for chunk in &mut chunks {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            *lane = (*lane).max(magnitude(v));
        }
    }
    let rest = chunks.remainder().iter().map(magnitude).fold(0, u32::max);
    f32::from_bits(lanes.into_iter().fold(rest, u32::max))
}

/// The sum of a run of digits.
#[inline(always)]
fn span_sum(digits: &[i8; SUM_SPAN]) -> i32 {
    digits.iter().map(|&q| i32::from(q)).sum()
}

/// `value` scaled by `inverse`, rounded to the nearest int8 in `-127..=127`. `as` maps NaN
/// to 0: a non-finite activation cannot panic here.
///
/// The integer is read from the bits of `y + ROUNDING`, whose low mantissa bits hold it, so
/// no float-to-integer conversion runs (a saturating `as` keeps the compiler from vectorizing
/// the loop); NaN is replaced by 0 first.
#[inline(always)]
fn digit(value: f32, inverse: f32) -> i8 {
    let y = value * inverse;
    let y = if y.is_nan() {
        0.0
    } else {
        y.clamp(-127.0, 127.0)
    };
    (y + ROUNDING).to_bits().wrapping_sub(ROUNDING.to_bits()) as i8
}

impl Q8Rows {
    /// [`Q8Rows::quantize_on`] the portable level.
    #[cfg(test)]
    pub fn quantize(&mut self, x: &[f32], inner: usize, block: usize, digits: ActivationDigits) {
        self.quantize_on(Isa::portable(), x, inner, block, digits);
    }

    /// Quantizes the `x.len() / inner` rows of `x` in blocks of `block` (32 or 256, dividing
    /// `inner`) to `digits` digits, reusing this value's storage, in code compiled for
    /// `isa`'s vector registers. Every step is exact per element (a maximum, a product, a
    /// clamp, the rounding additions, integer sums), so the digits are those of the portable
    /// code on every level; only the rate differs.
    pub fn quantize_on(
        &mut self,
        isa: Isa,
        x: &[f32],
        inner: usize,
        block: usize,
        digits: ActivationDigits,
    ) {
        let tokens = x.len().checked_div(inner).unwrap_or(0);
        self.shape(tokens, inner, block, digits);
        if let Some(mut span) = self.spans(tokens).next() {
            span.fill_on(isa, &x[..tokens * inner], digits);
        }
    }

    /// Sizes the storage for `tokens` rows of `inner` in blocks of `block`, to be filled span
    /// by span ([`Q8Rows::spans`]). Nothing is zeroed: a span's fill writes all of it.
    fn shape(&mut self, tokens: usize, inner: usize, block: usize, digits: ActivationDigits) {
        assert!(
            (block == 32 || block == MAX_BLOCK) && inner.is_multiple_of(block),
            "rows of {inner} cannot be cut into blocks of {block}"
        );
        self.digits = digits;
        self.block = block;
        self.inner = inner;
        let values = tokens * inner;
        self.high.resize(values, 0);
        self.low.resize(values, 0);
        self.scales.resize(values / block, 0.0);
        self.sums.resize(values / SUM_SPAN, 0);
    }

    /// The storage in spans of `rows` whole rows (the last may hold fewer), front to back.
    fn spans(&mut self, rows: usize) -> impl Iterator<Item = Q8RowsSpan<'_>> {
        let (inner, block) = (self.inner, self.block);
        let values = rows * inner;
        let spans = self.high.len().div_ceil(values.max(1));
        let each = cut(&mut self.high, values, spans)
            .zip(cut(&mut self.low, values, spans))
            .zip(cut(&mut self.scales, values / block, spans))
            .zip(cut(&mut self.sums, values / SUM_SPAN, spans));
        each.map(move |(((high, low), scales), sums)| Q8RowsSpan {
            inner,
            block,
            high,
            low,
            scales,
            sums,
        })
    }

    /// Row `t`.
    pub fn row(&self, t: usize) -> Q8Row<'_> {
        row_of(
            (self.inner, self.block),
            [&self.high, &self.low],
            &self.scales,
            &self.sums,
            t,
        )
    }
}

/// `data` in `spans` pieces of `each` from the front, the last ones shorter or empty.
fn cut<T>(data: &mut [T], each: usize, spans: usize) -> impl Iterator<Item = &mut [T]> {
    let mut rest = data;
    (0..spans).map(move |_| {
        let taken = std::mem::take(&mut rest);
        let (piece, tail) = taken.split_at_mut(each.min(taken.len()));
        rest = tail;
        piece
    })
}

/// Row `t` of rows of `inner` values in blocks of `block`, from both digits' values, the
/// blocks' scales and the spans' sums.
fn row_of<'a>(
    (inner, block): (usize, usize),
    [high, low]: [&'a [i8]; 2],
    scales: &'a [f32],
    sums: &'a [i32],
    t: usize,
) -> Q8Row<'a> {
    Q8Row {
        high: &high[t * inner..(t + 1) * inner],
        low: &low[t * inner..(t + 1) * inner],
        scales: &scales[t * inner / block..(t + 1) * inner / block],
        sums: &sums[t * inner / SUM_SPAN..(t + 1) * inner / SUM_SPAN],
    }
}

/// The storage of a run of whole rows of a [`Q8Rows`]: what one thread fills.
struct Q8RowsSpan<'a> {
    inner: usize,
    block: usize,
    high: &'a mut [i8],
    low: &'a mut [i8],
    scales: &'a mut [f32],
    sums: &'a mut [i32],
}

impl Q8RowsSpan<'_> {
    /// Quantizes `x`, this span's rows, as [`Q8Rows::quantize_on`] describes.
    fn fill_on(&mut self, isa: Isa, x: &[f32], digits: ActivationDigits) {
        assert_eq!(x.len(), self.high.len(), "a span's rows and its storage");
        if digits == ActivationDigits::One {
            // The second digit is zero with one; the fill writes only the first.
            self.low.fill(0);
        }
        #[cfg(target_arch = "x86_64")]
        if isa.has(IsaLevel::Avx512) {
            // SAFETY: the level has AVX-512 F, BW, DQ and VL (checked when the `Isa` was made).
            return unsafe { self.fill_avx512(x, digits) };
        } else if isa.has(IsaLevel::Avx2) {
            // SAFETY: the level has AVX2 (checked when the `Isa` was made).
            return unsafe { self.fill_avx2(x, digits) };
        }
        let _ = isa;
        self.fill(x, digits);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
    fn fill_avx512(&mut self, x: &[f32], digits: ActivationDigits) {
        self.fill(x, digits);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn fill_avx2(&mut self, x: &[f32], digits: ActivationDigits) {
        self.fill(x, digits);
    }

    /// The digits, scales and sums of `x`.
    #[inline(always)]
    fn fill(&mut self, x: &[f32], digits: ActivationDigits) {
        if self.block == MAX_BLOCK {
            self.fill_blocks::<MAX_BLOCK>(x, digits);
        } else {
            self.fill_blocks::<32>(x, digits);
        }
    }

    /// [`Q8RowsSpan::fill`] for blocks of `N`: with the length known, each block's loops
    /// compile to straight vector code, where a loop over a slice of 32 spent most of its time
    /// on its own bounds and remainders (a 576-value row took some 2.5 µs, on the launch's
    /// path).
    #[inline(always)]
    fn fill_blocks<const N: usize>(&mut self, x: &[f32], digits: ActivationDigits) {
        let (blocks, _) = x.as_chunks::<N>();
        let (highs, _) = self.high.as_chunks_mut::<N>();
        let (lows, _) = self.low.as_chunks_mut::<N>();
        let each = blocks
            .chunks(STEP_BATCH)
            .zip(highs.chunks_mut(STEP_BATCH))
            .zip(lows.chunks_mut(STEP_BATCH))
            .zip(self.scales.chunks_mut(STEP_BATCH))
            .zip(self.sums.chunks_mut(STEP_BATCH * N / SUM_SPAN));
        for ((((blocks, highs), lows), scales), sums) in each {
            // The steps of a batch of blocks together: each is two divisions after the
            // block's maximum, which block by block made one long chain per block.
            let mut d = [0.0; STEP_BATCH];
            for (d, values) in d.iter_mut().zip(blocks) {
                *d = max_magnitude(values);
            }
            let d = d.map(|amax| amax / 127.0);
            let inverse = d.map(|d| if d > 0.0 { 1.0 / d } else { 0.0 });
            let block_sums = sums.chunks_exact_mut(N / SUM_SPAN);
            let each = blocks
                .iter()
                .zip(highs.iter_mut())
                .zip(lows.iter_mut())
                .zip(scales.iter_mut())
                .zip(block_sums)
                .zip(d.iter().zip(inverse));
            for (((((values, high), low), scale), sums), (&d, inverse)) in each {
                *scale = d / DIGIT;
                for (&v, high) in values.iter().zip(high.iter_mut()) {
                    *high = digit(v, inverse);
                }
                if digits == ActivationDigits::Two {
                    for ((&v, &high), low) in values.iter().zip(high.iter()).zip(low.iter_mut()) {
                        *low = digit(v - d * f32::from(high), inverse * DIGIT);
                    }
                }
                let (high, _) = high.as_chunks::<SUM_SPAN>();
                let (low, _) = low.as_chunks::<SUM_SPAN>();
                for ((h, l), sum) in high.iter().zip(low).zip(sums) {
                    // Each digit summed apart, so that with one digit the second, all zero,
                    // is not summed at all.
                    *sum = 256 * span_sum(h);
                    if digits == ActivationDigits::Two {
                        *sum += span_sum(l);
                    }
                }
            }
        }
    }

    /// Row `t` of the span.
    fn row(&self, t: usize) -> Q8Row<'_> {
        row_of(
            (self.inner, self.block),
            [&*self.high, &*self.low],
            &*self.scales,
            &*self.sums,
            t,
        )
    }
}

/// The rows of a [`Q8Rows`] regrouped for the group tiles, in tiles of `width` tokens (the
/// last may be narrower): for each 32 values and each four of them, the tile's tokens' four
/// first digits side by side, then their four second digits; for each block, the tokens'
/// scales, and for 32-value blocks their joined block sums (for Q4_1's minimum, and for what
/// the offsets of the tiles' weights add), for the K-quants' 256-value blocks their
/// sub-blocks' sums of each digit in i16 pairs ([`K_PAIRS`]). A tile then reads its tokens'
/// activations as one stream.
#[derive(Debug, Default)]
pub struct Q8Tiles {
    kept: ActivationDigits,
    /// Whether the rows were quantized in the K-quants' blocks: pairs, not sums.
    k_quants: bool,
    width: usize,
    tokens: usize,
    /// 32-value chunks per row.
    chunks: usize,
    blocks: usize,
    digits: Vec<i8>,
    scales: Vec<f32>,
    sums: Vec<i32>,
    pairs: Vec<i32>,
}

/// The i16 pairs of sub-block sums per token and 256-value block, each the sum of one digit
/// over a sub-block, a pair's first in the low half: Q4_K's sub-blocks of 32 as `(0, 2)`,
/// `(1, 3)`, `(4, 6)`, `(5, 7)` of the first digits, then of the second (the pairs the tiles'
/// minima fall in), then Q6_K's sub-blocks of 16 as `(0, 1)` .. `(14, 15)` of the first
/// digits, then of the second. A sum of 32 digits is at most `32 · 127`: an i16.
pub const K_PAIRS: usize = 24;

/// One tile of [`Q8Tiles`]: `tokens` tokens' digits, scales and block sums.
// Only the x86-64 group tiles read tiles.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy, Debug)]
pub struct Q8Tile<'a> {
    pub tokens: usize,
    pub digits: &'a [i8],
    pub scales: &'a [f32],
    pub sums: &'a [i32],
    pub pairs: &'a [i32],
}

/// Two i16 in one i32, `a` in the low half.
fn pair(a: i32, b: i32) -> i32 {
    (i32::from(b as i16) << 16) | i32::from(a as i16 as u16)
}

/// The [`K_PAIRS`] words of the 256 digits `high` and `low` of one block.
fn k_pairs(high: &[i8], low: &[i8]) -> [i32; K_PAIRS] {
    let spans = |digits: &[i8]| -> [i32; 16] {
        let mut spans = [0; 16];
        for (span, digits) in spans.iter_mut().zip(digits.as_chunks::<16>().0) {
            *span = digits.iter().map(|&q| i32::from(q)).sum();
        }
        spans
    };
    let mut words = [0; K_PAIRS];
    for (digit, spans) in [spans(high), spans(low)].iter().enumerate() {
        let sub = |j: usize| spans[2 * j] + spans[2 * j + 1];
        for (k, (a, b)) in [(0, 2), (1, 3), (4, 6), (5, 7)].into_iter().enumerate() {
            words[4 * digit + k] = pair(sub(a), sub(b));
        }
        for p in 0..8 {
            words[8 + 8 * digit + p] = pair(spans[2 * p], spans[2 * p + 1]);
        }
    }
    words
}

impl Q8Tiles {
    /// Regroups the first `tokens` rows of `rows` in tiles of `width` tokens, reusing this
    /// value's storage.
    pub fn regroup(&mut self, rows: &Q8Rows, tokens: usize, width: usize) {
        self.shape(rows, tokens, width);
        if let Some(mut span) = self.spans(tokens.max(1).next_multiple_of(width)).next() {
            span.regroup(|t| rows.row(t));
        }
    }

    /// Sizes the storage for `tokens` of `rows` in tiles of `width`, to be filled span by span
    /// ([`Q8Tiles::spans`]). Nothing is zeroed: a span's regrouping writes all of it.
    fn shape(&mut self, rows: &Q8Rows, tokens: usize, width: usize) {
        assert!(width > 0, "a tile holds tokens");
        let (chunks, blocks) = (rows.inner / 32, rows.inner / rows.block);
        (self.width, self.tokens, self.chunks, self.blocks) = (width, tokens, chunks, blocks);
        self.kept = rows.digits;
        self.k_quants = rows.block == MAX_BLOCK;
        self.digits.resize(tokens * chunks * 64, 0);
        self.scales.resize(tokens * blocks, 0.0);
        let (sums, pairs) = if self.k_quants {
            (0, tokens * blocks * K_PAIRS)
        } else {
            (tokens * blocks, 0)
        };
        self.sums.resize(sums, 0);
        self.pairs.resize(pairs, 0);
    }

    /// The storage in spans of `tokens` tokens (a multiple of the width; the last span may
    /// hold fewer), front to back.
    fn spans(&mut self, tokens: usize) -> impl Iterator<Item = Q8TilesSpan<'_>> {
        assert!(
            tokens > 0 && tokens.is_multiple_of(self.width),
            "a span holds whole tiles"
        );
        let (width, blocks, k_quants) = (self.width, self.blocks, self.k_quants);
        let spans = self.tokens.div_ceil(tokens);
        let (sums, pairs) = if k_quants { (0, K_PAIRS) } else { (1, 0) };
        let each = cut(&mut self.digits, tokens * self.chunks * 64, spans)
            .zip(cut(&mut self.scales, tokens * blocks, spans))
            .zip(cut(&mut self.sums, tokens * blocks * sums, spans))
            .zip(cut(&mut self.pairs, tokens * blocks * pairs, spans));
        each.map(move |(((digits, scales), sums), pairs)| Q8TilesSpan {
            width,
            blocks,
            k_quants,
            digits,
            scales,
            sums,
            pairs,
        })
    }

    // Only the x86-64 group tiles read tiles.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    /// The digits the rows were quantized to: with one, the tiles may skip the second.
    pub fn digits(&self) -> ActivationDigits {
        self.kept
    }

    // Only the x86-64 group tiles read tiles.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    /// Tokens per tile (the last tile may have fewer).
    pub fn width(&self) -> usize {
        self.width
    }

    // Only the x86-64 group tiles (and the tests) read tiles.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    /// The tile that starts at token `first` (a multiple of the width).
    pub fn tile(&self, first: usize) -> Q8Tile<'_> {
        assert!(
            first.is_multiple_of(self.width) && first < self.tokens,
            "a tile's first token"
        );
        let (blocks, tokens) = (self.blocks, self.width.min(self.tokens - first));
        let chunks = self.chunks;
        let span = |per: usize| first * blocks * per..(first + tokens) * blocks * per;
        Q8Tile {
            tokens,
            digits: &self.digits[first * chunks * 64..(first + tokens) * chunks * 64],
            scales: &self.scales[span(1)],
            sums: self.sums.get(span(1)).unwrap_or_default(),
            pairs: self.pairs.get(span(K_PAIRS)).unwrap_or_default(),
        }
    }
}

/// The storage of a run of whole tiles of a [`Q8Tiles`]: what one thread regroups.
struct Q8TilesSpan<'a> {
    width: usize,
    blocks: usize,
    k_quants: bool,
    digits: &'a mut [i8],
    scales: &'a mut [f32],
    sums: &'a mut [i32],
    pairs: &'a mut [i32],
}

impl Q8TilesSpan<'_> {
    /// Regroups the span's tokens, whose quantized rows `row(t)` gives (`t` from the span's
    /// first token).
    fn regroup<'r>(&mut self, row: impl Fn(usize) -> Q8Row<'r>) {
        let (width, blocks) = (self.width, self.blocks);
        let tokens = self.scales.len() / blocks.max(1);
        let chunks = self.digits.len() / (64 * tokens.max(1));
        for first in (0..tokens).step_by(width) {
            let m = width.min(tokens - first);
            let digits = &mut self.digits[first * chunks * 64..(first + m) * chunks * 64];
            let (quads, _) = digits.as_chunks_mut::<4>();
            for t in 0..m {
                let row = row(first + t);
                // Quad `i` (values `4i..4i + 4`) of the first digits goes to quad `2mi + t`,
                // of the second to the `m` quads after it.
                let (high, _) = row.high.as_chunks::<4>();
                let (low, _) = row.low.as_chunks::<4>();
                for ((high, low), group) in high.iter().zip(low).zip(quads.chunks_exact_mut(2 * m))
                {
                    let (highs, lows) = group.split_at_mut(m);
                    highs[t] = *high;
                    lows[t] = *low;
                }
                for b in 0..blocks {
                    let at = first * blocks + b * m + t;
                    self.scales[at] = row.scales[b];
                    if self.k_quants {
                        let values = 256 * b..256 * b + 256;
                        let words = k_pairs(&row.high[values.clone()], &row.low[values]);
                        self.pairs[at * K_PAIRS..(at + 1) * K_PAIRS].copy_from_slice(&words);
                    } else {
                        self.sums[at] = row.sums[2 * b] + row.sums[2 * b + 1];
                    }
                }
            }
        }
    }
}

/// The most spans [`spans`] cuts a launch's activations into: few enough to stay on the stack.
pub const MAX_SPANS: usize = 16;

/// A run of whole tiles' tokens of a launch's activations, which one thread quantizes and
/// regroups alone: their rows and, for the group tiles, their tiles.
pub struct ActivationSpan<'a> {
    first: usize,
    rows: Q8RowsSpan<'a>,
    tiles: Option<Q8TilesSpan<'a>>,
}

impl ActivationSpan<'_> {
    /// Quantizes the span's rows of `x` (all the launch's rows) and regroups them, as
    /// [`Q8Rows::quantize_on`] and [`Q8Tiles::regroup`] would.
    pub fn fill_on(&mut self, isa: Isa, x: &[f32], digits: ActivationDigits) {
        let at = self.first * self.rows.inner;
        self.rows
            .fill_on(isa, &x[at..at + self.rows.high.len()], digits);
        if let Some(tiles) = &mut self.tiles {
            let rows = &self.rows;
            tiles.regroup(|t| rows.row(t));
        }
    }
}

/// `rows`, and with a tile width `tiles`, sized for `tokens` rows of `inner` in blocks of
/// `block` to `digits` digits, and cut into spans of `per_span` tokens (a multiple of the
/// width, at least `tokens / MAX_SPANS`) for threads to fill.
pub fn spans<'a>(
    rows: &'a mut Q8Rows,
    tiles: Option<(&'a mut Q8Tiles, usize)>,
    (tokens, inner, block, digits): (usize, usize, usize, ActivationDigits),
    per_span: usize,
) -> SmallVec<[ActivationSpan<'a>; MAX_SPANS]> {
    assert!(
        per_span > 0 && tokens.div_ceil(per_span) <= MAX_SPANS,
        "{tokens} tokens in spans of {per_span}"
    );
    rows.shape(tokens, inner, block, digits);
    let firsts = (0..).step_by(per_span);
    match tiles {
        Some((tiles, width)) => {
            tiles.shape(rows, tokens, width);
            let each = rows.spans(per_span).zip(tiles.spans(per_span)).zip(firsts);
            each.map(|((rows, tiles), first)| ActivationSpan {
                first,
                rows,
                tiles: Some(tiles),
            })
            .collect()
        }
        None => rows
            .spans(per_span)
            .zip(firsts)
            .map(|(rows, first)| ActivationSpan {
                first,
                rows,
                tiles: None,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests;
