//! The FCFS scheduler plugin: the `Scheduler` implementation and, in the component, its export.
//!
//! The policy lives in [`policy`] as plain Rust so tests and the host's
//! benchmarks run the same code natively; only the wasm32 build exports the
//! `scheduler` world.

pub mod policy;

pub use policy::{FcfsConfig, schedule};

use plughost_sdk::scheduler::{Plan, RequestView, Resources, Scheduler};

/// First come, first served with chunked prefill and recompute preemption.
#[derive(Debug, Clone, Default)]
pub struct Fcfs {
    config: FcfsConfig,
}

impl Fcfs {
    pub fn new(config: FcfsConfig) -> Fcfs {
        Fcfs { config }
    }

    pub fn config(&self) -> &FcfsConfig {
        &self.config
    }
}

impl Scheduler for Fcfs {
    fn init(config: &str) -> Result<Fcfs, String> {
        FcfsConfig::from_json(config).map(Fcfs::new)
    }

    fn schedule(&mut self, _step: u64, requests: &[RequestView], resources: &Resources) -> Plan {
        policy::schedule(requests, resources, &self.config)
    }
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_scheduler!(Fcfs);
