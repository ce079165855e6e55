//! The scheduler world on the host side: one call per engine step with request views, returning a plan.

use std::path::Path;

use plughost_sdk::scheduler::{Phase, Plan, RequestView, Resources, Scheduled};

use super::instance::{ContainedInstance, PluginState};
use super::{InstanceLimits, PluginError, PluginRuntime, PluginStats};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit/0.1",
        world: "scheduler",
    });
}

use bindings::plughost::plugin::scheduling as wit;

super::instance::impl_world!(bindings::Scheduler, SchedulerPre, "scheduler");

impl wit::Host for PluginState {}
impl bindings::plughost::plugin::types::Host for PluginState {}

fn view_to_wit(v: &RequestView) -> wit::RequestView {
    wit::RequestView {
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
    }
}

/// A loaded scheduler plugin.
pub struct SchedulerPlugin {
    instance: ContainedInstance<bindings::Scheduler>,
}

impl super::generation::PluginWorld for SchedulerPlugin {
    const WORLD: &'static str = "scheduler";
    type Bindings = bindings::Scheduler;
    fn from_instance(instance: ContainedInstance<bindings::Scheduler>) -> Self {
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

    /// Asks the plugin for this step's plan. The caller validates it against its own state.
    pub fn schedule(
        &mut self,
        requests: &[RequestView],
        resources: &Resources,
    ) -> Result<Plan, PluginError> {
        let views: Vec<wit::RequestView> = requests.iter().map(view_to_wit).collect();
        let resources = wit::Resources {
            token_budget: resources.token_budget,
            max_running: resources.max_running,
            block_size: resources.block_size,
            free_blocks: resources.free_blocks,
            total_blocks: resources.total_blocks,
        };
        let plan = self
            .instance
            .call(|world, store| world.call_schedule(store, &views, resources))?;
        Ok(Plan {
            run: plan
                .run
                .into_iter()
                .map(|s| Scheduled {
                    id: s.id,
                    num_tokens: s.num_tokens,
                })
                .collect(),
            preempt: plan.preempt,
        })
    }
}
