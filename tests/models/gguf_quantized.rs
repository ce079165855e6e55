//! A GGUF whose weights mix Q8_0, Q4_0, Q4_1, Q4_K and Q6_K, served from the file on the CPU device, against `transformers` on the same weights dequantized by the `gguf` package.
//!
//! The fixture and its references come from `tests/reference/make_gguf_fixture.py`. On the
//! portable path and on AVX2 (where the CPU has it): the logits at every position have a
//! cosine similarity of at least 0.999 with the reference's; the greedy tokens are the
//! reference's, or the first divergence is a near-tie of the reference (top-2 margin under
//! 1e-2), reported; and a sequence gives the same bits alone, in a batch and prefilled in
//! chunks. (The quantized dot products give the same bits on both paths, see the CPU device's
//! `linear::quant` tests; the model's other kernels differ between paths in rounding.)

use std::path::{Path, PathBuf};

use plughost::device::DType;
use plughost::model::gguf::folder;
use plughost::runtime::{Runtime, RuntimeConfig, StepSequence, load_model};
use plughost_device_abi::elements::decode_float;
use serde::Deserialize;

use crate::common;

const BLOCK_SIZE: u32 = 4;
/// Blocks each sequence may hold: 64 tokens.
const BLOCKS_PER_SEQUENCE: u32 = 16;

#[derive(Deserialize)]
struct Reference {
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    name: String,
    prompt_len: usize,
    /// The prompt, then the tokens `transformers` generated greedily.
    token_ids: Vec<u32>,
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-llama-gguf")
}

/// `transformers`' logits rows at every position of `name`.
fn reference_rows(name: &str, vocab: usize) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(fixture().join("reference.safetensors")).expect("reference");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("reference parses");
    let view = file.tensor(name).expect("reference tensor");
    let values = decode_float(DType::F16, view.data()).expect("f16 logits");
    values.chunks(vocab).map(<[f32]>::to_vec).collect()
}

/// The fixture's GGUF on the CPU device at `isa`.
fn load(isa: &str) -> Runtime {
    let cache = std::env::temp_dir().join(format!("plughost-gguf-test-{}", std::process::id()));
    let dir = folder::prepare(&fixture().join("mixed.gguf"), &cache).expect("model folder");
    let (device, mut glue) =
        common::device_and_glue("libplughost_device_cpu.so", &format!("isa={isa}"));
    let config = RuntimeConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 256,
        block_size: BLOCK_SIZE,
        num_kv_blocks: 4 * BLOCKS_PER_SEQUENCE,
        max_model_len: BLOCK_SIZE * BLOCKS_PER_SEQUENCE,
        kv_cache_dtype: DType::F32,
    };
    let runtime = load_model(device, &mut glue, &dir, config).expect("the GGUF loads");
    let _ = std::fs::remove_dir_all(&cache);
    runtime
}

/// Runs `sequences` (sequence `i` on KV blocks of slot `i`) `chunk` tokens a step, all of them
/// in each step; the logits row of every step's last token, per sequence.
fn run(runtime: &mut Runtime, sequences: &[(usize, &[u32])], chunk: usize) -> Vec<Vec<Vec<f32>>> {
    let vocab = runtime.model_info().vocab_size as usize;
    let tables: Vec<Vec<u32>> = sequences
        .iter()
        .map(|&(slot, _)| {
            let first = slot as u32 * BLOCKS_PER_SEQUENCE;
            (first..first + BLOCKS_PER_SEQUENCE).collect()
        })
        .collect();
    let mut rows = vec![Vec::new(); sequences.len()];
    let mut done = 0;
    let longest = sequences.iter().map(|(_, t)| t.len()).max().unwrap_or(0);
    while done < longest {
        let end = (done + chunk).min(longest);
        let batch: Vec<StepSequence<'_>> = sequences
            .iter()
            .zip(&tables)
            .filter(|((_, tokens), _)| tokens.len() > done)
            .map(|((slot, tokens), table)| StepSequence {
                id: *slot as u64 + 1,
                tokens: &tokens[done..end.min(tokens.len())],
                computed_len: done as u32,
                block_table: table,
                emit: true,
            })
            .collect();
        let emitting: Vec<usize> = sequences
            .iter()
            .enumerate()
            .filter(|(_, (_, tokens))| tokens.len() > done)
            .map(|(i, _)| i)
            .collect();
        let mut logits = Vec::new();
        runtime.execute(&batch, &mut logits).expect("step runs");
        for (i, row) in emitting.iter().zip(logits.chunks(vocab)) {
            rows[*i].push(row.to_vec());
        }
        done = end;
    }
    rows
}

/// The index of the largest value (the first of equals).
fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best })
}

fn bits(rows: &[Vec<f32>]) -> Vec<u32> {
    rows.iter().flatten().map(|v| v.to_bits()).collect()
}

/// The CPU device's paths this machine has: portable, and AVX2 where present.
fn paths() -> Vec<&'static str> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        return vec!["portable", "avx2"];
    }
    vec!["portable"]
}

#[test]
fn mixed_block_types_match_transformers_on_the_dequantized_weights() {
    let text = std::fs::read_to_string(fixture().join("reference.json")).expect("reference.json");
    let reference: Reference = serde_json::from_str(&text).expect("reference.json parses");
    for isa in paths() {
        let mut runtime = load(isa);
        let vocab = runtime.model_info().vocab_size as usize;
        let mut alone = Vec::new();
        let mut lowest = f64::INFINITY;
        for (slot, prompt) in reference.prompts.iter().enumerate() {
            let tokens = &prompt.token_ids;
            let rows = run(&mut runtime, &[(slot, tokens)], 1).remove(0);
            let expected = reference_rows(&prompt.name, vocab);
            assert_eq!(rows.len(), expected.len(), "{} at {isa}", prompt.name);
            for (position, (ours, theirs)) in rows.iter().zip(&expected).enumerate() {
                let similarity = common::cosine(ours, theirs);
                lowest = lowest.min(similarity);
                assert!(
                    similarity >= 0.999,
                    "{} at {isa}: cosine {similarity} at position {position}",
                    prompt.name
                );
            }
            // Greedy tokens: row `p` predicts token `p + 1`, the one `transformers` chose.
            for position in prompt.prompt_len - 1..tokens.len() - 1 {
                let ours = argmax(&rows[position]);
                let theirs = tokens[position + 1] as usize;
                if ours != theirs {
                    // How far the reference preferred its token over ours (f16-rounded logits
                    // can put that at or below zero: a tie).
                    let margin = expected[position][theirs] - expected[position][ours];
                    assert!(
                        margin < 1e-2,
                        "{} at {isa}: token {ours} instead of {theirs} at position {position}, \
                         where the reference's margin is {margin}",
                        prompt.name
                    );
                    eprintln!(
                        "{} at {isa}: first divergence at position {position}, a near-tie \
                         (reference margin {margin})",
                        prompt.name
                    );
                    break;
                }
            }
            alone.push(rows);
        }
        eprintln!(
            "{isa}: 1 - the lowest cosine similarity with the reference: {:.1e}",
            1.0 - lowest
        );
        // The three together, one token of each per step: the same bits as alone.
        let together: Vec<(usize, &[u32])> = reference
            .prompts
            .iter()
            .enumerate()
            .map(|(slot, p)| (slot, p.token_ids.as_slice()))
            .collect();
        let batched = run(&mut runtime, &together, 1);
        for ((prompt, alone), batched) in reference.prompts.iter().zip(&alone).zip(&batched) {
            assert_eq!(
                bits(alone),
                bits(batched),
                "{} in a batch at {isa}",
                prompt.name
            );
        }
        // Prefilled in chunks of 5: every chunk's last row is that position's row alone.
        let chunked = run(&mut runtime, &together, 5);
        for ((prompt, alone), chunked) in reference.prompts.iter().zip(&alone).zip(&chunked) {
            for (step, row) in chunked.iter().enumerate() {
                let position = (5 * step + 4).min(prompt.token_ids.len() - 1);
                assert_eq!(
                    bits(std::slice::from_ref(row)),
                    bits(&alone[position..=position]),
                    "{} chunked at {isa}, position {position}",
                    prompt.name
                );
            }
        }
    }
}
