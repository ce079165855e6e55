//! Quantizing f32/f16/bf16 weights at load (`--quantize q8_0|q4_k`) into ggml's block layouts, which the device multiplies as it does a GGUF file's.
//!
//! Each weight row is cut into blocks of the target type along its input dimension. Q8_0 is
//! llama.cpp's scheme exactly: per 32 values, `d = max|x| / 127` and `q = round(x / d)`.
//! Q4_K keeps per 32 values a 6-bit scale and a 6-bit minimum relative to the block's two
//! f16 factors; each sub-block's pair is searched for as llama.cpp's K-quants search (grids
//! around the range's, refitted by weighted least squares), though not bit for bit the same. A row whose length is not a whole
//! number of 256-value blocks falls back to Q8_0, as llama.cpp falls back to a type that fits.

use half::f16;
use plughost_device_abi::DType;

/// The block type `--quantize` turns linear weights into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightQuantization {
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_k")]
    Q4K,
}

impl WeightQuantization {
    /// The type a row of `row_len` values becomes: the target, or Q8_0 when the row does not
    /// split into the target's blocks; `None` when not even Q8_0's blocks fit.
    pub fn dtype_for(self, row_len: usize) -> Option<DType> {
        match self {
            WeightQuantization::Q4K if row_len.is_multiple_of(256) => Some(DType::Q4_K),
            _ if row_len.is_multiple_of(32) => Some(DType::Q8_0),
            _ => None,
        }
    }

    /// The block type this target names.
    pub fn dtype(self) -> DType {
        match self {
            WeightQuantization::Q8_0 => DType::Q8_0,
            WeightQuantization::Q4K => DType::Q4_K,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightQuantization::Q8_0 => "q8_0",
            WeightQuantization::Q4K => "q4_k",
        }
    }
}

/// The values of an f32, f16 or bf16 tensor's little-endian bytes; `None` for other types.
pub fn widen(dtype: DType, bytes: &[u8]) -> Option<Vec<f32>> {
    let values = match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    };
    Some(values)
}

/// The blocks of `values` (whole blocks of `dtype`, which is Q8_0 or Q4_K).
pub fn quantize(dtype: DType, values: &[f32]) -> Vec<u8> {
    let elements = dtype.block_elements() as usize;
    let mut out = Vec::with_capacity(values.len() / elements * dtype.size_bytes() as usize);
    for block in values.chunks_exact(elements) {
        match dtype {
            DType::Q4_K => quantize_q4_k(block, &mut out, |sub| fit_scale_and_min(sub, 15)),
            _ => quantize_q8_0(block, &mut out),
        }
    }
    out
}

fn quantize_q8_0(block: &[f32], out: &mut Vec<u8>) {
    let amax = block.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    out.extend(block.iter().map(|&x| (x * id).round() as i8 as u8));
}

/// One Q4_K block of `block`, each 32-value sub-block's scale and minimum chosen by `fit`.
fn quantize_q4_k(block: &[f32], out: &mut Vec<u8>, fit: impl Fn(&[f32]) -> (f32, f32)) {
    // Per sub-block of 32: value = scale * q - min, q in 0..=15, min >= 0.
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for (j, sub) in block.chunks_exact(32).enumerate() {
        (scales[j], mins[j]) = fit(sub);
    }
    let d = scales.iter().fold(0.0f32, |m, &s| m.max(s)) / 63.0;
    let dmin = mins.iter().fold(0.0f32, |m, &s| m.max(s)) / 63.0;
    let (d16, dmin16) = (f16::from_f32(d), f16::from_f32(dmin));
    let (d, dmin) = (d16.to_f32(), dmin16.to_f32());
    let six_bits = |value: f32, unit: f32| {
        if unit > 0.0 {
            (value / unit).round().clamp(0.0, 63.0) as u8
        } else {
            0
        }
    };
    let sc: [u8; 8] = std::array::from_fn(|j| six_bits(scales[j], d));
    let m: [u8; 8] = std::array::from_fn(|j| six_bits(mins[j], dmin));
    out.extend_from_slice(&d16.to_le_bytes());
    out.extend_from_slice(&dmin16.to_le_bytes());
    // The inverse of llama.cpp's `get_scale_min_k4`.
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    out.extend_from_slice(&packed);
    let mut q = [0u8; 256];
    for (j, (sub, q)) in block
        .chunks_exact(32)
        .zip(q.chunks_exact_mut(32))
        .enumerate()
    {
        let scale = d * f32::from(sc[j]);
        let min = dmin * f32::from(m[j]);
        for (q, &x) in q.iter_mut().zip(sub) {
            *q = if scale > 0.0 {
                ((x + min) / scale).round().clamp(0.0, 15.0) as u8
            } else {
                0
            };
        }
    }
    // Each 64 values: the low nibbles of 32 bytes, then their high nibbles.
    for chunk in q.chunks_exact(64) {
        out.extend((0..32).map(|l| chunk[l] | (chunk[l + 32] << 4)));
    }
}

/// Candidate grids tried around the range's own, in steps of a tenth of a level either way.
const SEARCH_STEPS: i32 = 20;

/// The scale and minimum (`x ≈ scale * q - min`, `q` in `0..=levels`, `min >= 0`) that best
/// fit `values`, weighting each value's squared error by `rms + |x|` so large values, which
/// dominate a dot product, are kept most exactly.
///
/// Rounding to the grid the range gives is rarely the best choice: grids slightly finer and
/// coarser are tried, and for each the scale and minimum are re-fitted by least squares to
/// the levels it picked. That recovers most of the error a plain range-based grid leaves, as
/// llama.cpp's K-quant search does.
fn fit_scale_and_min(values: &[f32], levels: u8) -> (f32, f32) {
    let levels = f32::from(levels);
    let lo = values.iter().fold(0.0f32, |m, &x| m.min(x));
    let hi = values.iter().fold(f32::MIN, |m, &x| m.max(x));
    if hi <= lo {
        return (0.0, -lo);
    }
    let rms = (values.iter().map(|x| x * x).sum::<f32>() / values.len() as f32).sqrt();
    let weights: Vec<f32> = values.iter().map(|x| rms + x.abs()).collect();
    let error = |scale: f32, offset: f32| -> f32 {
        values
            .iter()
            .zip(&weights)
            .map(|(&x, &w)| {
                let q = if scale > 0.0 {
                    ((x - offset) / scale).round().clamp(0.0, levels)
                } else {
                    0.0
                };
                w * (scale * q + offset - x).powi(2)
            })
            .sum()
    };
    let mut best = ((hi - lo) / levels, lo);
    let mut best_error = error(best.0, best.1);
    for step in -SEARCH_STEPS / 2..=SEARCH_STEPS / 2 {
        let inverse = (levels + step as f32 / 10.0) / (hi - lo);
        if inverse <= 0.0 {
            continue;
        }
        // Weighted least squares of x ≈ scale * q + offset over the levels this grid picks.
        let (mut sw, mut sq, mut sqq, mut sx, mut sqx) = (0.0f32, 0.0f32, 0.0f32, 0.0f32, 0.0f32);
        for (&x, &w) in values.iter().zip(&weights) {
            let q = ((x - lo) * inverse).round().clamp(0.0, levels);
            sw += w;
            sq += w * q;
            sqq += w * q * q;
            sx += w * x;
            sqx += w * q * x;
        }
        let det = sw * sqq - sq * sq;
        if det <= 0.0 {
            continue;
        }
        let mut scale = (sw * sqx - sx * sq) / det;
        let mut offset = (sqq * sx - sq * sqx) / det;
        if offset > 0.0 {
            // The format keeps a non-positive offset: refit the scale through zero.
            offset = 0.0;
            scale = if sqq > 0.0 { sqx / sqq } else { 0.0 };
        }
        if scale <= 0.0 {
            continue;
        }
        let candidate_error = error(scale, offset);
        if candidate_error < best_error {
            best = (scale, offset);
            best_error = candidate_error;
        }
    }
    (best.0, -best.1)
}

#[cfg(test)]
mod tests {
    use plughost_device_abi::blocks::dequantize;

    use super::*;

    /// Values spread over a few orders of magnitude, both signs, with a zero block.
    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                if (256..288).contains(&i) {
                    return 0.0;
                }
                let x = ((i * 7919) % 1000) as f32 / 1000.0 - 0.45;
                x * (1.0 + (i % 97) as f32 / 10.0)
            })
            .collect()
    }

    #[test]
    fn q8_0_round_trips_within_half_a_step_per_block() {
        let x = values(1024);
        let back = dequantize(DType::Q8_0, &quantize(DType::Q8_0, &x)).unwrap();
        for (block, back) in x.chunks(32).zip(back.chunks(32)) {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // Half a step of the f16 scale, plus the scale's own f16 rounding at 127 steps.
            let bound = amax / 127.0 * (0.5 + 127.0 / 1024.0) + 1e-7;
            for (a, b) in block.iter().zip(back) {
                assert!((a - b).abs() <= bound, "{a} -> {b}, bound {bound}");
            }
        }
    }

    #[test]
    fn q4_k_round_trips_within_its_sub_block_steps() {
        let x = values(1024);
        let back = dequantize(DType::Q4_K, &quantize(DType::Q4_K, &x)).unwrap();
        for (block, back) in x.chunks(256).zip(back.chunks(256)) {
            // The largest sub-block range sets the 6-bit units; a value is off by at most half
            // a 4-bit step plus what rounding the scale and the minimum to 6 bits costs.
            let range = |s: &[f32]| {
                let lo = s.iter().fold(0.0f32, |m, &v| m.min(v));
                let hi = s.iter().fold(f32::MIN, |m, &v| m.max(v));
                hi - lo
            };
            let widest = block.chunks(32).map(range).fold(0.0f32, f32::max);
            let deepest = block.iter().fold(0.0f32, |m, &v| m.max(-v)).max(0.0);
            let bound = widest / 15.0 * 0.5
                + widest / 15.0 / 63.0 * 0.5 * 15.0
                + deepest / 63.0 * 0.5
                + 1e-3 * widest;
            for (a, b) in block.iter().zip(back) {
                assert!((a - b).abs() <= bound, "{a} -> {b}, bound {bound}");
            }
        }
    }

    /// Weights as trained matrices have them: roughly normal, with a few outliers.
    fn weights(n: usize) -> Vec<f32> {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f32 / (1u64 << 53) as f32
        };
        (0..n)
            .map(|i| {
                // Box-Muller.
                let (u, v) = (uniform().max(1e-12), uniform());
                let normal = (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos();
                let outlier = if i % 101 == 0 { 6.0 } else { 1.0 };
                0.02 * normal * outlier
            })
            .collect()
    }

    fn squared_error(x: &[f32], blocks: &[u8]) -> f64 {
        let back = dequantize(DType::Q4_K, blocks).unwrap();
        x.iter()
            .zip(&back)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum()
    }

    #[test]
    fn the_q4_k_search_beats_the_range_of_each_sub_block() {
        // Each sub-block's range cut into 15 steps, the choice without a search.
        let range = |sub: &[f32]| {
            let lo = sub.iter().fold(0.0f32, |m, &x| m.min(x));
            let hi = sub.iter().fold(f32::MIN, |m, &x| m.max(x));
            ((hi - lo).max(0.0) / 15.0, -lo)
        };
        // On weights like a model's, the search removes a good part of the error; on any
        // values it removes some.
        for (x, most) in [(weights(64 * 256), 0.9), (values(1024), 1.0)] {
            let (mut searched, mut ranged) = (Vec::new(), Vec::new());
            for block in x.chunks_exact(256) {
                quantize_q4_k(block, &mut searched, |sub| fit_scale_and_min(sub, 15));
                quantize_q4_k(block, &mut ranged, range);
            }
            let ratio = squared_error(&x, &searched) / squared_error(&x, &ranged);
            assert!(
                ratio < most,
                "the search keeps {ratio} of the range's squared error"
            );
        }
    }

    #[test]
    fn rows_pick_the_type_that_fits() {
        assert_eq!(WeightQuantization::Q4K.dtype_for(512), Some(DType::Q4_K));
        assert_eq!(WeightQuantization::Q4K.dtype_for(576), Some(DType::Q8_0));
        assert_eq!(WeightQuantization::Q8_0.dtype_for(576), Some(DType::Q8_0));
        assert_eq!(WeightQuantization::Q8_0.dtype_for(100), None);
    }
}
