//! The scheduler world on the host side: one call per engine step with the step number and request views, returning a plan.
//!
//! A 0.2 component gets the step number; a 0.1 component, whose `schedule` has no such
//! argument, gets the same views and resources without it.

use std::path::Path;

use plughost_sdk::scheduler::{Plan, RequestView, Resources};

use super::instance::{ContainedInstance, PluginState};
use super::versioned::{Versioned, impl_world_bindings};
use super::{InstanceLimits, PluginError, PluginRuntime, PluginStats};

/// One version's scheduler bindings, generated from the WIT in folder `$wit`, and its
/// `schedule`: the host's records as the version's generated ones (both versions' records have
/// the same fields) and back, with the version's call (`$call`) in between.
macro_rules! scheduler_version {
    ($wit:tt, |$world:ident, $store:ident, $step:ident, $views:ident, $resources:ident| $call:expr) => {
        mod bindings {
            wasmtime::component::bindgen!({
                path: $wit,
                world: "scheduler",
            });
        }
        pub(super) use bindings::Scheduler;
        use bindings::plughost::plugin::scheduling as wit;
        use plughost_sdk::scheduler::{Phase, Plan, RequestView, Resources, Scheduled};

        use super::{PluginState, impl_world_bindings};

        impl_world_bindings!(bindings::Scheduler, SchedulerPre, "scheduler");

        pub(super) fn schedule(
            $world: &Scheduler,
            $store: &mut wasmtime::Store<PluginState>,
            $step: u64,
            requests: &[RequestView],
            resources: &Resources,
        ) -> wasmtime::Result<Plan> {
            let $views = &views(requests);
            let $resources = self::resources(resources);
            $call.map(plan)
        }

        pub(super) fn views(requests: &[RequestView]) -> Vec<wit::RequestView> {
            requests
                .iter()
                .map(|v| wit::RequestView {
                    id: v.id,
                    phase: match v.phase {
                        Phase::Waiting => wit::Phase::Waiting,
                        Phase::Running => wit::Phase::Running,
                        Phase::Preempted => wit::Phase::Preempted,
                    },
                    priority: v.priority,
                    arrival_us: v.arrival_us,
                    prompt_len: v.prompt_len,
                    computed_len: v.computed_len,
                    cached_prefix_len: v.cached_prefix_len,
                    output_len: v.output_len,
                    max_output: v.max_output,
                    blocks_held: v.blocks_held,
                })
                .collect()
        }

        pub(super) fn resources(r: &Resources) -> wit::Resources {
            wit::Resources {
                token_budget: r.token_budget,
                max_running: r.max_running,
                block_size: r.block_size,
                free_blocks: r.free_blocks,
                total_blocks: r.total_blocks,
            }
        }

        pub(super) fn plan(plan: wit::Plan) -> Plan {
            Plan {
                run: plan
                    .run
                    .into_iter()
                    .map(|s| Scheduled {
                        id: s.id,
                        num_tokens: s.num_tokens,
                    })
                    .collect(),
                preempt: plan.preempt,
            }
        }

        impl wit::Host for PluginState {}
        impl bindings::plughost::plugin::types::Host for PluginState {}
    };
}

/// `plughost:plugin@0.1`: the adapter drops the step number, which this version lacks.
mod v0_1 {
    scheduler_version!("../wit/0.1", |world, store, _step, views, resources| world
        .call_schedule(store, views, resources));
}

/// `plughost:plugin@0.2`, the host's own.
mod v0_2 {
    scheduler_version!("../wit/0.2", |world, store, step, views, resources| world
        .call_schedule(store, step, views, resources));
}

type Bindings = Versioned<v0_1::Scheduler, v0_2::Scheduler>;

/// A loaded scheduler plugin.
pub struct SchedulerPlugin {
    instance: ContainedInstance<Bindings>,
}

impl super::generation::PluginWorld for SchedulerPlugin {
    const WORLD: &'static str = "scheduler";
    type Bindings = Bindings;
    fn from_instance(instance: ContainedInstance<Bindings>) -> Self {
        SchedulerPlugin { instance }
    }
}

impl SchedulerPlugin {
    pub fn load(
        runtime: &PluginRuntime,
        path: &Path,
        config: &str,
        limits: InstanceLimits,
    ) -> Result<Self, PluginError> {
        Ok(SchedulerPlugin {
            instance: runtime.instantiate(path, config, limits)?,
        })
    }

    pub fn stats(&self) -> PluginStats {
        self.instance.stats()
    }

    /// Asks the plugin for the plan of engine step `step`. The caller validates it against its
    /// own state.
    pub fn schedule(
        &mut self,
        step: u64,
        requests: &[RequestView],
        resources: &Resources,
    ) -> Result<Plan, PluginError> {
        self.instance.call(|world, store| match world {
            Versioned::V0_1(world) => v0_1::schedule(world, store, step, requests, resources),
            Versioned::V0_2(world) => v0_2::schedule(world, store, step, requests, resources),
        })
    }
}
