//! SmolLM2-135M-Instruct end to end on the CPU device, converted and as the Q4_1 GGUF it ships as: greedy continuations and log-probabilities against `transformers`, and a chat answer over HTTP.

use std::sync::Arc;

use plughost::api::ApiConfig;
use plughost::engine::{
    EngineHandle, EngineOptions, EngineSetup, GenerationEvent, GenerationRequest, StopConditions,
};
use plughost::metrics::Metrics;
use plughost::plugins::PluginSpec;
use plughost_sdk::sampler::SamplingParams;
use serde_json::json;

use crate::common::{self, api, smollm2};

fn plugin(file: &str) -> PluginSpec {
    PluginSpec {
        component: common::plugin_path(file),
        config: Default::default(),
        memory_mib: None,
        call_timeout_ms: None,
        failure: Default::default(),
    }
}

fn start_engine() -> Arc<EngineHandle> {
    start_engine_at(smollm2::model_dir())
}

fn start_engine_at(model_dir: std::path::PathBuf) -> Arc<EngineHandle> {
    let setup = EngineSetup {
        model_dir,
        model_name: "smollm2-135m-instruct".into(),
        device_library: common::plugin_path("libplughost_device_cpu.so"),
        // The device's defaults: the highest level this CPU has. The weights are f32, so bf16
        // products never apply, and the 1e-3 bound on log-probabilities holds at every level.
        device_config: String::new(),
        glue: plugin("plughost_model_qwen3.wasm"),
        scheduler: Some(plugin("plughost_scheduler_fcfs.wasm")),
        sampler: Some(plugin("plughost_sampler_standard.wasm")),
        named_samplers: Default::default(),
        component_cache: Some(std::env::temp_dir().join("plughost-test-component-cache")),
        options: EngineOptions {
            max_num_seqs: 4,
            max_num_batched_tokens: 512,
            max_model_len: Some(1024),
            ..Default::default()
        },
        profile_output: None,
    };
    let engine =
        Arc::new(EngineHandle::start(setup, Arc::new(Metrics::new())).expect("engine starts"));
    engine.wait_ready().expect("SmolLM2 loads");
    engine
}

/// Reference `[16, 50]` top logits and `[16]` log-sum-exp of a prompt: per position, the
/// top-1 token's logprob and its margin over the second.
fn reference_top1(name: &str) -> Vec<(f32, f32)> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/smollm2/reference.safetensors");
    let bytes = std::fs::read(path).expect("reference.safetensors");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("parses");
    let floats = |tensor: &str| -> Vec<f32> {
        let view = file.tensor(tensor).expect("reference tensor");
        view.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let top = floats(&format!("{name}.top_logits"));
    let lse = floats(&format!("{name}.logsumexp"));
    lse.iter()
        .enumerate()
        .map(|(row, l)| (top[row * 50] - l, top[row * 50] - top[row * 50 + 1]))
        .collect()
}

/// Runs every reference prompt greedily on `engine`: each logprob within `tolerance` of the
/// reference's, and the reference's tokens, except that with `near_ties` the first divergence
/// may fall where the reference's top-2 margin is under 1e-2 (reported; nothing after it is
/// compared).
fn check_greedy_against_transformers(engine: &EngineHandle, tolerance: f32, near_ties: bool) {
    for case in smollm2::reference().generation {
        let request = GenerationRequest {
            stop: StopConditions {
                ignore_eos: true,
                ..Default::default()
            },
            logprobs: true,
            ..GenerationRequest::new(
                case.token_ids.clone(),
                SamplingParams::GREEDY,
                case.generated_token_ids.len() as u32,
            )
        };
        let (_, mut events) = engine.submit(request).expect("submitted");
        let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
        while let Some(event) = events.blocking_recv() {
            match event {
                GenerationEvent::Delta {
                    token_ids,
                    logprobs: lp,
                    ..
                } => {
                    tokens.extend(token_ids);
                    logprobs.extend(lp.into_iter().map(|l| l.logprob));
                }
                GenerationEvent::Finished { .. } => break,
                GenerationEvent::Failed { message } | GenerationEvent::Unavailable { message } => {
                    panic!("{}: {message}", case.name)
                }
                GenerationEvent::Rejected(r) => panic!("{}: {r}", case.name),
            }
        }
        let want = reference_top1(&case.name);
        let same = tokens
            .iter()
            .zip(&case.generated_token_ids)
            .take_while(|(a, b)| a == b)
            .count();
        if same < case.generated_token_ids.len() {
            let margin = want[same].1;
            assert!(
                near_ties && margin < 1e-2,
                "{}: greedy continuation {tokens:?} leaves the reference's {:?} at position \
                 {same}, where its top-2 margin is {margin}",
                case.name,
                case.generated_token_ids
            );
            eprintln!(
                "{}: first divergence at position {same}, a near-tie (margin {margin})",
                case.name
            );
        }
        for (k, (got, (want, _))) in logprobs.iter().zip(&want).take(same + 1).enumerate() {
            assert!(
                (got - want).abs() <= tolerance,
                "{} position {k}: logprob {got} vs {want}",
                case.name
            );
        }
    }
}

#[test]
fn greedy_continuations_and_logprobs_match_transformers() {
    let engine = start_engine();
    check_greedy_against_transformers(&engine, 1e-3, false);
    engine.shutdown();
}

/// The references are `transformers` on the GGUF's weights dequantized (the converted
/// folder holds exactly those), so the GGUF served as it is meets the same references, its
/// block-quantized weights multiplied by quantized activations.
#[test]
fn the_q4_1_gguf_served_as_it_is_matches_transformers() {
    let cache = std::env::temp_dir().join(format!("plughost-smollm2-gguf-{}", std::process::id()));
    let dir = plughost::model::gguf::folder::prepare(&smollm2::gguf_path(), &cache)
        .expect("the GGUF's model folder");
    let engine = start_engine_at(dir);
    check_greedy_against_transformers(&engine, 5e-3, true);
    engine.shutdown();
    let _ = std::fs::remove_dir_all(&cache);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chat_api_knows_the_capital_of_france() {
    let engine = tokio::task::spawn_blocking(start_engine)
        .await
        .expect("engine thread");
    let base = format!(
        "http://{}",
        api::spawn_server(engine.clone(), ApiConfig::default())
    );
    let body = json!({
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32,
        "temperature": 0
    });
    let response: serde_json::Value = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("request sent")
        .json()
        .await
        .expect("JSON answer");
    let answer = response["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    assert!(answer.contains("Paris"), "answer: {response}");
    assert_eq!(
        answer,
        smollm2::reference().answer.text,
        "the same answer as transformers"
    );
    tokio::task::spawn_blocking(move || engine.shutdown())
        .await
        .expect("shutdown");
}
