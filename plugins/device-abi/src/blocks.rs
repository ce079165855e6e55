//! ggml's block-quantized weight formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K): reading their fields and dequantizing rows.
//!
//! The layouts are llama.cpp's (`ggml-common.h`), byte for byte, so a GGUF tensor's bytes are
//! a device buffer as they are. Dequantizing is for the places that need a few rows in f32 (an
//! embedding gather, the mock device, references in tests): the linear kernels read the
//! blocks themselves. Products are rounded to f32 before any sum, as the `gguf` Python package
//! computes them, so the values equal its `dequantize` exactly.

use crate::abi::DType;

/// An f16 stored little-endian at `bytes[at..at + 2]`, widened.
pub fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// The eight 6-bit (scale, min) pairs of a Q4_K block, from its 12 packed bytes
/// (llama.cpp's `get_scale_min_k4`).
pub fn q4_k_scales_mins(packed: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut scales = [0u8; 8];
    let mut mins = [0u8; 8];
    for j in 0..8 {
        if j < 4 {
            scales[j] = packed[j] & 63;
            mins[j] = packed[j + 4] & 63;
        } else {
            scales[j] = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4);
            mins[j] = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
        }
    }
    (scales, mins)
}

/// The 4-bit values of a 32-element Q4_0/Q4_1 block in element order: the low nibbles of the
/// 16 bytes, then the high ones.
pub fn unpack_nibbles_32(qs: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, &byte) in qs[..16].iter().enumerate() {
        out[i] = byte & 0x0F;
        out[i + 16] = byte >> 4;
    }
    out
}

/// The 4-bit values of a Q4_K block in element order: each 64 elements are the low nibbles of
/// 32 bytes, then their high nibbles.
pub fn unpack_q4_k(qs: &[u8]) -> [u8; 256] {
    let mut out = [0u8; 256];
    for (chunk, bytes) in qs[..128].chunks_exact(32).enumerate() {
        for (l, &byte) in bytes.iter().enumerate() {
            out[chunk * 64 + l] = byte & 0x0F;
            out[chunk * 64 + 32 + l] = byte >> 4;
        }
    }
    out
}

/// The signed 6-bit values (`q - 32`) of a Q6_K block in element order.
pub fn unpack_q6_k(block: &[u8]) -> [i8; 256] {
    let (ql, qh) = (&block[..128], &block[128..192]);
    let mut out = [0i8; 256];
    for half in 0..2 {
        let (ql, qh) = (&ql[half * 64..], &qh[half * 32..]);
        let y = &mut out[half * 128..];
        for l in 0..32 {
            let value = |low: u8, shift: u32| (low | (((qh[l] >> shift) & 3) << 4)) as i8 - 32;
            y[l] = value(ql[l] & 0x0F, 0);
            y[l + 32] = value(ql[l + 32] & 0x0F, 2);
            y[l + 64] = value(ql[l] >> 4, 4);
            y[l + 96] = value(ql[l + 32] >> 4, 6);
        }
    }
    out
}

/// Fills `out` with the values of `bytes`, whole blocks of the block-quantized `dtype`;
/// `None` (and nothing written) when `dtype` is not block-quantized or the lengths disagree.
pub fn dequantize_into(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Option<()> {
    let (elements, size) = (dtype.block_elements() as usize, dtype.size_bytes() as usize);
    if !dtype.is_block_quantized()
        || !bytes.len().is_multiple_of(size)
        || bytes.len() / size * elements != out.len()
    {
        return None;
    }
    for (block, y) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(elements)) {
        dequantize_block(dtype, block, y);
    }
    Some(())
}

/// The values of `bytes` as a new vector; see [`dequantize_into`].
pub fn dequantize(dtype: DType, bytes: &[u8]) -> Option<Vec<f32>> {
    let size = dtype.size_bytes() as usize;
    let mut out = vec![0.0; bytes.len() / size * dtype.block_elements() as usize];
    dequantize_into(dtype, bytes, &mut out).map(|()| out)
}

fn dequantize_block(dtype: DType, block: &[u8], y: &mut [f32]) {
    match dtype {
        DType::Q8_0 => {
            let d = f16_at(block, 0);
            for (y, &q) in y.iter_mut().zip(&block[2..34]) {
                *y = d * f32::from(q as i8);
            }
        }
        DType::Q4_0 => {
            let d = f16_at(block, 0);
            for (y, q) in y.iter_mut().zip(unpack_nibbles_32(&block[2..18])) {
                *y = d * f32::from(q as i8 - 8);
            }
        }
        DType::Q4_1 => {
            let (d, m) = (f16_at(block, 0), f16_at(block, 2));
            for (y, q) in y.iter_mut().zip(unpack_nibbles_32(&block[4..20])) {
                *y = d * f32::from(q) + m;
            }
        }
        DType::Q4_K => {
            let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
            let (scales, mins) = q4_k_scales_mins(&block[4..16]);
            let q = unpack_q4_k(&block[16..144]);
            for (sub, (y, q)) in y.chunks_exact_mut(32).zip(q.chunks_exact(32)).enumerate() {
                let (scale, min) = (d * f32::from(scales[sub]), dmin * f32::from(mins[sub]));
                for (y, &q) in y.iter_mut().zip(q) {
                    *y = scale * f32::from(q) - min;
                }
            }
        }
        DType::Q6_K => {
            let d = f16_at(block, 208);
            let q = unpack_q6_k(block);
            for (sub, (y, q)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
                let scale = d * f32::from(block[192 + sub] as i8);
                for (y, &q) in y.iter_mut().zip(q) {
                    *y = scale * f32::from(q);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_that_are_not_whole_blocks_are_refused() {
        assert!(dequantize(DType::Q8_0, &[0; 33]).is_none());
        assert!(dequantize(DType::F32, &[0; 4]).is_none());
        let mut out = [0.0; 31];
        assert!(dequantize_into(DType::Q8_0, &[0; 34], &mut out).is_none());
    }

    #[test]
    fn q8_0_is_scale_times_value() {
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        block[2] = (-128i8) as u8;
        block[3] = 127;
        let values = dequantize(DType::Q8_0, &block).unwrap();
        assert_eq!(&values[..3], &[-64.0, 63.5, 0.0]);
    }
}
