//! Per-step host overhead of the engine: 64 running decodes on the mock device with a 151,936-token vocabulary.
//!
//! Run with `cargo xtask bench-engine`. The mock device does almost no
//! arithmetic, so what a step costs beyond its reported device time is the
//! host's share: scheduling (a plugin call), input refresh, dispatch, reading
//! the logits, sampling (a plugin call over 64 rows of 151,936 logits) and
//! emitting. The figures are means over every step, from the engine's own
//! step metrics.
//!
//! `-- --json-schema` gives every request a JSON schema (`response_format`): the masks are
//! then computed each step on the grammar thread, and since the mock device leaves nothing
//! to overlap them with, `mask_wait` shows their whole cost.
//!
//! `-- --long-penalised` runs a few 4,000-token generations with `repetition_penalty`
//! instead, and reports the host's time per step early (output tokens 0 to 500) and late
//! (3,500 to 4,000): penalties read each sequence's history every step, so any per-step cost
//! that grows with the length shows as a difference between the two.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use plughost::engine::{
    EngineHandle, EngineOptions, EngineSetup, GenerationEvent, GenerationRequest, StopConditions,
};
use plughost::grammar::{CompiledGrammar, Constraint};
use plughost::metrics::Metrics;
use plughost::plugins::PluginSpec;
use plughost_sdk::sampler::{Penalties, SamplingParams};

const VOCAB: usize = 151_936;
const HIDDEN: usize = 64;
const SEQUENCES: usize = 64;
const NEW_TOKENS: u32 = 128;
/// Sequences and output length of `--long-penalised`.
const LONG_SEQUENCES: usize = 4;
const LONG_TOKENS: u32 = 4000;
/// Output lengths at which `--long-penalised` reads the step metrics: the windows between
/// consecutive marks, early, a little later (past anything the first steps warm up) and late.
const LONG_MARKS: [u32; 5] = [1, 500, 1000, 3500, LONG_TOKENS];
/// The parts of a step that run on the host.
const HOST_PARTS: [&str; 7] = [
    "schedule",
    "prepare_inputs",
    "dispatch",
    "read_logits",
    "mask_wait",
    "sample",
    "emit",
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn env_dir(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(default))
}

/// A one-layer Qwen3-shaped model with the real vocabulary size and the real Qwen3 tokenizer.
fn write_model(dir: &Path) {
    std::fs::create_dir_all(dir).expect("model folder");
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "tie_word_embeddings": true, "eos_token_id": 151645
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config.json");
    let shapes: Vec<(String, Vec<usize>)> = [
        ("model.embed_tokens.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("model.norm.weight".into(), vec![HIDDEN]),
        ("model.layers.0.input_layernorm.weight".into(), vec![HIDDEN]),
        (
            "model.layers.0.post_attention_layernorm.weight".into(),
            vec![HIDDEN],
        ),
        (
            "model.layers.0.self_attn.q_proj.weight".into(),
            vec![64, HIDDEN],
        ),
        (
            "model.layers.0.self_attn.k_proj.weight".into(),
            vec![32, HIDDEN],
        ),
        (
            "model.layers.0.self_attn.v_proj.weight".into(),
            vec![32, HIDDEN],
        ),
        (
            "model.layers.0.self_attn.o_proj.weight".into(),
            vec![HIDDEN, 64],
        ),
        ("model.layers.0.self_attn.q_norm.weight".into(), vec![16]),
        ("model.layers.0.self_attn.k_norm.weight".into(), vec![16]),
        (
            "model.layers.0.mlp.gate_proj.weight".into(),
            vec![128, HIDDEN],
        ),
        (
            "model.layers.0.mlp.up_proj.weight".into(),
            vec![128, HIDDEN],
        ),
        (
            "model.layers.0.mlp.down_proj.weight".into(),
            vec![HIDDEN, 128],
        ),
    ]
    .into_iter()
    .collect();
    let data: Vec<(String, Vec<u8>, Vec<usize>)> = shapes
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let bytes = (0..n)
                .flat_map(|i| (((i * 7919) % 97) as f32 * 0.01 - 0.48).to_le_bytes())
                .collect();
            (name, bytes, shape)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(name, bytes, shape)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .expect("view"),
            )
        })
        .collect();
    let file = safetensors::serialize(views, None).expect("serialize");
    std::fs::write(dir.join("model.safetensors"), file).expect("model.safetensors");
    let tokenizer = env_dir(
        "PLUGHOST_QWEN3_TOKENIZER_DIR",
        "target/fixtures/qwen3-tokenizer",
    );
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer.join(name), dir.join(name)).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run `cargo xtask test` once to fetch the Qwen3 tokenizer",
                tokenizer.join(name).display()
            )
        });
    }
}

/// Sequence `i`: 16 prompt tokens of its own, then `max_tokens` past any end-of-sequence token.
fn decode(
    i: u32,
    sampling: SamplingParams,
    max_tokens: u32,
    constraint: Option<CompiledGrammar>,
) -> GenerationRequest {
    GenerationRequest {
        stop: StopConditions {
            ignore_eos: true,
            ..Default::default()
        },
        constraint,
        ..GenerationRequest::new(
            (0..16).map(|t| 1000 + i * 16 + t).collect(),
            sampling,
            max_tokens,
        )
    }
}

fn metric_sum_count(text: &str, part: &str) -> (f64, f64) {
    let value = |suffix: &str| {
        let prefix = format!("plughost_step_seconds_{suffix}{{part=\"{part}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    (value("sum"), value("count"))
}

/// Each host part's summed seconds, and the number of steps, as the metrics read now.
#[derive(Debug, Clone, Copy)]
struct StepTotals {
    parts: [f64; HOST_PARTS.len()],
    steps: f64,
}

impl StepTotals {
    fn read(metrics: &Metrics) -> StepTotals {
        let text = metrics.render();
        StepTotals {
            parts: HOST_PARTS.map(|part| metric_sum_count(&text, part).0),
            steps: metric_sum_count(&text, "device").1,
        }
    }

    /// Microseconds per step of each host part between `earlier` and `self`.
    fn per_step_since(&self, earlier: &StepTotals) -> ([f64; HOST_PARTS.len()], f64) {
        let steps = (self.steps - earlier.steps).max(1.0);
        let mut parts = [0.0; HOST_PARTS.len()];
        for (i, part) in parts.iter_mut().enumerate() {
            *part = (self.parts[i] - earlier.parts[i]) / steps * 1e6;
        }
        (parts, steps)
    }
}

fn main() {
    let plugins = env_dir("PLUGHOST_PLUGINS_DIR", "target/plugins");
    let long = std::env::args().any(|a| a == "--long-penalised");
    let model = std::env::temp_dir().join("plughost-bench-vocab-151936");
    write_model(&model);
    let spec = |file: &str| PluginSpec {
        component: plugins.join(file),
        config: Default::default(),
        memory_mib: None,
        call_timeout_ms: None,
        failure: Default::default(),
    };
    let metrics = Arc::new(Metrics::new());
    let setup = EngineSetup {
        model_dir: model.clone(),
        model_name: "bench".into(),
        device_library: plugins.join("libplughost_device_mock.so"),
        device_config: String::new(),
        glue: spec("plughost_model_qwen3.wasm"),
        scheduler: Some(spec("plughost_scheduler_fcfs.wasm")),
        sampler: Some(spec("plughost_sampler_standard.wasm")),
        named_samplers: Default::default(),
        component_cache: Some(std::env::temp_dir().join("plughost-bench-component-cache")),
        options: EngineOptions {
            max_num_seqs: SEQUENCES as u32,
            max_num_batched_tokens: 2048,
            block_size: 16,
            num_kv_blocks: Some(2048),
            max_model_len: Some(if long { 4096 } else { 1024 }),
            ..Default::default()
        },
        profile_output: None,
    };
    let engine = EngineHandle::start(setup, metrics.clone()).expect("engine starts");
    let summary = engine.wait_ready().expect("model loads");
    if long {
        long_penalised(&engine, &metrics);
        engine.shutdown();
        let _ = std::fs::remove_dir_all(model);
        return;
    }
    let with_schema = std::env::args().any(|a| a == "--json-schema");
    // Long enough that no output completes it within NEW_TOKENS.
    let schema = serde_json::json!({
        "type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 200
    });
    let constraint = with_schema.then(|| {
        summary
            .grammars
            .compile(&Constraint::JsonSchema(schema))
            .expect("the schema compiles")
    });
    let started = Instant::now();
    let receivers: Vec<_> = (0..SEQUENCES as u32)
        .map(|i| {
            let request = decode(i, SamplingParams::GREEDY, NEW_TOKENS, constraint.clone());
            engine.submit(request).expect("submitted").1
        })
        .collect();
    for mut rx in receivers {
        while let Some(event) = rx.blocking_recv() {
            if matches!(
                event,
                GenerationEvent::Finished { .. } | GenerationEvent::Failed { .. }
            ) {
                break;
            }
        }
    }
    let wall = started.elapsed();
    let text = metrics.render();
    let (_, steps) = metric_sum_count(&text, "device");
    println!(
        "{SEQUENCES} sequences x {NEW_TOKENS} tokens, vocabulary {VOCAB}, mock device{}: {steps} steps in {:.2} s",
        if with_schema { ", JSON schema" } else { "" },
        wall.as_secs_f64()
    );
    println!("{:<16} {:>12}", "part", "µs per step");
    let mut host = 0.0;
    for part in HOST_PARTS.into_iter().chain(["device"]) {
        let (sum, count) = metric_sum_count(&text, part);
        let per_step = if count > 0.0 { sum / steps * 1e6 } else { 0.0 };
        if part != "device" {
            host += per_step;
        }
        println!("{part:<16} {per_step:>12.1}");
    }
    println!("{:<16} {:>12.1}", "host total", host);
    println!(
        "{:<16} {:>12.1}",
        "wall per step",
        wall.as_secs_f64() / steps * 1e6
    );
    engine.shutdown();
    let _ = std::fs::remove_dir_all(model);
}

/// `--long-penalised`: greedy generations of [`LONG_TOKENS`] tokens with a repetition penalty,
/// and the host's time per step early and late in them.
fn long_penalised(engine: &EngineHandle, metrics: &Metrics) {
    let started = Instant::now();
    let receivers: Vec<_> = (0..LONG_SEQUENCES as u32)
        .map(|i| {
            let sampling = SamplingParams {
                penalties: Penalties {
                    repetition: 1.1,
                    ..Penalties::NONE
                },
                ..SamplingParams::GREEDY
            };
            let request = decode(i, sampling, LONG_TOKENS, None);
            engine.submit(request).expect("submitted").1
        })
        .collect();
    // Every sequence runs in every step, so the first one's length is the step's position;
    // the totals are read as its output passes each mark.
    let mut marks = Vec::with_capacity(LONG_MARKS.len());
    let mut receivers = receivers.into_iter();
    let mut first = receivers.next().expect("one sequence at least");
    let mut generated = 0u32;
    let mut distinct = std::collections::HashSet::new();
    while let Some(event) = first.blocking_recv() {
        match event {
            GenerationEvent::Delta { token_ids, .. } => {
                generated += token_ids.len() as u32;
                distinct.extend(token_ids);
                if LONG_MARKS.get(marks.len()) == Some(&generated) {
                    marks.push(StepTotals::read(metrics));
                }
            }
            GenerationEvent::Finished { .. } => break,
            other => panic!("the generation failed: {other:?}"),
        }
    }
    for mut rx in receivers {
        while let Some(event) = rx.blocking_recv() {
            if !matches!(event, GenerationEvent::Delta { .. }) {
                break;
            }
        }
    }
    assert_eq!(
        marks.len(),
        LONG_MARKS.len(),
        "{generated} tokens generated"
    );
    println!(
        "{LONG_SEQUENCES} sequences x {LONG_TOKENS} tokens, repetition_penalty 1.1, greedy, \
         vocabulary {VOCAB}, mock device: {:.2} s; the first sequence used {} distinct tokens",
        started.elapsed().as_secs_f64(),
        distinct.len()
    );
    // The window from 1,000 to 3,500 only separates the others.
    let windows: Vec<(usize, ([f64; HOST_PARTS.len()], f64))> = [0, 1, 3]
        .into_iter()
        .map(|w| (w, marks[w + 1].per_step_since(&marks[w])))
        .collect();
    print!("{:<16}", "µs per step");
    for (w, _) in &windows {
        print!(
            " {:>12}",
            format!("{}-{}", LONG_MARKS[*w], LONG_MARKS[w + 1])
        );
    }
    println!();
    for (i, part) in HOST_PARTS.iter().enumerate() {
        print!("{part:<16}");
        for (_, (parts, _)) in &windows {
            print!(" {:>12.1}", parts[i]);
        }
        println!();
    }
    print!("{:<16}", "host total");
    for (_, (parts, _)) in &windows {
        print!(" {:>12.1}", parts.iter().sum::<f64>());
    }
    println!();
    print!("{:<16}", "steps measured");
    for (_, (_, steps)) in &windows {
        print!(" {steps:>12}");
    }
    println!();
}
