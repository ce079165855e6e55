//! The fields of a Hugging Face config.json that the decoder program depends on, with the checks that refuse what it cannot run.

use serde::Deserialize;

/// Which variant of the decoder layer to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Per-head RMSNorm on q and k.
    Qwen3,
    Llama,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

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
    #[serde(default = "default_theta")]
    rope_theta: f64,
    #[serde(default = "default_max_position")]
    max_position_embeddings: u32,
    #[serde(default)]
    tie_word_embeddings: bool,
    eos_token_id: Option<OneOrMany>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    hidden_act: Option<String>,
    rope_scaling: Option<serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_max_position() -> u32 {
    2048
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
    pub rope_theta: f32,
    pub max_position: u32,
    pub tied_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
}

impl TransformerConfig {
    pub fn parse(config_json: &str) -> Result<Self, String> {
        let raw: RawConfig =
            serde_json::from_str(config_json).map_err(|e| format!("config.json: {e}"))?;
        let architecture = raw
            .architectures
            .first()
            .cloned()
            .ok_or("config.json has no `architectures` entry")?;
        let family = match architecture.as_str() {
            "Qwen3ForCausalLM" => Family::Qwen3,
            "LlamaForCausalLM" => Family::Llama,
            other => {
                return Err(format!(
                    "unsupported architecture {other}: this glue runs Qwen3ForCausalLM and LlamaForCausalLM"
                ));
            }
        };
        if raw.attention_bias {
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
        if let Some(scaling) = raw.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            let kind = scaling.get("rope_type").or_else(|| scaling.get("type"));
            if kind.and_then(|k| k.as_str()) != Some("default") {
                return Err(format!(
                    "config.json: rope_scaling {scaling} is not supported"
                ));
            }
        }
        let kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        let head_dim = raw
            .head_dim
            .or_else(|| raw.hidden_size.checked_div(raw.num_attention_heads))
            .unwrap_or(0);
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
            rope_theta: raw.rope_theta as f32,
            max_position: raw.max_position_embeddings,
            tied_embeddings: raw.tie_word_embeddings,
            eos_token_ids,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "max_position_embeddings": 40960, "tie_word_embeddings": true,
        "eos_token_id": 151645, "attention_bias": false, "hidden_act": "silu", "rope_scaling": null}"#;

    #[test]
    fn reads_a_qwen3_config() {
        let c = TransformerConfig::parse(QWEN3).expect("valid");
        assert_eq!(c.family, Family::Qwen3);
        assert_eq!((c.heads, c.kv_heads, c.head_dim), (16, 8, 128));
        assert_eq!(c.eos_token_ids, vec![151645]);
        assert!(c.tied_embeddings);
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
                r#""rope_scaling": {"rope_type": "yarn", "factor": 4}"#,
                "rope_scaling",
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
        ];
        for (from, to, message) in cases {
            let text = QWEN3.replace(from, to);
            let err = TransformerConfig::parse(&text).expect_err(to);
            assert!(err.contains(message), "{to}: {err}");
        }
        assert!(TransformerConfig::parse("not json").is_err());
        assert!(TransformerConfig::parse("{}").is_err());
    }
}
