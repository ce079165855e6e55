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
//! The K-quants are defined per 256-value block, each activation digit apart: `H` sums over
//! the block's sub-blocks (Q4_K: eight of 32 values; Q6_K: sixteen of 16) the sub-block's
//! integer scale times the exact sum of its values (Q4_K's nibbles, Q6_K's `q - 32`) times
//! the first digits, `L` the same with the second digits ([`q4_k_ints`], [`q6_k_ints`]).
//! Joined in i32 as the 32-value blocks are, `256 · H + L` could overflow, so the digits are
//! joined in floats: `acc = acc + (d · s) · (256 · H + L)` ([`scaled_digits`]; `256 · H` is
//! exact in f32, so the join's add rounds once, fused or not). Q4_K then subtracts its minima:
//! `T = Σ m_j · S_j` over the sub-blocks' joined activation sums, and
//! `acc = acc - (dmin · s) · T` ([`scaled`]). A block's integers are whole sums, so the group
//! tiles hold one row in one lane, as for the 32-value blocks.
//!
//! Integer sums are exact and these float operations are the same IEEE operations in any
//! vector width, so a row's result has the same bits on every path; since it depends on that
//! weight row and that token's row alone, in every batch and every chunk.
//!
//! Bounds, with activation digits in `-127..=127`: Q4_K's `|H|` at most
//! `8 · 63 · 32 · 15 · 127` (3.1e7) and `|T|` at most `8 · 63 · 32 · 127 · 257` (5.3e8);
//! Q6_K's `|H|` at most `16 · 128 · 16 · 32 · 127` (1.3e8), and the vector tiles' sums of
//! the unsigned `q` before they take the offset off at most `16 · 128 · 16 · 63 · 127`
//! (2.6e8). All inside i32.
//!
//! [`dot_row`] is the plain-Rust path.

use plughost_device_abi::DType;
use plughost_device_abi::blocks::f16_at;

use super::activations::Q8Row;

/// Bytes of one block of each type.
pub const Q8_0_BYTES: usize = 34;
pub const Q4_0_BYTES: usize = 18;
pub const Q4_1_BYTES: usize = 20;
pub const Q4_K_BYTES: usize = 144;
pub const Q6_K_BYTES: usize = 210;

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

/// What one K-quant block adds, `(d · s) · (256 · H + L)` from its digits' integers `h`
/// and `l`. The vector paths do the same operations lane by lane.
#[inline(always)]
pub fn scaled_digits(d: f32, s: f32, h: i32, l: i32) -> f32 {
    (d * s) * (256.0 * h as f32 + l as f32)
}

/// Q4_K block `b` of a row against the activations `x`: `H`, `L` and the minima's `T`.
pub fn q4_k_ints(block: &[u8], x: &Q8Row<'_>, b: usize) -> (i32, i32, i32) {
    let (scales, mins) = q4_k_scales_mins(block);
    let qs = &block[16..Q4_K_BYTES];
    let (mut h, mut l, mut t) = (0i32, 0i32, 0i32);
    for j in 0..8 {
        let bytes = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2);
        let at = 256 * b + 32 * j;
        let (mut sh, mut sl) = (0i32, 0i32);
        for (k, &q) in bytes.iter().enumerate() {
            let q = i32::from((q >> shift) & 0x0F);
            sh += q * i32::from(x.high[at + k]);
            sl += q * i32::from(x.low[at + k]);
        }
        h += i32::from(scales[j]) * sh;
        l += i32::from(scales[j]) * sl;
        t += i32::from(mins[j]) * (x.sums[16 * b + 2 * j] + x.sums[16 * b + 2 * j + 1]);
    }
    (h, l, t)
}

/// The 6-bit value `v` (`0..=63`) of a Q6_K block: the low four bits from `ql`'s nibbles, the
/// high two from `qh`'s bit pairs, in GGUF's order.
pub fn q6_k_value(block: &[u8], v: usize) -> i32 {
    let (half, k, i) = (v / 128, (v % 128) / 32, v % 32);
    let ql = block[64 * half + 32 * (k % 2) + i];
    let low = if k < 2 { ql & 0x0F } else { ql >> 4 };
    let high = (block[128 + 32 * half + i] >> (2 * k)) & 3;
    i32::from(low | (high << 4))
}

/// Q6_K block `b` of a row against the activations `x`: `H` and `L`, of the values `q - 32`.
pub fn q6_k_ints(block: &[u8], x: &Q8Row<'_>, b: usize) -> (i32, i32) {
    let (mut h, mut l) = (0i32, 0i32);
    for j in 0..16 {
        let (mut sh, mut sl) = (0i32, 0i32);
        for v in 16 * j..16 * j + 16 {
            let q = q6_k_value(block, v) - 32;
            sh += q * i32::from(x.high[256 * b + v]);
            sl += q * i32::from(x.low[256 * b + v]);
        }
        let scale = i32::from(block[192 + j] as i8);
        h += scale * sh;
        l += scale * sl;
    }
    (h, l)
}

/// `Σ_k w[k] · x[k]` for one row of `dtype` blocks and one token's activations, quantized in
/// blocks of [`activation_block`]`(dtype)`: the plain-Rust path.
pub fn dot_row(dtype: DType, w: &[u8], x: Q8Row<'_>) -> f32 {
    if matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1) {
        return blocks_32_row(dtype, w, x);
    }
    let mut acc = 0.0f32;
    for (b, block) in w.chunks_exact(block_bytes(dtype)).enumerate() {
        let s = x.scales[b];
        match dtype {
            DType::Q4_K => {
                let (h, l, t) = q4_k_ints(block, &x, b);
                acc += scaled_digits(f16_at(block, 0), s, h, l);
                acc -= scaled(f16_at(block, 2), s, t);
            }
            DType::Q6_K => {
                let (h, l) = q6_k_ints(block, &x, b);
                acc += scaled_digits(f16_at(block, 208), s, h, l);
            }
            _ => unreachable!("only block-quantized weights reach the integer dot products"),
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn integers_are_what_the_definitions_say() {
        // First digits all 2, second all 0; the 16-value sums joined (times 256).
        let high = [2i8; 256];
        let low = [0i8; 256];
        let sums = [256 * 2 * 16; 16];
        let x = Q8Row {
            high: &high,
            low: &low,
            scales: &[1.0],
            sums: &sums,
        };
        // A Q4_K block of nibbles all 1, scales all 1 (bytes 0..4 and the low nibbles of
        // 8..12) and minima all 1 (bytes 4..8): each sub-block sums 32 products of 2.
        let mut block = [0u8; Q4_K_BYTES];
        block[4..12].fill(1);
        block[12..16].fill(0x11);
        block[16..].fill(0x11);
        assert_eq!(q4_k_ints(&block, &x, 0), (8 * 32 * 2, 0, 8 * 256 * 2 * 32));
        // A Q6_K block of values 33 (low nibbles 1, high bits 2) with scales 1: each value
        // counts `33 - 32 = 1`.
        let mut block = [0u8; Q6_K_BYTES];
        block[..128].fill(0x11);
        block[128..192].fill(0b1010_1010);
        block[192..208].fill(1);
        assert!((0..256).all(|v| q6_k_value(&block, v) == 33));
        assert_eq!(q6_k_ints(&block, &x, 0), (256 * 2, 0));
        // Scales of -128 and values 0: the extreme of the bound, inside i32.
        block[..192].fill(0);
        block[192..208].fill(0x80);
        assert_eq!(q6_k_ints(&block, &x, 0).0, 16 * -128 * 16 * -32 * 2);
    }
}
