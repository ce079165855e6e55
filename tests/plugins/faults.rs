//! A sampler's faults through the host, with real components: culprit rows are found alone and
//! re-run from the values they came with, and a plugin's memory does not stay resident in the
//! host after the call that grew it.
//!
//! The memory test reads this process's resident set, which other tests running in the same
//! process would disturb: it takes the process alone (see [`crate::whole_process`]).

use std::sync::Arc;
use std::time::Duration;

use plughost::plugins::logits::{LogitsBatch, TokenHistory};
use plughost::plugins::sampler::{RowFailure, SamplerPlugin, SequenceToSample};
use plughost::plugins::{InstanceLimits, PluginError, PluginRuntime, RuntimeOptions};
use plughost_sdk::sampler::{Penalties, SamplingParams};

use crate::common;

/// The faulty sampler's seeds (plugins/sampler-faulty).
const SEED_TRAP: u64 = 66_601;
const SEED_LOOP: u64 = 66_602;
const SEED_BAD_TOKEN: u64 = 66_604;
const SEED_HOARD: u64 = 66_605;
const SEED_GROW: u64 = 66_606;
const HOARD_MIB: u64 = 512;
const VOCAB: usize = 64;

fn faulty(limits: InstanceLimits) -> SamplerPlugin {
    let runtime = PluginRuntime::new(RuntimeOptions {
        cache_dir: Some(std::env::temp_dir().join("plughost-test-component-cache")),
    })
    .expect("plugin runtime");
    SamplerPlugin::load(
        &runtime,
        &common::plugin_path("plughost_sampler_faulty.wasm"),
        "",
        limits,
    )
    .expect("the faulty sampler loads")
}

fn sequence(request: u64, seed: u64, frequency: f32) -> SequenceToSample {
    SequenceToSample {
        request,
        position: 3,
        params: SamplingParams {
            seed,
            penalties: Penalties {
                frequency,
                ..Penalties::NONE
            },
            ..SamplingParams::GREEDY
        },
    }
}

/// Row 0 has token 5 at 10.0 and token 6 at 9.0, and token 5 three times in its output: one
/// frequency penalty of 0.2 leaves 9.4 (token 5 wins); applied twice, 8.8 (token 6 would).
fn batch(rows: usize) -> LogitsBatch {
    let mut values = vec![0.0f32; rows * VOCAB];
    for row in 0..rows {
        values[row * VOCAB + 5] = 10.0;
        values[row * VOCAB + 6] = 9.0;
    }
    let mut batch = LogitsBatch::new(values, VOCAB);
    for row in 0..rows {
        batch.set_history(
            row,
            TokenHistory {
                prompt: Arc::from(vec![1u32, 2]),
                output: vec![5, 5, 5],
            },
        );
    }
    batch
}

#[test]
fn the_culprit_row_fails_alone_and_the_others_are_re_run_from_their_original_values() {
    let _process = crate::shared_process();
    let mut sampler = faulty(InstanceLimits::default());
    // The plugin penalises row 0 in place, then traps on row 1; row 2 is never reached.
    let sequences = [
        sequence(1, 1, 0.2),
        sequence(2, SEED_TRAP, 0.2),
        sequence(3, 3, 0.2),
    ];
    let mut logits = batch(3);
    let rows = sampler.sample_rows(&mut logits, &sequences);
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0].as_ref().map(|s| s.token), Ok(5), "{rows:?}");
    assert_eq!(rows[2].as_ref().map(|s| s.token), Ok(5), "{rows:?}");
    match &rows[1] {
        Err(RowFailure::Faulted(cause)) => {
            assert!(cause.contains("trapped"), "{cause}")
        }
        other => panic!("row 1 must be the culprit: {other:?}"),
    }
    // The batch's rows are as they came, for a fallback to sample.
    assert_eq!(logits.row(0).map(|r| r[5]), Some(10.0));
    assert_eq!(sampler.stats().faults, 1, "one isolation is one fault");

    // A token outside the vocabulary is its row's fault; the rest of the batch keeps its tokens.
    let sequences = [sequence(1, 1, 0.0), sequence(2, SEED_BAD_TOKEN, 0.0)];
    let rows = sampler.sample_rows(&mut batch(2), &sequences);
    assert_eq!(rows[0].as_ref().map(|s| s.token), Ok(5));
    assert!(
        matches!(&rows[1], Err(RowFailure::Faulted(c)) if c.contains("outside the vocabulary")),
        "{rows:?}"
    );
    assert_eq!(sampler.stats().faults, 2);
}

#[test]
fn a_looping_row_costs_its_deadline_and_the_rest_keep_their_tokens() {
    let _process = crate::shared_process();
    let mut sampler = faulty(InstanceLimits {
        call_timeout: Duration::from_millis(50),
        ..InstanceLimits::default()
    });
    let sequences = [sequence(1, 1, 0.0), sequence(2, SEED_LOOP, 0.0)];
    let rows = sampler.sample_rows(&mut batch(2), &sequences);
    assert_eq!(rows[0].as_ref().map(|s| s.token), Ok(5), "{rows:?}");
    assert!(
        matches!(&rows[1], Err(RowFailure::Faulted(c)) if c.contains("deadline")),
        "{rows:?}"
    );
}

/// This process's resident set, in MiB.
fn rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb / 1024)
        .expect("VmRSS")
}

#[test]
fn memory_a_call_grew_does_not_stay_resident_after_it() {
    let _alone = crate::whole_process();
    let limits = InstanceLimits {
        memory_bytes: 2048 << 20,
        call_timeout: Duration::from_secs(30),
    };
    let mut sampler = faulty(limits);
    let ordinary = [sequence(1, 1, 0.0)];
    sampler
        .sample(&mut batch(1), &ordinary)
        .expect("an ordinary call");
    let before = rss_mib();

    // The call keeps 512 MiB in the instance; the host drops the instance after it.
    let kept = sampler
        .sample(&mut batch(1), &[sequence(1, SEED_HOARD, 0.0)])
        .expect("the hoarding call succeeds");
    assert_eq!(kept[0].token, 5);
    let after_hoard = rss_mib();
    assert_eq!(sampler.stats().memory_resets, 1);

    // The call grows until the 2048 MiB cap traps it; the trap drops the instance.
    let err = sampler
        .sample(&mut batch(1), &[sequence(1, SEED_GROW, 0.0)])
        .expect_err("the cap traps the call");
    assert!(matches!(err, PluginError::Trap { .. }), "{err}");
    assert!(err.to_string().contains("cap"), "{err}");
    let after_grow = rss_mib();
    eprintln!(
        "resident set: {before} MiB before, {after_hoard} MiB after a call that kept \
         {HOARD_MIB} MiB, {after_grow} MiB after a call that grew to the 2048 MiB cap"
    );
    let margin = HOARD_MIB / 2;
    assert!(
        after_hoard < before + margin,
        "{after_hoard} MiB resident after the hoarding call, {before} MiB before"
    );
    assert!(
        after_grow < before + margin,
        "{after_grow} MiB resident after the capped call, {before} MiB before"
    );
    // And the plugin still serves.
    let sampled = sampler
        .sample(&mut batch(1), &ordinary)
        .expect("a fresh instance");
    assert_eq!(sampled[0].token, 5);
}
