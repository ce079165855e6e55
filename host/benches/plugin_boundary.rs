//! What crossing the plugin boundary costs: a near-empty call, a 256-request schedule, and batch sampling against native.
//!
//! Run with `cargo xtask bench-plugins`, which builds the components first.
//! Every figure is the median of many timed calls in one process, so the
//! plugin and native numbers share the machine's state at that moment.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use plughost::plugins::logits::{LogitsBatch, NativeRow, SeenTokens};
use plughost::plugins::sampler::{SamplerPlugin, SequenceToSample};
use plughost::plugins::scheduler::SchedulerPlugin;
use plughost::plugins::{InstanceLimits, PluginRuntime, RuntimeOptions};
use plughost_sdk::sampler::SamplingParams;
use plughost_sdk::scheduler::{Phase, RequestView, Resources};

const VOCAB: usize = 151_936;
const ROWS: usize = 16;

fn plugin_path(file: &str) -> PathBuf {
    let dir = std::env::var_os("PLUGHOST_PLUGINS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/plugins"));
    let path = dir.join(file);
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask build-plugins`",
        path.display()
    );
    path
}

fn median_of(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// Median wall time of one call of `f`, after warming up.
fn median(iterations: usize, mut f: impl FnMut()) -> Duration {
    for _ in 0..iterations.div_ceil(10) {
        f();
    }
    median_of(
        (0..iterations)
            .map(|_| {
                let started = Instant::now();
                f();
                started.elapsed()
            })
            .collect(),
    )
}

/// Medians of `a` and `b` timed alternately, so both see the same machine load.
fn paired_medians(
    iterations: usize,
    mut a: impl FnMut(),
    mut b: impl FnMut(),
) -> (Duration, Duration) {
    let (mut times_a, mut times_b) = (Vec::new(), Vec::new());
    for i in 0..iterations + iterations.div_ceil(10) {
        let started = Instant::now();
        a();
        let took_a = started.elapsed();
        let started = Instant::now();
        b();
        let took_b = started.elapsed();
        // The first tenth warms caches and the instance up.
        if i >= iterations.div_ceil(10) {
            times_a.push(took_a);
            times_b.push(took_b);
        }
    }
    (median_of(times_a), median_of(times_b))
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn requests(n: u64) -> Vec<RequestView> {
    (0..n)
        .map(|id| RequestView {
            id,
            phase: if id < n / 2 {
                Phase::Running
            } else {
                Phase::Waiting
            },
            priority: 0,
            arrival_us: id,
            prompt_len: 200,
            computed_len: if id < n / 2 { 210 } else { 0 },
            cached_prefix_len: 0,
            output_len: if id < n / 2 { 11 } else { 0 },
            max_output: 128,
            blocks_held: if id < n / 2 { 14 } else { 0 },
        })
        .collect()
}

fn logits() -> Vec<f32> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    (0..ROWS * VOCAB)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 12.0 - 6.0
        })
        .collect()
}

fn bench_scheduler(runtime: &PluginRuntime) {
    let mut fcfs = SchedulerPlugin::load(
        runtime,
        &plugin_path("plughost_scheduler_fcfs.wasm"),
        "",
        InstanceLimits::default(),
    )
    .expect("fcfs loads");
    let resources = Resources {
        token_budget: 8192,
        max_running: 256,
        block_size: 16,
        free_blocks: 100_000,
        total_blocks: 100_000,
    };
    let empty = median(20_000, || {
        fcfs.schedule(1, &[], &resources).expect("schedule");
    });
    let views = requests(256);
    let full = median(2_000, || {
        fcfs.schedule(1, &views, &resources).expect("schedule");
    });
    let native_policy = {
        use plughost_sdk::scheduler::Scheduler;
        let mut native = plughost_scheduler_fcfs::Fcfs::init("").expect("native fcfs");
        median(2_000, || {
            std::hint::black_box(native.schedule(1, &views, &resources));
        })
    };
    println!(
        "{:<52} {:>10.2} µs",
        "near-empty plugin call (schedule, 0 requests)",
        micros(empty)
    );
    println!(
        "{:<52} {:>10.2} µs",
        "scheduler call, 256 request views (plugin)",
        micros(full)
    );
    println!(
        "{:<52} {:>10.2} µs",
        "same FCFS policy, native",
        micros(native_policy)
    );
}

fn bench_sampling(runtime: &PluginRuntime, name: &str, params: SamplingParams) {
    let mut sampler = SamplerPlugin::load(
        runtime,
        &plugin_path("plughost_sampler_standard.wasm"),
        "",
        InstanceLimits::default(),
    )
    .expect("sampler loads");
    let values = logits();
    let sequences: Vec<SequenceToSample> = (0..ROWS as u64)
        .map(|request| SequenceToSample {
            request,
            position: 3,
            params,
        })
        .collect();
    let mut batch = LogitsBatch::new(values.clone(), VOCAB);
    let mut native_values = values;
    let history = SeenTokens::default();
    let (through_plugin, native) = paired_medians(
        100,
        || {
            std::hint::black_box(sampler.sample(&mut batch, &sequences).expect("sample"));
        },
        || {
            for (row, seq) in native_values.chunks_mut(VOCAB).zip(&sequences) {
                let row = NativeRow::new(row, &history);
                std::hint::black_box(plughost_sampler_standard::sample_sequence(
                    &row,
                    &seq.params,
                    seq.request,
                    seq.position,
                ));
            }
        },
    );
    println!(
        "{:<30} plugin {:>9.1} µs   native {:>9.1} µs   ratio {:.3}",
        name,
        micros(through_plugin),
        micros(native),
        through_plugin.as_secs_f64() / native.as_secs_f64()
    );
}

fn main() {
    let cache = std::env::temp_dir().join("plughost-bench-component-cache");
    let runtime = PluginRuntime::new(RuntimeOptions {
        cache_dir: Some(cache),
    })
    .expect("plugin runtime");
    println!("plugin boundary (median per call)");
    bench_scheduler(&runtime);
    println!("\nsampling {ROWS} rows x {VOCAB} logits, one call per batch");
    bench_sampling(&runtime, "greedy", SamplingParams::GREEDY);
    let sampled = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: 7,
        logprobs: true,
        num_top_logprobs: 5,
        ..SamplingParams::GREEDY
    };
    bench_sampling(&runtime, "temperature 0.8, top_p 0.95", sampled);
    bench_sampling(
        &runtime,
        "temperature 0.8, top_k 50",
        SamplingParams {
            top_k: 50,
            top_p: 1.0,
            ..sampled
        },
    );
    bench_sampling(
        &runtime,
        "temperature 1.0 only",
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            logprobs: false,
            num_top_logprobs: 0,
            ..sampled
        },
    );
}
