//! The kernels against Hugging Face `transformers`: the tiny Qwen3 (f32 and bf16 weights) and Llama fixtures run chunked prefills and decodes through a paged cache, and every logit row is compared with the reference.
//!
//! The fixtures live in `tests/fixtures/` at the workspace root (see `tests/reference/README.md`);
//! their logits come from HF eager attention in float32 (the bf16 checkpoint upcast to f32).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use plughost_device_abi::export::FloatSlice;
use serde_json::Value;

use crate::attention::{self, AttentionShape, KvCache, StepLayout};
use crate::isa::Isa;
use crate::linear::{self, Bf16Products, LinearShape};
use crate::workers::Workers;
use crate::{elementwise, gather, kv_cache, norm, rotary, step_inputs};

/// The acceptance bound: `|ours - hf| <= 1e-4 * max(1, |hf|)`.
const TOLERANCE: f64 = 1e-4;
const BLOCK_SIZE: usize = 4;
const NUM_BLOCKS: usize = 64;
/// Generated tokens fed back one decode step at a time after each prompt.
const NUM_DECODES: usize = 8;
/// Prompt tokens each sequence computes per step, different per sequence so prefill chunks,
/// continuations and decodes of different sequences share steps.
const CHUNK_SIZES: [usize; 4] = [4, 9, 11, 16];

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// One tensor of a safetensors file, decoded.
enum Stored {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

struct Safetensors {
    tensors: HashMap<String, Stored>,
}

impl Safetensors {
    fn load(path: &Path) -> Safetensors {
        let bytes = fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
        let data = &bytes[8 + header_len..];
        let mut tensors = HashMap::new();
        for (name, info) in header.as_object().unwrap() {
            if name == "__metadata__" {
                continue;
            }
            let offsets = &info["data_offsets"];
            let (start, end) = (
                offsets[0].as_u64().unwrap() as usize,
                offsets[1].as_u64().unwrap() as usize,
            );
            let raw = &data[start..end];
            let stored = match info["dtype"].as_str().unwrap() {
                "F32" => Stored::F32(
                    raw.chunks_exact(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                        .collect(),
                ),
                "BF16" => Stored::Bf16(
                    raw.chunks_exact(2)
                        .map(|b| u16::from_le_bytes(b.try_into().unwrap()))
                        .collect(),
                ),
                other => panic!("{name}: dtype {other}"),
            };
            tensors.insert(name.clone(), stored);
        }
        Safetensors { tensors }
    }

    fn float(&self, name: &str) -> FloatSlice<'_> {
        match self.tensors.get(name) {
            Some(Stored::F32(values)) => FloatSlice::F32(values),
            Some(Stored::Bf16(bits)) => FloatSlice::BF16(bits),
            None => panic!("no tensor {name}"),
        }
    }

    fn f32s(&self, name: &str) -> &[f32] {
        match self.float(name) {
            FloatSlice::F32(values) => values,
            _ => panic!("{name} is not f32"),
        }
    }
}

#[derive(Clone)]
struct Config {
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    vocab: usize,
    eps: f32,
    theta: f32,
    /// Qwen3 normalizes each q and k head before rotary.
    qk_norm: bool,
    lm_head: &'static str,
}

impl Config {
    fn load(dir: &Path) -> Config {
        let text = fs::read_to_string(dir.join("config.json")).unwrap();
        let json: Value = serde_json::from_str(&text).unwrap();
        let size = |key: &str| json[key].as_u64().unwrap() as usize;
        let tied = json["tie_word_embeddings"].as_bool().unwrap();
        Config {
            hidden: size("hidden_size"),
            layers: size("num_hidden_layers"),
            heads: size("num_attention_heads"),
            kv_heads: size("num_key_value_heads"),
            head_dim: size("head_dim"),
            intermediate: size("intermediate_size"),
            vocab: size("vocab_size"),
            eps: json["rms_norm_eps"].as_f64().unwrap() as f32,
            // config.json in transformers 5's form: the theta under `rope_parameters`.
            theta: json["rope_parameters"]["rope_theta"].as_f64().unwrap() as f32,
            qk_norm: json["model_type"] == "qwen3",
            lm_head: if tied {
                "model.embed_tokens.weight"
            } else {
                "lm_head.weight"
            },
        }
    }
}

/// A sequence of the test: the tokens to feed, how many are computed, and its KV blocks.
struct Sequence {
    tokens: Vec<i32>,
    /// Reference logits for each fed token (prompt rows, then generated rows 1..).
    expected: Vec<Vec<f32>>,
    prompt_len: usize,
    chunk_size: usize,
    computed: usize,
    blocks: Vec<i32>,
}

impl Sequence {
    /// Tokens this step: a prefill chunk, or one token once the prompt is done.
    fn next_len(&self) -> usize {
        let left = self.tokens.len() - self.computed;
        if self.computed < self.prompt_len {
            left.min(self.chunk_size)
                .min(self.prompt_len - self.computed)
        } else {
            left.min(1)
        }
    }
}

/// The model and its paged caches, running one flattened step at a time.
struct Engine {
    config: Config,
    weights: Safetensors,
    key_caches: Vec<Vec<f32>>,
    value_caches: Vec<Vec<f32>>,
    /// Blocks handed out in a scattered order, so tables are never contiguous.
    free_blocks: Vec<i32>,
    workers: Workers,
    /// The level every kernel runs at.
    isa: Isa,
}

/// The inputs of one step, as the device-maintained step inputs derive them.
struct Step {
    ids: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i32>,
    block_table: Vec<i32>,
    blocks_per_seq: usize,
    seq_lens: Vec<i32>,
    query_start: Vec<i32>,
}

impl Engine {
    fn new(dir: &Path, isa: Isa, threads: usize) -> Engine {
        let config = Config::load(dir);
        let cache_len = NUM_BLOCKS * BLOCK_SIZE * config.kv_heads * config.head_dim;
        Engine {
            key_caches: vec![vec![f32::NAN; cache_len]; config.layers],
            value_caches: vec![vec![f32::NAN; cache_len]; config.layers],
            free_blocks: (0..NUM_BLOCKS as i32)
                .map(|i| (i * 37) % NUM_BLOCKS as i32)
                .collect(),
            weights: Safetensors::load(&dir.join("model.safetensors")),
            workers: Workers::new(threads).unwrap(),
            isa,
            config,
        }
    }

    fn prepare(&mut self, sequences: &mut [Sequence], lens: &[usize]) -> Step {
        let mut step = Step {
            ids: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            block_table: Vec::new(),
            blocks_per_seq: 0,
            seq_lens: Vec::new(),
            query_start: vec![0],
        };
        for (sequence, &len) in sequences.iter_mut().zip(lens) {
            let needed = (sequence.computed + len).div_ceil(BLOCK_SIZE);
            while sequence.blocks.len() < needed {
                sequence
                    .blocks
                    .push(self.free_blocks.pop().expect("enough blocks"));
            }
            step.ids
                .extend_from_slice(&sequence.tokens[sequence.computed..][..len]);
            step.seq_lens.push(sequence.computed as i32);
            step.query_start.push(step.ids.len() as i32);
            step.blocks_per_seq = step.blocks_per_seq.max(sequence.blocks.len());
        }
        for sequence in sequences.iter() {
            let mut row = sequence.blocks.clone();
            row.resize(step.blocks_per_seq, -1);
            step.block_table.extend(row);
        }
        let num_tokens = step.ids.len();
        step_inputs::advance_seq_lens(&mut step.seq_lens, &step.query_start).unwrap();
        step.positions = vec![0; num_tokens];
        step_inputs::derive_positions(&step.seq_lens, &step.query_start, &mut step.positions)
            .unwrap();
        step.slots = vec![0; num_tokens];
        step_inputs::derive_slot_mapping(
            (&step.block_table, step.blocks_per_seq),
            &step.seq_lens,
            &step.query_start,
            BLOCK_SIZE,
            &mut step.slots,
        )
        .unwrap();
        step
    }

    fn widened(&self, name: &str) -> Vec<f32> {
        let src = self.weights.float(name);
        let mut out = vec![0.0; src.len()];
        crate::widen::widen_into(src, 0, &mut out);
        out
    }

    /// One step's logits, `[T, V]`.
    fn forward(&mut self, step: &Step) -> Vec<f32> {
        let c = self.config.clone();
        let (tokens, hidden) = (step.ids.len(), c.hidden);
        let mut x = vec![f32::NAN; tokens * hidden];
        let embedding = self.weights.float("model.embed_tokens.weight");
        gather::gather(embedding, hidden, &step.ids, &mut x, ("ids", &self.workers)).unwrap();
        let mut normed = vec![f32::NAN; tokens * hidden];
        for layer in 0..c.layers {
            let name = |suffix: &str| format!("model.layers.{layer}.{suffix}");
            let weight = self.widened(&name("input_layernorm.weight"));
            norm::rms_norm(self.isa, &x, &weight, c.eps, &mut normed, &self.workers);
            let attention = self.attention(layer, &normed, step);
            elementwise::add(&mut x, &attention, &self.workers);

            let weight = self.widened(&name("post_attention_layernorm.weight"));
            norm::rms_norm(self.isa, &x, &weight, c.eps, &mut normed, &self.workers);
            let gate = self.linear(&normed, hidden, &name("mlp.gate_proj.weight"));
            let up = self.linear(&normed, hidden, &name("mlp.up_proj.weight"));
            let mut activation = vec![f32::NAN; gate.len()];
            elementwise::silu_mul(self.isa, &gate, &up, &mut activation, &self.workers);
            let down = self.linear(&activation, c.intermediate, &name("mlp.down_proj.weight"));
            elementwise::add(&mut x, &down, &self.workers);
        }
        let weight = self.widened("model.norm.weight");
        norm::rms_norm(self.isa, &x, &weight, c.eps, &mut normed, &self.workers);
        self.linear(&normed, hidden, self.config.lm_head)
    }

    /// `x · wᵀ` for `x` with rows `inner` wide.
    fn linear(&self, x: &[f32], inner: usize, weight: &str) -> Vec<f32> {
        let tokens = x.len() / inner;
        let outputs = self.weights.float(weight).len() / inner;
        let mut out = vec![f32::NAN; tokens * outputs];
        let shape = LinearShape {
            tokens,
            inner,
            outputs,
        };
        // f32 products: the reference multiplies the bf16 fixture's weights with f32
        // activations, and the tolerance here is tight.
        linear::linear(
            (x, self.weights.float(weight)),
            &mut out,
            shape,
            (self.isa, Bf16Products::F32),
            &self.workers,
        );
        out
    }

    fn attention(&mut self, layer: usize, normed: &[f32], step: &Step) -> Vec<f32> {
        let c = self.config.clone();
        let name = |suffix: &str| format!("model.layers.{layer}.self_attn.{suffix}");
        let q_width = c.heads * c.head_dim;
        let mut q = self.linear(normed, c.hidden, &name("q_proj.weight"));
        let mut k = self.linear(normed, c.hidden, &name("k_proj.weight"));
        let v = self.linear(normed, c.hidden, &name("v_proj.weight"));
        if c.qk_norm {
            let q_norm = self.widened(&name("q_norm.weight"));
            norm::rms_norm_in_place(self.isa, &mut q, &q_norm, c.eps, &self.workers);
            let k_norm = self.widened(&name("k_norm.weight"));
            norm::rms_norm_in_place(self.isa, &mut k, &k_norm, c.eps, &self.workers);
        }
        let inv_freq = crate::test_support::inverse_frequencies(c.head_dim, c.theta);
        rotary::rotate_rows(&mut q, &step.positions, &inv_freq, &self.workers);
        rotary::rotate_rows(&mut k, &step.positions, &inv_freq, &self.workers);
        let rows = kv_cache::KvRows {
            keys: &k,
            values: &v,
        };
        let shape = AttentionShape {
            num_heads: c.heads,
            num_kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            block_size: BLOCK_SIZE,
            num_blocks: NUM_BLOCKS,
            blocks_per_seq: step.blocks_per_seq,
        };
        let caches = (
            &mut self.key_caches[layer][..],
            &mut self.value_caches[layer][..],
        );
        let cache_layout = shape.cache_layout();
        // f32 caches: kept in rows at every level.
        let order = kv_cache::arranged(self.isa, Bf16Products::F32, false, &cache_layout);
        kv_cache::kv_write(rows, caches, &step.slots, (cache_layout, order)).unwrap();

        let layout = StepLayout {
            block_table: &step.block_table,
            seq_lens: &step.seq_lens,
            query_start: &step.query_start,
        };
        let cache = KvCache {
            keys: &self.key_caches[layer],
            values: &self.value_caches[layer],
        };
        // HF: `head_dim ** -0.5`, applied as an f32 scalar.
        let scale = (c.head_dim as f64).powf(-0.5) as f32;
        let mut out = vec![f32::NAN; q.len()];
        let params = (shape, scale, usize::MAX);
        attention::paged_attention(
            (self.isa, Bf16Products::F32),
            &q,
            &cache,
            &layout,
            &mut out,
            params,
            &self.workers,
        )
        .unwrap();
        self.linear(&out, q_width, &name("o_proj.weight"))
    }
}

fn sequences(dir: &Path) -> Vec<Sequence> {
    let reference: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let logits = Safetensors::load(&dir.join("reference.safetensors"));
    let vocab = reference["vocab_size"].as_u64().unwrap() as usize;
    let ids = |value: &Value| -> Vec<i32> {
        value
            .as_array()
            .unwrap()
            .iter()
            .map(|id| id.as_i64().unwrap() as i32)
            .collect()
    };
    let prompts = reference["prompts"].as_array().unwrap();
    prompts
        .iter()
        .zip(CHUNK_SIZES)
        .map(|(prompt, chunk_size)| {
            let name = prompt["name"].as_str().unwrap();
            let mut tokens = ids(&prompt["token_ids"]);
            let prompt_len = tokens.len();
            tokens.extend(&ids(&prompt["generated_token_ids"])[..NUM_DECODES]);
            let rows = |tensor: String| -> Vec<Vec<f32>> {
                logits
                    .f32s(&tensor)
                    .chunks_exact(vocab)
                    .map(<[f32]>::to_vec)
                    .collect()
            };
            let mut expected = rows(format!("{name}.logits"));
            // Feeding generated token k produces the logits of generated token k + 1.
            expected.extend(
                rows(format!("{name}.generated_logits"))
                    .into_iter()
                    .skip(1)
                    .take(NUM_DECODES),
            );
            Sequence {
                tokens,
                expected,
                prompt_len,
                chunk_size,
                computed: 0,
                blocks: Vec::new(),
            }
        })
        .collect()
}

/// Runs every sequence to the end and returns the largest scaled difference from HF.
fn run_fixture(name: &str, isa: Isa, threads: usize) -> f64 {
    let dir = fixture_dir(name);
    let mut engine = Engine::new(&dir, isa, threads);
    let mut sequences = sequences(&dir);
    let vocab = engine.config.vocab;
    let mut worst = 0.0f64;
    let mut num_mixed_steps = 0;
    loop {
        let lens: Vec<usize> = sequences.iter().map(Sequence::next_len).collect();
        if lens.iter().all(|&len| len == 0) {
            break;
        }
        let decodes = sequences
            .iter()
            .zip(&lens)
            .filter(|(s, l)| **l == 1 && s.computed >= s.prompt_len)
            .count();
        if decodes > 0 && lens.iter().any(|&len| len > 1) {
            num_mixed_steps += 1;
        }
        let step = engine.prepare(&mut sequences, &lens);
        let logits = engine.forward(&step);
        let mut rows = logits.chunks_exact(vocab);
        for (seq, (sequence, &len)) in sequences.iter_mut().zip(&lens).enumerate() {
            for index in sequence.computed..sequence.computed + len {
                let row = rows.next().unwrap();
                for (token, (&got, &want)) in row.iter().zip(&sequence.expected[index]).enumerate()
                {
                    let difference =
                        (f64::from(got) - f64::from(want)).abs() / f64::from(want).abs().max(1.0);
                    assert!(
                        difference <= TOLERANCE,
                        "{name}, {isa:?}, {threads} threads: sequence {seq}, token {index}, logit {token}: {got} vs HF {want}"
                    );
                    worst = worst.max(difference);
                }
            }
            sequence.computed += len;
        }
    }
    assert!(
        num_mixed_steps > 0,
        "the schedule mixes prefill chunks and decodes"
    );
    worst
}

#[test]
fn logits_match_hugging_face() {
    for name in ["tiny-qwen3", "tiny-qwen3-bf16", "tiny-llama"] {
        for (isa, threads) in Isa::every().into_iter().flat_map(|i| [(i, 1), (i, 2)]) {
            let worst = run_fixture(name, isa, threads);
            println!("{name}, {isa:?}, {threads} threads: largest difference from HF {worst:.2e}");
        }
    }
}
