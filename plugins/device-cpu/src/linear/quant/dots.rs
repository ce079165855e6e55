//! The dot product of one block-quantized weight row and one [`Q8Row`]: exact integer sums per block, then the scales applied in one fixed order.
//!
//! Each instruction set only computes the integer part, [`BlockInts`]: the sums of products of
//! the weights' stored integers and the activations' int8 values, per block (Q8_0, Q4_0,
//! Q4_1), per 32 values (Q4_K) or per 16 (Q6_K). Integer sums are exact, so every instruction
//! set finds the same ones; [`dot_row`] then applies the scales in f32 block by block, the same
//! code whichever found them. So a row's result has the same bits on every path, and since
//! it depends on that row and that weight row alone, in every batch.

use plughost_device_abi::DType;
use plughost_device_abi::blocks::{f16_at, q4_k_scales_mins};

use super::activations::{Q8Row, SUM_SPAN};

/// Bytes of one block of each type.
pub const Q8_0_BYTES: usize = 34;
pub const Q4_0_BYTES: usize = 18;
pub const Q4_1_BYTES: usize = 20;
pub const Q4_K_BYTES: usize = 144;
pub const Q6_K_BYTES: usize = 210;

/// The integer sums of one weight block against the activations of the same span.
pub trait BlockInts {
    /// `Σ w·x` over a Q8_0 block's 32 signed values.
    fn q8_0(block: &[u8], x: &[i8]) -> i32;
    /// `Σ q·x` over the 32 nibbles (`0..=15`) of a Q4_0 or Q4_1 block's 16 bytes `qs`.
    fn q4(qs: &[u8], x: &[i8]) -> i32;
    /// `Σ q·x` per 32 values over a Q4_K block's 128 bytes of nibbles.
    fn q4_k(qs: &[u8], x: &[i8]) -> [i32; 8];
    /// `Σ q·x` per 16 values over a Q6_K block's 6-bit values (`0..=63`, before the `- 32`).
    fn q6_k(block: &[u8], x: &[i8]) -> [i32; 16];
}

/// The activation block a weight type meets: 32 values, or 256 for the K-quants.
pub fn activation_block(dtype: DType) -> usize {
    if matches!(dtype, DType::Q4_K | DType::Q6_K) {
        256
    } else {
        32
    }
}

/// `Σ_k w[k] · x[k]` for one row of `dtype` blocks and activations quantized in blocks of
/// [`activation_block`]`(dtype)`.
#[inline(always)]
pub fn dot_row<I: BlockInts>(dtype: DType, w: &[u8], x: Q8Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    // Sum of the activations' span `i` and `i + 1`: one 32-value block.
    let pair = |i: usize| x.sums[i] + x.sums[i + 1];
    match dtype {
        DType::Q8_0 => {
            for (b, block) in w.chunks_exact(Q8_0_BYTES).enumerate() {
                let ints = I::q8_0(block, &x.qs[b * 32..]);
                acc += f16_at(block, 0) * x.scales[b] * ints as f32;
            }
        }
        DType::Q4_0 => {
            for (b, block) in w.chunks_exact(Q4_0_BYTES).enumerate() {
                let ints = I::q4(&block[2..], &x.qs[b * 32..]) - 8 * pair(2 * b);
                acc += f16_at(block, 0) * x.scales[b] * ints as f32;
            }
        }
        DType::Q4_1 => {
            for (b, block) in w.chunks_exact(Q4_1_BYTES).enumerate() {
                let ints = I::q4(&block[4..], &x.qs[b * 32..]);
                let (d, m) = (f16_at(block, 0), f16_at(block, 2));
                acc += d * x.scales[b] * ints as f32 + m * (x.scales[b] * pair(2 * b) as f32);
            }
        }
        DType::Q4_K => {
            for (b, block) in w.chunks_exact(Q4_K_BYTES).enumerate() {
                let dots = I::q4_k(&block[16..], &x.qs[b * 256..]);
                let (scales, mins) = q4_k_scales_mins(&block[4..16]);
                let spans = 256 / SUM_SPAN * b;
                let (mut sumi, mut summ) = (0i32, 0i32);
                for j in 0..8 {
                    sumi += i32::from(scales[j]) * dots[j];
                    summ += i32::from(mins[j]) * pair(spans + 2 * j);
                }
                let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
                acc += d * x.scales[b] * sumi as f32 - dmin * x.scales[b] * summ as f32;
            }
        }
        DType::Q6_K => {
            for (b, block) in w.chunks_exact(Q6_K_BYTES).enumerate() {
                let dots = I::q6_k(block, &x.qs[b * 256..]);
                let spans = 256 / SUM_SPAN * b;
                let mut sumi = 0i32;
                for (g, dot) in dots.iter().enumerate() {
                    let scale = i32::from(block[192 + g] as i8);
                    sumi += scale * (dot - 32 * x.sums[spans + g]);
                }
                acc += f16_at(block, 208) * x.scales[b] * sumi as f32;
            }
        }
        _ => unreachable!("dot_row is only reached for block-quantized weights"),
    }
    acc
}

/// The integer sums in plain Rust, for every machine.
pub struct Portable;

impl BlockInts for Portable {
    fn q8_0(block: &[u8], x: &[i8]) -> i32 {
        block[2..Q8_0_BYTES]
            .iter()
            .zip(x)
            .map(|(&w, &x)| i32::from(w as i8) * i32::from(x))
            .sum()
    }

    fn q4(qs: &[u8], x: &[i8]) -> i32 {
        qs[..16]
            .iter()
            .enumerate()
            .map(|(i, &q)| {
                i32::from(q & 0x0F) * i32::from(x[i]) + i32::from(q >> 4) * i32::from(x[i + 16])
            })
            .sum()
    }

    fn q4_k(qs: &[u8], x: &[i8]) -> [i32; 8] {
        let mut out = [0i32; 8];
        for c in 0..4 {
            let (bytes, x) = (&qs[32 * c..32 * c + 32], &x[64 * c..]);
            for (l, &q) in bytes.iter().enumerate() {
                out[2 * c] += i32::from(q & 0x0F) * i32::from(x[l]);
                out[2 * c + 1] += i32::from(q >> 4) * i32::from(x[32 + l]);
            }
        }
        out
    }

    fn q6_k(block: &[u8], x: &[i8]) -> [i32; 16] {
        let mut out = [0i32; 16];
        for half in 0..2 {
            let (ql, qh) = (&block[64 * half..], &block[128 + 32 * half..]);
            let x = &x[128 * half..];
            for l in 0..32 {
                let values = [
                    (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (g, &q) in values.iter().enumerate() {
                    let k = 32 * g + l;
                    out[8 * half + k / 16] += i32::from(q) * i32::from(x[k]);
                }
            }
        }
        out
    }
}
