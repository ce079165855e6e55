//! Tokens depend only on the request: a chaotic scheduler, random arrival schedules, chunk budgets, KV pool sizes and shared prefixes change none of them, on the mock and the CPU device.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use plughost::engine::{
    EngineHandle, EngineOptions, EngineSetup, FinishReason, GenerationEvent, GenerationRequest,
    StopConditions,
};
use plughost::metrics::Metrics;
use plughost::plugins::PluginSpec;
use plughost_sdk::sampler::{RowRng, SamplingParams};

use crate::common;

const CPU: &str = "libplughost_device_cpu.so";
const MOCK: &str = "libplughost_device_mock.so";

fn plugin(file: &str, config: toml::Table) -> PluginSpec {
    PluginSpec {
        component: common::plugin_path(file),
        config,
        memory_mib: None,
        call_timeout_ms: None,
        failure: Default::default(),
    }
}

fn start(device: &str, scheduler: PluginSpec, options: EngineOptions) -> EngineHandle {
    let setup = EngineSetup {
        model_dir: Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-qwen3"),
        model_name: "tiny-qwen3".into(),
        device_library: common::plugin_path(device),
        device_config: String::new(),
        glue: plugin("plughost_model_qwen3.wasm", Default::default()),
        scheduler: Some(scheduler),
        sampler: Some(plugin("plughost_sampler_standard.wasm", Default::default())),
        named_samplers: Default::default(),
        component_cache: Some(std::env::temp_dir().join("plughost-test-component-cache")),
        options,
        profile_output: None,
    };
    let engine = EngineHandle::start(setup, Arc::new(Metrics::new())).expect("engine starts");
    engine.wait_ready().expect("model loads");
    engine
}

/// Ten requests over the tiny model's 445 ordinary tokens: three groups share a prefix (so
/// the prefix cache has something to hit), half are greedy and half sampled with a seed.
fn requests(rng: &mut RowRng) -> Vec<GenerationRequest> {
    let mut token = || (rng.next().as_u64() % 445) as u32;
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|g| (0..(4 + 6 * g)).map(|_| token()).collect())
        .collect();
    (0..10)
        .map(|i| {
            let mut prompt = prefixes[i % 3].clone();
            let tail = 1 + (token() % 12) as usize;
            prompt.extend((0..tail).map(|_| token()));
            let sampling = match i % 2 {
                0 => SamplingParams::GREEDY,
                _ => SamplingParams {
                    temperature: 0.8,
                    top_p: 0.95,
                    seed: 7 + i as u64,
                    ..SamplingParams::GREEDY
                },
            };
            GenerationRequest {
                stop: StopConditions {
                    ignore_eos: true,
                    ..Default::default()
                },
                ..GenerationRequest::new(prompt, sampling, 4 + token() % 14)
            }
        })
        .collect()
}

fn tokens_of(mut rx: tokio::sync::mpsc::UnboundedReceiver<GenerationEvent>) -> Vec<u32> {
    let mut tokens = Vec::new();
    loop {
        match rx.blocking_recv().expect("the request finishes") {
            GenerationEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
            GenerationEvent::Finished { reason, .. } => {
                assert_eq!(reason, FinishReason::Length);
                return tokens;
            }
            GenerationEvent::Failed { message } | GenerationEvent::Unavailable { message } => {
                panic!("request failed: {message}")
            }
            GenerationEvent::Rejected(r) => panic!("request rejected: {r}"),
        }
    }
}

/// Each request alone, under FCFS, with room to spare: the reference.
fn solo_runs(device: &str, requests: &[GenerationRequest]) -> Vec<Vec<u32>> {
    let engine = start(
        device,
        plugin("plughost_scheduler_fcfs.wasm", Default::default()),
        EngineOptions {
            block_size: 4,
            num_kv_blocks: Some(512),
            enable_prefix_caching: false,
            ..Default::default()
        },
    );
    let tokens = requests
        .iter()
        .map(|r| tokens_of(engine.submit(r.clone()).expect("submitted").1))
        .collect();
    engine.shutdown();
    tokens
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

/// One random schedule: the chaotic scheduler's seed and preemption rate, the step's token
/// budget, the sequences and KV blocks, the prefix cache, and the order and spacing in which
/// the requests arrive. Returns how many preemptions it caused.
fn run_case(device: &str, case: u32, requests: &[GenerationRequest], expected: &[Vec<u32>]) -> f64 {
    let mut rng = RowRng::new(0x5eed, case);
    let mut pick = |choices: &[u32]| choices[(rng.next().as_u64() % choices.len() as u64) as usize];
    let mut scheduler_config = toml::Table::new();
    scheduler_config.insert(
        "seed".into(),
        toml::Value::Integer(pick(&[1, 2, 3, 4, 5, 6, 7, 8]).into()),
    );
    scheduler_config.insert(
        "preempt_percent".into(),
        toml::Value::Integer(pick(&[0, 10, 25, 40]).into()),
    );
    // The largest request needs 28 + 17 tokens: 12 blocks of 4. Every pool fits one request
    // alone; the small ones cannot hold all ten at once and preempt.
    let options = EngineOptions {
        max_num_seqs: pick(&[2, 4, 8]),
        max_num_batched_tokens: pick(&[8, 16, 64]),
        block_size: 4,
        num_kv_blocks: Some(pick(&[16, 24, 64, 256])),
        enable_prefix_caching: pick(&[0, 1]) == 1,
        ..Default::default()
    };
    let description = format!("case {case} on {device}: {scheduler_config:?} {options:?}");
    let engine = start(
        device,
        plugin("plughost_scheduler_chaotic.wasm", scheduler_config.clone()),
        options,
    );
    let mut order: Vec<usize> = (0..requests.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(
            i,
            (pick(&[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]) as usize) % (i + 1),
        );
    }
    let mut receivers = HashMap::new();
    for &i in &order {
        receivers.insert(i, engine.submit(requests[i].clone()).expect("submitted").1);
        std::thread::sleep(Duration::from_millis(u64::from(pick(&[0, 0, 1, 3]))));
    }
    for (i, expected) in expected.iter().enumerate() {
        let rx = receivers.remove(&i).expect("submitted");
        assert_eq!(&tokens_of(rx), expected, "request {i}, {description}");
    }
    assert_eq!(
        metric(&engine, "plughost_scheduler_fallbacks_total"),
        0.0,
        "every step followed the chaotic plan, {description}"
    );
    let preemptions = metric(&engine, "plughost_num_preemptions_total");
    engine.shutdown();
    preemptions
}

fn schedules_change_no_token(device: &str, cases: std::ops::Range<u32>) {
    let requests = requests(&mut RowRng::new(2026, 11));
    let expected = solo_runs(device, &requests);
    let preemptions: f64 = cases
        .map(|case| run_case(device, case, &requests, &expected))
        .sum();
    assert!(
        preemptions > 0.0,
        "the chaotic schedules preempted nothing on {device}; the test would prove less"
    );
}

#[test]
fn chaotic_schedules_change_no_token_on_the_cpu_device() {
    schedules_change_no_token(CPU, 0..6);
}

#[test]
fn chaotic_schedules_change_no_token_on_the_mock_device() {
    schedules_change_no_token(MOCK, 100..106);
}
