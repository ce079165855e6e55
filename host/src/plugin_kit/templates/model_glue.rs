//! __NAME__: model glue for a bigram language model, a starting point for a model family.
//!
//! The model embeds each token and projects it straight to logits: two
//! weights, no attention. A real family adds its layers between the two
//! tasks of `build_program` (see plughost's `models/qwen3` for a decoder).

use plughost_sdk::model_glue::ModelGlue;
use plughost_sdk::model_glue::types::{
    ArgTag, BufferRef, Dim, Dtype, Extent, KvLayout, ModelInfo, RefreshPolicy, Scratch, StepInput,
    StepInputKind, StepProgram, Task, TensorArg, WeightSpec,
};
use serde::Deserialize;

/// The plugin's options: the `config` table of the deployment file, as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The `architectures` entry of config.json this glue accepts.
    pub architecture: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            architecture: "BigramForCausalLM".into(),
        }
    }
}

/// The fields of a model's config.json this glue reads.
#[derive(Debug, Deserialize)]
struct ModelConfig {
    architectures: Vec<String>,
    vocab_size: u32,
    hidden_size: u32,
    max_position_embeddings: u32,
    #[serde(default)]
    eos_token_id: Option<u32>,
}

pub struct Bigram {
    config: Config,
}

impl Bigram {
    fn model(&self, config_json: &str) -> Result<ModelConfig, String> {
        let model: ModelConfig =
            serde_json::from_str(config_json).map_err(|e| format!("config.json: {e}"))?;
        if !model.architectures.contains(&self.config.architecture) {
            return Err(format!(
                "config.json names {:?}; this glue serves {}",
                model.architectures, self.config.architecture
            ));
        }
        Ok(model)
    }
}

fn rows(extent: Extent, width: u64) -> Vec<Dim> {
    vec![
        Dim {
            extent,
            factor: 1,
            offset: 0,
        },
        Dim {
            extent: Extent::One,
            factor: width,
            offset: 0,
        },
    ]
}

fn arg(buffer: BufferRef, tag: ArgTag) -> TensorArg {
    TensorArg { buffer, tag }
}

impl ModelGlue for Bigram {
    fn init(config: &str) -> Result<Self, String> {
        let config = if config.trim().is_empty() {
            Config::default()
        } else {
            serde_json::from_str(config).map_err(|e| format!("invalid config: {e}"))?
        };
        Ok(Bigram { config })
    }

    fn describe(&self, config_json: &str) -> Result<ModelInfo, String> {
        let model = self.model(config_json)?;
        let matrix = vec![u64::from(model.vocab_size), u64::from(model.hidden_size)];
        Ok(ModelInfo {
            architecture: self.config.architecture.clone(),
            vocab_size: model.vocab_size,
            max_position: model.max_position_embeddings,
            eos_token_ids: model.eos_token_id.into_iter().collect(),
            // One layer of one head keeps the host's KV cache minimal; nothing reads it.
            kv: KvLayout {
                num_layers: 1,
                num_kv_heads: 1,
                head_dim: 1,
            },
            weights: vec![
                WeightSpec {
                    name: "embed.weight".into(),
                    shape: matrix.clone(),
                },
                WeightSpec {
                    name: "lm_head.weight".into(),
                    shape: matrix,
                },
            ],
        })
    }

    fn build_program(&self, config_json: &str) -> Result<StepProgram, String> {
        let model = self.model(config_json)?;
        let hidden = u64::from(model.hidden_size);
        let dim = |extent, offset| Dim {
            extent,
            factor: 1,
            offset,
        };
        let input = |name: &str, kind, shape, policy| StepInput {
            name: name.into(),
            kind,
            dtype: Dtype::I32,
            shape,
            policy,
        };
        // The host needs these five inputs to lay out a step, whether or not a task reads them.
        Ok(StepProgram {
            inputs: vec![
                input(
                    "token_ids",
                    StepInputKind::TokenIds,
                    vec![dim(Extent::Tokens, 0)],
                    RefreshPolicy::EveryStep,
                ),
                input(
                    "query_start",
                    StepInputKind::QueryStart,
                    vec![dim(Extent::Sequences, 1)],
                    RefreshPolicy::OnChange,
                ),
                input(
                    "block_table",
                    StepInputKind::BlockTable,
                    vec![dim(Extent::Sequences, 0), dim(Extent::BlocksPerSequence, 0)],
                    RefreshPolicy::OnChange,
                ),
                input(
                    "seq_lens",
                    StepInputKind::SeqLens,
                    vec![dim(Extent::Sequences, 0)],
                    RefreshPolicy::DeviceMaintained,
                ),
                input(
                    "logits_indices",
                    StepInputKind::LogitsIndices,
                    vec![dim(Extent::Emitting, 0)],
                    RefreshPolicy::OnChange,
                ),
            ],
            scratch: vec![
                Scratch {
                    name: "hidden".into(),
                    dtype: Dtype::F32,
                    shape: rows(Extent::Tokens, hidden),
                },
                Scratch {
                    name: "last".into(),
                    dtype: Dtype::F32,
                    shape: rows(Extent::Emitting, hidden),
                },
            ],
            tasks: vec![
                // Sequence lengths live on the device and advance by each step's query lengths.
                Task {
                    callable: "advance_seq_lens".into(),
                    args: vec![
                        arg(BufferRef::Input("seq_lens".into()), ArgTag::Inout),
                        arg(BufferRef::Input("query_start".into()), ArgTag::Input),
                    ],
                    params: vec![],
                },
                Task {
                    callable: "embedding_gather".into(),
                    args: vec![
                        arg(BufferRef::Input("token_ids".into()), ArgTag::Input),
                        arg(BufferRef::Weight("embed.weight".into()), ArgTag::Input),
                        arg(BufferRef::Scratch("hidden".into()), ArgTag::Output),
                    ],
                    params: vec![],
                },
                Task {
                    callable: "gather_rows".into(),
                    args: vec![
                        arg(BufferRef::Scratch("hidden".into()), ArgTag::Input),
                        arg(BufferRef::Input("logits_indices".into()), ArgTag::Input),
                        arg(BufferRef::Scratch("last".into()), ArgTag::Output),
                    ],
                    params: vec![],
                },
                Task {
                    callable: "linear".into(),
                    args: vec![
                        arg(BufferRef::Scratch("last".into()), ArgTag::Input),
                        arg(BufferRef::Weight("lm_head.weight".into()), ArgTag::Input),
                        arg(BufferRef::Logits, ArgTag::OutputExisting),
                    ],
                    params: vec![],
                },
            ],
        })
    }
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_model_glue!(Bigram);

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG_JSON: &str = r#"{"architectures": ["BigramForCausalLM"], "vocab_size": 256,
        "hidden_size": 32, "max_position_embeddings": 2048, "eos_token_id": 2}"#;

    #[test]
    fn describes_the_model_and_reads_every_weight_it_lists() {
        let glue = Bigram::init("").unwrap();
        let info = glue.describe(CONFIG_JSON).unwrap();
        assert_eq!(
            (info.vocab_size, info.eos_token_ids.clone()),
            (256, vec![2])
        );
        let program = glue.build_program(CONFIG_JSON).unwrap();
        for weight in &info.weights {
            let read = program
                .tasks
                .iter()
                .flat_map(|t| &t.args)
                .any(|a| matches!(&a.buffer, BufferRef::Weight(name) if *name == weight.name));
            assert!(read, "{} is never read", weight.name);
        }
    }

    #[test]
    fn another_architecture_is_refused() {
        let glue = Bigram::init(r#"{"architecture": "LlamaForCausalLM"}"#).unwrap();
        let error = glue.describe(CONFIG_JSON).unwrap_err();
        assert!(error.contains("LlamaForCausalLM"), "{error}");
    }
}
