//! Block-quantized weights through the C ABI: a linear and an embedding gather over buffers of each type as a host uploads them from a GGUF, and weights whose rows are not whole blocks refused before anything runs.

use plughost_device_abi::blocks::dequantize;
use plughost_device_abi::{DType, status};

use super::device::{Device, IN, OUT, Tensor, random};
use crate::isa::Isa;

/// `rows` rows of `width` values in `dtype`: random blocks with small finite f16 scales.
fn blocks(dtype: DType, rows: usize, width: usize, seed: u64) -> Vec<u8> {
    let size = dtype.size_bytes() as usize;
    let count = rows * width / dtype.block_elements() as usize;
    let noise = random(seed, count * size, 1.0);
    let mut bytes: Vec<u8> = noise.iter().map(|v| (v.to_bits() >> 7) as u8).collect();
    // Where each type keeps its f16 scale, and its minimum's if it has one.
    let (scale_at, minimum_at) = match dtype {
        DType::Q4_1 | DType::Q4_K => (0, Some(2)),
        DType::Q6_K => (208, None),
        _ => (0, None),
    };
    for (b, block) in bytes.chunks_exact_mut(size).enumerate() {
        let scale = half::f16::from_f32(0.01 + 0.001 * b as f32).to_le_bytes();
        block[scale_at..scale_at + 2].copy_from_slice(&scale);
        if let Some(at) = minimum_at {
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(-0.05).to_le_bytes());
        }
    }
    bytes
}

/// The rows `ids` of `table` (rows of `width`) as an embedding gather gives them.
fn gather(device: &Device, table: &Tensor, ids: &[i32], width: usize) -> Vec<f32> {
    let ids_tensor = device.i32s(&[ids.len() as u64], ids);
    let gathered = device.zeros(&[ids.len() as u64, width as u64]);
    let args = [ids_tensor.arg(IN), table.arg(IN), gathered.arg(OUT)];
    device.launch("embedding_gather", &args, &[]).unwrap();
    device.read_f32(&gathered)
}

#[test]
fn quantized_weights_serve_linears_and_gathers() {
    let device = Device::open("").unwrap();
    let x_values = random(3, 2 * 64, 1.0);
    for dtype in [DType::Q4_1, DType::Q8_0] {
        let bytes = blocks(dtype, 3, 64, 11);
        let w = device.upload(dtype, &[3, 64], &bytes);
        let x = device.f32s(&[2, 64], &x_values);
        let out = device.zeros(&[2, 3]);
        device
            .launch("linear", &[x.arg(IN), w.arg(IN), out.arg(OUT)], &[])
            .unwrap();
        let values = dequantize(dtype, &bytes).unwrap();
        let got = device.read_f32(&out);
        for t in 0..2 {
            for n in 0..3 {
                let row = &values[n * 64..(n + 1) * 64];
                let want: f32 = row
                    .iter()
                    .zip(&x_values[t * 64..])
                    .map(|(w, x)| w * x)
                    .sum();
                let scale: f32 = row
                    .iter()
                    .zip(&x_values[t * 64..])
                    .map(|(w, x)| (w * x).abs())
                    .sum();
                assert!(
                    (got[t * 3 + n] - want).abs() <= 1e-4 * scale.max(1e-3),
                    "{dtype} [{t}, {n}]: {} vs {want}",
                    got[t * 3 + n]
                );
            }
        }
        let mut expected = values[128..192].to_vec();
        expected.extend_from_slice(&values[..64]);
        assert_eq!(gather(&device, &w, &[2, 0], 64), expected, "{dtype} gather");
    }
}

/// `activation_digits=1` reaches the kernels: each output is within the rounding of int8
/// activations of the f32 product (half a step, `max|x| / 254` per block, times the row's
/// magnitudes), and is not what the default two digits give.
#[test]
fn one_activation_digit_rounds_as_int8() {
    let (rows, width, tokens) = (5usize, 256usize, 2usize);
    let x_values = random(7, tokens * width, 1.0);
    for dtype in [DType::Q8_0, DType::Q4_1, DType::Q4_K, DType::Q6_K] {
        let bytes = blocks(dtype, rows, width, 13);
        let values = dequantize(dtype, &bytes).unwrap();
        let block = if dtype.block_elements() == 256 {
            256
        } else {
            32
        };
        let outputs = |config: &str| {
            let device = Device::open(config).unwrap();
            let w = device.upload(dtype, &[rows as u64, width as u64], &bytes);
            let x = device.f32s(&[tokens as u64, width as u64], &x_values);
            let out = device.zeros(&[tokens as u64, rows as u64]);
            device
                .launch("linear", &[x.arg(IN), w.arg(IN), out.arg(OUT)], &[])
                .unwrap();
            device.read_f32(&out)
        };
        let (one, two) = (outputs("activation_digits=1"), outputs(""));
        let mut differ = false;
        for t in 0..tokens {
            let x = &x_values[t * width..(t + 1) * width];
            for n in 0..rows {
                let row = &values[n * width..(n + 1) * width];
                let exact: f64 = row.iter().zip(x).map(|(w, x)| f64::from(w * x)).sum();
                // Half a step of each block's quantization, times the block's |w|.
                let bound: f64 = row
                    .chunks_exact(block)
                    .zip(x.chunks_exact(block))
                    .map(|(w, x)| {
                        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                        let w_sum: f32 = w.iter().map(|w| w.abs()).sum();
                        f64::from(amax / 254.0 * w_sum)
                    })
                    .sum();
                let got = f64::from(one[t * rows + n]);
                assert!(
                    (got - exact).abs() <= bound * 1.01 + 1e-6,
                    "{dtype} [{t}, {n}]: {got} vs {exact}, bound {bound}"
                );
                differ |= one[t * rows + n].to_bits() != two[t * rows + n].to_bits();
            }
        }
        assert!(differ, "{dtype}: one digit gave the bits of two");
    }
}

/// Weights the linears interleave (from `avx2` up; 19 rows: a whole group of 16 and three
/// rows after it): gathers from them, the host's read, and a projection after that read see
/// them as written, at every level, for the 32-value blocks and the K-quants (rows of two
/// 256-value blocks).
#[test]
fn interleaved_weights_read_and_gather_as_written() {
    let (rows, tokens) = (19usize, 3usize);
    let levels = Isa::every().into_iter().map(|isa| isa.level());
    for (dtype, level) in [DType::Q8_0, DType::Q4_1, DType::Q4_K, DType::Q6_K]
        .into_iter()
        .flat_map(|dtype| levels.clone().map(move |level| (dtype, level)))
    {
        let width = 2 * dtype.block_elements() as usize;
        let x_values = random(29, tokens * width, 1.0);
        let bytes = blocks(dtype, rows, width, 23);
        let values = dequantize(dtype, &bytes).unwrap();
        let config = format!("isa={level},threads=2");
        let device = Device::open(&config).unwrap();
        let w = device.upload(dtype, &[rows as u64, width as u64], &bytes);
        let x = device.f32s(&[tokens as u64, width as u64], &x_values);
        let out = device.zeros(&[tokens as u64, rows as u64]);
        let project = || {
            device
                .launch("linear", &[x.arg(IN), w.arg(IN), out.arg(OUT)], &[])
                .unwrap();
            device.read_f32(&out)
        };
        let gather = || gather(&device, &w, &[17, 3], width);
        let mut expected_rows = values[17 * width..18 * width].to_vec();
        expected_rows.extend_from_slice(&values[3 * width..4 * width]);
        let first = project();
        assert_eq!(
            gather(),
            expected_rows,
            "{dtype} at {config}: gathered after the projection"
        );
        assert_eq!(
            device.read_blocks(&w),
            bytes,
            "{dtype} at {config}: the host's read"
        );
        assert_eq!(
            project(),
            first,
            "{dtype} at {config}: a projection after the host's read"
        );
        assert_eq!(
            gather(),
            expected_rows,
            "{dtype} at {config}: a gather after that"
        );
    }
}

#[test]
fn rows_that_are_not_whole_blocks_are_refused() {
    let device = Device::open("").unwrap();
    // 48 values a row: one and a half Q8_0 blocks.
    let w = device.upload(DType::Q8_0, &[2, 48], &[0; 2 * 51]);
    let x = device.f32s(&[1, 48], &[0.0; 48]);
    let out = device.f32s(&[1, 2], &[7.0; 2]);
    let (code, message) = device
        .launch("linear", &[x.arg(IN), w.arg(IN), out.arg(OUT)], &[])
        .unwrap_err();
    assert_eq!(code, status::INVALID_ARGUMENT);
    assert!(message.contains("not whole blocks of 32"), "{message}");
    assert_eq!(device.read_f32(&out), [7.0; 2]);
}
