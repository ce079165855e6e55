//! `--quantize q8_0|q4_k`: safetensors weights quantized at load run on the CPU device's block-quantized kernels, hold less device memory, and stay close to the unquantized model.
//!
//! The bounds are the formats' own error, measured against the same model unquantized on the
//! same path, with a margin: Q8_0 weights dequantized to f32 and run on the f32 kernels
//! give the same cosines to four digits, so the loss is the quantization's, not the kernels'.
//! Measured on AMD Zen 4, worst position: tiny-llama (random weights, which amplify weight
//! noise) Q8_0 0.9908; SmolLM2 Q8_0 0.99857, Q4_K 0.9899 (its down projections; rows of 576
//! fall back to Q8_0).

use std::path::Path;

use plughost::device::DType;
use plughost::model::{Checkpoint, WeightQuantization};
use plughost::runtime::{Runtime, RuntimeConfig, StepSequence, load_with_recipe};

use crate::common;

const BLOCK_SIZE: u32 = 16;
const BLOCKS: u32 = 4;

fn load(model_dir: &Path, quantize: Option<WeightQuantization>) -> Runtime {
    let (device, mut glue) = common::device_and_glue("libplughost_device_cpu.so", "");
    let checkpoint = Checkpoint::open(model_dir).expect("the model opens");
    let info = glue
        .describe(checkpoint.config_json())
        .expect("the glue describes it");
    let config = RuntimeConfig {
        max_num_seqs: 1,
        max_num_batched_tokens: 64,
        block_size: BLOCK_SIZE,
        num_kv_blocks: BLOCKS,
        max_model_len: BLOCK_SIZE * BLOCKS,
        kv_cache_dtype: DType::F32,
    };
    let (runtime, _) = load_with_recipe(device, &mut glue, info, model_dir, config, quantize)
        .expect("the model loads");
    runtime
}

/// The logits after each token of `tokens`, fed one token a step.
fn logits_per_position(runtime: &mut Runtime, tokens: &[u32]) -> Vec<Vec<f32>> {
    let table: Vec<u32> = (0..BLOCKS).collect();
    (0..tokens.len())
        .map(|i| {
            let step = [StepSequence {
                id: 1,
                tokens: &tokens[i..=i],
                computed_len: i as u32,
                block_table: &table,
                emit: true,
            }];
            let mut logits = Vec::new();
            runtime.execute(&step, &mut logits).expect("the step runs");
            logits
        })
        .collect()
}

/// The smallest cosine over positions between `model_dir` quantized to `target` and not, and
/// the device bytes each holds.
fn compare(model_dir: &Path, target: WeightQuantization, tokens: &[u32]) -> (f64, u64, u64) {
    let mut plain = load(model_dir, None);
    let mut quantized = load(model_dir, Some(target));
    let plain_bytes = plain.device().stats().expect("stats").live_bytes;
    let quantized_bytes = quantized.device().stats().expect("stats").live_bytes;
    let expected = logits_per_position(&mut plain, tokens);
    let got = logits_per_position(&mut quantized, tokens);
    let worst = expected
        .iter()
        .zip(&got)
        .map(|(a, b)| common::cosine(a, b))
        .fold(1.0f64, f64::min);
    (worst, plain_bytes, quantized_bytes)
}

#[test]
fn q8_0_at_load_shrinks_the_tiny_model_and_keeps_its_logits() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-llama");
    let tokens: Vec<u32> = (1..=24).map(|i| (i * 37) % 250).collect();
    let (worst, plain, quantized) = compare(&dir, WeightQuantization::Q8_0, &tokens);
    eprintln!("tiny-llama q8_0: worst cosine {worst}, {plain} -> {quantized} device bytes");
    assert!(worst >= 0.98, "worst cosine {worst}");
    assert!(
        quantized < plain,
        "{quantized} bytes quantized, {plain} plain"
    );
}

#[test]
fn smollm2_at_q8_0_and_q4_k_stays_close_to_f32() {
    let dir = common::smollm2::model_dir();
    let tokens: Vec<u32> = vec![
        504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 6120, 314,
    ];
    for (target, bound) in [
        (WeightQuantization::Q8_0, 0.995),
        (WeightQuantization::Q4K, 0.97),
    ] {
        let (worst, plain, quantized) = compare(&dir, target, &tokens);
        eprintln!(
            "SmolLM2 {}: worst cosine {worst}, {plain} -> {quantized} device bytes",
            target.name()
        );
        assert!(worst >= bound, "{}: worst cosine {worst}", target.name());
        assert!(quantized < plain, "{}", target.name());
    }
}
