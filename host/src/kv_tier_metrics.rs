//! The KV tiers' Prometheus metrics: prefix hits in tokens per tier, blocks and bytes moved each way between the device and the tiers below it, load latency, and each tier's usage and capacity.

use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGaugeVec, Opts, Registry};

use crate::kv::offload::{KvOffload, TierName};

const LOAD_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Directions of the copies between the device and the tiers below it.
#[derive(Clone, Copy, Debug)]
pub enum Direction {
    /// Device to host: a block stored when it became cached-free.
    Store,
    /// Host to device: a block loaded for a prefix hit below the device.
    Load,
}

impl Direction {
    fn label(self) -> &'static str {
        match self {
            Direction::Store => "device_to_host",
            Direction::Load => "host_to_device",
        }
    }
}

pub struct KvTierMetrics {
    hit_tokens: IntCounterVec,
    blocks_moved: IntCounterVec,
    bytes_moved: IntCounterVec,
    load_seconds: Histogram,
    usage_bytes: IntGaugeVec,
    capacity_bytes: IntGaugeVec,
    blocks: IntGaugeVec,
    disk_faults: IntGaugeVec,
}

fn register<T: prometheus::core::Collector + Clone + 'static>(registry: &Registry, metric: T) -> T {
    registry
        .register(Box::new(metric.clone()))
        .expect("metric names are unique");
    metric
}

impl KvTierMetrics {
    pub fn register(registry: &Registry) -> KvTierMetrics {
        let counters = |name: &str, help: &str, label: &str| {
            let vec = IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid options");
            register(registry, vec)
        };
        let gauges = |name: &str, help: &str, label: &str| {
            let vec = IntGaugeVec::new(Opts::new(name, help), &[label]).expect("valid options");
            register(registry, vec)
        };
        let metrics = KvTierMetrics {
            hit_tokens: counters(
                "kv_tier_hit_tokens_total",
                "Prompt tokens whose keys and values came from a KV tier (device, memory, disk)",
                "tier",
            ),
            blocks_moved: counters(
                "kv_tier_blocks_moved_total",
                "KV blocks copied between the device and the tiers below it, by direction",
                "direction",
            ),
            bytes_moved: counters(
                "kv_tier_bytes_moved_total",
                "Bytes of KV blocks copied between the device and the tiers below it, by direction",
                "direction",
            ),
            load_seconds: register(
                registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "kv_tier_load_seconds",
                        "From a prefix hit below the device to its blocks written into the device",
                    )
                    .buckets(LOAD_BUCKETS.to_vec()),
                )
                .expect("valid histogram options"),
            ),
            usage_bytes: gauges(
                "kv_tier_usage_bytes",
                "Bytes of KV blocks each tier below the device holds",
                "tier",
            ),
            capacity_bytes: gauges(
                "kv_tier_capacity_bytes",
                "Bytes of KV blocks each tier below the device can hold",
                "tier",
            ),
            blocks: gauges(
                "kv_tier_blocks",
                "KV blocks each tier below the device holds",
                "tier",
            ),
            disk_faults: gauges(
                "kv_tier_disk_faults",
                "Block files skipped because a check failed (corrupt), and blocks not written (dropped)",
                "fault",
            ),
        };
        for tier in ["device", "memory", "disk"] {
            metrics.hit_tokens.with_label_values(&[tier]);
        }
        for direction in [Direction::Store, Direction::Load] {
            metrics.blocks_moved.with_label_values(&[direction.label()]);
            metrics.bytes_moved.with_label_values(&[direction.label()]);
        }
        metrics
    }

    /// Prompt tokens found in `tier` (`device`, `memory` or `disk`).
    pub fn hit(&self, tier: &str, tokens: u64) {
        self.hit_tokens.with_label_values(&[tier]).inc_by(tokens);
    }

    pub fn moved(&self, direction: Direction, blocks: u64, bytes: u64) {
        let label = direction.label();
        self.blocks_moved.with_label_values(&[label]).inc_by(blocks);
        self.bytes_moved.with_label_values(&[label]).inc_by(bytes);
    }

    pub fn loaded_in(&self, seconds: f64) {
        self.load_seconds.observe(seconds);
    }

    /// Copies each tier's usage and the disk's fault counts.
    pub fn publish(&self, offload: &KvOffload) {
        for tier in [TierName::Memory, TierName::Disk] {
            if let Some(usage) = offload.usage(tier) {
                let label = [tier.label()];
                self.usage_bytes
                    .with_label_values(&label)
                    .set(usage.bytes as i64);
                self.capacity_bytes
                    .with_label_values(&label)
                    .set(usage.capacity_bytes as i64);
                self.blocks
                    .with_label_values(&label)
                    .set(usage.blocks as i64);
            }
        }
        let (corrupt, dropped) = offload.disk_faults();
        self.disk_faults
            .with_label_values(&["corrupt"])
            .set(corrupt as i64);
        self.disk_faults
            .with_label_values(&["dropped"])
            .set(dropped as i64);
    }
}
