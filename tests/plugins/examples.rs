//! The example plugins in a running engine on the mock device: the priority scheduler admits by priority where FCFS admits by arrival, the banned-tokens sampler never emits a banned id, and requests choose among a deployment's named samplers.

use std::collections::HashMap;
use std::sync::Arc;

use futures::StreamExt;
use plughost::engine::{
    EngineHandle, EngineOptions, EngineSetup, GenerationEvent, GenerationRequest, StopConditions,
};
use plughost::metrics::Metrics;
use plughost::plugins::{Deployment, NamedSamplers, PluginSpec};
use plughost_sdk::sampler::SamplingParams;

use crate::common::{self, api};

fn plugin(file: &str, config: &str) -> PluginSpec {
    PluginSpec {
        component: common::plugin_path(file),
        config: toml::from_str(config).expect("a TOML config table"),
        memory_mib: None,
        call_timeout_ms: None,
        failure: Default::default(),
    }
}

/// An engine on the mock device running `scheduler` and `sampler`, at most `max_num_seqs`
/// sequences at once.
fn start(
    scheduler: PluginSpec,
    sampler: PluginSpec,
    max_num_seqs: u32,
    device_config: &str,
) -> Arc<EngineHandle> {
    start_named(
        scheduler,
        sampler,
        NamedSamplers::default(),
        max_num_seqs,
        device_config,
    )
}

/// [`start`], with the deployment's `[samplers.NAME]` too.
fn start_named(
    scheduler: PluginSpec,
    sampler: PluginSpec,
    named_samplers: NamedSamplers,
    max_num_seqs: u32,
    device_config: &str,
) -> Arc<EngineHandle> {
    let setup = EngineSetup {
        model_dir: api::model_dir(),
        model_name: api::MODEL.into(),
        device_library: common::plugin_path("libplughost_device_mock.so"),
        device_config: device_config.into(),
        glue: plugin("plughost_model_qwen3.wasm", ""),
        scheduler: Some(scheduler),
        sampler: Some(sampler),
        named_samplers,
        component_cache: Some(std::env::temp_dir().join("plughost-test-component-cache")),
        options: EngineOptions {
            max_num_seqs,
            max_num_batched_tokens: 256,
            block_size: 4,
            num_kv_blocks: Some(256),
            ..Default::default()
        },
        profile_output: None,
    };
    let engine =
        Arc::new(EngineHandle::start(setup, Arc::new(Metrics::new())).expect("start the engine"));
    engine.wait_ready().expect("the model loads");
    engine
}

fn request(
    prompt: &[u32],
    max_tokens: u32,
    priority: i32,
    sampling: SamplingParams,
) -> GenerationRequest {
    GenerationRequest {
        stop: StopConditions {
            ignore_eos: true,
            ..Default::default()
        },
        priority,
        ..GenerationRequest::new(prompt.to_vec(), sampling, max_tokens)
    }
}

/// The generated token ids of one request, or its failure.
fn generate(engine: &EngineHandle, request: GenerationRequest) -> Result<Vec<u32>, String> {
    let (_, mut events) = engine.submit(request).map_err(|e| e.to_string())?;
    let mut tokens = Vec::new();
    while let Some(event) = events.blocking_recv() {
        match event {
            GenerationEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
            GenerationEvent::Finished { .. } => return Ok(tokens),
            GenerationEvent::Failed { message } | GenerationEvent::Unavailable { message } => {
                return Err(message);
            }
            GenerationEvent::Rejected(r) => return Err(r.to_string()),
        }
    }
    Err("the event stream ended without Finished".into())
}

/// Submits a blocker and then requests of the given priorities while the blocker's first
/// step hangs on the device, all with one sequence slot, and returns the priorities in the
/// order the engine started them.
async fn start_order(scheduler: PluginSpec, priorities: &[i32]) -> Vec<i32> {
    let sampler = plugin("plughost_sampler_standard.wasm", "");
    // The first launch sleeps 2 s: every request below is queued before the blocker's first
    // step ends, so the scheduler sees them all at once.
    let engine = start(scheduler, sampler, 1, "hang_launch=1,hang_ms=2000");
    let prompt = [11, 12, 13, 14, 15];
    let mut all = vec![100];
    all.extend_from_slice(priorities);
    let mut streams = Vec::new();
    for (index, &priority) in all.iter().enumerate() {
        let (_, mut events) = engine
            .submit(request(&prompt, 8, priority, SamplingParams::GREEDY))
            .expect("submitted");
        streams.push(
            futures::stream::poll_fn(move |cx| events.poll_recv(cx))
                .map(move |e| (index, e))
                .boxed(),
        );
    }
    // One sequence runs at a time, so a request's first event is sent after the previous
    // request's last one. `select_all` yields ready streams in the order they were woken,
    // which is the order the engine sent their events.
    let mut merged = futures::stream::select_all(streams);
    let mut order = Vec::new();
    let mut finished = 0;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
    while finished < all.len() {
        let (index, event) = tokio::time::timeout_at(deadline, merged.next())
            .await
            .expect("every request finishes within the deadline")
            .expect("the streams stay open until each request finishes");
        if !order.contains(&index) {
            order.push(index);
        }
        match event {
            GenerationEvent::Finished { .. } => finished += 1,
            GenerationEvent::Failed { message } | GenerationEvent::Unavailable { message } => {
                panic!("request {index} failed: {message}")
            }
            GenerationEvent::Rejected(r) => panic!("request {index} rejected: {r}"),
            GenerationEvent::Delta { .. } => {}
        }
    }
    let engine_for_shutdown = engine.clone();
    tokio::task::spawn_blocking(move || engine_for_shutdown.shutdown())
        .await
        .expect("shutdown joins");
    order.into_iter().map(|i| all[i]).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_priority_scheduler_starts_requests_by_priority_where_fcfs_keeps_arrival_order() {
    let _process = crate::shared_process_async().await;
    let arrivals = [1, 10, -2, 5, 3];
    let fcfs = start_order(plugin("plughost_scheduler_fcfs.wasm", ""), &arrivals).await;
    assert_eq!(fcfs, [100, 1, 10, -2, 5, 3], "FCFS keeps arrival order");
    let priority = start_order(
        plugin("plughost_scheduler_priority.wasm", "aging_rate = 0.05"),
        &arrivals,
    )
    .await;
    // Requests queued together age together, so their priorities alone order them.
    assert_eq!(priority, [100, 10, 5, 3, 1, -2]);
}

#[test]
fn the_banned_sampler_never_emits_a_banned_token() {
    let _process = crate::shared_process();
    let prompt = [21, 22, 23, 24, 25, 26];
    let fcfs = || plugin("plughost_scheduler_fcfs.wasm", "");
    let (baseline, most_frequent) = most_frequent_greedy_token(&prompt);

    let config = format!("banned_token_ids = [{most_frequent}]");
    let banned = start(
        fcfs(),
        plugin("plughost_sampler_banned.wasm", &config),
        4,
        "",
    );
    let greedy = generate(&banned, request(&prompt, 24, 0, SamplingParams::GREEDY))
        .expect("greedy generates");
    assert_eq!(greedy.len(), 24);
    assert!(
        !greedy.contains(&most_frequent),
        "{most_frequent} in {greedy:?}"
    );
    assert_ne!(greedy, baseline, "the ban changed the output");
    for seed in 0..8 {
        let sampling = SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::GREEDY
        };
        let drawn = generate(&banned, request(&prompt, 24, 0, sampling)).expect("a draw generates");
        assert!(!drawn.contains(&most_frequent), "seed {seed}: {drawn:?}");
    }
    banned.shutdown();
}

/// The most frequent token of a greedy run of `prompt` with the standard sampler alone.
fn most_frequent_greedy_token(prompt: &[u32]) -> (Vec<u32>, u32) {
    let standard = start(
        plugin("plughost_scheduler_fcfs.wasm", ""),
        plugin("plughost_sampler_standard.wasm", ""),
        4,
        "",
    );
    let baseline = generate(&standard, request(prompt, 24, 0, SamplingParams::GREEDY))
        .expect("the baseline generates");
    standard.shutdown();
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &token in &baseline {
        *counts.entry(token).or_default() += 1;
    }
    let (&most_frequent, _) = counts
        .iter()
        .max_by_key(|(token, count)| (**count, std::cmp::Reverse(**token)))
        .expect("the baseline has tokens");
    (baseline, most_frequent)
}

#[test]
fn requests_choose_a_named_sampler_and_an_unknown_name_is_refused() {
    let _process = crate::shared_process();
    let prompt = [21, 22, 23, 24, 25, 26];
    let (baseline, banned_token) = most_frequent_greedy_token(&prompt);
    let file = format!(
        "[samplers.no-repeat]\ncomponent = {:?}\nconfig = {{ banned_token_ids = [{banned_token}] }}\n",
        common::plugin_path("plughost_sampler_banned.wasm")
    );
    let deployment =
        Deployment::from_str_in(&file, std::path::Path::new("/")).expect("a valid deployment");
    let engine = start_named(
        plugin("plughost_scheduler_fcfs.wasm", ""),
        plugin("plughost_sampler_standard.wasm", ""),
        deployment.named_samplers(),
        4,
        "",
    );
    let with = |name: Option<&str>| GenerationRequest {
        sampler: name.map(str::to_string),
        ..request(&prompt, 24, 0, SamplingParams::GREEDY)
    };
    assert_eq!(generate(&engine, with(None)).expect("default"), baseline);
    assert_eq!(
        generate(&engine, with(Some("default"))).expect("by name"),
        baseline
    );
    let banned = generate(&engine, with(Some("no-repeat"))).expect("the named sampler");
    assert!(
        !banned.contains(&banned_token),
        "{banned_token} in {banned:?}"
    );
    assert_ne!(banned, baseline);

    // Run together, each request keeps its own sampler: the batch is split by sampler.
    let (_, mut plain) = engine.submit(with(None)).expect("submitted");
    let (_, mut named) = engine.submit(with(Some("no-repeat"))).expect("submitted");
    let drain = |events: &mut tokio::sync::mpsc::UnboundedReceiver<GenerationEvent>| {
        let mut tokens = Vec::new();
        while let Some(event) = events.blocking_recv() {
            match event {
                GenerationEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
                GenerationEvent::Finished { .. } => break,
                GenerationEvent::Failed { message } | GenerationEvent::Unavailable { message } => {
                    panic!("failed: {message}")
                }
                GenerationEvent::Rejected(r) => panic!("rejected: {r}"),
            }
        }
        tokens
    };
    assert_eq!(drain(&mut plain), baseline);
    assert_eq!(drain(&mut named), banned);

    let unknown = generate(&engine, with(Some("creative"))).expect_err("an unknown name fails");
    assert_eq!(
        unknown,
        "unknown sampler `creative`; this deployment has: default, no-repeat"
    );
    engine.shutdown();
}
