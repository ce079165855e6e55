//! Activation rows quantized to int8 for the integer dot products with block-quantized weights ([`Q8Rows`]), in llama.cpp's `q8_0` and `q8_K` blocks, plus an int8 residual.
//!
//! A row of `K` f32 values is cut into blocks of 32 (for Q8_0, Q4_0 and Q4_1 weights) or 256
//! (for the K-quants): each block gets the scale `d = max|x| / 127` and values
//! `q = round(x / d)` in `-127..=127`, so `x ≈ d * q`, as llama.cpp quantizes activations.
//! Then the residual `x - d * q` is quantized the same way into a second level, so
//! `x ≈ d * q + d' * q'`: both levels meet the weights in integer dot products (twice the
//! integer work), and the activations keep some 14 bits instead of 8. One level alone moves
//! the logits enough to flip near-ties of a small model (SmolLM2-135M's answer to "What is the
//! capital of France?" among them); two keep them where f32 activations put them.
//!
//! Each run of 16 values also keeps the sum of its `q`, which the weight formats with an
//! offset (Q4_0's `- 8`, Q4_1's and Q4_K's minimum, Q6_K's `- 32`) multiply once instead of
//! per element. A row's values depend on that row alone, which is what keeps a token's
//! outputs the same in any batch.

/// Values per running sum.
pub const SUM_SPAN: usize = 16;
/// The largest block: the K-quants' 256.
const MAX_BLOCK: usize = 256;

/// `T` rows of `K` activations quantized in blocks of `block` values, in two levels.
#[derive(Debug, Default)]
pub struct Q8Rows {
    block: usize,
    inner: usize,
    levels: [Level; 2],
}

/// One level's values, scales and sums of every row.
#[derive(Debug, Default)]
struct Level {
    qs: Vec<i8>,
    scales: Vec<f32>,
    sums: Vec<i32>,
}

impl Level {
    fn clear(&mut self) {
        self.qs.clear();
        self.scales.clear();
        self.sums.clear();
    }

    /// Appends one block of `values`; returns its scale.
    fn push_block(&mut self, values: impl Iterator<Item = f32> + Clone) -> f32 {
        let amax = values.clone().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
        self.scales.push(d);
        let start = self.qs.len();
        // `as` saturates and maps NaN to 0: a non-finite activation cannot panic here.
        self.qs
            .extend(values.map(|v| (v * inverse).round().clamp(-127.0, 127.0) as i8));
        self.sums.extend(
            self.qs[start..]
                .chunks_exact(SUM_SPAN)
                .map(|span| span.iter().map(|&q| i32::from(q)).sum::<i32>()),
        );
        d
    }

    fn row(&self, t: usize, inner: usize, block: usize) -> Q8Row<'_> {
        Q8Row {
            qs: &self.qs[t * inner..(t + 1) * inner],
            scales: &self.scales[t * inner / block..(t + 1) * inner / block],
            sums: &self.sums[t * inner / SUM_SPAN..(t + 1) * inner / SUM_SPAN],
        }
    }
}

/// One quantized row: `qs[k]`, the scale of block `k / block`, the sum of span `k / 16`.
#[derive(Clone, Copy, Debug)]
pub struct Q8Row<'a> {
    pub qs: &'a [i8],
    pub scales: &'a [f32],
    pub sums: &'a [i32],
}

impl Q8Rows {
    /// Quantizes the `x.len() / inner` rows of `x` in blocks of `block` (which divides
    /// `inner`), reusing this value's storage.
    pub fn quantize(&mut self, x: &[f32], inner: usize, block: usize) {
        assert!(
            block.is_multiple_of(SUM_SPAN) && block <= MAX_BLOCK && inner.is_multiple_of(block),
            "rows of {inner} cannot be cut into blocks of {block}"
        );
        self.block = block;
        self.inner = inner;
        let [high, low] = &mut self.levels;
        high.clear();
        low.clear();
        for values in x.chunks_exact(block) {
            let start = high.qs.len();
            let d = high.push_block(values.iter().copied());
            let mut residual = [0.0f32; MAX_BLOCK];
            for ((r, &v), &q) in residual.iter_mut().zip(values).zip(&high.qs[start..]) {
                *r = v - d * f32::from(q);
            }
            low.push_block(residual[..block].iter().copied());
        }
    }

    /// Row `t`: the first level, then the residual's.
    pub fn row(&self, t: usize) -> [Q8Row<'_>; 2] {
        self.levels
            .each_ref()
            .map(|level| level.row(t, self.inner, self.block))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_scale_to_their_largest_magnitude() {
        let mut x: Vec<f32> = (0..64).map(|i| i as f32 - 20.0).collect();
        x[40] = f32::NAN;
        let mut rows = Q8Rows::default();
        rows.quantize(&x, 64, 32);
        let [row, residual] = rows.row(0);
        assert_eq!(row.scales, &[20.0 / 127.0, 43.0 / 127.0]);
        // The residual of a value is at most half a step of the first level.
        assert!(residual.scales[0] <= 0.5 * row.scales[0] / 127.0 * 1.0001);
        assert_eq!(row.qs[0], -127);
        assert_eq!(row.qs[63], 127);
        assert_eq!(row.qs[40], 0);
        let sum: i32 = row.qs[..16].iter().map(|&q| i32::from(q)).sum();
        assert_eq!(row.sums[0], sum);
        // A zero block has scale 0 and values 0, never a division by zero.
        rows.quantize(&[0.0; 32], 32, 32);
        assert_eq!((rows.row(0)[0].scales[0], rows.row(0)[1].qs[5]), (0.0, 0));
    }
}
