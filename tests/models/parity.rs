//! Parity with Hugging Face: the tiny Qwen3, Qwen2, Llama, Mistral (with a sliding window), Llama 3 and YaRN checkpoints on the CPU device against `transformers` references.
//!
//! References come from `tests/reference/make_fixtures.py` and
//! `make_family_fixtures.py`. Every fixture runs
//! with its config in both styles checkpoints come in: `transformers` 5's
//! (`rope_parameters`, `dtype`: config.json) and `transformers` 4's (top-level
//! `rope_theta`, `torch_dtype`: config.transformers4.json). Besides matching
//! the references, four ways of running the same prompts (one at a time, one
//! batch, 3-token prefill chunks, a shared prefix already cached) must agree.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use plughost::device::DType;
use plughost::device::{Device, DeviceLibrary};
use plughost::model::ModelConfig;
use plughost::model::gguf::folder;
use plughost::plugins::glue::GluePlugin;
use plughost::plugins::{InstanceLimits, PluginRuntime, RuntimeOptions};
use plughost::runtime::{KvCacheDtype, Runtime, RuntimeConfig, StepSequence, load_model};
use serde::Deserialize;

use crate::common;

const BLOCK_SIZE: u32 = 4;
const NEW_TOKENS: usize = 32;

#[derive(Deserialize)]
struct Reference {
    prompts: Vec<PromptReference>,
    shared_prefix: SharedPrefix,
}

#[derive(Deserialize)]
struct PromptReference {
    name: String,
    token_ids: Vec<u32>,
    generated_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct SharedPrefix {
    prompts: Vec<String>,
    num_tokens: usize,
}

/// The two styles of config.json (see `tests/reference/fixture_configs.py`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum ConfigStyle {
    /// `rope_parameters` and `dtype`, as `transformers` 5 writes them: the fixture's config.json.
    Transformers5,
    /// Top-level `rope_theta`, `rope_scaling` and `torch_dtype`: config.transformers4.json.
    Transformers4,
}

const STYLES: [ConfigStyle; 2] = [ConfigStyle::Transformers5, ConfigStyle::Transformers4];

impl ConfigStyle {
    fn file(self) -> &'static str {
        match self {
            ConfigStyle::Transformers5 => "config.json",
            ConfigStyle::Transformers4 => "config.transformers4.json",
        }
    }
}

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// A scratch checkpoint folder: a fixture's weights with one style of its config, edited,
/// as config.json, or the model folder the host makes of a GGUF. Removed on drop.
struct ModelDir(PathBuf, Option<PathBuf>);

impl ModelDir {
    /// A folder of its own: tests run in parallel threads of one process.
    fn scratch(name: &str) -> PathBuf {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        std::env::temp_dir().join(format!(
            "plughost-parity-{name}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ))
    }

    fn new(name: &str, style: ConfigStyle, edit: impl Fn(&mut serde_json::Value)) -> ModelDir {
        let from = fixture_dir(name);
        let to = ModelDir::scratch(name);
        std::fs::create_dir_all(&to).expect("temp folder");
        std::fs::copy(from.join("model.safetensors"), to.join("model.safetensors"))
            .expect("copy the weights");
        let path = from.join(style.file());
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let mut config: serde_json::Value = serde_json::from_str(&text).expect("config parses");
        edit(&mut config);
        std::fs::write(to.join("config.json"), config.to_string()).expect("write config.json");
        ModelDir(to, None)
    }

    /// The folder the host serves `fixtures/{name}/model.gguf` from.
    fn from_gguf(name: &str) -> ModelDir {
        let cache = ModelDir::scratch(name);
        let file = fixture_dir(name).join("model.gguf");
        let dir =
            folder::prepare(&file, &cache).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        ModelDir(dir, Some(cache))
    }
}

impl Drop for ModelDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.1.as_ref().unwrap_or(&self.0));
    }
}

struct Fixture {
    /// The fixture and the config style, for messages.
    name: String,
    model: ModelDir,
    tolerance: f32,
    reference: Reference,
    logits: Vec<u8>,
}

impl Fixture {
    fn open(name: &str, tolerance: f32, style: ConfigStyle) -> Fixture {
        Fixture::edited(name, tolerance, style, |_| {})
    }

    /// The fixture with its config edited by `edit`; the references stay those of the original.
    fn edited(
        name: &str,
        tolerance: f32,
        style: ConfigStyle,
        edit: impl Fn(&mut serde_json::Value),
    ) -> Fixture {
        let dir = fixture_dir(name);
        let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
        let reference = serde_json::from_str(&text).expect("reference.json parses");
        let logits =
            std::fs::read(dir.join("reference.safetensors")).expect("reference.safetensors");
        Fixture {
            name: format!("{name} ({style:?} config)"),
            model: ModelDir::new(name, style, edit),
            tolerance,
            reference,
            logits,
        }
    }

    /// `{name}-gguf/model.gguf`, the fixture as llama.cpp's converter writes it, with the
    /// fixture's references.
    fn gguf(name: &str, tolerance: f32) -> Fixture {
        let dir = fixture_dir(name);
        let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
        Fixture {
            name: format!("{name} (GGUF)"),
            model: ModelDir::from_gguf(&format!("{name}-gguf")),
            tolerance,
            reference: serde_json::from_str(&text).expect("reference.json parses"),
            logits: std::fs::read(dir.join("reference.safetensors"))
                .expect("reference.safetensors"),
        }
    }

    /// Every fixture in every config style, and the GGUF ones.
    fn all() -> impl Iterator<Item = Fixture> {
        let folders = CHECKPOINTS.into_iter().flat_map(|(name, tolerance)| {
            STYLES
                .into_iter()
                .map(move |style| Fixture::open(name, tolerance, style))
        });
        // Among the GGUF files, Llama 3's scaling as a GGUF states it: no metadata, a
        // `rope_freqs` table of divisors, which the host fits back to the parameters.
        folders.chain(GGUF_CHECKPOINTS.map(|(name, tolerance)| Fixture::gguf(name, tolerance)))
    }

    /// Rows of a reference logits tensor.
    fn rows(&self, tensor: &str) -> Vec<Vec<f32>> {
        let file =
            safetensors::SafeTensors::deserialize(&self.logits).expect("reference logits parse");
        let view = file.tensor(tensor).expect("reference tensor");
        let width = view.shape()[1];
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        values.chunks(width).map(<[f32]>::to_vec).collect()
    }
}

/// How a test runs the model: the CPU device's config and the KV cache's element type.
struct Precision {
    device_config: &'static str,
    kv_cache_dtype: KvCacheDtype,
}

/// The references multiply bf16 weights with f32 activations and keep f32 keys and values.
/// Serving a bf16 checkpoint rounds both to bf16 instead (activations where the CPU has
/// AVX-512 BF16); `bf16_serving_defaults_are_batch_invariant_and_close` checks that.
const REFERENCE: Precision = Precision {
    device_config: "bf16_products=f32",
    kv_cache_dtype: KvCacheDtype::F32,
};

/// What `plughost serve` uses by default.
const SERVING_DEFAULT: Precision = Precision {
    device_config: "",
    kv_cache_dtype: KvCacheDtype::Auto,
};

/// The dtype the checkpoint's config.json names.
fn checkpoint_dtype(dir: &Path) -> Option<String> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ModelConfig::parse(&text, &path)
        .expect("config.json parses")
        .torch_dtype
}

fn load(fixture: &Fixture, num_kv_blocks: u32, precision: &Precision) -> Runtime {
    let (device, mut glue) =
        common::device_and_glue("libplughost_device_cpu.so", precision.device_config);
    let config = RuntimeConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
        block_size: BLOCK_SIZE,
        num_kv_blocks,
        max_model_len: 128,
        kv_cache_dtype: precision
            .kv_cache_dtype
            .resolve(checkpoint_dtype(&fixture.model.0).as_deref()),
    };
    load_model(device, &mut glue, &fixture.model.0, config).expect("model loads")
}

/// One sequence as the test drives it: its tokens, what the cache holds, and its blocks.
#[derive(Clone)]
struct Sequence {
    id: u64,
    tokens: Vec<u32>,
    computed: usize,
    blocks: Vec<u32>,
    /// Logits rows this sequence emitted, in order.
    emitted: Vec<Vec<f32>>,
}

impl Sequence {
    fn new(prompt: &[u32]) -> Sequence {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Sequence {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            tokens: prompt.to_vec(),
            computed: 0,
            blocks: Vec::new(),
            emitted: Vec::new(),
        }
    }
}

/// Hands out KV blocks in order; the tests never free.
struct Driver {
    runtime: Runtime,
    next_block: u32,
}

impl Driver {
    fn reserve(&mut self, seq: &mut Sequence, until: usize) {
        while (seq.blocks.len() as u32) * BLOCK_SIZE < until as u32 {
            seq.blocks.push(self.next_block);
            self.next_block += 1;
        }
    }

    /// One step: each sequence computes up to `chunk` of its pending tokens.
    fn step(&mut self, seqs: &mut [&mut Sequence], chunk: usize) {
        let mut spans = Vec::new();
        for seq in seqs.iter_mut() {
            let end = seq.computed.saturating_add(chunk).min(seq.tokens.len());
            self.reserve(seq, end);
            spans.push((seq.computed, end));
        }
        let batch: Vec<StepSequence<'_>> = seqs
            .iter()
            .zip(&spans)
            .map(|(seq, &(start, end))| StepSequence {
                id: seq.id,
                tokens: &seq.tokens[start..end],
                computed_len: start as u32,
                block_table: &seq.blocks,
                emit: end == seq.tokens.len(),
            })
            .collect();
        let mut logits = Vec::new();
        self.runtime
            .execute(&batch, &mut logits)
            .expect("step runs");
        let vocab = self.runtime.model_info().vocab_size as usize;
        let mut rows = logits.chunks(vocab);
        for (seq, &(_, end)) in seqs.iter_mut().zip(&spans) {
            seq.computed = end;
            if end == seq.tokens.len() {
                seq.emitted
                    .push(rows.next().expect("a row per emitting sequence").to_vec());
            }
        }
    }

    /// Prefills in `chunk`-token steps, then decodes greedily until `NEW_TOKENS` are generated.
    fn generate(&mut self, seqs: &mut [&mut Sequence], chunk: usize) {
        while seqs.iter().any(|s| s.computed < s.tokens.len()) {
            let mut pending: Vec<&mut Sequence> = seqs
                .iter_mut()
                .filter(|s| s.computed < s.tokens.len())
                .map(|s| &mut **s)
                .collect();
            self.step(&mut pending, chunk);
        }
        for _ in 0..NEW_TOKENS {
            for seq in seqs.iter_mut() {
                let row = seq.emitted.last().expect("prefill emitted");
                seq.tokens.push(argmax(row));
            }
            if seqs[0].emitted.len() == NEW_TOKENS {
                break;
            }
            self.step(seqs, 1);
        }
    }
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

const CHECKPOINTS: [(&str, f32); 8] = [
    ("tiny-qwen3", 1e-4),
    ("tiny-qwen3-bf16", 2e-2),
    ("tiny-llama", 1e-4),
    // Biases on q, k and v.
    ("tiny-qwen2", 1e-4),
    // A sliding window longer than every test sequence.
    ("tiny-mistral", 1e-4),
    // A sliding window of 12 positions, far shorter than the test sequences.
    ("tiny-mistral-swa", 1e-4),
    // Llama 3.1's rotary frequency scaling.
    ("tiny-llama3", 1e-4),
    // YaRN, past the pretrained window of 32 positions.
    ("tiny-qwen3-yarn", 1e-4),
];

/// As llama.cpp's converter writes them: Llama 3 (`make_llama3_gguf.py`), and Qwen3 in float32
/// and in bfloat16 with float32 norms (`make_qwen3_gguf.py`).
const GGUF_CHECKPOINTS: [(&str, f32); 3] = [
    ("tiny-llama3", 1e-4),
    ("tiny-qwen3", 1e-4),
    ("tiny-qwen3-bf16", 2e-2),
];

#[test]
fn logits_at_every_prompt_position_match_the_reference() {
    for fixture in Fixture::all() {
        let name = &fixture.name;
        let mut driver = Driver {
            runtime: load(&fixture, 256, &REFERENCE),
            next_block: 0,
        };
        for prompt in &fixture.reference.prompts {
            // One token per step makes every position emit, through the paged cache.
            let mut seq = Sequence::new(&prompt.token_ids);
            while seq.computed < seq.tokens.len() {
                let upto = seq.computed + 1;
                let mut partial = Sequence {
                    tokens: seq.tokens[..upto].to_vec(),
                    ..seq.clone()
                };
                driver.step(&mut [&mut partial], 1);
                seq.computed = partial.computed;
                seq.blocks = partial.blocks;
                seq.emitted = partial.emitted;
            }
            let want = fixture.rows(&format!("{}.logits", prompt.name));
            assert_eq!(seq.emitted.len(), want.len());
            for (position, (got, want)) in seq.emitted.iter().zip(&want).enumerate() {
                let diff = max_abs_diff(got, want);
                assert!(
                    diff <= fixture.tolerance,
                    "{name} {} position {position}: max abs diff {diff}",
                    prompt.name
                );
            }
        }
    }
}

#[test]
fn greedy_continuations_match_the_reference() {
    for fixture in Fixture::all() {
        let name = &fixture.name;
        for (prompt, (generated, emitted)) in fixture.reference.prompts.iter().zip(greedy(&fixture))
        {
            assert_eq!(
                generated, prompt.generated_token_ids,
                "{name} {}",
                prompt.name
            );
            let want = fixture.rows(&format!("{}.generated_logits", prompt.name));
            assert_eq!(emitted.len(), want.len(), "{name} {}", prompt.name);
            for (k, (got, want)) in emitted.iter().zip(&want).enumerate() {
                let diff = max_abs_diff(got, want);
                assert!(
                    diff <= fixture.tolerance,
                    "{name} {} generated {k}: max abs diff {diff}",
                    prompt.name
                );
            }
        }
    }
}

/// Each prompt's greedy continuation and the logits of every generated step.
fn greedy(fixture: &Fixture) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut driver = Driver {
        runtime: load(fixture, 256, &REFERENCE),
        next_block: 0,
    };
    fixture
        .reference
        .prompts
        .iter()
        .map(|prompt| {
            let mut seq = Sequence::new(&prompt.token_ids);
            driver.generate(&mut [&mut seq], usize::MAX);
            (seq.tokens[prompt.token_ids.len()..].to_vec(), seq.emitted)
        })
        .collect()
}

/// The parity above holds because the theta the config states is the one computed with: the
/// fixtures' theta is also the architectures' default, so a reader that missed the field
/// would match the references just as well. With the field changed, in either style, the
/// output must move away from them.
#[test]
fn the_rope_theta_is_read_from_the_field_each_style_states_it_in() {
    type Edit = fn(&mut serde_json::Value);
    let edits: [(ConfigStyle, Edit); 2] = [
        (ConfigStyle::Transformers5, |c| {
            c["rope_parameters"]["rope_theta"] = serde_json::json!(1_000_000.0)
        }),
        (ConfigStyle::Transformers4, |c| {
            c["rope_theta"] = serde_json::json!(1_000_000.0)
        }),
    ];
    for (name, tolerance) in CHECKPOINTS {
        for (style, edit) in edits {
            let fixture = Fixture::edited(name, tolerance, style, edit);
            let mut moved = 0.0f32;
            let mut tokens_differ = false;
            for (prompt, (generated, emitted)) in
                fixture.reference.prompts.iter().zip(greedy(&fixture))
            {
                let want = fixture.rows(&format!("{}.generated_logits", prompt.name));
                moved = moved.max(max_abs_diff(&emitted[0], &want[0]));
                tokens_differ |= generated != prompt.generated_token_ids;
            }
            // Measured: the first generated logits move by whole units and continuations differ.
            assert!(
                moved > 0.1 && tokens_differ,
                "{}: theta 1e6 moved the logits by only {moved}",
                fixture.name
            );
        }
    }
}

/// The same for the rotary scalings: with the scaling dropped from either style (the default
/// rotary embedding, the same theta), the Llama 3 and YaRN fixtures move away from their
/// references, so their parity above rests on the scaled tables.
#[test]
fn the_rope_scaling_is_read_from_either_style() {
    type Edit = fn(&mut serde_json::Value);
    let edits: [(ConfigStyle, Edit); 2] = [
        (
            ConfigStyle::Transformers5,
            |c| {
                c["rope_parameters"] =
                    serde_json::json!({"rope_type": "default", "rope_theta": 10000.0})
            },
        ),
        (ConfigStyle::Transformers4, |c| {
            c["rope_scaling"] = serde_json::Value::Null
        }),
    ];
    for name in ["tiny-llama3", "tiny-qwen3-yarn"] {
        for (style, edit) in edits {
            let fixture = Fixture::edited(name, 1e-4, style, edit);
            let moved = last_logits_moved(&fixture);
            assert!(
                moved > 0.1,
                "{}: without the scaling the logits moved by only {moved}",
                fixture.name
            );
        }
    }
}

/// How far an edited fixture's last generated logits are from its references, at most over
/// its prompts.
fn last_logits_moved(fixture: &Fixture) -> f32 {
    fixture
        .reference
        .prompts
        .iter()
        .zip(greedy(fixture))
        .map(|(prompt, (_, emitted))| {
            let want = fixture.rows(&format!("{}.generated_logits", prompt.name));
            max_abs_diff(&emitted[NEW_TOKENS - 1], &want[NEW_TOKENS - 1])
        })
        .fold(0.0, f32::max)
}

/// The parity of tiny-mistral-swa holds because the window is applied: without it, in
/// either config style, the logits move away from the references.
#[test]
fn the_sliding_window_is_applied() {
    for style in STYLES {
        let fixture = Fixture::edited("tiny-mistral-swa", 1e-4, style, |c| {
            c["sliding_window"] = serde_json::Value::Null
        });
        let moved = last_logits_moved(&fixture);
        assert!(
            moved > 0.1,
            "{}: without the window the logits moved by only {moved}",
            fixture.name
        );
    }
}

/// Runs every prompt and returns each one's generated tokens and emitted logits.
fn run_way(fixture: &Fixture, way: &str, precision: &Precision) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let prompts = &fixture.reference.prompts;
    let mut driver = Driver {
        runtime: load(fixture, 512, precision),
        next_block: 0,
    };
    let mut seqs: Vec<Sequence> = prompts
        .iter()
        .map(|p| Sequence::new(&p.token_ids))
        .collect();
    match way {
        "one at a time" => seqs
            .iter_mut()
            .for_each(|s| driver.generate(&mut [s], usize::MAX)),
        "one batch" => driver.generate(&mut seqs.iter_mut().collect::<Vec<_>>(), usize::MAX),
        "chunks of 3" => driver.generate(&mut seqs.iter_mut().collect::<Vec<_>>(), 3),
        "cached prefix" => {
            let shared = &fixture.reference.shared_prefix;
            let first = prompts
                .iter()
                .position(|p| p.name == shared.prompts[0])
                .expect("first sharer");
            let second = prompts
                .iter()
                .position(|p| p.name == shared.prompts[1])
                .expect("second sharer");
            driver.generate(&mut [&mut seqs[first]], usize::MAX);
            // The second sharer starts with the first one's full blocks of the common prefix.
            let full_blocks = shared.num_tokens / BLOCK_SIZE as usize;
            let reused = seqs[first].blocks[..full_blocks].to_vec();
            let seq = &mut seqs[second];
            seq.blocks = reused;
            seq.computed = full_blocks * BLOCK_SIZE as usize;
            for (i, s) in seqs.iter_mut().enumerate() {
                if i != first {
                    driver.generate(&mut [s], usize::MAX);
                }
            }
        }
        other => panic!("unknown way {other}"),
    }
    seqs.into_iter()
        .zip(prompts)
        .map(|(s, p)| (s.tokens[p.token_ids.len()..].to_vec(), s.emitted))
        .collect()
}

#[test]
fn four_ways_of_running_agree() {
    for fixture in Fixture::all() {
        let name = &fixture.name;
        let baseline = run_way(&fixture, "one at a time", &REFERENCE);
        for (prompt, (tokens, _)) in fixture.reference.prompts.iter().zip(&baseline) {
            assert_eq!(
                tokens, &prompt.generated_token_ids,
                "{name} {}: one at a time",
                prompt.name
            );
        }
        assert_ways_agree(&fixture, &baseline, &REFERENCE);
    }
}

/// Every way of running gives `baseline`'s tokens, with logits within 1e-5.
fn assert_ways_agree(
    fixture: &Fixture,
    baseline: &[(Vec<u32>, Vec<Vec<f32>>)],
    precision: &Precision,
) {
    let name = &fixture.name;
    for way in ["one batch", "chunks of 3", "cached prefix"] {
        let other = run_way(fixture, way, precision);
        for ((prompt, (want_tokens, want_logits)), (tokens, logits)) in
            fixture.reference.prompts.iter().zip(baseline).zip(&other)
        {
            assert_eq!(tokens, want_tokens, "{name} {}: {way}", prompt.name);
            for (k, (got, want)) in logits.iter().zip(want_logits).enumerate() {
                let diff = max_abs_diff(got, want);
                assert!(
                    diff <= 1e-5,
                    "{name} {} {way} row {k}: max abs diff {diff}",
                    prompt.name
                );
            }
        }
    }
}

#[test]
fn bf16_serving_defaults_are_batch_invariant_and_close() {
    // The KV cache's dtype follows the config's `dtype` or `torch_dtype`, which for the GGUF
    // names the type all its matrices share: bf16 here, in every form.
    let folders = STYLES.map(|style| Fixture::open("tiny-qwen3-bf16", 2e-2, style));
    for fixture in folders
        .into_iter()
        .chain([Fixture::gguf("tiny-qwen3-bf16", 2e-2)])
    {
        assert_eq!(
            SERVING_DEFAULT
                .kv_cache_dtype
                .resolve(checkpoint_dtype(&fixture.model.0).as_deref()),
            DType::BF16,
            "{}",
            fixture.name
        );
        // Activations rounded to bf16 where the CPU multiplies in bf16, keys and values cached
        // in bf16.
        let baseline = run_way(&fixture, "one at a time", &SERVING_DEFAULT);
        assert_ways_agree(&fixture, &baseline, &SERVING_DEFAULT);
        // The rounding moves the first generated logits by a few hundredths here (measured
        // 0.03 with bf16 activations); a real error (a wrong row, a dropped block) moves them
        // by whole units.
        for (prompt, (_, logits)) in fixture.reference.prompts.iter().zip(&baseline) {
            let want = fixture.rows(&format!("{}.generated_logits", prompt.name));
            let diff = max_abs_diff(&logits[0], &want[0]);
            assert!(
                diff <= 0.1,
                "{} {}: max abs diff {diff}",
                fixture.name,
                prompt.name
            );
        }
    }
}

#[test]
fn loading_a_bad_checkpoint_names_the_problem() {
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, ConfigStyle, Edit, &str); 9] = [
        (
            "architecture",
            ConfigStyle::Transformers5,
            |c| c["architectures"] = serde_json::json!(["MixtralForCausalLM"]),
            "unsupported architecture MixtralForCausalLM",
        ),
        (
            "shape",
            ConfigStyle::Transformers5,
            |c| c["intermediate_size"] = serde_json::json!(96),
            "model.layers.0.mlp.gate_proj.weight",
        ),
        (
            "bias",
            ConfigStyle::Transformers5,
            |c| c["attention_bias"] = serde_json::json!(true),
            "attention_bias",
        ),
        (
            "llama3 rope without its ramp",
            ConfigStyle::Transformers5,
            |c| {
                c["rope_parameters"] = serde_json::json!({
                    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0,
                    "low_freq_factor": 1.0, "original_max_position_embeddings": 8192
                })
            },
            r#"rope_parameters.high_freq_factor is required for rotary type "llama3""#,
        ),
        (
            "linear rope",
            ConfigStyle::Transformers4,
            |c| c["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 4.0}),
            r#"rope_scaling.type "linear" is not supported"#,
        ),
        (
            "qwen2 without biases",
            ConfigStyle::Transformers5,
            |c| c["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]),
            "model.layers.0.self_attn.q_proj.bias",
        ),
        (
            "two thetas",
            ConfigStyle::Transformers5,
            |c| c["rope_theta"] = serde_json::json!(1_000_000.0),
            "rope_theta = 1000000 and rope_parameters.rope_theta = 10000 disagree",
        ),
        (
            "a layer type without a kernel",
            ConfigStyle::Transformers5,
            |c| c["layer_types"] = serde_json::json!(["full_attention", "chunked_attention"]),
            r#"layer_types[1] is "chunked_attention""#,
        ),
        (
            "sliding layers without a window",
            ConfigStyle::Transformers4,
            |c| {
                c["layer_types"] = serde_json::json!(["full_attention", "sliding_attention"]);
                c["sliding_window"] = serde_json::Value::Null;
            },
            "layer_types[1] is sliding_attention, but no sliding_window applies",
        ),
    ];
    let plugins = PluginRuntime::new(RuntimeOptions {
        cache_dir: Some(std::env::temp_dir().join("plughost-test-component-cache")),
    })
    .expect("plugin runtime");
    let library = DeviceLibrary::load(common::plugin_path("libplughost_device_cpu.so"))
        .expect("cpu device loads");
    for (case, style, edit, message) in cases {
        let dir = ModelDir::new("tiny-qwen3", style, edit);
        let mut glue = GluePlugin::load(
            &plugins,
            &common::plugin_path("plughost_model_qwen3.wasm"),
            "",
            InstanceLimits::for_prepare(),
        )
        .expect("glue loads");
        let device = Device::open(&library, "").expect("device opens");
        let config = RuntimeConfig {
            max_num_seqs: 2,
            max_num_batched_tokens: 16,
            block_size: BLOCK_SIZE,
            num_kv_blocks: 8,
            max_model_len: 32,
            kv_cache_dtype: DType::F32,
        };
        let error = match load_model(device, &mut glue, &dir.0, config) {
            Ok(_) => panic!("{case}: a bad checkpoint loaded"),
            Err(e) => e.to_string(),
        };
        assert!(error.contains(message), "{case}: {error}");
    }
}
