//! The weight list and the step program of the decoder: one flattened token batch, layer by layer.
//!
//! Step inputs: the host writes token ids every step and the query offsets,
//! block table and logits indices when they change; sequence lengths are
//! advanced on the device, and positions and slot mapping are derived there.

use plughost_sdk::model_glue::types::{
    ArgTag, BufferRef, Dim, Dtype, Extent, KvLayout, ModelInfo, Param, RefreshPolicy, Scratch,
    StepInput, StepInputKind, StepProgram, Task, TensorArg, WeightSpec,
};

use crate::config::TransformerConfig;

fn layer_weight(layer: u32, name: &str) -> String {
    format!("model.layers.{layer}.{name}")
}

const EMBED: &str = "model.embed_tokens.weight";
const LM_HEAD: &str = "lm_head.weight";
const FINAL_NORM: &str = "model.norm.weight";

/// Every tensor the checkpoint must hold, with its shape.
pub fn weights(c: &TransformerConfig) -> Vec<WeightSpec> {
    let (h, i) = (c.hidden as u64, c.intermediate as u64);
    let q = (c.heads * c.head_dim) as u64;
    let kv = (c.kv_heads * c.head_dim) as u64;
    let spec = |name: String, shape: &[u64]| WeightSpec {
        name,
        shape: shape.to_vec(),
    };
    let mut out = vec![spec(EMBED.into(), &[c.vocab as u64, h])];
    for l in 0..c.layers {
        let w = |n: &str| layer_weight(l, n);
        out.push(spec(w("input_layernorm.weight"), &[h]));
        out.push(spec(w("self_attn.q_proj.weight"), &[q, h]));
        out.push(spec(w("self_attn.k_proj.weight"), &[kv, h]));
        out.push(spec(w("self_attn.v_proj.weight"), &[kv, h]));
        out.push(spec(w("self_attn.o_proj.weight"), &[h, q]));
        if c.family.biases_qkv() {
            out.push(spec(w("self_attn.q_proj.bias"), &[q]));
            out.push(spec(w("self_attn.k_proj.bias"), &[kv]));
            out.push(spec(w("self_attn.v_proj.bias"), &[kv]));
        }
        if c.family.normalises_qk() {
            out.push(spec(w("self_attn.q_norm.weight"), &[c.head_dim as u64]));
            out.push(spec(w("self_attn.k_norm.weight"), &[c.head_dim as u64]));
        }
        out.push(spec(w("post_attention_layernorm.weight"), &[h]));
        out.push(spec(w("mlp.gate_proj.weight"), &[i, h]));
        out.push(spec(w("mlp.up_proj.weight"), &[i, h]));
        out.push(spec(w("mlp.down_proj.weight"), &[h, i]));
    }
    out.push(spec(FINAL_NORM.into(), &[h]));
    if !c.tied_embeddings {
        out.push(spec(LM_HEAD.into(), &[c.vocab as u64, h]));
    }
    out
}

pub fn describe(c: &TransformerConfig) -> ModelInfo {
    ModelInfo {
        architecture: c.architecture.clone(),
        vocab_size: c.vocab,
        max_position: c.max_position,
        eos_token_ids: c.eos_token_ids.clone(),
        kv: KvLayout {
            num_layers: c.layers,
            num_kv_heads: c.kv_heads,
            head_dim: c.head_dim,
        },
        weights: weights(c),
    }
}

fn dim(extent: Extent, factor: u64) -> Dim {
    Dim {
        extent,
        factor,
        offset: 0,
    }
}

fn rows(extent: Extent, width: u64) -> Vec<Dim> {
    vec![dim(extent, 1), dim(Extent::One, width)]
}

fn input(name: &str, kind: StepInputKind, shape: Vec<Dim>, policy: RefreshPolicy) -> StepInput {
    StepInput {
        name: name.into(),
        kind,
        dtype: Dtype::I32,
        shape,
        policy,
    }
}

fn step_inputs() -> Vec<StepInput> {
    use RefreshPolicy::{DeviceMaintained, EveryStep, OnChange};
    let tokens = vec![dim(Extent::Tokens, 1)];
    let seqs = vec![dim(Extent::Sequences, 1)];
    vec![
        input(
            "token_ids",
            StepInputKind::TokenIds,
            tokens.clone(),
            EveryStep,
        ),
        input(
            "query_start",
            StepInputKind::QueryStart,
            vec![Dim {
                extent: Extent::Sequences,
                factor: 1,
                offset: 1,
            }],
            OnChange,
        ),
        input(
            "block_table",
            StepInputKind::BlockTable,
            vec![dim(Extent::Sequences, 1), dim(Extent::BlocksPerSequence, 1)],
            OnChange,
        ),
        input(
            "logits_indices",
            StepInputKind::LogitsIndices,
            vec![dim(Extent::Emitting, 1)],
            OnChange,
        ),
        input("seq_lens", StepInputKind::SeqLens, seqs, DeviceMaintained),
        input(
            "positions",
            StepInputKind::Positions,
            tokens.clone(),
            DeviceMaintained,
        ),
        input(
            "slot_mapping",
            StepInputKind::SlotMapping,
            tokens,
            DeviceMaintained,
        ),
    ]
}

fn scratch(c: &TransformerConfig) -> Vec<Scratch> {
    let h = c.hidden as u64;
    let q = (c.heads * c.head_dim) as u64;
    let kv = (c.kv_heads * c.head_dim) as u64;
    let i = c.intermediate as u64;
    let f32_rows = |name: &str, extent: Extent, width: u64| Scratch {
        name: name.into(),
        dtype: Dtype::F32,
        shape: rows(extent, width),
    };
    vec![
        f32_rows("hidden", Extent::Tokens, h),
        f32_rows("normed", Extent::Tokens, h),
        f32_rows("q", Extent::Tokens, q),
        f32_rows("k", Extent::Tokens, kv),
        f32_rows("v", Extent::Tokens, kv),
        f32_rows("attn", Extent::Tokens, q),
        f32_rows("proj", Extent::Tokens, h),
        f32_rows("act", Extent::Tokens, i),
        f32_rows("last", Extent::Emitting, h),
    ]
}

/// Builds tasks with short helpers so the layer reads like the model code.
struct Tasks(Vec<Task>);

fn weight(name: impl Into<String>) -> TensorArg {
    // Weights are never written during a step, so they need no tracking.
    TensorArg {
        buffer: BufferRef::Weight(name.into()),
        tag: ArgTag::NoDep,
    }
}
fn read(name: &str) -> TensorArg {
    TensorArg {
        buffer: BufferRef::Scratch(name.into()),
        tag: ArgTag::Input,
    }
}
fn write(name: &str) -> TensorArg {
    TensorArg {
        buffer: BufferRef::Scratch(name.into()),
        tag: ArgTag::Output,
    }
}
fn inout(name: &str) -> TensorArg {
    TensorArg {
        buffer: BufferRef::Scratch(name.into()),
        tag: ArgTag::Inout,
    }
}
fn step(name: &str, tag: ArgTag) -> TensorArg {
    TensorArg {
        buffer: BufferRef::Input(name.into()),
        tag,
    }
}

impl Tasks {
    fn push(&mut self, callable: &str, args: Vec<TensorArg>, params: Vec<Param>) {
        self.0.push(Task {
            callable: callable.into(),
            args,
            params,
        });
    }
    fn linear(&mut self, x: &str, w: String, out: &str) {
        self.push("linear", vec![read(x), weight(w), write(out)], vec![]);
    }
    fn rms_norm(&mut self, x: &str, w: impl Into<String>, out: &str, eps: f32) {
        self.push(
            "rms_norm",
            vec![read(x), weight(w), write(out)],
            vec![Param::Float(eps)],
        );
    }
    /// The residual add of `y` into `hidden`, then `normed = rms_norm(hidden)`.
    fn add_rms_norm(&mut self, y: &str, w: impl Into<String>, eps: f32) {
        self.push(
            "add_rms_norm",
            vec![inout("hidden"), read(y), weight(w), write("normed")],
            vec![Param::Float(eps)],
        );
    }
}

pub fn build(c: &TransformerConfig) -> StepProgram {
    let mut t = Tasks(Vec::new());
    t.push(
        "advance_seq_lens",
        vec![
            step("seq_lens", ArgTag::Inout),
            step("query_start", ArgTag::Input),
        ],
        vec![],
    );
    t.push(
        "derive_positions",
        vec![
            step("seq_lens", ArgTag::Input),
            step("query_start", ArgTag::Input),
            step("positions", ArgTag::OutputExisting),
        ],
        vec![],
    );
    t.push(
        "derive_slot_mapping",
        vec![
            step("block_table", ArgTag::Input),
            step("seq_lens", ArgTag::Input),
            step("query_start", ArgTag::Input),
            step("slot_mapping", ArgTag::OutputExisting),
        ],
        vec![Param::BlockSize],
    );
    t.push(
        "embedding_gather",
        vec![
            step("token_ids", ArgTag::Input),
            weight(EMBED),
            write("hidden"),
        ],
        vec![],
    );
    let head_dim = c.head_dim as i64;
    // The rotary table, computed once: `head_dim`, then one inverse frequency per pair.
    let rotary_params: Vec<Param> = std::iter::once(Param::Int(head_dim))
        .chain(
            c.rope
                .inverse_frequencies(c.head_dim)
                .into_iter()
                .map(Param::Float),
        )
        .collect();
    // YaRN multiplies cos and sin by its attention factor, which scales every q·k product by
    // its square: folded into the softmax scale instead of a pass over q and k.
    let attention_factor = c.rope.attention_factor();
    let mut attention_scale = 1.0 / (c.head_dim as f32).sqrt();
    if attention_factor != 1.0 {
        attention_scale *= (attention_factor * attention_factor) as f32;
    }
    // Every later norm follows a residual add and runs in the same launch as it.
    let input_norm = |l: u32| {
        if l < c.layers {
            layer_weight(l, "input_layernorm.weight")
        } else {
            FINAL_NORM.to_string()
        }
    };
    t.rms_norm("hidden", input_norm(0), "normed", c.eps);
    for l in 0..c.layers {
        let w = |n: &str| layer_weight(l, n);
        t.push(
            "qkv_linear",
            vec![
                read("normed"),
                weight(w("self_attn.q_proj.weight")),
                weight(w("self_attn.k_proj.weight")),
                weight(w("self_attn.v_proj.weight")),
                write("q"),
                write("k"),
                write("v"),
            ],
            vec![],
        );
        if c.family.biases_qkv() {
            for (x, bias) in [
                ("q", "self_attn.q_proj.bias"),
                ("k", "self_attn.k_proj.bias"),
                ("v", "self_attn.v_proj.bias"),
            ] {
                t.push("bias_add", vec![inout(x), weight(w(bias))], vec![]);
            }
        }
        if c.family.normalises_qk() {
            for (x, norm) in [
                ("q", "self_attn.q_norm.weight"),
                ("k", "self_attn.k_norm.weight"),
            ] {
                t.push(
                    "rms_norm_heads",
                    vec![inout(x), weight(w(norm))],
                    vec![Param::Float(c.eps), Param::Int(head_dim)],
                );
            }
        }
        t.push(
            "rotary",
            vec![inout("q"), inout("k"), step("positions", ArgTag::Input)],
            rotary_params.clone(),
        );
        t.push(
            "kv_write",
            vec![
                read("k"),
                read("v"),
                TensorArg {
                    buffer: BufferRef::KeyCache(l),
                    tag: ArgTag::OutputExisting,
                },
                TensorArg {
                    buffer: BufferRef::ValueCache(l),
                    tag: ArgTag::OutputExisting,
                },
                step("slot_mapping", ArgTag::Input),
            ],
            vec![],
        );
        let mut params = vec![
            Param::Int(c.heads as i64),
            Param::Int(c.kv_heads as i64),
            Param::Int(head_dim),
            Param::BlockSize,
            Param::Float(attention_scale),
        ];
        let window = c.windows.get(l as usize).copied().flatten();
        let callable = match window {
            Some(window) => {
                params.push(Param::Int(i64::from(window)));
                "paged_attention_window"
            }
            None => "paged_attention",
        };
        t.push(
            callable,
            vec![
                read("q"),
                TensorArg {
                    buffer: BufferRef::KeyCache(l),
                    tag: ArgTag::Input,
                },
                TensorArg {
                    buffer: BufferRef::ValueCache(l),
                    tag: ArgTag::Input,
                },
                step("block_table", ArgTag::Input),
                step("seq_lens", ArgTag::Input),
                step("query_start", ArgTag::Input),
                write("attn"),
            ],
            params,
        );
        t.linear("attn", w("self_attn.o_proj.weight"), "proj");
        t.add_rms_norm("proj", w("post_attention_layernorm.weight"), c.eps);
        t.push(
            "silu_gate_linear",
            vec![
                read("normed"),
                weight(w("mlp.gate_proj.weight")),
                weight(w("mlp.up_proj.weight")),
                write("act"),
            ],
            vec![],
        );
        t.linear("act", w("mlp.down_proj.weight"), "proj");
        t.add_rms_norm("proj", input_norm(l + 1), c.eps);
    }
    t.push(
        "gather_rows",
        vec![
            read("normed"),
            step("logits_indices", ArgTag::Input),
            write("last"),
        ],
        vec![],
    );
    let head = if c.tied_embeddings { EMBED } else { LM_HEAD };
    t.push(
        "linear",
        vec![
            read("last"),
            weight(head),
            TensorArg {
                buffer: BufferRef::Logits,
                tag: ArgTag::OutputExisting,
            },
        ],
        vec![],
    );
    StepProgram {
        inputs: step_inputs(),
        scratch: scratch(c),
        tasks: t.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(arch: &str, tied: bool) -> TransformerConfig {
        let text = format!(
            r#"{{"architectures": ["{arch}"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "vocab_size": 500, "tie_word_embeddings": {tied}}}"#
        );
        TransformerConfig::parse(&text).expect("valid config")
    }

    #[test]
    fn every_weight_a_task_reads_is_listed_and_every_listed_weight_is_read() {
        for (arch, tied) in [
            ("Qwen3ForCausalLM", true),
            ("LlamaForCausalLM", false),
            ("Qwen2ForCausalLM", true),
            ("MistralForCausalLM", false),
        ] {
            let c = config(arch, tied);
            let listed: std::collections::BTreeSet<String> =
                weights(&c).into_iter().map(|w| w.name).collect();
            let read: std::collections::BTreeSet<String> = build(&c)
                .tasks
                .iter()
                .flat_map(|t| t.args.iter())
                .filter_map(|a| match &a.buffer {
                    BufferRef::Weight(n) => Some(n.clone()),
                    _ => None,
                })
                .collect();
            assert_eq!(listed, read, "{arch}");
        }
    }

    #[test]
    fn qwen3_normalises_q_and_k_per_head_and_llama_does_not() {
        let count = |c: &TransformerConfig| {
            build(c)
                .tasks
                .iter()
                .filter(|t| t.callable == "rms_norm_heads")
                .count()
        };
        assert_eq!(count(&config("Qwen3ForCausalLM", true)), 4);
        assert_eq!(count(&config("LlamaForCausalLM", true)), 0);
    }

    #[test]
    fn every_rotary_task_carries_the_table_of_the_theta_config_json_states_in_either_form() {
        let base = r#"{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 500, ROPE}"#;
        let cases = [
            (r#""rope_theta": 1000000, "torch_dtype": "float32""#, 1e6),
            (
                r#""rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
                    "dtype": "float32""#,
                1e6,
            ),
            (
                r#""rope_parameters": {"full_attention": {"rope_theta": 1000000, "rope_type": "default"}}"#,
                1e6,
            ),
            (r#""rope_scaling": null"#, 10_000.0),
        ];
        for (rope, want) in cases {
            let config = TransformerConfig::parse(&base.replace("ROPE", rope)).expect(rope);
            // 1 / theta^(2i/32) for the 16 pairs of a head: the last is theta^(-30/32).
            let want: Vec<f32> = (0..16)
                .map(|i| 1.0 / (want as f32).powf(2.0 * i as f32 / 32.0))
                .collect();
            let tables: Vec<Vec<f32>> = build(&config)
                .tasks
                .iter()
                .filter(|t| t.callable == "rotary")
                .map(|t| match t.params.split_first() {
                    Some((Param::Int(32), table)) => table
                        .iter()
                        .map(|p| match p {
                            Param::Float(f) => *f,
                            other => panic!("table entry {other:?}"),
                        })
                        .collect(),
                    other => panic!("rotary params {other:?}"),
                })
                .collect();
            assert_eq!(tables, [want.clone(), want], "{rope}");
        }
    }

    #[test]
    fn qwen2_adds_a_bias_to_q_k_and_v_and_the_others_do_not() {
        let biased = |arch: &str| {
            build(&config(arch, true))
                .tasks
                .iter()
                .filter(|t| t.callable == "bias_add")
                .count()
        };
        assert_eq!(biased("Qwen2ForCausalLM"), 6, "q, k and v of 2 layers");
        for arch in ["Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"] {
            assert_eq!(biased(arch), 0, "{arch}");
        }
    }

    #[test]
    fn sliding_layers_attend_within_their_window() {
        let text = r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 500, "use_sliding_window": true,
            "sliding_window": 48, "max_window_layers": 1}"#;
        let program = build(&TransformerConfig::parse(text).expect("a windowed config"));
        let attention: Vec<(&str, Option<i64>)> = program
            .tasks
            .iter()
            .filter(|t| t.callable.starts_with("paged_attention"))
            .map(|t| {
                let window = match t.params.get(5) {
                    Some(Param::Int(window)) => Some(*window),
                    _ => None,
                };
                (t.callable.as_str(), window)
            })
            .collect();
        assert_eq!(
            attention,
            [
                ("paged_attention", None),
                ("paged_attention_window", Some(48)),
                ("paged_attention_window", Some(48)),
            ]
        );
    }

    #[test]
    fn yarn_scales_the_softmax_by_the_square_of_its_attention_factor() {
        let scale = |rope: &str| {
            let text = format!(
                r#"{{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 500, {rope}}}"#
            );
            let config = TransformerConfig::parse(&text).expect(rope);
            let program = build(&config);
            let attention = program
                .tasks
                .iter()
                .find(|t| t.callable == "paged_attention")
                .expect("an attention task");
            match attention.params.last() {
                Some(Param::Float(scale)) => *scale,
                other => panic!("{other:?}"),
            }
        };
        let plain = scale(r#""rope_theta": 10000"#);
        assert_eq!(plain, 1.0 / 32f32.sqrt());
        let yarn = scale(r#""rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#);
        let factor = 0.1 * 4f64.ln() + 1.0;
        let want = plain * (factor * factor) as f32;
        assert_eq!(yarn, want);
        let stated = scale(
            r#""rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5}"#,
        );
        assert_eq!(stated, plain * 2.25);
    }

    #[test]
    fn every_scratch_and_input_a_task_names_is_declared() {
        let program = build(&config("Qwen3ForCausalLM", false));
        let scratch: Vec<&str> = program.scratch.iter().map(|s| s.name.as_str()).collect();
        let inputs: Vec<&str> = program.inputs.iter().map(|s| s.name.as_str()).collect();
        for task in &program.tasks {
            for arg in &task.args {
                match &arg.buffer {
                    BufferRef::Scratch(n) => assert!(scratch.contains(&n.as_str()), "{n}"),
                    BufferRef::Input(n) => assert!(inputs.contains(&n.as_str()), "{n}"),
                    _ => {}
                }
            }
        }
    }
}
