//! Decoding and encoding little-endian tensor elements stored in device buffer bytes.

use crate::abi::DType;

/// Decodes f32, f16 or bf16 elements, or dequantizes whole blocks of a block-quantized type,
/// into f32; `None` for integer dtypes.
pub fn decode_float(dtype: DType, bytes: &[u8]) -> Option<Vec<f32>> {
    match dtype {
        DType::F32 => Some(
            bytes
                .chunks_exact(4)
                .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
                .collect(),
        ),
        DType::F16 => Some(
            bytes
                .chunks_exact(2)
                .map(|chunk| f16_to_f32(u16::from_le_bytes([chunk[0], chunk[1]])))
                .collect(),
        ),
        DType::BF16 => Some(
            bytes
                .chunks_exact(2)
                .map(|chunk| bf16_to_f32(u16::from_le_bytes([chunk[0], chunk[1]])))
                .collect(),
        ),
        DType::I32 | DType::I64 | DType::U8 => None,
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q4_K | DType::Q6_K => {
            crate::blocks::dequantize(dtype, bytes)
        }
    }
}

pub fn decode_i32(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|chunk| i32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
        .collect()
}

pub fn encode_f32(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

/// Encodes f32 values as `dtype` elements, rounding to the nearest even f16 or bf16; `None`
/// for dtypes that are not floats (and for the block-quantized ones, which only weights take).
pub fn encode_float(dtype: DType, values: &[f32]) -> Option<Vec<u8>> {
    match dtype {
        DType::F32 => Some(encode_f32(values)),
        DType::F16 => Some(
            values
                .iter()
                .flat_map(|&value| half::f16::from_f32(value).to_le_bytes())
                .collect(),
        ),
        DType::BF16 => Some(
            values
                .iter()
                .flat_map(|&value| half::bf16::from_f32(value).to_le_bytes())
                .collect(),
        ),
        _ => None,
    }
}

pub fn encode_i32(values: &[i32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

/// bf16 is the upper half of an f32, so widening is exact.
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// IEEE-754 binary16 to f32; exact for every input, including subnormals, infinities and NaN.
pub fn f16_to_f32(bits: u16) -> f32 {
    let negative = bits & 0x8000 != 0;
    let exponent = u32::from((bits >> 10) & 0x1f);
    let mantissa = u32::from(bits & 0x3ff);
    let magnitude = match exponent {
        // Subnormal: mantissa * 2^-24, representable exactly as a normal f32.
        0 => mantissa as f32 * f32::from_bits(0x3380_0000),
        0x1f => f32::from_bits(0x7f80_0000 | (mantissa << 13)),
        _ => f32::from_bits(((exponent + 127 - 15) << 23) | (mantissa << 13)),
    };
    if negative { -magnitude } else { magnitude }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_known_values() {
        let cases: [(u16, f32); 8] = [
            (0x0000, 0.0),
            (0x3c00, 1.0),
            (0xc000, -2.0),
            (0x3555, 0.333_251_95),
            (0x7bff, 65504.0),
            (0x0001, 5.960_464_5e-8),
            (0x03ff, 6.097_555e-5),
            (0x7c00, f32::INFINITY),
        ];
        for (bits, expected) in cases {
            assert_eq!(f16_to_f32(bits), expected, "{bits:#06x}");
        }
        assert!(f16_to_f32(0x7e00).is_nan());
        assert!(f16_to_f32(0x8000).is_sign_negative());
    }

    #[test]
    fn bf16_and_round_trips() {
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0xc040), -3.0);
        let floats = [1.5f32, -0.25, 3.0e7];
        assert_eq!(
            decode_float(DType::F32, &encode_f32(&floats)),
            Some(floats.to_vec())
        );
        let ints = [0, -1, i32::MAX];
        assert_eq!(decode_i32(&encode_i32(&ints)), ints.to_vec());
        assert_eq!(
            decode_float(DType::BF16, &[0x80, 0x3f, 0x40, 0xc0]),
            Some(vec![1.0, -3.0])
        );
        assert_eq!(decode_float(DType::I32, &[0; 4]), None);
    }
}
