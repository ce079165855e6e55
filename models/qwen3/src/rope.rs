//! The rotary position embedding a config.json asks for: its base, its frequency scaling, and the inverse-frequency table and attention factor computed from them once, at prepare time.
//!
//! The rotary dict is read in both forms configs carry:
//! - as `transformers` 4 writes it: a top-level `rope_theta`, and `rope_scaling` (null, or a
//!   dict naming a scaling);
//! - as `transformers` 5 writes it: `rope_parameters: {"rope_type": ..., "rope_theta": ...}`,
//!   which configs with several attention types key by type (`{"full_attention": {...}}`).
//!
//! Fields that state the same quantity must agree. Three types are computed: `default`,
//! `llama3` (Llama 3.1+ frequency scaling) and `yarn`; the others (`linear`, `dynamic`,
//! `longrope`, ...) are refused with the field named. Every table is computed in f32 step by
//! step as `transformers`' `_compute_*_parameters` functions compute it, so the device
//! rotates by the same angles.

use serde_json::{Map, Value};

/// The rotary base when no field states one: `default_theta` of `Qwen3Config`, `Qwen2Config`,
/// `LlamaConfig` and `MistralConfig` in `transformers`, which it applies in the same case.
/// Configs in the wild rely on it, so its absence is not an error.
const DEFAULT_ROPE_THETA: f64 = 10_000.0;

/// YaRN's defaults in `transformers` (from the paper) for the keys a config may leave out.
const YARN_BETA_FAST: f64 = 32.0;
const YARN_BETA_SLOW: f64 = 1.0;

/// How the frequencies of the default rotary embedding are rescaled for longer contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Llama 3.1's scaling: low frequencies divided by `factor`, high ones kept, a smooth
    /// ramp between them.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: u32,
    },
    /// YaRN ("NTK-by-parts" interpolation with an attention temperature).
    Yarn {
        factor: f64,
        /// The window the model was pretrained on.
        original_max_position: u32,
        beta_fast: f64,
        beta_slow: f64,
        /// Multiplies cos and sin (so the attention logits by its square).
        attention_factor: f64,
        /// Round the ramp's ends outward to whole dimensions.
        truncate: bool,
    },
}

/// A checked rotary embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f32,
    pub scaling: RopeScaling,
}

/// The config.json fields a rotary embedding is read from.
pub struct RopeFields<'a> {
    pub rope_theta: Option<f64>,
    pub rope_parameters: Option<&'a Value>,
    pub rope_scaling: Option<&'a Value>,
    pub partial_rotary_factor: Option<&'a Value>,
    pub max_position_embeddings: u32,
    /// A top-level `original_max_position_embeddings` (Phi-3's place for it), which
    /// `transformers` prefers to the one in the rotary dict.
    pub original_max_position_embeddings: Option<u32>,
}

impl Rope {
    pub fn parse(fields: &RopeFields<'_>) -> Result<Rope, String> {
        if let Some(factor) = fields.partial_rotary_factor {
            check_partial_rotary_factor("partial_rotary_factor", factor)?;
        }
        let mut thetas: Vec<(String, f64)> = Vec::new();
        if let Some(theta) = fields.rope_theta {
            thetas.push(("rope_theta".to_string(), theta));
        }
        let mut scalings: Vec<(String, RopeScaling)> = Vec::new();
        let dicts = [
            ("rope_parameters", fields.rope_parameters),
            ("rope_scaling", fields.rope_scaling),
        ];
        for (field, value) in dicts {
            let Some(value) = value.filter(|v| !v.is_null()) else {
                continue;
            };
            let (name, entry) = rope_entry(field, value)?;
            let stated = check_rope_entry(&name, entry, fields)?;
            if let Some(theta) = stated.theta {
                thetas.push((format!("{name}.rope_theta"), theta));
            }
            scalings.push((name, stated.scaling));
        }
        Ok(Rope {
            theta: the_theta(&thetas)?,
            scaling: the_scaling(scalings)?,
        })
    }

    /// One inverse frequency per pair of a `head_dim`-wide head, as `transformers` computes
    /// `inv_freq` for this rotary type.
    pub fn inverse_frequencies(&self, head_dim: u32) -> Vec<f32> {
        match &self.scaling {
            RopeScaling::None => default_inverse_frequencies(head_dim, self.theta),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => llama3_inverse_frequencies(
                &default_inverse_frequencies(head_dim, self.theta),
                *factor,
                *low_freq_factor,
                *high_freq_factor,
                *original_max_position,
            ),
            RopeScaling::Yarn {
                factor,
                original_max_position,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let ramp = yarn_ramp(
                    head_dim,
                    f64::from(self.theta),
                    *original_max_position,
                    (*beta_fast, *beta_slow),
                    *truncate,
                );
                let factor = *factor as f32;
                powers(head_dim, self.theta)
                    .zip(ramp)
                    .map(|(power, ramp)| {
                        let extrapolation = 1.0 / power;
                        let interpolation = 1.0 / (factor * power);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect()
            }
        }
    }

    /// What cos and sin are multiplied by: 1, or YaRN's attention temperature.
    pub fn attention_factor(&self) -> f64 {
        match &self.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }

    /// The positions this embedding is good for: YaRN stretches the pretrained window by its
    /// factor (as vLLM derives the longest context); the others keep
    /// `max_position_embeddings`, which Llama 3.1's config already states at full length.
    pub fn context_window(&self, max_position_embeddings: u32) -> u32 {
        match &self.scaling {
            RopeScaling::Yarn {
                factor,
                original_max_position,
                ..
            } => {
                let scaled = (f64::from(*original_max_position) * factor).floor();
                scaled.min(f64::from(u32::MAX)) as u32
            }
            _ => max_position_embeddings,
        }
    }
}

/// `theta^(2i/D)` in f32 for each pair `i` of a head.
fn powers(head_dim: u32, theta: f32) -> impl Iterator<Item = f32> {
    (0..head_dim / 2).map(move |i| theta.powf((2 * i) as f32 / head_dim as f32))
}

/// `1 / theta^(2i/D)` in f32, as `_compute_default_rope_parameters` computes it.
fn default_inverse_frequencies(head_dim: u32, theta: f32) -> Vec<f32> {
    powers(head_dim, theta).map(|power| 1.0 / power).collect()
}

/// `_compute_llama3_parameters`, in f32 like its tensors.
fn llama3_inverse_frequencies(
    default: &[f32],
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original_max_position: u32,
) -> Vec<f32> {
    let old_context = f64::from(original_max_position);
    let low_freq_wavelen = (old_context / low_freq_factor) as f32;
    let high_freq_wavelen = (old_context / high_freq_factor) as f32;
    let factor = factor as f32;
    let two_pi = std::f64::consts::TAU as f32;
    default
        .iter()
        .map(|&inv_freq| {
            let wavelen = two_pi / inv_freq;
            let scaled = if wavelen > low_freq_wavelen {
                inv_freq / factor
            } else {
                inv_freq
            };
            // transformers: `~(wavelen < high) * ~(wavelen > low)`; wavelengths are finite.
            let medium = (high_freq_wavelen..=low_freq_wavelen).contains(&wavelen);
            if !medium {
                return scaled;
            }
            let smooth = (old_context as f32 / wavelen - low_freq_factor as f32)
                / (high_freq_factor - low_freq_factor) as f32;
            (1.0 - smooth) * scaled / factor + smooth * scaled
        })
        .collect()
}

/// YaRN's linear ramp over the pairs of a head: 0 below the dimension that turns
/// `beta_fast` times within the pretrained window, 1 above the one that turns `beta_slow`
/// times, as `find_correction_range` and `linear_ramp_factor` compute it.
fn yarn_ramp(
    head_dim: u32,
    base: f64,
    original_max_position: u32,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> Vec<f32> {
    let dim = f64::from(head_dim);
    let correction_dim = |rotations: f64| {
        dim * (f64::from(original_max_position) / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        // transformers' guard against a zero-width ramp.
        high += 0.001;
    }
    let (low, width) = (low as f32, (high - low) as f32);
    (0..head_dim / 2)
        .map(|i| ((i as f32 - low) / width).clamp(0.0, 1.0))
        .collect()
}

/// `get_mscale` of YaRN: the attention temperature for a context stretched `scale` times.
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

fn the_theta(stated: &[(String, f64)]) -> Result<f32, String> {
    if let Some((name, theta)) = stated
        .iter()
        .find(|(_, theta)| !(theta.is_finite() && *theta > 0.0))
    {
        return Err(format!(
            "config.json: {name} must be a positive number, got {theta}"
        ));
    }
    let Some((first, theta)) = stated.first() else {
        return Ok(DEFAULT_ROPE_THETA as f32);
    };
    if let Some((other, different)) = stated.iter().find(|(_, t)| t != theta) {
        return Err(format!(
            "config.json: {first} = {theta} and {other} = {different} disagree"
        ));
    }
    Ok(*theta as f32)
}

/// The one scaling the dicts state; a dict of the default type states none.
fn the_scaling(stated: Vec<(String, RopeScaling)>) -> Result<RopeScaling, String> {
    let mut scaled = stated
        .into_iter()
        .filter(|(_, scaling)| *scaling != RopeScaling::None);
    let Some((first, scaling)) = scaled.next() else {
        return Ok(RopeScaling::None);
    };
    if let Some((other, _)) = scaled.find(|(_, other)| *other != scaling) {
        return Err(format!(
            "config.json: {first} and {other} state different rotary scalings"
        ));
    }
    Ok(scaling)
}

/// The dict of rotary parameters that full-attention layers use, and the name to report it by.
fn rope_entry<'a>(
    field: &str,
    value: &'a Value,
) -> Result<(String, &'a Map<String, Value>), String> {
    let dict = value
        .as_object()
        .ok_or_else(|| format!("config.json: {field} must be an object, got {value}"))?;
    let nested = dict.values().filter(|v| v.is_object()).count();
    if nested == 0 {
        return Ok((field.to_string(), dict));
    }
    if nested < dict.len() {
        return Err(format!(
            "config.json: {field} mixes entries keyed by attention type with plain parameters"
        ));
    }
    // Keyed by attention type. Every layer here is full attention (the config check refuses
    // sliding layers), so the other entries are never used.
    let entry = dict
        .get("full_attention")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            format!(
                "config.json: {field} is keyed by attention type but has no full_attention entry"
            )
        })?;
    Ok((format!("{field}.full_attention"), entry))
}

/// What one rotary dict states.
struct StatedRope {
    theta: Option<f64>,
    scaling: RopeScaling,
}

/// Reads a rotary dict, refusing a type this glue does not compute. `name` is where the dict
/// sits in config.json.
fn check_rope_entry(
    name: &str,
    entry: &Map<String, Value>,
    fields: &RopeFields<'_>,
) -> Result<StatedRope, String> {
    let kind = match (entry.get("rope_type"), entry.get("type")) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!(
                "config.json: {name}.rope_type {a} and {name}.type {b} disagree"
            ));
        }
        (Some(kind), _) => Some(("rope_type", kind)),
        (None, Some(kind)) => Some(("type", kind)),
        // `transformers` computes the default rotary embedding for a dict without a type.
        (None, None) => None,
    };
    if let Some(factor) = entry.get("partial_rotary_factor") {
        check_partial_rotary_factor(&format!("{name}.partial_rotary_factor"), factor)?;
    }
    let number = |key: &str| -> Result<Option<f64>, String> {
        match entry.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => value
                .as_f64()
                .map(Some)
                .ok_or_else(|| format!("config.json: {name}.{key} must be a number, got {value}")),
        }
    };
    let positive = |key: &str| -> Result<Option<f64>, String> {
        match number(key)? {
            Some(v) if !(v.is_finite() && v > 0.0) => Err(format!(
                "config.json: {name}.{key} must be a positive number, got {v}"
            )),
            other => Ok(other),
        }
    };
    let required = |key: &str, kind: &str| -> Result<f64, String> {
        positive(key)?.ok_or_else(|| {
            format!("config.json: {name}.{key} is required for rotary type {kind:?}")
        })
    };
    let positions = |value: f64, key: &str| -> Result<u32, String> {
        if value.fract() == 0.0 && value <= f64::from(u32::MAX) {
            Ok(value as u32)
        } else {
            Err(format!(
                "config.json: {name}.{key} must be a whole number of positions, got {value}"
            ))
        }
    };
    // The pretrained window, which `transformers` fills in from max_position_embeddings.
    let original_max_position = || -> Result<u32, String> {
        if let Some(top_level) = fields.original_max_position_embeddings {
            return Ok(top_level);
        }
        match positive("original_max_position_embeddings")? {
            Some(value) => positions(value, "original_max_position_embeddings"),
            None => Ok(fields.max_position_embeddings),
        }
    };
    let theta = number("rope_theta")?;
    let scaling = match kind.map(|(key, kind)| (key, kind, kind.as_str())) {
        None | Some((_, _, Some("default"))) => RopeScaling::None,
        Some((_, _, Some("llama3"))) => {
            let low_freq_factor = required("low_freq_factor", "llama3")?;
            let high_freq_factor = required("high_freq_factor", "llama3")?;
            if high_freq_factor <= low_freq_factor {
                return Err(format!(
                    "config.json: {name}.high_freq_factor {high_freq_factor} must be above \
                     low_freq_factor {low_freq_factor}"
                ));
            }
            RopeScaling::Llama3 {
                factor: required("factor", "llama3")?,
                low_freq_factor,
                high_freq_factor,
                original_max_position: original_max_position()?,
            }
        }
        Some((_, _, Some("yarn"))) => {
            let original = original_max_position()?;
            // Without a factor, `transformers` stretches the pretrained window to
            // max_position_embeddings (DeepSeek-V3's configs).
            let factor = match positive("factor")? {
                Some(factor) => factor,
                None => f64::from(fields.max_position_embeddings) / f64::from(original.max(1)),
            };
            let attention_factor = match (
                positive("attention_factor")?,
                positive("mscale")?,
                positive("mscale_all_dim")?,
            ) {
                (Some(stated), _, _) => stated,
                (None, Some(mscale), Some(all_dim)) => {
                    yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
                }
                _ => yarn_mscale(factor, 1.0),
            };
            let truncate = match entry.get("truncate") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(other) => {
                    return Err(format!(
                        "config.json: {name}.truncate must be true or false, got {other}"
                    ));
                }
            };
            let beta_fast = positive("beta_fast")?.unwrap_or(YARN_BETA_FAST);
            let beta_slow = positive("beta_slow")?.unwrap_or(YARN_BETA_SLOW);
            RopeScaling::Yarn {
                factor,
                original_max_position: original,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            }
        }
        Some((key, kind, _)) => {
            return Err(format!(
                "config.json: {name}.{key} {kind} is not supported: this glue computes the \
                 default, llama3 and yarn rotary embeddings (linear, dynamic and longrope \
                 scaling are not implemented)"
            ));
        }
    };
    Ok(StatedRope { theta, scaling })
}

fn check_partial_rotary_factor(name: &str, factor: &Value) -> Result<(), String> {
    if factor.is_null() || factor.as_f64() == Some(1.0) {
        Ok(())
    } else {
        Err(format!(
            "config.json: {name} {factor} is not supported: this glue rotates every dimension of a head (1.0)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope(dict: &str, max_position_embeddings: u32) -> Rope {
        let value: Value = serde_json::from_str(dict).expect("json");
        Rope::parse(&RopeFields {
            rope_theta: None,
            rope_parameters: Some(&value),
            rope_scaling: None,
            partial_rotary_factor: None,
            max_position_embeddings,
            original_max_position_embeddings: None,
        })
        .unwrap_or_else(|e| panic!("{dict}: {e}"))
    }

    const LLAMA3: &str = r#"{"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#;

    #[test]
    fn llama3_keeps_high_frequencies_divides_low_ones_and_ramps_between() {
        let scaled = rope(LLAMA3, 131_072);
        let plain = default_inverse_frequencies(64, 500_000.0);
        let table = scaled.inverse_frequencies(64);
        assert_eq!(table.len(), 32);
        let mut kinds = [0; 3];
        for (&got, &base) in table.iter().zip(&plain) {
            let wavelen = std::f32::consts::TAU / base;
            if wavelen < 8192.0 / 4.0 {
                assert_eq!(got, base, "a short wavelength is kept");
                kinds[0] += 1;
            } else if wavelen > 8192.0 {
                assert_eq!(
                    got,
                    base / 32.0,
                    "a long wavelength is stretched by the factor"
                );
                kinds[1] += 1;
            } else {
                assert!(
                    got < base && got > base / 32.0,
                    "{got} between {base} / 32 and {base}"
                );
                kinds[2] += 1;
            }
        }
        assert!(
            kinds.iter().all(|&n| n > 0),
            "every regime is exercised: {kinds:?}"
        );
        assert_eq!(scaled.attention_factor(), 1.0);
        assert_eq!(scaled.context_window(131_072), 131_072);
    }

    #[test]
    fn yarn_interpolates_low_frequencies_and_sets_an_attention_temperature() {
        let yarn = rope(
            r#"{"rope_type": "yarn", "rope_theta": 1000000, "factor": 4.0,
                "original_max_position_embeddings": 32768}"#,
            40_960,
        );
        let plain = default_inverse_frequencies(128, 1e6);
        let table = yarn.inverse_frequencies(128);
        // The fastest pairs turn many times within the pretrained window: extrapolated as
        // they are. The slowest turn less than once: interpolated by the factor.
        assert_eq!(table[0], plain[0]);
        assert_eq!(table[63], 1.0 / (4.0 * (1.0 / plain[63])));
        assert!(table.windows(2).all(|pair| pair[1] <= pair[0]));
        assert_eq!(yarn.attention_factor(), 0.1 * 4f64.ln() + 1.0);
        assert_eq!(yarn.context_window(40_960), 131_072);
        // DeepSeek's style: the temperature from mscale and mscale_all_dim.
        let deepseek = rope(
            r#"{"rope_type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096}"#,
            163_840,
        );
        assert_eq!(deepseek.attention_factor(), 1.0);
        // No factor: the window stretched to max_position_embeddings.
        let implied = rope(
            r#"{"rope_type": "yarn", "original_max_position_embeddings": 4096}"#,
            16_384,
        );
        assert_eq!(implied.context_window(16_384), 16_384);
        assert_eq!(implied.attention_factor(), 0.1 * 4f64.ln() + 1.0);
    }

    #[test]
    fn a_top_level_original_window_wins_as_in_transformers() {
        let value: Value = serde_json::from_str(
            r#"{"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1000}"#,
        )
        .expect("json");
        let fields = RopeFields {
            rope_theta: Some(10_000.0),
            rope_parameters: None,
            rope_scaling: Some(&value),
            partial_rotary_factor: None,
            max_position_embeddings: 4096,
            original_max_position_embeddings: Some(2048),
        };
        let rope = Rope::parse(&fields).expect("valid");
        assert_eq!(rope.context_window(4096), 4096);
        assert_eq!(rope.theta, 10_000.0);
    }
}
