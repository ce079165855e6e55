//! The load gauges a router picks replicas by: waiting and running requests, KV usage as a 0..1 fraction and the cache geometry, labelled with the served model, under plughost's names and, on request, vLLM's.
//!
//! The Gateway API inference extension's endpoint picker reads these three gauges and the
//! cache's block size from every replica; its metric names are flags whose defaults are
//! vLLM's. `--metrics-names vllm` exports the same values a second time under those names.

use std::sync::{Mutex, OnceLock};

use prometheus::{Gauge, GaugeVec, Opts, Registry};

/// Which names `/metrics` carries the load gauges under.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MetricNames {
    /// `plughost_num_requests_waiting` and the rest.
    #[default]
    Plughost,
    /// Those, and the same values as `vllm:num_requests_waiting`, `vllm:num_requests_running`,
    /// `vllm:kv_cache_usage_perc` and `vllm:cache_config_info`.
    Vllm,
}

/// The KV cache's shape, as `cache_config_info` labels it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    pub block_size: u32,
    pub num_blocks: u32,
    /// `f32`, `f16` or `bf16`.
    pub dtype: String,
}

/// One naming of the gauges.
struct Family {
    waiting: GaugeVec,
    running: GaugeVec,
    kv_usage: GaugeVec,
    cache_config: GaugeVec,
}

impl Family {
    /// Registers the gauges in `registry`; names are `prefix` + the vLLM-style suffix.
    fn register(registry: &Registry, prefix: &str, num_blocks_label: &'static str) -> Family {
        let vec = |name: &str, help: &str, labels: &[&str]| {
            let gauge = GaugeVec::new(Opts::new(format!("{prefix}{name}"), help), labels)
                .expect("valid gauge options");
            registry
                .register(Box::new(gauge.clone()))
                .expect("metric names are unique");
            gauge
        };
        Family {
            waiting: vec(
                "num_requests_waiting",
                "Requests waiting or preempted",
                &["model_name"],
            ),
            running: vec(
                "num_requests_running",
                "Requests holding KV blocks",
                &["model_name"],
            ),
            kv_usage: vec(
                "kv_cache_usage_perc",
                "KV blocks held by requests, as a fraction from 0 to 1",
                &["model_name"],
            ),
            cache_config: vec(
                "cache_config_info",
                "1, labelled with the KV cache's block size, block count and element type",
                &["model_name", "block_size", num_blocks_label, "cache_dtype"],
            ),
        }
    }
}

/// The gauges of the served model, once it is known.
struct ModelGauges {
    waiting: Vec<Gauge>,
    running: Vec<Gauge>,
    kv_usage: Vec<Gauge>,
}

/// The load gauges in every naming asked for.
pub struct LoadGauges {
    families: Vec<Family>,
    model: OnceLock<ModelGauges>,
    /// Held while the namings are updated and while they are read, so a scrape never sees
    /// one naming a step ahead of the other.
    consistent: Mutex<()>,
}

impl LoadGauges {
    /// Registers plughost's names in `own` (its prefix applies) and, for `vllm`, vLLM's in
    /// `bare` (a registry without prefix).
    pub fn register(own: &Registry, bare: &Registry, names: MetricNames) -> LoadGauges {
        let mut families = vec![Family::register(own, "", "num_blocks")];
        if names == MetricNames::Vllm {
            families.push(Family::register(bare, "vllm:", "num_gpu_blocks"));
        }
        LoadGauges {
            families,
            model: OnceLock::new(),
            consistent: Mutex::new(()),
        }
    }

    /// Names the served model and its cache; the gauges exist, at 0, from here on.
    pub fn describe_model(&self, model: &str, cache: &CacheConfig) {
        for family in &self.families {
            family
                .cache_config
                .with_label_values(&[
                    model,
                    &cache.block_size.to_string(),
                    &cache.num_blocks.to_string(),
                    &cache.dtype,
                ])
                .set(1.0);
        }
        let children = |pick: fn(&Family) -> &GaugeVec| -> Vec<Gauge> {
            self.families
                .iter()
                .map(|f| pick(f).with_label_values(&[model]))
                .collect()
        };
        let _ = self.model.set(ModelGauges {
            waiting: children(|f| &f.waiting),
            running: children(|f| &f.running),
            kv_usage: children(|f| &f.kv_usage),
        });
    }

    /// The engine's load after a step.
    pub fn set(&self, waiting: usize, running: usize, kv_usage: f64) {
        let Some(gauges) = self.model.get() else {
            return;
        };
        let _consistent = self.consistent.lock().unwrap_or_else(|p| p.into_inner());
        for g in &gauges.waiting {
            g.set(waiting as f64);
        }
        for g in &gauges.running {
            g.set(running as f64);
        }
        for g in &gauges.kv_usage {
            g.set(kv_usage.clamp(0.0, 1.0));
        }
    }

    /// Runs `read` (a scrape) with every naming at the same update.
    pub fn read_consistently<R>(&self, read: impl FnOnce() -> R) -> R {
        let _consistent = self.consistent.lock().unwrap_or_else(|p| p.into_inner());
        read()
    }
}
