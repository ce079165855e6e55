//! The server's Prometheus metrics: request latencies, queue and KV state, prefix cache, step time split.

use prometheus::{
    CounterVec, Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::kv_tier_metrics::KvTierMetrics;
use crate::load_metrics::{LoadGauges, MetricNames};

/// Every metric the engine records: plughost's in one registry (names prefixed `plughost_`),
/// the vLLM-named mirrors of the load gauges, when asked for, in another.
pub struct Metrics {
    registry: Registry,
    /// Metrics under names of other servers (no prefix).
    foreign: Registry,
    /// Waiting and running requests, KV usage and the cache geometry, per served model.
    pub load: LoadGauges,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_latency: Histogram,
    pub queue_time: Histogram,
    pub kv_blocks_free: IntGauge,
    pub prefix_cache_queries: IntCounter,
    pub prefix_cache_hits: IntCounter,
    pub preemptions: IntCounter,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub requests_finished: IntCounterVec,
    pub scheduler_fallbacks: IntCounter,
    pub sampler_fallbacks: IntCounter,
    /// Tokens a sampler plugin returned that the request's grammar forbids, each replaced by a
    /// native draw from the masked row.
    pub grammar_rejections: IntCounter,
    /// Requests that ended at a grammar dead end (no token allowed).
    pub grammar_dead_ends: IntCounter,
    pub device_step_retries: IntCounter,
    pub device_restarts: IntCounter,
    /// Step time by part: `schedule`, `prepare_inputs`, `dispatch`, `device`, `read_logits`, `sample`, `emit`;
    /// with KV tiers below the device also `kv_store` and `kv_load`.
    pub step_seconds: HistogramVec,
    /// The device's own counters, copied after every step and at shutdown.
    pub device: IntGaugeVec,
    /// Device time spent in each callable's launches (`linear`, `paged_attention`...), for a
    /// device that reports it, by kind of step: `decode` or `prefill`.
    pub device_callable_seconds: CounterVec,
    /// Steps in which every sequence computed the one token after its last: with
    /// `device_callable_seconds{step="decode"}`, what a decode step spends in each callable.
    pub decode_steps: IntCounter,
    /// Deployment reloads by result, `ok` or `error`.
    pub deployment_reloads: IntCounterVec,
    /// The number of the active deployment generation; 1 at start, one more per reload.
    pub deployment_generation: IntGauge,
    /// 1 for each component of the active deployment, by slot, file, sha256 and WIT version.
    pub plugin_info: IntGaugeVec,
    /// Per component of the active deployment (slot, file stem), 1 for its failure-policy
    /// state (`active`, `backing_off`, `disabled`) and 0 for the others.
    pub plugin_state: IntGaugeVec,
    /// Faults of each component of the active deployment since it loaded.
    pub plugin_faults: IntGaugeVec,
    /// The KV tiers below the device (`--kv-offload-*`).
    pub kv_tiers: KvTierMetrics,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const STEP_BUCKETS: &[f64] = &[
    0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5,
];

fn histogram(registry: &Registry, name: &str, help: &str, buckets: &[f64]) -> Histogram {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("valid histogram options");
    registry
        .register(Box::new(h.clone()))
        .expect("metric names are unique");
    h
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid counter options");
    registry
        .register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid gauge options");
    registry
        .register(Box::new(g.clone()))
        .expect("metric names are unique");
    g
}

impl Metrics {
    /// plughost's names only.
    pub fn new() -> Metrics {
        Metrics::with_names(MetricNames::Plughost)
    }

    pub fn with_names(names: MetricNames) -> Metrics {
        let registry =
            Registry::new_custom(Some("plughost".into()), None).expect("valid registry prefix");
        let foreign = Registry::new();
        let load = LoadGauges::register(&registry, &foreign, names);
        let r = &registry;
        let requests_finished = IntCounterVec::new(
            Opts::new(
                "requests_finished_total",
                "Finished requests by finish reason",
            ),
            &["reason"],
        )
        .expect("valid counter options");
        registry
            .register(Box::new(requests_finished.clone()))
            .expect("metric names are unique");
        let step_seconds = HistogramVec::new(
            HistogramOpts::new(
                "step_seconds",
                "Engine step time by part; device is reported by the device",
            )
            .buckets(STEP_BUCKETS.to_vec()),
            &["part"],
        )
        .expect("valid histogram options");
        registry
            .register(Box::new(step_seconds.clone()))
            .expect("metric names are unique");
        let device = IntGaugeVec::new(
            Opts::new("device", "The device's counters: allocations, frees, live allocations and bytes, bytes and calls each way, launches"),
            &["counter"],
        )
        .expect("valid gauge options");
        registry
            .register(Box::new(device.clone()))
            .expect("metric names are unique");
        let device_callable_seconds = CounterVec::new(
            Opts::new(
                "device_callable_seconds_total",
                "Device time spent in each callable's launches, for a device that reports it, by kind of step (decode: one token after the prompt for every sequence; prefill: any other)",
            ),
            &["callable", "step"],
        )
        .expect("valid counter options");
        registry
            .register(Box::new(device_callable_seconds.clone()))
            .expect("metric names are unique");
        let deployment_reloads = IntCounterVec::new(
            Opts::new(
                "deployment_reloads_total",
                "Deployment reloads by result (ok, error)",
            ),
            &["result"],
        )
        .expect("valid counter options");
        registry
            .register(Box::new(deployment_reloads.clone()))
            .expect("metric names are unique");
        // Both series exist from the start, so a scraper sees 0 rather than nothing.
        for result in ["ok", "error"] {
            deployment_reloads.with_label_values(&[result]);
        }
        let plugin_info = IntGaugeVec::new(
            Opts::new(
                "plugin_info",
                "The components of the active deployment: 1 per slot, file, hash and WIT version",
            ),
            &["slot", "component", "sha256", "wit_version"],
        )
        .expect("valid gauge options");
        registry
            .register(Box::new(plugin_info.clone()))
            .expect("metric names are unique");
        let plugin_state = IntGaugeVec::new(
            Opts::new(
                "plugin_state",
                "Failure-policy state of each active component: 1 for its state, 0 for the others",
            ),
            &["slot", "component", "state"],
        )
        .expect("valid gauge options");
        registry
            .register(Box::new(plugin_state.clone()))
            .expect("metric names are unique");
        let plugin_faults = IntGaugeVec::new(
            Opts::new(
                "plugin_faults",
                "Faults of each active component since it loaded (traps, timeouts, errors, refused output)",
            ),
            &["slot", "component"],
        )
        .expect("valid gauge options");
        registry
            .register(Box::new(plugin_faults.clone()))
            .expect("metric names are unique");
        Metrics {
            kv_tiers: KvTierMetrics::register(r),
            foreign,
            load,
            device,
            deployment_reloads,
            plugin_info,
            plugin_state,
            plugin_faults,
            deployment_generation: gauge(
                r,
                "deployment_generation",
                "The active deployment generation, one more per successful reload",
            ),
            time_to_first_token: histogram(
                r,
                "time_to_first_token_seconds",
                "Arrival to first generated token",
                LATENCY_BUCKETS,
            ),
            inter_token_latency: histogram(
                r,
                "inter_token_latency_seconds",
                "Time between consecutive tokens of a request",
                LATENCY_BUCKETS,
            ),
            e2e_latency: histogram(
                r,
                "e2e_request_latency_seconds",
                "Arrival to finish",
                LATENCY_BUCKETS,
            ),
            queue_time: histogram(
                r,
                "request_queue_time_seconds",
                "Arrival to first scheduling",
                LATENCY_BUCKETS,
            ),
            kv_blocks_free: gauge(r, "kv_cache_free_blocks", "KV blocks no request holds"),
            prefix_cache_queries: counter(
                r,
                "prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache",
            ),
            prefix_cache_hits: counter(
                r,
                "prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache",
            ),
            preemptions: counter(r, "num_preemptions_total", "Requests preempted (recompute)"),
            prompt_tokens: counter(
                r,
                "prompt_tokens_total",
                "Prompt tokens of admitted requests",
            ),
            generation_tokens: counter(r, "generation_tokens_total", "Generated tokens"),
            requests_finished,
            scheduler_fallbacks: counter(
                r,
                "scheduler_fallbacks_total",
                "Steps scheduled by the built-in FCFS after a scheduler plugin fault, a refused or empty plan, or while it is backed off",
            ),
            sampler_fallbacks: counter(
                r,
                "sampler_fallbacks_total",
                "Rows sampled natively because the sampler plugin failed them or was backed off (on_failure = \"fallback\")",
            ),
            grammar_rejections: counter(
                r,
                "grammar_rejections_total",
                "Sampled tokens the request's grammar forbids, rejected and drawn again natively",
            ),
            grammar_dead_ends: counter(
                r,
                "grammar_dead_ends_total",
                "Requests ended because their grammar allowed no token",
            ),
            device_step_retries: counter(
                r,
                "device_step_retries_total",
                "Device steps recomputed after a failed launch or synchronize",
            ),
            device_restarts: counter(
                r,
                "device_restarts_total",
                "Device worker processes started again after one crashed or hung",
            ),
            decode_steps: counter(
                r,
                "decode_steps_total",
                "Engine steps in which every sequence computed the one token after its last",
            ),
            step_seconds,
            device_callable_seconds,
            registry,
        }
    }

    /// Copies the device's counters into the `device` gauges.
    pub fn record_device(&self, stats: &crate::device::DeviceStats) {
        for (name, value) in [
            ("allocations", stats.allocations),
            ("frees", stats.frees),
            ("live_allocations", stats.live_allocations),
            ("live_bytes", stats.live_bytes),
            ("h2d_bytes", stats.h2d_bytes),
            ("h2d_calls", stats.h2d_calls),
            ("d2h_bytes", stats.d2h_bytes),
            ("d2h_calls", stats.d2h_calls),
            ("launches", stats.launches),
        ] {
            self.device.with_label_values(&[name]).set(value as i64);
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let families = self.load.read_consistently(|| {
            let mut families = self.registry.gather();
            families.extend(self.foreign.gather());
            families
        });
        if TextEncoder::new().encode(&families, &mut out).is_err() {
            return String::new();
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
