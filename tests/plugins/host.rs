//! Contract tests: every built component loaded through the host and called with real data.

use std::time::Duration;

use plughost::plugins::logits::{self, LogitsBatch};
use plughost::plugins::sampler::{SamplerPlugin, SequenceToSample};
use plughost::plugins::scheduler::SchedulerPlugin;
use plughost::plugins::{InstanceLimits, PluginError, PluginRuntime, RuntimeOptions};
use plughost_sdk::sampler::SamplingParams;
use plughost_sdk::scheduler::{Phase, Plan, RequestView, Resources, Scheduled};

use crate::common;

const VOCAB: usize = 151_936;

fn runtime() -> PluginRuntime {
    let cache = std::env::temp_dir().join("plughost-test-component-cache");
    PluginRuntime::new(RuntimeOptions {
        cache_dir: Some(cache),
    })
    .expect("plugin runtime")
}

fn view(
    id: u64,
    phase: Phase,
    prompt_len: u32,
    computed_len: u32,
    output_len: u32,
    blocks_held: u32,
) -> RequestView {
    RequestView {
        id,
        phase,
        priority: 0,
        arrival_us: id * 10,
        prompt_len,
        computed_len,
        cached_prefix_len: 0,
        output_len,
        max_output: 64,
        blocks_held,
    }
}

/// Pseudo-random logits from a fixed LCG, so every run sees the same rows.
fn random_logits(rows: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..rows * VOCAB)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        })
        .collect()
}

/// Limits for the tests of what a plugin returns, not of how fast: sampling 16 rows of a
/// 151,936-token vocabulary can outlast the serving default of 500 ms on a busy machine.
fn unhurried() -> InstanceLimits {
    InstanceLimits {
        call_timeout: Duration::from_secs(30),
        ..InstanceLimits::default()
    }
}

fn sampler() -> SamplerPlugin {
    let path = common::plugin_path("plughost_sampler_standard.wasm");
    SamplerPlugin::load(&runtime(), &path, "", unhurried()).expect("sampler loads")
}

#[test]
fn fcfs_plan_for_a_synthetic_queue() {
    let _process = crate::shared_process();
    let path = common::plugin_path("plughost_scheduler_fcfs.wasm");
    let mut fcfs = SchedulerPlugin::load(
        &runtime(),
        &path,
        r#"{"long_prefill_token_threshold": 8}"#,
        unhurried(),
    )
    .expect("fcfs loads");
    let resources = Resources {
        token_budget: 16,
        max_running: 8,
        block_size: 4,
        free_blocks: 100,
        total_blocks: 120,
    };
    struct Case {
        name: &'static str,
        requests: Vec<RequestView>,
        resources: Resources,
        want: Plan,
    }
    let run = |pairs: &[(u64, u32)]| Plan {
        run: pairs
            .iter()
            .map(|&(id, num_tokens)| Scheduled { id, num_tokens })
            .collect(),
        preempt: vec![],
    };
    let cases = vec![
        Case {
            name: "decodes first, then prefills cut to the budget and the long-prefill threshold",
            requests: vec![
                view(1, Phase::Running, 6, 8, 3, 3),
                view(2, Phase::Running, 5, 6, 2, 2),
                view(3, Phase::Waiting, 5, 0, 0, 0),
                view(4, Phase::Waiting, 30, 0, 0, 0),
            ],
            resources,
            want: run(&[(1, 1), (2, 1), (3, 5), (4, 8)]),
        },
        Case {
            name: "the budget runs out in the middle of the queue",
            requests: vec![
                view(1, Phase::Running, 6, 8, 3, 3),
                view(3, Phase::Waiting, 40, 0, 0, 0),
                view(4, Phase::Waiting, 5, 0, 0, 0),
            ],
            resources: Resources {
                token_budget: 6,
                ..resources
            },
            want: run(&[(1, 1), (3, 5)]),
        },
        Case {
            name: "max running keeps waiting requests out",
            requests: vec![
                view(1, Phase::Running, 6, 8, 3, 3),
                view(3, Phase::Waiting, 5, 0, 0, 0),
            ],
            resources: Resources {
                max_running: 1,
                ..resources
            },
            want: run(&[(1, 1)]),
        },
        Case {
            name: "a waiting request is admitted only when its blocks fit",
            requests: vec![
                view(3, Phase::Waiting, 8, 0, 0, 0),
                view(4, Phase::Waiting, 8, 0, 0, 0),
            ],
            resources: Resources {
                free_blocks: 3,
                ..resources
            },
            want: run(&[(3, 8)]),
        },
        Case {
            name: "out of blocks, the newest running request is preempted",
            requests: vec![
                view(1, Phase::Running, 4, 8, 5, 2),
                view(2, Phase::Running, 4, 8, 5, 2),
            ],
            resources: Resources {
                free_blocks: 0,
                ..resources
            },
            want: Plan {
                run: vec![Scheduled {
                    id: 1,
                    num_tokens: 1,
                }],
                preempt: vec![2],
            },
        },
    ];
    for (step, case) in (1..).zip(cases) {
        let plan = fcfs
            .schedule(step, &case.requests, &case.resources)
            .expect("schedule call");
        assert_eq!(plan, case.want, "{}", case.name);
    }
}

#[test]
fn sampler_returns_the_argmax_at_temperature_zero() {
    let _process = crate::shared_process();
    let mut sampler = sampler();
    let rows = 16;
    let values = random_logits(rows, 7);
    let want: Vec<u32> = values.chunks(VOCAB).map(logits::argmax).collect();
    let mut batch = LogitsBatch::new(values, VOCAB);
    let sequences: Vec<SequenceToSample> = (0..rows as u64)
        .map(|request| SequenceToSample {
            request,
            position: 0,
            params: SamplingParams {
                logprobs: true,
                ..SamplingParams::GREEDY
            },
        })
        .collect();
    let sampled = sampler.sample(&mut batch, &sequences).expect("sample call");
    let got: Vec<u32> = sampled.iter().map(|s| s.token).collect();
    assert_eq!(got, want);
    for (s, row) in sampled.iter().zip(0..) {
        let direct = logits::log_softmax(batch.row(row).expect("row"), &[s.token], 1.0)[0];
        assert!(
            (s.logprob - direct).abs() < 1e-4,
            "logprob {} vs {direct}",
            s.logprob
        );
    }
}

fn seeded_stream(sampler: &mut SamplerPlugin, seed: u64) -> Vec<u32> {
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 50,
        top_p: 0.95,
        seed,
        ..SamplingParams::GREEDY
    };
    let values = random_logits(1, 11);
    (0..32)
        .map(|position| {
            let mut batch = LogitsBatch::new(values.clone(), VOCAB);
            let seq = SequenceToSample {
                request: 1,
                position,
                params,
            };
            sampler.sample(&mut batch, &[seq]).expect("sample call")[0].token
        })
        .collect()
}

#[test]
fn a_seed_fixes_the_token_stream() {
    let _process = crate::shared_process();
    let mut sampler = sampler();
    let first = seeded_stream(&mut sampler, 42);
    let again = seeded_stream(&mut sampler, 42);
    let other = seeded_stream(&mut sampler, 43);
    assert_eq!(first, again, "same seed, same tokens");
    assert_ne!(first, other, "different seed, different tokens");
    let distinct: std::collections::HashSet<u32> = first.iter().copied().collect();
    assert!(
        distinct.len() > 4,
        "temperature 1 over 50 candidates should vary: {first:?}"
    );
}

#[test]
fn a_component_of_another_world_is_refused() {
    let _process = crate::shared_process();
    let path = common::plugin_path("plughost_sampler_standard.wasm");
    let err = SchedulerPlugin::load(&runtime(), &path, "", InstanceLimits::default())
        .err()
        .expect("must be refused");
    assert!(
        matches!(
            &err,
            PluginError::Contract(plughost::plugins::ContractError::World {
                world: "sampler",
                needs: "scheduler",
                ..
            })
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .ends_with("exports the sampler world; the [scheduler] slot needs scheduler"),
        "{err}"
    );
}

#[test]
fn a_bad_plugin_config_is_refused_with_the_plugin_message() {
    let _process = crate::shared_process();
    let path = common::plugin_path("plughost_scheduler_fcfs.wasm");
    let err = SchedulerPlugin::load(
        &runtime(),
        &path,
        r#"{"no_such_option": 1}"#,
        InstanceLimits::default(),
    )
    .err()
    .expect("must be refused");
    assert!(matches!(err, PluginError::Plugin { .. }), "{err}");
    assert!(err.to_string().contains("no_such_option"), "{err}");
}

#[test]
fn faults_are_contained_and_the_next_call_gets_a_fresh_instance() {
    let _process = crate::shared_process();
    let path = common::plugin_path("plughost_scheduler_faulty.wasm");
    let limits = InstanceLimits {
        memory_bytes: 32 << 20,
        call_timeout: Duration::from_millis(200),
    };
    let mut scheduler =
        SchedulerPlugin::load(&runtime(), &path, "", limits).expect("faulty scheduler loads");
    let resources = Resources {
        token_budget: 64,
        max_running: 8,
        block_size: 16,
        free_blocks: 10,
        total_blocks: 10,
    };
    let ordinary = [view(1, Phase::Waiting, 4, 0, 0, 0)];
    let healthy = scheduler
        .schedule(1, &ordinary, &resources)
        .expect("ordinary call");
    assert_eq!(
        healthy.run,
        vec![Scheduled {
            id: 1,
            num_tokens: 1
        }]
    );

    type IsExpected = fn(&PluginError) -> bool;
    let cases: [(&str, i32, IsExpected); 3] = [
        ("trap", -1001, |e| matches!(e, PluginError::Trap { .. })),
        // The loop ends because the call's own 200 ms epoch deadline fired, not by luck.
        ("infinite loop", -1002, |e| {
            matches!(e, PluginError::Timeout { limit_ms: 200, .. })
        }),
        ("unbounded memory", -1003, |e| {
            matches!(e, PluginError::Trap { .. })
        }),
    ];
    for (i, (name, priority, is_expected)) in cases.into_iter().enumerate() {
        let mut bad = view(2, Phase::Waiting, 4, 0, 0, 0);
        bad.priority = priority;
        let step = 2 * i as u64 + 2;
        let err = scheduler
            .schedule(step, &[bad], &resources)
            .err()
            .unwrap_or_else(|| panic!("{name}: must fail"));
        assert!(is_expected(&err), "{name}: unexpected error {err}");
        let after = scheduler
            .schedule(step + 1, &ordinary, &resources)
            .expect("next call on a fresh instance");
        assert_eq!(after, healthy, "{name}: fresh instance answers as before");
        let stats = scheduler.stats();
        assert_eq!(stats.faults as usize, i + 1, "{name}: faults counted");
        assert_eq!(
            stats.instantiations as usize,
            i + 2,
            "{name}: re-instantiated"
        );
    }
}

#[test]
fn a_plugin_that_keeps_faulting_is_backed_off() {
    let _process = crate::shared_process();
    let path = common::plugin_path("plughost_scheduler_faulty.wasm");
    let mut scheduler = SchedulerPlugin::load(&runtime(), &path, "", InstanceLimits::default())
        .expect("faulty scheduler loads");
    let mut bad = view(2, Phase::Waiting, 4, 0, 0, 0);
    bad.priority = -1001;
    let resources = Resources {
        token_budget: 64,
        max_running: 8,
        block_size: 16,
        free_blocks: 10,
        total_blocks: 10,
    };
    // The default policy: 5 faults within 60 s back the plugin off for 10 s.
    for step in 1..=5 {
        let err = scheduler
            .schedule(step, std::slice::from_ref(&bad), &resources)
            .expect_err("traps");
        assert!(matches!(err, PluginError::Trap { .. }), "{err}");
    }
    let err = scheduler
        .schedule(6, &[view(1, Phase::Waiting, 4, 0, 0, 0)], &resources)
        .expect_err("backed off");
    assert!(matches!(err, PluginError::BackingOff { .. }), "{err}");
    assert_eq!(scheduler.stats().faults, 5);
}
