//! The fields of a Hugging Face config.json that the decoder program depends on, with the checks that refuse what it cannot run.
//!
//! Four architectures share the decoder layer: Qwen3 (per-head q/k norms), Qwen2 (q, k and v
//! biases), Llama and Mistral. The rotary embedding is read by [`crate::rope`]. A field that
//! changes the maths and that this glue does not compute is refused with its name, never
//! replaced by a default; fields that `transformers` itself ignores for these architectures
//! are ignored here too.

use serde::Deserialize;
use serde_json::Value;

use crate::rope::{Rope, RopeFields};

/// `Qwen3Config`'s `head_dim` when the key is absent: unlike Llama, `transformers` does not
/// derive it from the hidden size for Qwen3.
const QWEN3_DEFAULT_HEAD_DIM: u32 = 128;

/// Which variant of the decoder layer to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Per-head RMSNorm on q and k.
    Qwen3,
    /// Biases on the q, k and v projections.
    Qwen2,
    Llama,
    /// The Llama layer; its configs may set a sliding window for every layer.
    Mistral,
}

impl Family {
    fn of(architecture: &str) -> Option<Family> {
        match architecture {
            "Qwen3ForCausalLM" => Some(Family::Qwen3),
            "Qwen2ForCausalLM" => Some(Family::Qwen2),
            "LlamaForCausalLM" => Some(Family::Llama),
            "MistralForCausalLM" => Some(Family::Mistral),
            _ => None,
        }
    }

    /// Whether q, k and v are normalised per head before the rotary embedding.
    pub fn normalises_qk(self) -> bool {
        self == Family::Qwen3
    }

    /// Whether the q, k and v projections add a bias (Qwen2's are fixed on, whatever
    /// `attention_bias` says, as in `transformers`).
    pub fn biases_qkv(self) -> bool {
        self == Family::Qwen2
    }

    /// `max_position_embeddings` when the key is absent, as each `transformers` config class
    /// defaults it.
    fn default_max_position(self) -> u32 {
        match self {
            Family::Qwen3 | Family::Qwen2 => 32_768,
            Family::Llama => 2048,
            Family::Mistral => 4096 * 32,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

// `pretraining_tp` (Llama) is deliberately not read: it only split the projections into
// slices whose products sum to the same result, and `transformers` no longer reads it either.
#[derive(Debug, Deserialize)]
struct RawConfig {
    #[serde(default)]
    architectures: Vec<String>,
    hidden_size: u32,
    intermediate_size: u32,
    num_hidden_layers: u32,
    num_attention_heads: u32,
    num_key_value_heads: Option<u32>,
    head_dim: Option<u32>,
    vocab_size: u32,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_parameters: Option<Value>,
    rope_scaling: Option<Value>,
    partial_rotary_factor: Option<Value>,
    original_max_position_embeddings: Option<u32>,
    max_position_embeddings: Option<u32>,
    #[serde(default)]
    tie_word_embeddings: bool,
    eos_token_id: Option<OneOrMany>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<u64>,
    max_window_layers: Option<u32>,
    layer_types: Option<Vec<String>>,
    quantization_config: Option<Value>,
}

fn default_eps() -> f64 {
    1e-6
}

/// A checked decoder configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct TransformerConfig {
    pub family: Family,
    pub architecture: String,
    pub hidden: u32,
    pub intermediate: u32,
    pub layers: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub vocab: u32,
    pub eps: f32,
    pub rope: Rope,
    /// The longest sequence the program computes exactly: the positions the rotary embedding
    /// covers.
    pub max_position: u32,
    /// Each layer's sliding window; `None` where a layer attends to the whole sequence.
    pub windows: Vec<Option<u32>>,
    pub tied_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
}

impl TransformerConfig {
    pub fn parse(config_json: &str) -> Result<Self, String> {
        let mut deserializer = serde_json::Deserializer::from_str(config_json);
        let raw: RawConfig = serde_path_to_error::deserialize(&mut deserializer)
            .map_err(|e| format!("config.json: {e}"))?;
        deserializer
            .end()
            .map_err(|e| format!("config.json: {e}"))?;
        let architecture = raw
            .architectures
            .first()
            .cloned()
            .ok_or("config.json has no `architectures` entry")?;
        let family = Family::of(&architecture).ok_or_else(|| {
            format!(
                "unsupported architecture {architecture}: this glue runs Qwen3ForCausalLM, \
                 Qwen2ForCausalLM, LlamaForCausalLM and MistralForCausalLM"
            )
        })?;
        if raw.attention_bias && family != Family::Qwen2 {
            return Err("config.json: attention_bias = true is not supported".into());
        }
        if raw.mlp_bias {
            return Err("config.json: mlp_bias = true is not supported".into());
        }
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(format!(
                "config.json: hidden_act {act:?} is not supported (only silu)"
            ));
        }
        if raw.quantization_config.is_some() {
            return Err(
                "config.json: quantization_config is not supported: weights must be plain f32, f16 or bf16"
                    .into(),
            );
        }
        let windows = attention_windows(&raw, family)?;
        let max_position_embeddings = raw
            .max_position_embeddings
            .unwrap_or(family.default_max_position());
        let rope = Rope::parse(&RopeFields {
            rope_theta: raw.rope_theta,
            rope_parameters: raw.rope_parameters.as_ref(),
            rope_scaling: raw.rope_scaling.as_ref(),
            partial_rotary_factor: raw.partial_rotary_factor.as_ref(),
            max_position_embeddings,
            original_max_position_embeddings: raw.original_max_position_embeddings,
        })?;
        let max_position = rope.context_window(max_position_embeddings);
        let kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        let head_dim = match (raw.head_dim, family) {
            (Some(head_dim), _) => head_dim,
            (None, Family::Qwen3) => QWEN3_DEFAULT_HEAD_DIM,
            (None, Family::Llama | Family::Qwen2 | Family::Mistral) => {
                if raw.num_attention_heads > 0
                    && !raw.hidden_size.is_multiple_of(raw.num_attention_heads)
                {
                    return Err(format!(
                        "config.json: head_dim is not given and hidden_size {} is not a multiple of num_attention_heads {}",
                        raw.hidden_size, raw.num_attention_heads
                    ));
                }
                raw.hidden_size
                    .checked_div(raw.num_attention_heads)
                    .unwrap_or(0)
            }
        };
        let positive = [
            ("hidden_size", raw.hidden_size),
            ("intermediate_size", raw.intermediate_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", raw.num_attention_heads),
            ("num_key_value_heads", kv_heads),
            ("head_dim", head_dim),
            ("vocab_size", raw.vocab_size),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("config.json: {name} must be positive"));
        }
        if !raw.num_attention_heads.is_multiple_of(kv_heads) {
            return Err(format!(
                "config.json: num_attention_heads {} is not a multiple of num_key_value_heads {kv_heads}",
                raw.num_attention_heads
            ));
        }
        if !head_dim.is_multiple_of(2) {
            return Err(format!(
                "config.json: head_dim {head_dim} must be even for rotary embeddings"
            ));
        }
        let eos_token_ids = match raw.eos_token_id {
            Some(OneOrMany::One(id)) => vec![id],
            Some(OneOrMany::Many(ids)) => ids,
            None => Vec::new(),
        };
        Ok(TransformerConfig {
            family,
            architecture,
            hidden: raw.hidden_size,
            intermediate: raw.intermediate_size,
            layers: raw.num_hidden_layers,
            heads: raw.num_attention_heads,
            kv_heads,
            head_dim,
            vocab: raw.vocab_size,
            eps: raw.rms_norm_eps as f32,
            rope,
            max_position,
            windows,
            tied_embeddings: raw.tie_word_embeddings,
            eos_token_ids,
        })
    }
}

/// `max_window_layers` when a Qwen config leaves it out, as `transformers` defaults it.
const QWEN_DEFAULT_MAX_WINDOW_LAYERS: u32 = 28;

/// Each layer's sliding window (`None`: it attends to the whole sequence), as `transformers`
/// decides it: `layer_types` when the config lists them; otherwise every Mistral layer
/// attends within `sliding_window`, and with Qwen's `use_sliding_window` the layers from
/// `max_window_layers` on do.
fn attention_windows(raw: &RawConfig, family: Family) -> Result<Vec<Option<u32>>, String> {
    let layers = raw.num_hidden_layers as usize;
    let window = match family {
        Family::Mistral => raw.sliding_window,
        Family::Qwen2 | Family::Qwen3 => raw
            .sliding_window
            .filter(|_| raw.use_sliding_window == Some(true)),
        Family::Llama => None,
    };
    let window = window
        .map(|w| {
            u32::try_from(w).ok().filter(|&w| w > 0).ok_or_else(|| {
                format!(
                    "config.json: sliding_window must be a positive number of positions, got {w}"
                )
            })
        })
        .transpose()?;
    if let Some(types) = &raw.layer_types {
        if types.len() != layers {
            return Err(format!(
                "config.json: layer_types lists {} layers, num_hidden_layers is {}",
                types.len(),
                raw.num_hidden_layers
            ));
        }
        return types
            .iter()
            .enumerate()
            .map(|(i, kind)| match kind.as_str() {
                "full_attention" => Ok(None),
                "sliding_attention" => window.map(Some).ok_or_else(|| {
                    format!(
                        "config.json: layer_types[{i}] is sliding_attention, but no sliding_window applies"
                    )
                }),
                other => Err(format!(
                    "config.json: layer_types[{i}] is {other:?}: only full_attention and sliding_attention are supported"
                )),
            })
            .collect();
    }
    Ok(match family {
        Family::Qwen2 | Family::Qwen3 => {
            let full = raw
                .max_window_layers
                .unwrap_or(QWEN_DEFAULT_MAX_WINDOW_LAYERS);
            (0..layers)
                .map(|i| window.filter(|_| i as u32 >= full))
                .collect()
        }
        Family::Mistral | Family::Llama => vec![window; layers],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-0.6B's config.json as `transformers` 4 writes it.
    const QWEN3: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "max_position_embeddings": 40960, "tie_word_embeddings": true,
        "eos_token_id": 151645, "attention_bias": false, "hidden_act": "silu", "rope_scaling": null,
        "torch_dtype": "bfloat16",
        "use_sliding_window": false, "sliding_window": null, "max_window_layers": 28}"#;

    /// The same config as `transformers` 5 writes it.
    const QWEN3_V5: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "max_position_embeddings": 40960, "tie_word_embeddings": true,
        "eos_token_id": 151645, "attention_bias": false, "hidden_act": "silu",
        "dtype": "bfloat16", "use_sliding_window": false, "sliding_window": null,
        "max_window_layers": 28, "layer_types": [LAYER_TYPES]}"#;

    fn qwen3_v5() -> String {
        let layer_types = vec![r#""full_attention""#; 28].join(", ");
        QWEN3_V5.replace("LAYER_TYPES", &layer_types)
    }

    /// A small Llama config (`transformers` 5) whose rotary fields the tests swap out.
    const LLAMA: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 448, "pretraining_tp": 1, "mlp_bias": false,
        ROPE}"#;

    fn llama(rope: &str) -> String {
        LLAMA.replace("ROPE", rope)
    }

    fn theta(config: &str) -> f32 {
        TransformerConfig::parse(config)
            .unwrap_or_else(|e| panic!("{config}: {e}"))
            .rope
            .theta
    }

    #[test]
    fn reads_a_qwen3_config_in_both_forms() {
        for text in [QWEN3.to_string(), qwen3_v5()] {
            let c = TransformerConfig::parse(&text).expect("valid");
            assert_eq!(c.family, Family::Qwen3);
            assert_eq!((c.heads, c.kv_heads, c.head_dim), (16, 8, 128));
            assert_eq!(c.eos_token_ids, vec![151645]);
            assert!(c.tied_embeddings);
            assert_eq!(c.rope.theta, 1_000_000.0);
        }
    }

    #[test]
    fn reads_the_rope_theta_from_every_field_that_states_it() {
        let cases = [
            (r#""rope_theta": 500000"#, 500_000.0),
            (r#""rope_theta": 500000, "rope_scaling": null"#, 500_000.0),
            (
                r#""rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}"#,
                500_000.0,
            ),
            // Older spelling of the type key.
            (
                r#""rope_parameters": {"rope_theta": 500000.0, "type": "default"}"#,
                500_000.0,
            ),
            // Keyed by attention type: full-attention layers use their own entry.
            (
                r#""rope_parameters": {"full_attention": {"rope_theta": 500000, "rope_type": "default"},
                    "sliding_attention": {"rope_theta": 10000, "rope_type": "default"}}"#,
                500_000.0,
            ),
            // A dict without a theta takes it from the top level, as transformers does.
            (
                r#""rope_theta": 500000, "rope_parameters": {"rope_type": "default"}"#,
                500_000.0,
            ),
            // A legacy rope_scaling dict of the default type changes nothing.
            (
                r#""rope_theta": 500000, "rope_scaling": {"rope_type": "default"}"#,
                500_000.0,
            ),
            // Both forms at once, agreeing.
            (
                r#""rope_theta": 500000,
                    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}"#,
                500_000.0,
            ),
            (
                r#""partial_rotary_factor": 1.0, "rope_theta": 500000"#,
                500_000.0,
            ),
            // No theta anywhere: the architecture's default, as transformers applies it.
            (r#""rope_scaling": null"#, 10_000.0),
            (r#""rope_parameters": {"rope_type": "default"}"#, 10_000.0),
        ];
        for (rope, want) in cases {
            assert_eq!(theta(&llama(rope)), want, "{rope}");
        }
    }

    #[test]
    fn refuses_what_it_cannot_compute() {
        let cases = [
            (
                r#""architectures": ["Qwen3ForCausalLM"]"#,
                r#""architectures": ["MixtralForCausalLM"]"#,
                "unsupported architecture MixtralForCausalLM",
            ),
            (
                r#""attention_bias": false"#,
                r#""attention_bias": true"#,
                "attention_bias",
            ),
            (
                r#""hidden_act": "silu""#,
                r#""hidden_act": "gelu""#,
                "hidden_act",
            ),
            (
                r#""rope_scaling": null"#,
                r#""rope_scaling": {"rope_type": "longrope", "factor": 4}"#,
                r#"rope_scaling.rope_type "longrope" is not supported"#,
            ),
            (
                r#""rope_scaling": null"#,
                r#""rope_scaling": {"type": "linear", "factor": 2.0}"#,
                r#"rope_scaling.type "linear" is not supported"#,
            ),
            (
                r#""rope_scaling": null"#,
                r#""quantization_config": {"quant_method": "fp8"}"#,
                "quantization_config",
            ),
            (
                r#""use_sliding_window": false, "sliding_window": null"#,
                r#""use_sliding_window": true, "sliding_window": 0"#,
                "sliding_window must be a positive number of positions",
            ),
            (
                r#""num_key_value_heads": 8"#,
                r#""num_key_value_heads": 5"#,
                "multiple",
            ),
            (
                r#""head_dim": 128"#,
                r#""head_dim": 0"#,
                "head_dim must be positive",
            ),
            (r#""head_dim": 128"#, r#""head_dim": "wide""#, "head_dim"),
            (
                r#""rope_theta": 1000000"#,
                r#""rope_theta": -1"#,
                "rope_theta must be a positive number",
            ),
        ];
        for (from, to, message) in cases {
            let text = QWEN3.replace(from, to);
            assert_ne!(text, QWEN3, "{from} is not in the config");
            let err = TransformerConfig::parse(&text).expect_err(to);
            assert!(err.contains(message), "{to}: {err}");
        }
        assert!(TransformerConfig::parse("not json").is_err());
        assert!(TransformerConfig::parse("{}").is_err());
        assert!(TransformerConfig::parse(&format!("{QWEN3} trailing")).is_err());
    }

    #[test]
    fn refuses_rotary_fields_it_cannot_compute_or_that_disagree() {
        let cases = [
            (
                r#""rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                    "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}"#,
                r#"rope_parameters.high_freq_factor is required for rotary type "llama3""#,
            ),
            (
                r#""rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                    "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}"#,
                "rope_parameters.high_freq_factor 1 must be above low_freq_factor 4",
            ),
            (
                r#""rope_parameters": {"rope_type": "yarn", "factor": -4.0}"#,
                "rope_parameters.factor must be a positive number, got -4",
            ),
            (
                r#""rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                    "original_max_position_embeddings": 1024.5}"#,
                "original_max_position_embeddings must be a whole number of positions, got 1024.5",
            ),
            (
                r#""rope_parameters": {"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}"#,
                "rope_parameters.truncate must be true or false",
            ),
            (
                r#""rope_parameters": {"rope_type": "yarn", "factor": 4.0},
                    "rope_scaling": {"rope_type": "yarn", "factor": 2.0}"#,
                "rope_parameters and rope_scaling state different rotary scalings",
            ),
            (
                r#""rope_parameters": {"type": "dynamic", "factor": 2.0}"#,
                r#"rope_parameters.type "dynamic" is not supported"#,
            ),
            (
                r#""rope_parameters": {"rope_type": "mystery"}"#,
                r#"rope_parameters.rope_type "mystery""#,
            ),
            (
                r#""rope_parameters": {"rope_type": "default", "type": "linear"}"#,
                "rope_parameters.rope_type \"default\" and rope_parameters.type \"linear\" disagree",
            ),
            (
                r#""rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0}}"#,
                r#"rope_parameters.full_attention.rope_type "linear""#,
            ),
            (
                r#""rope_parameters": {"sliding_attention": {"rope_type": "default"}}"#,
                "no full_attention entry",
            ),
            (
                r#""rope_parameters": {"full_attention": {"rope_type": "default"}, "rope_theta": 1.0}"#,
                "rope_parameters mixes",
            ),
            (
                r#""rope_parameters": "default""#,
                "rope_parameters must be an object",
            ),
            (
                r#""rope_theta": 1000000,
                    "rope_parameters": {"rope_theta": 10000, "rope_type": "default"}"#,
                "rope_theta = 1000000 and rope_parameters.rope_theta = 10000 disagree",
            ),
            (
                r#""rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
                    "rope_scaling": {"rope_theta": 500000, "rope_type": "default"}"#,
                "rope_parameters.rope_theta = 1000000 and rope_scaling.rope_theta = 500000 disagree",
            ),
            (
                r#""rope_parameters": {"rope_theta": "big", "rope_type": "default"}"#,
                "rope_parameters.rope_theta must be a number",
            ),
            (
                r#""rope_parameters": {"rope_theta": 0, "rope_type": "default"}"#,
                "rope_parameters.rope_theta must be a positive number",
            ),
            (
                r#""rope_parameters": {"rope_theta": 10000, "rope_type": "default",
                    "partial_rotary_factor": 0.5}"#,
                "rope_parameters.partial_rotary_factor 0.5 is not supported",
            ),
            (
                r#""partial_rotary_factor": 0.25"#,
                "partial_rotary_factor 0.25 is not supported",
            ),
        ];
        for (rope, message) in cases {
            let err = TransformerConfig::parse(&llama(rope)).expect_err(rope);
            assert!(err.contains(message), "{rope}: {err}");
        }
    }

    #[test]
    fn each_layer_slides_as_transformers_says() {
        let v5 = qwen3_v5();
        let with_window = |text: &str| {
            text.replace(
                r#""use_sliding_window": false"#,
                r#""use_sliding_window": true"#,
            )
            .replace(r#""sliding_window": null"#, r#""sliding_window": 4096"#)
        };
        let windows = |text: &str| {
            TransformerConfig::parse(text)
                .unwrap_or_else(|e| panic!("{e}: {text}"))
                .windows
        };
        let mut types = vec!["\"full_attention\""; 28];
        types[27] = "\"sliding_attention\"";
        let sliding = QWEN3_V5.replace("LAYER_TYPES", &types.join(", "));
        // A listed sliding layer slides, the others do not.
        let listed = windows(&with_window(&sliding));
        assert_eq!(listed[27], Some(4096));
        assert!(listed[..27].iter().all(Option::is_none));
        // Without a window that applies, a sliding layer is an error naming it.
        let err = TransformerConfig::parse(&sliding).expect_err("no window");
        assert!(
            err.contains("layer_types[27] is sliding_attention"),
            "{err}"
        );
        let chunked = QWEN3_V5.replace("LAYER_TYPES", &["\"chunked_attention\""; 28].join(", "));
        let err = TransformerConfig::parse(&chunked).expect_err("an unknown layer type");
        assert!(
            err.contains(r#"layer_types[0] is "chunked_attention""#),
            "{err}"
        );
        let short = QWEN3_V5.replace("LAYER_TYPES", r#""full_attention""#);
        let err = TransformerConfig::parse(&short).expect_err("one layer type for 28 layers");
        assert!(err.contains("layer_types lists 1 layers"), "{err}");

        // Qwen's flag: the layers from max_window_layers on slide.
        let from_20 = windows(
            &with_window(QWEN3).replace(r#""max_window_layers": 28"#, r#""max_window_layers": 20"#),
        );
        assert!(from_20[..20].iter().all(Option::is_none));
        assert!(from_20[20..].iter().all(|w| *w == Some(4096)));
        let none_slide = [
            // Qwen2.5-style: a window, but the flag is off.
            v5.replace(r#""sliding_window": null"#, r#""sliding_window": 32768"#),
            // The flag on, but every layer below max_window_layers (28, also its default).
            with_window(&v5),
            with_window(QWEN3).replace(r#", "max_window_layers": 28"#, ""),
            // The flag on without a window.
            v5.replace(
                r#""use_sliding_window": false"#,
                r#""use_sliding_window": true"#,
            ),
        ];
        for text in none_slide {
            assert!(windows(&text).iter().all(Option::is_none), "{text}");
        }
    }

    #[test]
    fn the_positions_a_model_covers_follow_its_rope_scaling_and_sliding_window() {
        let mistral = |extra: &str| {
            let text = llama(&format!(r#""rope_theta": 10000, {extra}"#))
                .replace("LlamaForCausalLM", "MistralForCausalLM");
            TransformerConfig::parse(&text).unwrap_or_else(|e| panic!("{extra}: {e}"))
        };
        // Mistral 7B v0.1: every layer slides over 4096 positions, and the model is served as
        // far as its rotary embedding goes.
        let v01 = mistral(r#""max_position_embeddings": 32768, "sliding_window": 4096"#);
        assert_eq!((v01.family, v01.max_position), (Family::Mistral, 32768));
        assert!(v01.windows.iter().all(|w| *w == Some(4096)));
        let v03 = mistral(r#""max_position_embeddings": 32768, "sliding_window": null"#);
        assert_eq!(v03.max_position, 32768);
        assert!(v03.windows.iter().all(Option::is_none));
        let long_window = mistral(r#""max_position_embeddings": 32768, "sliding_window": 65536"#);
        assert_eq!(long_window.max_position, 32768);
        assert_eq!(
            mistral(r#""sliding_window": null"#).max_position,
            131_072,
            "MistralConfig's default"
        );
        // YaRN stretches the original window by its factor (Qwen3's model card).
        let yarn = QWEN3.replace(
            r#""rope_scaling": null"#,
            r#""rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}"#,
        );
        let yarn = TransformerConfig::parse(&yarn).expect("yarn");
        assert_eq!(yarn.max_position, 131_072);
        // Llama 3.1's config states its full length already.
        let llama3 = llama(
            r#""max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3",
            "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        );
        assert_eq!(
            TransformerConfig::parse(&llama3)
                .expect("llama3")
                .max_position,
            131_072
        );
    }

    #[test]
    fn qwen2_always_has_qkv_biases_and_the_others_refuse_them() {
        let qwen2 = QWEN3
            .replace("Qwen3ForCausalLM", "Qwen2ForCausalLM")
            .replace(r#""attention_bias": false"#, r#""attention_bias": true"#);
        let c = TransformerConfig::parse(&qwen2).expect("Qwen2 ignores attention_bias");
        assert!(c.family.biases_qkv() && !c.family.normalises_qk());
        let llama = llama(r#""attention_bias": true"#);
        let err = TransformerConfig::parse(&llama).expect_err("llama with biases");
        assert!(
            err.contains("attention_bias = true is not supported"),
            "{err}"
        );
    }

    #[test]
    fn head_dim_defaults_as_in_transformers() {
        let qwen3 = QWEN3.replace(r#""head_dim": 128, "#, "");
        assert_eq!(
            TransformerConfig::parse(&qwen3).expect("valid").head_dim,
            128,
            "Qwen3Config's default, not hidden_size / heads (64)"
        );
        let c = TransformerConfig::parse(&llama(r#""rope_theta": 10000"#)).expect("valid");
        assert_eq!(c.head_dim, 16, "hidden_size / num_attention_heads");
        let odd =
            llama(r#""rope_theta": 10000"#).replace(r#""hidden_size": 64"#, r#""hidden_size": 66"#);
        let err = TransformerConfig::parse(&odd).expect_err("66 / 4");
        assert!(err.contains("head_dim is not given"), "{err}");
    }
}
