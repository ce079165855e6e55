//! Widening f32/f16/bf16 tensor elements to f32: whole rows, panels of rows, and single values.
//!
//! Kernels compute in f32 whatever the weights are stored in; weights stay in their checkpoint
//! precision in device memory and are widened a panel at a time into cache-sized scratch.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use plughost_device_abi::export::FloatSlice;

/// Widens `dst.len()` elements of `src` starting at element `first` into `dst`.
pub fn widen_into(src: FloatSlice<'_>, first: usize, dst: &mut [f32]) {
    let range = first..first + dst.len();
    match src {
        FloatSlice::F32(values) => dst.copy_from_slice(&values[range]),
        // `half` uses F16C (checked at run time) for whole slices.
        FloatSlice::F16(bits) => bits[range]
            .reinterpret_cast::<f16>()
            .convert_to_f32_slice(dst),
        FloatSlice::BF16(bits) => {
            for (out, &bits) in dst.iter_mut().zip(&bits[range]) {
                *out = bf16_to_f32(bits);
            }
        }
    }
}

/// bf16 is the upper half of an f32, so widening is a shift (and vectorizes as one).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// `src` as f32: borrowed when it already is, else widened into `buffer`.
pub fn widened<'a>(src: FloatSlice<'a>, buffer: &'a mut Vec<f32>) -> &'a [f32] {
    match src {
        FloatSlice::F32(values) => values,
        FloatSlice::F16(_) | FloatSlice::BF16(_) => {
            buffer.clear();
            buffer.resize(src.len(), 0.0);
            widen_into(src, 0, buffer);
            buffer
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn widens_every_dtype_exactly() {
        let values = [1.0f32, -2.5, 0.333_251_95, 65504.0, 0.0];
        let f16_bits: Vec<u16> = values.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let bf16_bits: Vec<u16> = values
            .iter()
            .map(|&v| bf16::from_f32(v).to_bits())
            .collect();
        let cases = [
            (FloatSlice::F32(&values), values.to_vec()),
            (
                FloatSlice::F16(&f16_bits),
                f16_bits
                    .iter()
                    .map(|&b| f16::from_bits(b).to_f32())
                    .collect(),
            ),
            (
                FloatSlice::BF16(&bf16_bits),
                bf16_bits
                    .iter()
                    .map(|&b| bf16::from_bits(b).to_f32())
                    .collect(),
            ),
        ];
        for (src, expected) in cases {
            let mut dst = [0.0; 3];
            widen_into(src, 1, &mut dst);
            assert_eq!(dst[..], expected[1..4], "{src:?}");
            let mut buffer = Vec::new();
            assert_eq!(widened(src, &mut buffer), expected, "{src:?}");
        }
    }
}
