//! Dequantizing ggml tensor bytes to f32, bit-for-bit as the `gguf` Python package does (through the device ABI's `blocks`).
//!
//! Q4_1 block (32 values, 20 bytes): f16 scale `d`, f16 minimum `m`, 16 bytes of nibbles; value
//! `i < 16` is the low nibble of byte `i`, value `16 + i` its high nibble; `x = d * q + m`.
//! Q8_0 block (32 values, 34 bytes): f16 scale `d`, 32 `i8`; `x = d * q`.
//! The products are rounded to f32 before the sum, as numpy and torch compute them (Rust never
//! fuses them into one FMA), so results equal the reference exactly.

use plughost_device_abi::elements::decode_float;

use plughost::model::gguf::GgmlType;

/// Appends the values of `bytes` (whole blocks of `kind`) to `out`.
pub fn dequantize_into(kind: GgmlType, bytes: &[u8], out: &mut Vec<f32>) {
    // The device ABI's decoding: the same code the devices and the host's loader use.
    out.extend(decode_float(kind.device_dtype(), bytes).unwrap_or_default());
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    fn hex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// Blocks and the values `gguf.dequantize` (gguf 0.19.0) gives for them: the first block of
    /// two SmolLM2 tensors and a synthetic block each covering the extremes (negative scale,
    /// nibbles 0 and 15, i8 -128 and 127).
    const CASES: &[(&str, GgmlType, &str, [f32; 32])] = &[
        (
            "q4_1 blk.0.attn_q block 0",
            GgmlType::Q4_1,
            "0f30d8b9458765406f65164b677664502267655a",
            [
                -0.09631348,
                0.15734863,
                -0.09631348,
                -0.73046875,
                1.1719971,
                -0.09631348,
                0.030517578,
                0.66467285,
                0.15734863,
                0.030517578,
                -0.22314453,
                -0.73046875,
                -0.47680664,
                0.15734863,
                -0.09631348,
                0.5378418,
                -0.22314453,
                0.2841797,
                0.030517578,
                -0.22314453,
                0.030517578,
                0.030517578,
                -0.6036377,
                -0.22314453,
                0.030517578,
                0.15734863,
                0.030517578,
                -0.09631348,
                -0.47680664,
                0.030517578,
                0.030517578,
                -0.09631348,
            ],
        ),
        (
            "q4_1 synthetic d=-0.5 m=1.25",
            GgmlType::Q4_1,
            "00b8003df0e1d2c3b4a5968778695a4b3c2d1e0f",
            [
                1.25, 0.75, 0.25, -0.25, -0.75, -1.25, -1.75, -2.25, -2.75, -3.25, -3.75, -4.25,
                -4.75, -5.25, -5.75, -6.25, -6.25, -5.75, -5.25, -4.75, -4.25, -3.75, -3.25, -2.75,
                -2.25, -1.75, -1.25, -0.75, -0.25, 0.25, 0.75, 1.25,
            ],
        ),
        (
            "q8_0 token_embd block 0",
            GgmlType::Q8_0,
            "3219d60d13f7e5ee08d02aa801de56818608fd21dbee104fe81efaf9e21128391fb1",
            [
                -0.106544495,
                0.032978058,
                0.0481987,
                -0.022830963,
                -0.06849289,
                -0.045661926,
                0.02029419,
                -0.12176514,
                0.106544495,
                -0.22323608,
                0.0025367737,
                -0.086250305,
                0.21816254,
                -0.32217026,
                -0.3094864,
                0.02029419,
                -0.007610321,
                0.08371353,
                -0.093860626,
                -0.045661926,
                0.04058838,
                0.20040512,
                -0.06088257,
                0.07610321,
                -0.015220642,
                -0.017757416,
                -0.07610321,
                0.043125153,
                0.10147095,
                0.1445961,
                0.078639984,
                -0.20040512,
            ],
        ),
        (
            "q8_0 synthetic d=1/128",
            GgmlType::Q8_0,
            "0020807f0001ffbfc4c9ced3d8dde2e7ecf1f6fb00050a0f14191e23282d32373c41",
            [
                -1.0, 0.9921875, 0.0, 0.0078125, -0.0078125, -0.5078125, -0.46875, -0.4296875,
                -0.390625, -0.3515625, -0.3125, -0.2734375, -0.234375, -0.1953125, -0.15625,
                -0.1171875, -0.078125, -0.0390625, 0.0, 0.0390625, 0.078125, 0.1171875, 0.15625,
                0.1953125, 0.234375, 0.2734375, 0.3125, 0.3515625, 0.390625, 0.4296875, 0.46875,
                0.5078125,
            ],
        ),
    ];

    #[test]
    fn blocks_match_the_gguf_package_bit_for_bit() {
        for (name, kind, bytes, expected) in CASES {
            let mut out = Vec::new();
            dequantize_into(*kind, &hex(bytes), &mut out);
            let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
            let want: Vec<u32> = expected.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{name}: {out:?}");
        }
    }

    #[test]
    fn consecutive_blocks_append_in_order() {
        let (_, kind, first, first_values) = &CASES[0];
        let (_, _, second, second_values) = &CASES[1];
        let mut out = Vec::new();
        dequantize_into(*kind, &[hex(first), hex(second)].concat(), &mut out);
        assert_eq!(out, [first_values.as_slice(), second_values].concat());
    }

    #[test]
    fn float_types_pass_through() {
        let mut out = Vec::new();
        dequantize_into(GgmlType::F32, &(-1.5f32).to_le_bytes(), &mut out);
        let half_bits = f16::from_f32(0.333).to_le_bytes();
        dequantize_into(GgmlType::F16, &half_bits, &mut out);
        assert_eq!(out, [-1.5, f16::from_f32(0.333).to_f32()]);
    }
}
