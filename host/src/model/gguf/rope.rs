//! A GGUF's rotary scaling as `config.json`'s `rope_parameters`: from the `ARCH.rope.scaling.*` keys, or from llama.cpp's `rope_freqs` table fitted back to the llama3 parameters that made it.
//!
//! llama.cpp's converter writes no metadata for Llama 3.1+'s `llama3` scaling: it bakes the
//! parameters into a per-frequency table of divisors, the `rope_freqs` tensor. The model glue
//! computes rotary frequencies from `rope_parameters`, so the table is turned back into the
//! four numbers, then checked: the frequencies those numbers give must reproduce every entry
//! of the table, or the file is refused. Serving an approximation of the table would move
//! every position's rotation, a silent wrong answer.

use serde_json::{Value, json};

use super::{GgmlType, Gguf, GgufError, Result};

/// The name llama.cpp gives the table of frequency divisors.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// Relative error allowed between the table and the divisors the fitted parameters give:
/// the table is f32 computed in f64 from f32 frequencies, so entries agree to a few ulps.
const TABLE_TOLERANCE: f64 = 1e-5;

/// The scaling part of `rope_parameters` (without `rope_theta`), or `None` for none; `arch`
/// is the metadata keys' prefix (`general.architecture`).
pub fn rope_scaling(gguf: &Gguf, arch: &str, theta: f64, head_dim: usize) -> Result<Option<Value>> {
    let type_key = format!("{arch}.rope.scaling.type");
    let kind = match gguf.get(&type_key) {
        Some(_) => Some(gguf.str(&type_key)?),
        None => None,
    };
    let table = rope_freqs(gguf)?;
    match (kind, table) {
        (Some(kind), Some(_)) if kind != "none" => unsupported!(
            "GGUF has both {type_key} {kind:?} and a rope_freqs table; \
             one scaling is supported at a time"
        ),
        (_, Some(table)) => llama3_parameters(&table, theta, head_dim).map(Some),
        (None | Some("none"), None) => Ok(None),
        (Some("yarn"), None) => yarn_parameters(gguf, arch).map(Some),
        (Some(kind), None) => unsupported!(
            "GGUF {type_key} {kind:?} is not supported: none, yarn and \
             llama3 (a rope_freqs table) are"
        ),
    }
}

/// The `rope_freqs` table, when the file has one.
fn rope_freqs(gguf: &Gguf) -> Result<Option<Vec<f32>>> {
    let Some(tensor) = gguf.tensors().iter().find(|t| t.name == ROPE_FREQS) else {
        return Ok(None);
    };
    ensure!(
        tensor.kind == GgmlType::F32 && tensor.dims.len() == 1,
        "GGUF {ROPE_FREQS} must be a vector of f32, is {:?} {:?}",
        tensor.kind,
        tensor.dims
    );
    let table = gguf
        .tensor_data(tensor)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(Some(table))
}

fn yarn_parameters(gguf: &Gguf, arch: &str) -> Result<Value> {
    let factor = gguf.f64(&format!("{arch}.rope.scaling.factor"))?;
    let original = gguf.usize(&format!("{arch}.rope.scaling.original_context_length"))?;
    ensure!(
        factor.is_finite() && factor >= 1.0,
        "GGUF {arch}.rope.scaling.factor {factor} is below 1"
    );
    let mut parameters = json!({
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
    });
    for (key, name) in [
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        // llama.cpp's converter writes `attention_factor` as yarn_attn_factor; older files as
        // attn_factor.
        ("attn_factor", "attention_factor"),
        ("yarn_attn_factor", "attention_factor"),
    ] {
        let key = format!("{arch}.rope.scaling.{key}");
        if gguf.get(&key).is_some() {
            parameters[name] = json!(gguf.f64(&key)?);
        }
    }
    for key in ["yarn_ext_factor", "yarn_log_multiplier"] {
        let key = format!("{arch}.rope.scaling.{key}");
        if gguf.get(&key).is_some() {
            unsupported!("GGUF {key} is not supported");
        }
    }
    Ok(parameters)
}

/// The pretrained window stated in `rope_parameters`. Only its ratios to the two frequency
/// factors shape the table, so any value gives the same frequencies; Llama 3's is used.
const LLAMA3_ORIGINAL_WINDOW: f64 = 8192.0;

/// Fits `factor`, `low_freq_factor` and `high_freq_factor` to `table`.
///
/// Entries of 1 are the kept high frequencies and entries of `factor` the divided low ones.
/// Between them, an entry `r` of frequency `f` has `s = (1/r - 1/factor) / (1 - 1/factor)`,
/// and `s = a·f/2π - b` with `a = window / (high - low)` and `b = low / (high - low)`: a line
/// through the ramp's entries.
fn llama3_parameters(table: &[f32], theta: f64, head_dim: usize) -> Result<Value> {
    let frequencies = default_frequencies(theta, head_dim);
    ensure!(
        table.len() == frequencies.len(),
        "GGUF {ROPE_FREQS} has {} entries; head_dim {head_dim} needs {}",
        table.len(),
        frequencies.len()
    );
    let refuse = |why: &str| -> Result<Value> {
        unsupported!("GGUF {ROPE_FREQS} is not a llama3 rotary scaling table: {why}")
    };
    let factor = f64::from(table.iter().fold(0.0f32, |m, &r| m.max(r)));
    if factor.is_nan() || factor <= 1.0 || table.iter().any(|&r| r.is_nan() || r < 1.0) {
        return refuse("entries must be at least 1, and some above it");
    }
    let factor = snap(factor);
    let ramp: Vec<(f64, f64)> = table
        .iter()
        .zip(&frequencies)
        .map(|(&r, &f)| (f64::from(r), f))
        .filter(|&(r, _)| !near(r, 1.0) && !near(r, factor))
        .map(|(r, f)| {
            let s = (1.0 / r - 1.0 / factor) / (1.0 - 1.0 / factor);
            (f / std::f64::consts::TAU, s)
        })
        .collect();
    let (low, high) = match ramp.as_slice() {
        [] | [_] => {
            // Too few ramp entries to fit a line: Llama 3's own factors are the one choice
            // the check below can confirm.
            (1.0, 4.0)
        }
        points => {
            let (a, b) = least_squares_line(points);
            if a.is_nan() || a <= 0.0 {
                return refuse("its ramp does not rise with frequency");
            }
            let width = LLAMA3_ORIGINAL_WINDOW / a;
            let low = -b * width;
            (snap(low), snap(low + width))
        }
    };
    if low.is_nan() || high.is_nan() || low <= 0.0 || high <= low {
        return refuse("its ramp implies no positive frequency factors");
    }
    let fitted = llama3_divisors(&frequencies, factor, low, high);
    let worst = fitted
        .iter()
        .zip(table)
        .map(|(&fit, &r)| (fit - f64::from(r)).abs() / f64::from(r))
        .fold(0.0f64, f64::max);
    if worst > TABLE_TOLERANCE {
        return refuse(&format!(
            "the closest llama3 parameters (factor {factor}, low_freq_factor {low}, \
             high_freq_factor {high}) miss an entry by {worst:.1e}"
        ));
    }
    Ok(json!({
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": LLAMA3_ORIGINAL_WINDOW as u64,
    }))
}

/// Rotary frequencies without scaling, in f32 as the converter computes them.
fn default_frequencies(theta: f64, head_dim: usize) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / head_dim as f32;
            f64::from(1.0 / (theta as f32).powf(exponent))
        })
        .collect()
}

/// The divisor of each frequency under llama3 scaling, as llama.cpp's converter writes it.
fn llama3_divisors(frequencies: &[f64], factor: f64, low: f64, high: f64) -> Vec<f64> {
    let low_wavelength = LLAMA3_ORIGINAL_WINDOW / low;
    let high_wavelength = LLAMA3_ORIGINAL_WINDOW / high;
    frequencies
        .iter()
        .map(|&f| {
            let wavelength = std::f64::consts::TAU / f;
            if wavelength < high_wavelength {
                1.0
            } else if wavelength > low_wavelength {
                factor
            } else {
                let s = (LLAMA3_ORIGINAL_WINDOW / wavelength - low) / (high - low);
                1.0 / ((1.0 - s) / factor + s)
            }
        })
        .collect()
}

/// The slope and intercept of the least-squares line through `points`.
fn least_squares_line(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (slope, mean_y - slope * mean_x)
}

fn near(x: f64, y: f64) -> bool {
    (x - y).abs() <= TABLE_TOLERANCE * y.abs()
}

/// Published configs state these factors in sixteenths (1, 4, 8, 32); a fitted value that
/// close to one is that value, so the config reads as the model's own.
fn snap(x: f64) -> f64 {
    let sixteenths = (x * 16.0).round() / 16.0;
    if (x - sixteenths).abs() <= 1e-4 * x.abs() {
        sixteenths
    } else {
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table llama.cpp's converter writes for Llama 3.2 (theta 500,000, head_dim 64).
    fn llama32_table() -> Vec<f32> {
        let frequencies = default_frequencies(500_000.0, 64);
        llama3_divisors(&frequencies, 32.0, 1.0, 4.0)
            .iter()
            .map(|&r| r as f32)
            .collect()
    }

    #[test]
    fn a_llama3_table_gives_back_its_parameters() {
        let parameters = llama3_parameters(&llama32_table(), 500_000.0, 64).unwrap();
        assert_eq!(parameters["rope_type"], "llama3");
        assert_eq!(parameters["factor"], 32.0);
        assert_eq!(parameters["low_freq_factor"], 1.0);
        assert_eq!(parameters["high_freq_factor"], 4.0);
        assert_eq!(parameters["original_max_position_embeddings"], 8192);
    }

    #[test]
    fn other_llama3_factors_are_fitted_too() {
        let frequencies = default_frequencies(500_000.0, 128);
        let table: Vec<f32> = llama3_divisors(&frequencies, 8.0, 1.5, 6.25)
            .iter()
            .map(|&r| r as f32)
            .collect();
        let parameters = llama3_parameters(&table, 500_000.0, 128).unwrap();
        assert_eq!(parameters["factor"], 8.0);
        assert_eq!(parameters["low_freq_factor"], 1.5);
        assert_eq!(parameters["high_freq_factor"], 6.25);
    }

    #[test]
    fn a_table_no_llama3_parameters_make_is_refused() {
        let mut table = llama32_table();
        // One ramp entry moved: no line fits every entry.
        let ramp = table.iter().position(|&r| r > 1.0 && r < 32.0).unwrap();
        table[ramp] *= 1.01;
        let error = llama3_parameters(&table, 500_000.0, 64).unwrap_err();
        assert!(matches!(error, GgufError::Unsupported(_)), "{error}");
        assert!(error.to_string().contains("rope_freqs"), "{error}");
        // A linear table (every entry the same) is not llama3 either.
        let error = llama3_parameters(&[2.0; 32], 500_000.0, 64).unwrap_err();
        assert!(matches!(error, GgufError::Unsupported(_)), "{error}");
    }

    #[test]
    fn a_table_of_the_wrong_length_is_refused() {
        let error = llama3_parameters(&llama32_table(), 500_000.0, 128).unwrap_err();
        assert!(error.to_string().contains("needs 64"), "{error}");
    }

    fn scaling_keys(arch: &str, kind: &str) -> Gguf {
        let key = |suffix: &str| format!("{arch}.rope.scaling.{suffix}");
        let bytes = crate::model::gguf::GgufWriter::default()
            .str(&key("type"), kind)
            .f32(&key("factor"), 4.0)
            .u32(&key("original_context_length"), 32_768)
            .f32(&key("yarn_attn_factor"), 1.5)
            .build();
        Gguf::parse(bytes).expect("parses")
    }

    #[test]
    fn yarn_is_read_under_the_files_architecture() {
        let gguf = scaling_keys("qwen3", "yarn");
        let parameters = rope_scaling(&gguf, "qwen3", 1e6, 128)
            .unwrap()
            .expect("a scaling");
        assert_eq!(parameters["rope_type"], "yarn");
        assert_eq!(parameters["factor"], 4.0);
        assert_eq!(parameters["original_max_position_embeddings"], 32_768);
        assert_eq!(parameters["attention_factor"], 1.5);
        // Another architecture's keys say nothing about this one.
        assert_eq!(rope_scaling(&gguf, "llama", 1e6, 128).unwrap(), None);
    }

    #[test]
    fn a_scaling_type_it_cannot_map_is_refused_naming_the_key_and_value() {
        let gguf = scaling_keys("qwen3", "longrope");
        let error = rope_scaling(&gguf, "qwen3", 1e6, 128).unwrap_err();
        assert!(matches!(error, GgufError::Unsupported(_)), "{error}");
        assert!(
            error
                .to_string()
                .contains(r#"qwen3.rope.scaling.type "longrope" is not supported"#),
            "{error}"
        );
    }
}
