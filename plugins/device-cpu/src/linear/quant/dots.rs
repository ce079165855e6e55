//! The dot product of one block-quantized weight row and one two-digit [`Q8Row`], defined once: exact integer sums, then the scales applied in one fixed float order that every instruction set follows.
//!
//! The 32-value blocks (Q8_0, Q4_0, Q4_1) are defined per block: the exact integer sum of the
//! block's 32 products (Q8_0's signed values, Q4_0's `q - 8`, Q4_1's unsigned `q`) for each
//! activation digit, joined as `256 · high + low` ([`join`], at most `32 · 128 · 127 · 257`),
//! then `acc = acc + (d · s) · ints` ([`scaled`], `d` the weights' scale, `s` the
//! activations'; a multiply, a multiply and an add, never fused), and for Q4_1 then
//! `acc = acc + (m · s) · sums` with its minimum `m` and the joined sum of the block's
//! activations ([`block_sum`]), in block order from `acc = 0`. One output is then one float
//! chain, which the group tiles hold in one lane per weight row (see `interleaved`): 16 rows
//! and many tokens at once with no horizontal sums.
//!
//! The K-quants keep 16 lanes. For a 256-value block, the joined four-product sums of each 32
//! values (values `4g..4g + 4`, what `vpmaddubsw` + `vpmaddwd` and `vpdpbusd` produce in
//! their lanes) are multiplied by their sub-block's integer scale and added, in integers, into
//! lane `8 · (chunk % 2) + g` (Q4_K: over the whole block, chunk = its 32-value sub-block;
//! Q6_K: over each half of the block, chunk = its 32 values, which keeps every lane inside
//! i32). What they subtract per block (Q4_K's minima, Q6_K's `- 32`) is an exact integer too,
//! from the activations' sums of 16 ([`SUM_SPAN`]), kept in a `tail` (in i64). The float part
//! is then fixed: for each block (Q6_K: each half) in order, each lane does
//! `lane += (d · s) · ints` ([`scaled`]), the tail likewise, and [`Sums::finish`] adds the 16
//! lanes in one tree (`i + 8`, `i + 4`, `i + 2`, `i + 1`) and then subtracts the tail.
//!
//! Integer sums are exact and these float operations are the same IEEE operations in any
//! vector width, so a row's result has the same bits on every path; since it depends on that
//! weight row and that token's row alone, in every batch and every chunk.
//!
//! Bounds, with activation digits in `-127..=127`: a Q4_K lane adds four sub-blocks of
//! `63 · 4 · 15 · 127 · 257`; a Q6_K lane two chunks of `128 · 4 · 63 · 127 · 257` (2.1e9,
//! under `i32::MAX`).
//!
//! [`dot_row`] is the plain-Rust path; the K-quants' vector paths keep their lanes in
//! registers and hand them to [`Sums::finish`].
//!
//! [`SUM_SPAN`]: super::activations::SUM_SPAN

use plughost_device_abi::DType;
use plughost_device_abi::blocks::f16_at;

use super::activations::Q8Row;

/// Bytes of one block of each type.
pub const Q8_0_BYTES: usize = 34;
pub const Q4_0_BYTES: usize = 18;
pub const Q4_1_BYTES: usize = 20;
pub const Q4_K_BYTES: usize = 144;
pub const Q6_K_BYTES: usize = 210;

/// Float lanes of one output.
pub const LANES: usize = 16;

/// The activation block a weight type meets: 32 values, or 256 for the K-quants.
pub fn activation_block(dtype: DType) -> usize {
    if matches!(dtype, DType::Q4_K | DType::Q6_K) {
        256
    } else {
        32
    }
}

/// Bytes of one block of `dtype`.
pub fn block_bytes(dtype: DType) -> usize {
    match dtype {
        DType::Q8_0 => Q8_0_BYTES,
        DType::Q4_0 => Q4_0_BYTES,
        DType::Q4_1 => Q4_1_BYTES,
        DType::Q4_K => Q4_K_BYTES,
        DType::Q6_K => Q6_K_BYTES,
        _ => unreachable!("only block-quantized weights reach the integer dot products"),
    }
}

/// Checks that every token row of `xs` holds the activations of all of `w`'s blocks: what the
/// vector tiles' loads rely on.
#[cfg(target_arch = "x86_64")]
pub fn check_rows(dtype: DType, w: &[u8], xs: &[Q8Row<'_>]) {
    let blocks = w.len() / block_bytes(dtype);
    for x in xs {
        assert!(x.high.len() >= blocks * activation_block(dtype) && x.low.len() == x.high.len());
        assert!(x.scales.len() >= blocks);
    }
}

/// One K-quant output's float accumulation: the 16 lanes and the tail.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sums {
    pub lanes: [f32; LANES],
    pub tail: f32,
}

impl Sums {
    /// The lanes added in the fixed tree, then the tail subtracted.
    pub fn finish(&self) -> f32 {
        let mut lanes = self.lanes;
        let mut width = LANES / 2;
        while width > 0 {
            for i in 0..width {
                lanes[i] += lanes[i + width];
            }
            width /= 2;
        }
        lanes[0] - self.tail
    }
}

/// The sums of both activation digits as one integer: `256 · high + low`.
#[inline(always)]
pub fn join(high: i32, low: i32) -> i32 {
    (high << 8) + low
}

/// What one block adds to a lane: `(d · s) · ints`, `d` the weights' scale and `s` the
/// activations'. The vector paths do the same operations lane by lane.
#[inline(always)]
pub fn scaled(d: f32, s: f32, ints: i32) -> f32 {
    (d * s) * ints as f32
}

/// What one block adds to the tail: as [`scaled`], from an i64.
#[inline(always)]
pub fn scaled_tail(d: f32, s: f32, ints: i64) -> f32 {
    (d * s) * ints as f32
}

/// The eight 6-bit scales and the eight 6-bit minima of a Q4_K block, from its 12 packed bytes
/// at `block[4..16]` (what `blocks::q4_k_scales_mins` gives), in a few word operations: the
/// unpacking runs once per block and weight row, on the hot path of decode.
#[inline(always)]
pub fn q4_k_scales_mins(block: &[u8]) -> ([u8; 8], [u8; 8]) {
    const LOW_6: u32 = 0x3f3f_3f3f;
    const LOW_4: u32 = 0x0f0f_0f0f;
    const LOW_2: u32 = 0x0303_0303;
    let word =
        |i: usize| u32::from_le_bytes([block[4 + i], block[5 + i], block[6 + i], block[7 + i]]);
    let (a, b, c) = (word(0), word(4), word(8));
    // Scales 0..4 and minima 0..4 are the low 6 bits of bytes 0..4 and 4..8; scales and
    // minima 4..8 take their low 4 bits from the nibbles of bytes 8..12 and their high 2 from
    // the top bits of bytes 0..4 and 4..8.
    let scales_low = a & LOW_6;
    let scales_high = (c & LOW_4) | (((a >> 6) & LOW_2) << 4);
    let mins_low = b & LOW_6;
    let mins_high = ((c >> 4) & LOW_4) | (((b >> 6) & LOW_2) << 4);
    let mut scales = [0u8; 8];
    let mut mins = [0u8; 8];
    scales[..4].copy_from_slice(&scales_low.to_le_bytes());
    scales[4..].copy_from_slice(&scales_high.to_le_bytes());
    mins[..4].copy_from_slice(&mins_low.to_le_bytes());
    mins[4..].copy_from_slice(&mins_high.to_le_bytes());
    (scales, mins)
}

/// Q4_K's tail integers for block `b`: each 32-value sub-block's minimum (`mins`, from
/// `q4_k_scales_mins`) times the joined sum of its activations. In i32: at most
/// `8 · 63 · 32 · 127 · 257`.
#[inline(always)]
pub fn q4_k_tail(mins: &[u8; 8], x: &Q8Row<'_>, b: usize) -> i64 {
    let sums = &x.sums[16 * b..16 * b + 16];
    let mut tail = 0i32;
    for j in 0..8 {
        tail += i32::from(mins[j]) * (sums[2 * j] + sums[2 * j + 1]);
    }
    i64::from(tail)
}

/// Q6_K's tail integers for block `b`: `32 ·` each 16-value sub-block's scale times the joined
/// sum of its activations (the stored values are `q + 32`). The sum in i32 (at most
/// `16 · 128 · 16 · 127 · 257`), times 32 in i64.
#[inline(always)]
pub fn q6_k_tail(block: &[u8], x: &Q8Row<'_>, b: usize) -> i64 {
    let sums = &x.sums[16 * b..16 * b + 16];
    let scales = &block[192..208];
    let mut tail = 0i32;
    for i in 0..16 {
        tail += i32::from(scales[i] as i8) * sums[i];
    }
    32 * i64::from(tail)
}

/// The joined sum of the activations of 32-value block `b`.
#[inline(always)]
pub fn block_sum(x: &Q8Row<'_>, b: usize) -> i32 {
    x.sums[2 * b] + x.sums[2 * b + 1]
}

/// Q8_0, Q4_0 and Q4_1: each block's joined integer sum, scaled and added in block order,
/// Q4_1's minimum times the block's activation sum after it.
fn blocks_32_row(dtype: DType, w: &[u8], x: Q8Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, block) in w.chunks_exact(block_bytes(dtype)).enumerate() {
        let values = values_32(dtype, block);
        let sum = |digits: &[i8]| -> i32 {
            let digits = &digits[32 * b..32 * b + 32];
            values
                .iter()
                .zip(digits)
                .map(|(&w, &x)| w * i32::from(x))
                .sum()
        };
        acc += scaled(f16_at(block, 0), x.scales[b], join(sum(x.high), sum(x.low)));
        if dtype == DType::Q4_1 {
            acc += scaled(f16_at(block, 2), x.scales[b], block_sum(&x, b));
        }
    }
    acc
}

/// The stored integers of a 32-value block, in value order: signed for Q8_0, `q - 8` for
/// Q4_0, the unsigned nibble for Q4_1.
fn values_32(dtype: DType, block: &[u8]) -> [i32; 32] {
    let mut out = [0i32; 32];
    match dtype {
        DType::Q8_0 => {
            for (o, &w) in out.iter_mut().zip(&block[2..Q8_0_BYTES]) {
                *o = i32::from(w as i8);
            }
        }
        _ => {
            let (qs, offset) = if dtype == DType::Q4_0 {
                (&block[2..18], 8)
            } else {
                (&block[4..20], 0)
            };
            for (i, &q) in qs.iter().enumerate() {
                out[i] = i32::from(q & 0x0F) - offset;
                out[i + 16] = i32::from(q >> 4) - offset;
            }
        }
    }
    out
}

/// The eight joined four-product sums of `values` and the activations from value `at`.
fn fours(values: &[i32], x: &Q8Row<'_>, at: usize) -> [i32; 8] {
    let sum = |digits: &[i8], g: usize| -> i32 {
        (4 * g..4 * g + 4)
            .map(|k| values[k] * i32::from(digits[at + k]))
            .sum()
    };
    std::array::from_fn(|g| join(sum(x.high, g), sum(x.low, g)))
}

/// The 16 integer lanes of a Q4_K block against the 256 activations from `at`.
fn q4_k_lanes(block: &[u8], x: &Q8Row<'_>, at: usize) -> [i32; LANES] {
    let (scales, _) = q4_k_scales_mins(block);
    let qs = &block[16..Q4_K_BYTES];
    let mut lanes = [0i32; LANES];
    for j in 0..8 {
        let bytes = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let values: Vec<i32> = bytes
            .iter()
            .map(|&q| i32::from(if j % 2 == 0 { q & 0x0F } else { q >> 4 }))
            .collect();
        for (g, p) in fours(&values, x, at + 32 * j).iter().enumerate() {
            lanes[8 * (j % 2) + g] += i32::from(scales[j]) * p;
        }
    }
    lanes
}

/// The 6-bit values (`0..=63`) of Q6_K chunk `c` (values `32c..32c + 32`).
fn q6_k_chunk(block: &[u8], c: usize) -> [i32; 32] {
    let (half, part) = (c / 4, c % 4);
    let ql = &block[64 * half + 32 * (part % 2)..];
    let qh = &block[128 + 32 * half..];
    std::array::from_fn(|l| {
        let low = if part < 2 { ql[l] & 0x0F } else { ql[l] >> 4 };
        let high = (qh[l] >> (2 * part)) & 3;
        i32::from(low | (high << 4))
    })
}

/// The 16 integer lanes of one half (128 values) of a Q6_K block against the activations
/// from `at` (the block's start).
fn q6_k_lanes(block: &[u8], half: usize, x: &Q8Row<'_>, at: usize) -> [i32; LANES] {
    let mut lanes = [0i32; LANES];
    for c in 4 * half..4 * half + 4 {
        let p = fours(&q6_k_chunk(block, c), x, at + 32 * c);
        for (g, p) in p.iter().enumerate() {
            let scale = i32::from(block[192 + 2 * c + g / 4] as i8);
            lanes[8 * (c % 2) + g] += scale * p;
        }
    }
    lanes
}

/// `Σ_k w[k] · x[k]` for one row of `dtype` blocks and one token's activations, quantized in
/// blocks of [`activation_block`]`(dtype)`: the plain-Rust path.
pub fn dot_row(dtype: DType, w: &[u8], x: Q8Row<'_>) -> f32 {
    if matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1) {
        return blocks_32_row(dtype, w, x);
    }
    let mut sums = Sums::default();
    let bytes = block_bytes(dtype);
    for (b, block) in w.chunks_exact(bytes).enumerate() {
        let s = x.scales[b];
        match dtype {
            DType::Q4_K => {
                let lanes = q4_k_lanes(block, &x, 256 * b);
                let d = f16_at(block, 0);
                for (lane, &ints) in sums.lanes.iter_mut().zip(&lanes) {
                    *lane += scaled(d, s, ints);
                }
                let (_, mins) = q4_k_scales_mins(block);
                sums.tail += scaled_tail(f16_at(block, 2), s, q4_k_tail(&mins, &x, b));
            }
            DType::Q6_K => {
                let d = f16_at(block, 208);
                for half in 0..2 {
                    let lanes = q6_k_lanes(block, half, &x, 256 * b);
                    for (lane, &ints) in sums.lanes.iter_mut().zip(&lanes) {
                        *lane += scaled(d, s, ints);
                    }
                }
                sums.tail += scaled_tail(d, s, q6_k_tail(block, &x, b));
            }
            _ => unreachable!("only block-quantized weights reach the integer dot products"),
        }
    }
    sums.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of one 256-value block of activations: first digits `high`, second digits 0.
    fn row_of(high: &[i8; 256]) -> (Vec<i8>, Vec<i32>) {
        let sums = high
            .chunks_exact(super::super::activations::SUM_SPAN)
            .map(|span| span.iter().map(|&q| 256 * i32::from(q)).sum())
            .collect();
        (vec![0; 256], sums)
    }

    #[test]
    fn q4_k_scales_and_minima_unpack_as_the_reference_does() {
        let mut block = [0u8; Q4_K_BYTES];
        for seed in 0..256u32 {
            for (i, byte) in block[4..16].iter_mut().enumerate() {
                *byte = (seed.wrapping_mul(2_654_435_761).rotate_left(i as u32 * 5) >> 8) as u8;
            }
            assert_eq!(
                q4_k_scales_mins(&block),
                plughost_device_abi::blocks::q4_k_scales_mins(&block[4..16]),
                "{:?}",
                &block[4..16]
            );
        }
    }

    #[test]
    fn integer_lanes_are_what_the_definitions_say() {
        let high = [2i8; 256];
        let (low, sums) = row_of(&high);
        let x = Q8Row {
            high: &high,
            low: &low,
            scales: &[1.0],
            sums: &sums,
        };
        // A Q4_K block of nibbles all 1 and scales all 1 (mins 0) against first digits all 2:
        // each lane sums four products of 2 over the four sub-blocks of its parity, times 256.
        let mut block = [0u8; Q4_K_BYTES];
        // Scales 0..4 in the low bits of bytes 0..4, scales 4..8 in the low nibbles of 8..12.
        block[4..8].fill(1);
        block[12..16].fill(1);
        block[16..].fill(0x11);
        assert_eq!(q4_k_lanes(&block, &x, 0), [256 * 4 * 2 * 4; LANES]);
        // A Q6_K block of values 33 (low nibbles 1, high bits 2) with scales 1: each lane of
        // a half holds the four-product sums of its two chunks.
        let mut block = [0u8; Q6_K_BYTES];
        block[..128].fill(0x11);
        block[128..192].fill(0b1010_1010);
        block[192..208].fill(1);
        assert_eq!(q6_k_chunk(&block, 5)[7], 33);
        assert_eq!(q6_k_lanes(&block, 1, &x, 0), [256 * 2 * 4 * 33 * 2; LANES]);
        // The tail: 32 times each scale times its span's sum, 16 spans.
        assert_eq!(q6_k_tail(&block, &x, 0), 32 * 16 * (256 * 2 * 16));
    }
}
