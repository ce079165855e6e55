//! The engine under load on the CPU device: continuous batching, preemption and the prefix cache give the same tokens as solo runs.

use std::path::Path;
use std::sync::Arc;

use plughost::engine::{
    EngineHandle, EngineOptions, EngineSetup, FinishReason, GenerationEvent, GenerationRequest,
    StopConditions,
};
use plughost::metrics::Metrics;
use plughost::plugins::PluginSpec;
use plughost_sdk::sampler::SamplingParams;

use crate::common;

fn plugin(file: &str) -> PluginSpec {
    PluginSpec {
        component: common::plugin_path(file),
        config: Default::default(),
        memory_mib: None,
        call_timeout_ms: None,
        failure: Default::default(),
    }
}

fn start(options: EngineOptions) -> EngineHandle {
    let setup = EngineSetup {
        model_dir: Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-qwen3"),
        model_name: "tiny-qwen3".into(),
        device_library: common::plugin_path("libplughost_device_cpu.so"),
        // The device's defaults, whatever level this CPU has: every level is batch-invariant,
        // which is all these tests compare.
        device_config: String::new(),
        glue: plugin("plughost_model_qwen3.wasm"),
        scheduler: Some(plugin("plughost_scheduler_fcfs.wasm")),
        sampler: Some(plugin("plughost_sampler_standard.wasm")),
        named_samplers: Default::default(),
        component_cache: Some(std::env::temp_dir().join("plughost-test-component-cache")),
        options,
        profile_output: None,
    };
    let engine = EngineHandle::start(setup, Arc::new(Metrics::new())).expect("engine starts");
    engine.wait_ready().expect("model loads");
    engine
}

fn greedy(prompt: Vec<u32>, max_tokens: u32) -> GenerationRequest {
    GenerationRequest {
        stop: StopConditions {
            ignore_eos: true,
            ..Default::default()
        },
        ..GenerationRequest::new(prompt, SamplingParams::GREEDY, max_tokens)
    }
}

/// Waits for every request's tokens; all were submitted before any is read.
fn collect(receivers: Vec<tokio::sync::mpsc::UnboundedReceiver<GenerationEvent>>) -> Vec<Vec<u32>> {
    receivers
        .into_iter()
        .map(|mut rx| {
            let mut tokens = Vec::new();
            loop {
                match rx.blocking_recv().expect("the request finishes") {
                    GenerationEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
                    GenerationEvent::Finished { reason, .. } => {
                        assert_eq!(reason, FinishReason::Length);
                        return tokens;
                    }
                    GenerationEvent::Failed { message }
                    | GenerationEvent::Unavailable { message } => {
                        panic!("request failed: {message}")
                    }
                    GenerationEvent::Rejected(r) => panic!("request rejected: {r}"),
                }
            }
        })
        .collect()
}

fn run_together(engine: &EngineHandle, requests: &[GenerationRequest]) -> Vec<Vec<u32>> {
    let receivers = requests
        .iter()
        .map(|r| engine.submit(r.clone()).expect("submitted").1)
        .collect();
    collect(receivers)
}

fn run_alone(engine: &EngineHandle, requests: &[GenerationRequest]) -> Vec<Vec<u32>> {
    requests
        .iter()
        .flat_map(|r| collect(vec![engine.submit(r.clone()).expect("submitted").1]))
        .collect()
}

/// Prompts of different lengths from a fixed pseudo-random stream over the 445 ordinary tokens.
fn prompts(count: usize) -> Vec<Vec<u32>> {
    let mut state = 12345u64;
    (0..count)
        .map(|i| {
            (0..(3 + (i * 7) % 40))
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 33) % 445) as u32
                })
                .collect()
        })
        .collect()
}

fn metric(engine: &EngineHandle, name: &str) -> f64 {
    let text = engine.metrics().render();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("metric {name} missing from:\n{text}"))
}

#[test]
fn thirty_two_concurrent_requests_match_their_solo_runs() {
    let engine = start(EngineOptions {
        max_num_seqs: 16,
        max_num_batched_tokens: 96,
        block_size: 4,
        num_kv_blocks: Some(1024),
        ..Default::default()
    });
    let requests: Vec<GenerationRequest> = prompts(32)
        .into_iter()
        .enumerate()
        .map(|(i, p)| greedy(p, 8 + (i as u32 % 5) * 6))
        .collect();
    let together = run_together(&engine, &requests);
    let alone = run_alone(&engine, &requests);
    for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(t.len() as u32, requests[i].max_tokens, "request {i} length");
        assert_eq!(t, a, "request {i}: batched tokens differ from its solo run");
    }
    engine.shutdown();
}

#[test]
fn a_kv_pool_too_small_for_everyone_preempts_and_still_gives_the_same_tokens() {
    // 40 blocks of 4 tokens; eight requests of up to 42 + 24 tokens cannot all hold their blocks.
    let engine = start(EngineOptions {
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        block_size: 4,
        num_kv_blocks: Some(40),
        enable_prefix_caching: false,
        ..Default::default()
    });
    let requests: Vec<GenerationRequest> = prompts(8).into_iter().map(|p| greedy(p, 24)).collect();
    let together = run_together(&engine, &requests);
    assert!(
        metric(&engine, "plughost_num_preemptions_total") > 0.0,
        "the pool is too small, so something was preempted"
    );
    let alone = run_alone(&engine, &requests);
    assert_eq!(together, alone);
    // Gauges are refreshed at the end of the step that finished the last request, which can
    // be a moment after its final event arrived.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while metric(
        &engine,
        "plughost_kv_cache_usage_perc{model_name=\"tiny-qwen3\"}",
    ) != 0.0
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(
        metric(
            &engine,
            "plughost_kv_cache_usage_perc{model_name=\"tiny-qwen3\"}"
        ),
        0.0,
        "every block is back"
    );
    engine.shutdown();
}

#[test]
fn a_shared_prefix_hits_the_cache_and_changes_nothing() {
    let options = EngineOptions {
        max_num_seqs: 4,
        max_num_batched_tokens: 128,
        block_size: 4,
        num_kv_blocks: Some(256),
        ..Default::default()
    };
    let cached = start(options.clone());
    let uncached = start(EngineOptions {
        enable_prefix_caching: false,
        ..options
    });
    let prefix = prompts(6).pop().expect("a long prompt");
    let first = greedy(prefix.iter().copied().chain([5, 6, 7]).collect(), 16);
    let second = greedy(prefix.iter().copied().chain([9, 10]).collect(), 16);
    let a = run_alone(&cached, std::slice::from_ref(&first));
    let hits_before = metric(&cached, "plughost_prefix_cache_hits_total");
    let b = run_alone(&cached, std::slice::from_ref(&second));
    let hits = metric(&cached, "plughost_prefix_cache_hits_total") - hits_before;
    assert!(
        hits >= (prefix.len() / 4 * 4) as f64 - 4.0,
        "the shared prefix's full blocks hit: {hits} of {}",
        prefix.len()
    );
    assert_eq!(
        run_alone(&uncached, &[first, second]),
        vec![a[0].clone(), b[0].clone()]
    );
    cached.shutdown();
    uncached.shutdown();
}
