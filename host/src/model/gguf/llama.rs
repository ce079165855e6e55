//! A Llama-family GGUF's shape and names as Hugging Face sees them: `config.json`, tensor names and the rotary row order, for `general.architecture` `llama` (`LlamaForCausalLM`) and `qwen3` (`Qwen3ForCausalLM`).
//!
//! Names: llama.cpp's `token_embd`, `blk.N.attn_q`, … map to HF's `model.embed_tokens`,
//! `model.layers.N.self_attn.q_proj`, … (see [`hf_name`]); Qwen3 adds the per-head norms
//! `blk.N.attn_q_norm` / `attn_k_norm`. Layout: for `llama`, llama.cpp's converter reorders
//! the rows of `q_proj` and `k_proj` within each head from HF's "rotate half" rotary layout
//! (first half of a head, then second half) to interleaved pairs (GGUF row `2i + j` of a head
//! is HF row `j * head_dim / 2 + i`); [`unpermute_rows`] puts them back, as `transformers`' own
//! GGUF loader does. Rows are whole blocks in every ggml type, so the reordering moves
//! quantized rows as they are. `qwen3` files keep HF's row order: llama.cpp rotates them
//! NEOX-style, which is "rotate half".

use serde_json::{Value, json};

use super::{Gguf, GgufError, Result, rope};

/// The `general.architecture` values served, each a Hugging Face architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen3,
}

impl Architecture {
    fn from_gguf(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Architecture::Llama),
            "qwen3" => Some(Architecture::Qwen3),
            _ => None,
        }
    }

    /// The `general.architecture` value, which also prefixes the model's metadata keys.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen3 => "qwen3",
        }
    }

    /// `config.json`'s `architectures` entry and `model_type`.
    fn hugging_face(self) -> (&'static str, &'static str) {
        match self {
            Architecture::Llama => ("LlamaForCausalLM", "llama"),
            Architecture::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        }
    }

    /// Whether `q_proj` and `k_proj` rows are stored in llama.cpp's interleaved rotary order.
    fn interleaves_rotary_rows(self) -> bool {
        self == Architecture::Llama
    }
}

/// The shape of a Llama-family model as the GGUF metadata gives it.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaParams {
    pub architecture: Architecture,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context_length: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// `rope_parameters` beyond `rope_theta`, for a scaled rotary embedding.
    pub rope_scaling: Option<Value>,
    pub tied_embeddings: bool,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    pub pad_token_id: Option<u64>,
}

impl LlamaParams {
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        let name = gguf.str("general.architecture")?;
        let Some(architecture) = Architecture::from_gguf(name) else {
            unsupported!(
                "GGUF general.architecture {name:?} is not supported: llama and qwen3 are"
            );
        };
        let arch = architecture.gguf_name();
        let key = |suffix: &str| format!("{arch}.{suffix}");
        let optional_usize = |suffix: &str| -> Result<Option<usize>> {
            let key = key(suffix);
            gguf.get(&key).map(|_| gguf.usize(&key)).transpose()
        };
        let hidden = gguf.usize(&key("embedding_length"))?;
        let heads = gguf.usize(&key("attention.head_count"))?;
        let kv_heads = optional_usize("attention.head_count_kv")?.unwrap_or(heads);
        ensure!(
            heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
            "GGUF has {heads} heads / {kv_heads} KV heads"
        );
        // Qwen3 sets head_dim apart from hidden / heads (0.6B: 128 against 1024 / 16 = 64).
        let head_dim = match optional_usize("attention.key_length")? {
            Some(head_dim) => head_dim,
            None => {
                ensure!(
                    hidden % heads == 0,
                    "GGUF has {heads} heads for hidden size {hidden} and no {arch}.attention.key_length"
                );
                hidden / heads
            }
        };
        ensure!(
            head_dim > 0 && head_dim % 2 == 0,
            "GGUF head_dim {head_dim} is not a positive even number"
        );
        if let Some(value_dim) = optional_usize("attention.value_length")?
            && value_dim != head_dim
        {
            unsupported!(
                "GGUF {arch}.attention.value_length {value_dim} is not \
                 {arch}.attention.key_length {head_dim}: values of another width are not supported"
            );
        }
        if let Some(rotary) = optional_usize("rope.dimension_count")?
            && rotary != head_dim
        {
            unsupported!(
                "GGUF {arch}.rope.dimension_count {rotary} is not head_dim {head_dim}: \
                 partial rotary embeddings are not supported"
            );
        }
        let vocab = match optional_usize("vocab_size")? {
            Some(vocab) => vocab,
            None => gguf.array("tokenizer.ggml.tokens")?.len(),
        };
        let optional_id =
            |key: &str| -> Result<Option<u64>> { gguf.get(key).map(|_| gguf.u64(key)).transpose() };
        let rope_theta = match gguf.get(&key("rope.freq_base")) {
            Some(_) => gguf.f64(&key("rope.freq_base"))? as f32,
            None => 10_000.0,
        };
        let rope_scaling = rope::rope_scaling(gguf, arch, shortest_f32(rope_theta), head_dim)?;
        Ok(LlamaParams {
            architecture,
            hidden,
            intermediate: gguf.usize(&key("feed_forward_length"))?,
            layers: gguf.usize(&key("block_count"))?,
            heads,
            kv_heads,
            head_dim,
            vocab,
            context_length: gguf.usize(&key("context_length"))?,
            rms_norm_eps: gguf.f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            rope_theta,
            rope_scaling,
            tied_embeddings: !gguf.tensors().iter().any(|t| t.name == "output.weight"),
            bos_token_id: optional_id("tokenizer.ggml.bos_token_id")?,
            eos_token_id: optional_id("tokenizer.ggml.eos_token_id")?,
            pad_token_id: optional_id("tokenizer.ggml.padding_token_id")?,
        })
    }

    /// `config.json` for the architecture, in the shape `transformers` 5 saves it plus the
    /// keys `transformers` 4 wrote (`torch_dtype`, top-level `rope_theta`, `rope_scaling`), so
    /// readers of either style find them. Readers refuse the two styles disagreeing.
    /// `torch_dtype` names the dtype of the activations and of `--kv-cache-dtype auto`.
    pub fn config_json(&self, torch_dtype: &str) -> Value {
        // The GGUF stores f32; its shortest decimal (1e-05, not 9.99999974e-06) reads back to the
        // same f32 and is what the model's own config.json says.
        let eps = shortest_f32(self.rms_norm_eps);
        let theta = shortest_f32(self.rope_theta);
        let rope_parameters = match &self.rope_scaling {
            Some(Value::Object(scaling)) => {
                let mut parameters = scaling.clone();
                parameters.insert("rope_theta".into(), json!(theta));
                Value::Object(parameters)
            }
            _ => json!({"rope_theta": theta, "rope_type": "default"}),
        };
        let (architecture, model_type) = self.architecture.hugging_face();
        let mut config = json!({
            "architectures": [architecture],
            "model_type": model_type,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": torch_dtype,
            "torch_dtype": torch_dtype,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate,
            "max_position_embeddings": self.context_length,
            "num_attention_heads": self.heads,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "rms_norm_eps": eps,
            "rope_parameters": rope_parameters,
            "rope_scaling": self.rope_scaling,
            "rope_theta": theta,
            "tie_word_embeddings": self.tied_embeddings,
            "use_cache": true,
            "vocab_size": self.vocab,
        });
        let extra = match self.architecture {
            Architecture::Llama => json!({"mlp_bias": false, "pretraining_tp": 1}),
            // A GGUF states no sliding window, and Qwen3's own configs switch it off.
            Architecture::Qwen3 => json!({
                "layer_types": vec!["full_attention"; self.layers],
                "max_window_layers": self.layers,
                "sliding_window": null,
                "use_sliding_window": false,
            }),
        };
        if let (Some(config), Value::Object(extra)) = (config.as_object_mut(), extra) {
            config.extend(extra);
        }
        config
    }

    /// `generation_config.json`: the ids `transformers` derives from the config.
    pub fn generation_config_json(&self) -> Value {
        json!({
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        })
    }

    /// The HF shape a tensor must have, so a GGUF that disagrees with its metadata is refused.
    pub fn expected_shape(&self, hf: &str) -> Option<Vec<usize>> {
        let (h, i, v) = (self.hidden, self.intermediate, self.vocab);
        let q = self.heads * self.head_dim;
        let kv = self.kv_heads * self.head_dim;
        let leaf = hf.rsplit_once(".layers.").map_or(hf, |(_, rest)| {
            rest.split_once('.').map_or(rest, |(_, leaf)| leaf)
        });
        Some(match leaf {
            "model.embed_tokens.weight" | "lm_head.weight" => vec![v, h],
            "model.norm.weight" | "input_layernorm.weight" | "post_attention_layernorm.weight" => {
                vec![h]
            }
            "self_attn.q_proj.weight" => vec![q, h],
            "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![kv, h],
            "self_attn.o_proj.weight" => vec![h, q],
            "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => vec![self.head_dim],
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![i, h],
            "mlp.down_proj.weight" => vec![h, i],
            _ => return None,
        })
    }
}

/// f32 → the shortest decimal that parses back to it, as an f64 JSON number.
fn shortest_f32(value: f32) -> f64 {
    value.to_string().parse().unwrap_or(f64::from(value))
}

/// Which rotary reordering a tensor needs, with its number of heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rotary {
    None,
    Unpermute { heads: usize },
}

/// The HF name of a GGUF tensor and the reordering it needs; `None` for a name a model of
/// `params`' architecture does not have.
pub fn hf_name(gguf_name: &str, params: &LlamaParams) -> Option<(String, Rotary)> {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some((name.to_string(), Rotary::None));
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok().filter(|&l| l < params.layers)?;
    let rotary = |heads| {
        if params.architecture.interleaves_rotary_rows() {
            Rotary::Unpermute { heads }
        } else {
            Rotary::None
        }
    };
    let qwen3 = params.architecture == Architecture::Qwen3;
    let (hf_leaf, rotary) = match leaf {
        "attn_norm.weight" => ("input_layernorm.weight", Rotary::None),
        "attn_q.weight" => ("self_attn.q_proj.weight", rotary(params.heads)),
        "attn_k.weight" => ("self_attn.k_proj.weight", rotary(params.kv_heads)),
        "attn_q_norm.weight" if qwen3 => ("self_attn.q_norm.weight", Rotary::None),
        "attn_k_norm.weight" if qwen3 => ("self_attn.k_norm.weight", Rotary::None),
        "attn_v.weight" => ("self_attn.v_proj.weight", Rotary::None),
        "attn_output.weight" => ("self_attn.o_proj.weight", Rotary::None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", Rotary::None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", Rotary::None),
        "ffn_up.weight" => ("mlp.up_proj.weight", Rotary::None),
        "ffn_down.weight" => ("mlp.down_proj.weight", Rotary::None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf_leaf}"), rotary))
}

/// Undoes llama.cpp's `permute(w, n_head)`: within each head of `2 * half` rows, GGUF row
/// `2 * i + j` becomes HF row `j * half + i`. `values` is row-major with rows of `cols`
/// elements (or bytes, for a quantized tensor's rows of blocks).
pub fn unpermute_rows<T: Copy + Default>(values: &[T], heads: usize, cols: usize) -> Vec<T> {
    let rows = values.len() / cols;
    let half = rows / heads / 2;
    let mut out = vec![T::default(); values.len()];
    for head in 0..heads {
        let base = head * 2 * half;
        for i in 0..half {
            for j in 0..2 {
                let from = (base + 2 * i + j) * cols;
                let to = (base + j * half + i) * cols;
                out[to..to + cols].copy_from_slice(&values[from..from + cols]);
            }
        }
    }
    out
}

/// The HF names of every tensor a model of `params` must have (the output projection only
/// when the embeddings are not tied).
pub fn required_names(params: &LlamaParams) -> Vec<String> {
    let mut names = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".to_string(),
    ];
    if !params.tied_embeddings {
        names.push("lm_head.weight".to_string());
    }
    for layer in 0..params.layers {
        for leaf in [
            "input_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "post_attention_layernorm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            names.push(format!("model.layers.{layer}.{leaf}.weight"));
        }
        if params.architecture == Architecture::Qwen3 {
            for leaf in ["self_attn.q_norm", "self_attn.k_norm"] {
                names.push(format!("model.layers.{layer}.{leaf}.weight"));
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> LlamaParams {
        LlamaParams {
            architecture: Architecture::Llama,
            hidden: 576,
            intermediate: 1536,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            vocab: 49152,
            context_length: 8192,
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            rope_scaling: None,
            tied_embeddings: true,
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            pad_token_id: Some(2),
        }
    }

    #[test]
    fn names_map_to_hugging_face_llama() {
        let p = params();
        let q = Rotary::Unpermute { heads: 9 };
        let k = Rotary::Unpermute { heads: 3 };
        let cases = [
            (
                "token_embd.weight",
                Some(("model.embed_tokens.weight", Rotary::None)),
            ),
            (
                "output_norm.weight",
                Some(("model.norm.weight", Rotary::None)),
            ),
            ("output.weight", Some(("lm_head.weight", Rotary::None))),
            (
                "blk.0.attn_norm.weight",
                Some(("model.layers.0.input_layernorm.weight", Rotary::None)),
            ),
            (
                "blk.3.attn_q.weight",
                Some(("model.layers.3.self_attn.q_proj.weight", q)),
            ),
            (
                "blk.3.attn_k.weight",
                Some(("model.layers.3.self_attn.k_proj.weight", k)),
            ),
            (
                "blk.29.attn_v.weight",
                Some(("model.layers.29.self_attn.v_proj.weight", Rotary::None)),
            ),
            (
                "blk.1.attn_output.weight",
                Some(("model.layers.1.self_attn.o_proj.weight", Rotary::None)),
            ),
            (
                "blk.1.ffn_norm.weight",
                Some((
                    "model.layers.1.post_attention_layernorm.weight",
                    Rotary::None,
                )),
            ),
            (
                "blk.1.ffn_gate.weight",
                Some(("model.layers.1.mlp.gate_proj.weight", Rotary::None)),
            ),
            (
                "blk.1.ffn_up.weight",
                Some(("model.layers.1.mlp.up_proj.weight", Rotary::None)),
            ),
            (
                "blk.1.ffn_down.weight",
                Some(("model.layers.1.mlp.down_proj.weight", Rotary::None)),
            ),
            ("blk.30.attn_q.weight", None),
            ("blk.x.attn_q.weight", None),
            ("rope_freqs.weight", None),
        ];
        for (gguf, expected) in cases {
            let got = hf_name(gguf, &p);
            let expected = expected.map(|(n, r)| (n.to_string(), r));
            assert_eq!(got, expected, "{gguf}");
        }
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(heads, 2, half, cols).swapaxes(1, 2).reshape(w.shape)
        let (heads, half, cols) = (3, 4, 2);
        let rows = heads * 2 * half;
        let hf: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
        let mut gguf = vec![0.0; hf.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..half {
                    let hf_row = (h * 2 + j) * half + i;
                    let gguf_row = (h * half + i) * 2 + j;
                    gguf[gguf_row * cols..(gguf_row + 1) * cols]
                        .copy_from_slice(&hf[hf_row * cols..(hf_row + 1) * cols]);
                }
            }
        }
        assert_ne!(gguf, hf);
        assert_eq!(unpermute_rows(&gguf, heads, cols), hf);
    }

    #[test]
    fn config_has_what_the_llama_glue_reads() {
        let config = params().config_json("bfloat16");
        let expected = [
            ("hidden_size", json!(576)),
            ("num_hidden_layers", json!(30)),
            ("num_attention_heads", json!(9)),
            ("num_key_value_heads", json!(3)),
            ("head_dim", json!(64)),
            ("intermediate_size", json!(1536)),
            ("vocab_size", json!(49152)),
            ("rms_norm_eps", json!(1e-5)),
            ("rope_theta", json!(100000.0)),
            ("max_position_embeddings", json!(8192)),
            ("tie_word_embeddings", json!(true)),
            ("eos_token_id", json!(2)),
            ("torch_dtype", json!("bfloat16")),
        ];
        for (key, value) in expected {
            assert_eq!(config[key], value, "{key}");
        }
        assert_eq!(config["architectures"], json!(["LlamaForCausalLM"]));
        // The transformers 5 keys say the same.
        assert_eq!(config["dtype"], config["torch_dtype"]);
        assert_eq!(
            config["rope_parameters"],
            json!({"rope_theta": 100000.0, "rope_type": "default"})
        );
        assert_eq!(config["rope_scaling"], Value::Null);
    }

    fn qwen3_params() -> LlamaParams {
        LlamaParams {
            architecture: Architecture::Qwen3,
            hidden: 1024,
            intermediate: 3072,
            layers: 28,
            heads: 16,
            kv_heads: 8,
            head_dim: 128,
            vocab: 151_936,
            context_length: 40_960,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            ..params()
        }
    }

    #[test]
    fn qwen3_keeps_the_rotary_row_order_and_has_per_head_norms() {
        let qwen3 = qwen3_params();
        let cases = [
            (
                "blk.2.attn_q.weight",
                "model.layers.2.self_attn.q_proj.weight",
            ),
            (
                "blk.2.attn_k.weight",
                "model.layers.2.self_attn.k_proj.weight",
            ),
            (
                "blk.2.attn_q_norm.weight",
                "model.layers.2.self_attn.q_norm.weight",
            ),
            (
                "blk.2.attn_k_norm.weight",
                "model.layers.2.self_attn.k_norm.weight",
            ),
        ];
        for (gguf, hf) in cases {
            assert_eq!(
                hf_name(gguf, &qwen3),
                Some((hf.to_string(), Rotary::None)),
                "{gguf}"
            );
        }
        assert_eq!(
            qwen3.expected_shape("model.layers.2.self_attn.q_norm.weight"),
            Some(vec![128])
        );
        assert_eq!(
            qwen3.expected_shape("model.layers.2.self_attn.q_proj.weight"),
            Some(vec![16 * 128, 1024])
        );
        let required = required_names(&qwen3);
        assert_eq!(required.len(), 2 + 28 * 11);
        assert!(required.contains(&"model.layers.27.self_attn.k_norm.weight".to_string()));
        // A Llama model has no per-head norms.
        assert_eq!(hf_name("blk.2.attn_q_norm.weight", &params()), None);
    }

    #[test]
    fn qwen3_config_is_qwen3s() {
        let config = qwen3_params().config_json("float32");
        assert_eq!(config["architectures"], json!(["Qwen3ForCausalLM"]));
        assert_eq!(config["model_type"], "qwen3");
        assert_eq!(config["head_dim"], 128);
        assert_eq!(config["rope_theta"], json!(1_000_000.0));
        assert_eq!(config["rms_norm_eps"], json!(1e-6));
        assert_eq!(config["use_sliding_window"], false);
        assert_eq!(config["layer_types"].as_array().map(Vec::len), Some(28));
        assert!(config.get("pretraining_tp").is_none());
    }
}
