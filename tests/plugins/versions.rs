//! Components of both contract versions: 0.1 builds of the decoder glue, FCFS and the standard sampler run through the host's adapter and give the tokens of their 0.2 builds, each names its version, a 0.1 component of another shape is named against the 0.1 contract, and a 0.2 scheduler sees the engine's step number count up.

use std::sync::Arc;
use std::time::Duration;

use plughost::engine::{
    EngineHandle, EngineOptions, EngineSetup, GenerationEvent, GenerationRequest, StopConditions,
};
use plughost::metrics::Metrics;
use plughost::plugins::sampler::SamplerPlugin;
use plughost::plugins::scheduler::SchedulerPlugin;
use plughost::plugins::{ContractVersion, InstanceLimits, PluginRuntime, RuntimeOptions};
use plughost_sdk::sampler::{Penalties, SamplingParams};
use plughost_sdk::scheduler::{Phase, RequestView, Resources};

use crate::common::{self, api};

/// The faulty scheduler plans nothing for a request of this priority unless the step number
/// counts up (plugins/scheduler-faulty).
const PRIORITY_STEP_CHECK: i32 = -1005;

/// Generous: each request below takes a few dozen mock steps.
const DEADLINE: Duration = Duration::from_secs(120);

/// An engine on the mock device with `glue`, `scheduler` and `sampler`: eight sequences at once, a
/// step budget of 16 tokens (so prompts are prefilled in chunks) and a pool of 24 blocks of 4,
/// which eight requests outgrow (so some are preempted and recompute).
fn start(glue: &str, scheduler: &str, sampler: &str) -> EngineHandle {
    let setup = EngineSetup {
        model_dir: api::model_dir(),
        model_name: api::MODEL.into(),
        device_library: common::plugin_path("libplughost_device_mock.so"),
        device_config: String::new(),
        glue: api::plugin(glue),
        scheduler: Some(api::plugin(scheduler)),
        sampler: Some(api::plugin(sampler)),
        named_samplers: Default::default(),
        component_cache: Some(std::env::temp_dir().join("plughost-test-component-cache")),
        options: EngineOptions {
            max_num_seqs: 8,
            max_num_batched_tokens: 16,
            block_size: 4,
            num_kv_blocks: Some(24),
            ..Default::default()
        },
        profile_output: None,
    };
    let engine = EngineHandle::start(setup, Arc::new(Metrics::new())).expect("the engine starts");
    engine.wait_ready().expect("the model loads");
    engine
}

/// Eight requests: greedy ones, and sampled ones with a seed, top-k or top-p and penalties,
/// so every field of the sampling records crosses the adapter.
fn requests(priority: i32) -> Vec<GenerationRequest> {
    (0..8u32)
        .map(|i| {
            let sampling = match i % 4 {
                0 => SamplingParams::GREEDY,
                1 => SamplingParams {
                    temperature: 0.8,
                    top_p: 0.95,
                    seed: 7 + u64::from(i),
                    ..SamplingParams::GREEDY
                },
                2 => SamplingParams {
                    temperature: 1.2,
                    top_k: 20,
                    min_p: 0.02,
                    seed: 100 + u64::from(i),
                    penalties: Penalties {
                        presence: 0.5,
                        frequency: 0.25,
                        repetition: 1.3,
                    },
                    ..SamplingParams::GREEDY
                },
                _ => SamplingParams {
                    temperature: 0.7,
                    seed: 3,
                    logprobs: true,
                    num_top_logprobs: 3,
                    ..SamplingParams::GREEDY
                },
            };
            let prompt = (0..6 + 3 * i)
                .map(|t| 11 + (t * 17 + i * 5) % 400)
                .collect();
            GenerationRequest {
                stop: StopConditions {
                    ignore_eos: true,
                    ..Default::default()
                },
                logprobs: i % 4 == 3,
                priority,
                ..GenerationRequest::new(prompt, sampling, 10 + i)
            }
        })
        .collect()
}

/// Submits every request at once and returns each one's tokens, in request order.
fn generate_all(engine: &EngineHandle, requests: Vec<GenerationRequest>) -> Vec<Vec<u32>> {
    let receivers: Vec<_> = requests
        .into_iter()
        .map(|r| engine.submit(r).expect("submitted").1)
        .collect();
    let started = std::time::Instant::now();
    receivers
        .into_iter()
        .enumerate()
        .map(|(i, mut events)| {
            let mut tokens = Vec::new();
            loop {
                assert!(started.elapsed() < DEADLINE, "request {i} is still running");
                let event = events.blocking_recv().expect("the request finishes");
                match event {
                    GenerationEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
                    GenerationEvent::Finished { .. } => return tokens,
                    GenerationEvent::Failed { message }
                    | GenerationEvent::Unavailable { message } => {
                        panic!("request {i} failed: {message}")
                    }
                    GenerationEvent::Rejected(r) => panic!("request {i} rejected: {r}"),
                }
            }
        })
        .collect()
}

fn metric(engine: &EngineHandle, name: &str) -> f64 {
    api::metric(&engine.metrics().render(), name).unwrap_or_else(|| panic!("metric {name} missing"))
}

/// Checks that `/admin/deployment` names `version` for the glue, the scheduler and the sampler.
fn assert_wit_versions(engine: &EngineHandle, version: &str) {
    let deployment = engine.deployment().expect("a deployment");
    let glue = deployment.glue.as_ref().expect("the glue is listed");
    assert_eq!(glue.wit_version, version);
    let listed: Vec<(String, String)> = deployment
        .components
        .iter()
        .map(|c| (c.slot.to_string(), c.wit_version.clone()))
        .collect();
    let expected = [("scheduler", version), ("sampler", version)]
        .map(|(slot, version)| (slot.to_string(), version.to_string()));
    assert_eq!(listed, expected);
}

#[test]
fn components_of_0_1_run_through_the_adapter_with_the_tokens_of_their_0_2_builds() {
    let _process = crate::shared_process();
    let current = start(
        "plughost_model_qwen3.wasm",
        "plughost_scheduler_fcfs.wasm",
        "plughost_sampler_standard.wasm",
    );
    let expected = generate_all(&current, requests(0));
    assert_wit_versions(&current, ContractVersion::CURRENT.as_str());
    current.shutdown();

    let legacy = start(
        "plughost_model_qwen3_wit01.wasm",
        "plughost_scheduler_fcfs_wit01.wasm",
        "plughost_sampler_standard_wit01.wasm",
    );
    let tokens = generate_all(&legacy, requests(0));
    assert_wit_versions(&legacy, "0.1.0");
    for (i, (got, want)) in tokens.iter().zip(&expected).enumerate() {
        assert_eq!(got, want, "request {i}: the 0.1 components' tokens");
    }
    assert_eq!(
        metric(&legacy, "plughost_scheduler_fallbacks_total"),
        0.0,
        "every step followed the 0.1 scheduler's plan"
    );
    assert_eq!(metric(&legacy, "plughost_sampler_fallbacks_total"), 0.0);
    assert!(
        metric(&legacy, "plughost_num_preemptions_total") > 0.0,
        "the pool is small enough that the 0.1 scheduler preempts"
    );
    legacy.shutdown();
}

#[test]
fn a_0_2_scheduler_sees_the_step_number_count_up() {
    let _process = crate::shared_process();
    // The plugin's check is live: the same step twice gets an empty plan.
    let runtime = PluginRuntime::new(RuntimeOptions::default()).expect("plugin runtime");
    let mut faulty = SchedulerPlugin::load(
        &runtime,
        &common::plugin_path("plughost_scheduler_faulty.wasm"),
        "",
        InstanceLimits::default(),
    )
    .expect("the faulty scheduler loads");
    let view = RequestView {
        id: 1,
        phase: Phase::Waiting,
        priority: PRIORITY_STEP_CHECK,
        arrival_us: 0,
        prompt_len: 4,
        computed_len: 0,
        cached_prefix_len: 0,
        output_len: 0,
        max_output: 4,
        blocks_held: 0,
    };
    let resources = Resources {
        token_budget: 16,
        max_running: 8,
        block_size: 4,
        free_blocks: 8,
        total_blocks: 8,
    };
    let views = std::slice::from_ref(&view);
    let plans: Vec<usize> = [5, 5, 6, 4]
        .into_iter()
        .map(|step| {
            let plan = faulty.schedule(step, views, &resources).expect("a plan");
            plan.run.len()
        })
        .collect();
    assert_eq!(plans, [1, 0, 1, 0], "steps 5, 5, 6, 4");

    // In the engine every step counts up, so the checking requests run to the end under the
    // scheduler's own plans.
    let engine = start(
        "plughost_model_qwen3.wasm",
        "plughost_scheduler_faulty.wasm",
        "plughost_sampler_standard.wasm",
    );
    let mut checking = requests(PRIORITY_STEP_CHECK);
    checking.truncate(4);
    let tokens = generate_all(&engine, checking.clone());
    for (request, tokens) in checking.iter().zip(&tokens) {
        assert_eq!(tokens.len(), request.max_tokens as usize);
    }
    assert_eq!(
        metric(&engine, "plughost_scheduler_fallbacks_total"),
        0.0,
        "the scheduler never saw a step number that did not count up"
    );
    engine.shutdown();
}

#[test]
fn a_0_1_component_whose_records_differ_is_named_against_the_0_1_contract() {
    let _process = crate::shared_process();
    let original = std::fs::read(common::plugin_path("plughost_sampler_standard_wit01.wasm"))
        .expect("the 0.1 sampler");
    // The fourth field of `sampling-params` renamed, same length, so the file stays well formed.
    let mut edited = original.clone();
    let mut renamed = 0;
    for start in 0..original.len().saturating_sub(5) {
        if &original[start..start + 5] == b"min-p" {
            edited[start..start + 5].copy_from_slice(b"max-p");
            renamed += 1;
        }
    }
    assert!(renamed > 0, "the component names `min-p`");
    let dir = std::env::temp_dir().join(format!("plughost-versions-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let path = dir.join("sampler-max-p.wasm");
    std::fs::write(&path, &edited).expect("the edited component");
    let runtime = PluginRuntime::new(RuntimeOptions::default()).expect("plugin runtime");
    let error = SamplerPlugin::load(&runtime, &path, "", InstanceLimits::default())
        .err()
        .expect("a component whose records differ is refused");
    let _ = std::fs::remove_dir_all(&dir);
    let message = error.to_string();
    assert!(
        message.contains("the sampler world of plughost:plugin@0.1.0")
            && message.contains(
                "record `sampling-params` of plughost:plugin/sampling@0.1.0 differs: field 4 is \
                 `min-p` in this host and `max-p` in the component"
            ),
        "{message}"
    );
}
