//! The scheduler side of a step: the plan (the scheduler plugin's, checked, or the built-in FCFS), preemption, and admission with KV blocks.

use std::time::Instant;

use crate::plugins::generation::{LoadedComponent, Slot};
use crate::plugins::scheduler::SchedulerPlugin;
use crate::plugins::{OnFailure, PluginError};
use crate::sched::{self, Plan, RequestView, Resources};

use super::super::state::RequestState;
use super::EngineCore;
use super::offload::relookup_prefix;
use super::sample::rejection;

impl EngineCore {
    /// Why `state` can never finish in this engine, if so. The API refuses such requests
    /// before they get here; this guards every other caller of the engine.
    pub(super) fn never_runs(&self, state: &RequestState) -> Option<String> {
        let prompt_len = state.prompt().len() as u64;
        if prompt_len == 0 {
            return Some("the prompt is empty".into());
        }
        let max_tokens = u64::from(state.request.max_tokens);
        let max_model_len = u64::from(self.limits.max_model_len);
        if prompt_len + max_tokens > max_model_len {
            return Some(format!(
                "the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the \
                 context of {max_model_len} tokens"
            ));
        }
        let block_size = u64::from(self.kv.block_size().max(1));
        let blocks = (prompt_len + max_tokens).div_ceil(block_size);
        if blocks > u64::from(self.kv.num_blocks()) {
            return Some(format!(
                "{} tokens need {blocks} KV blocks of {block_size}; the cache has {}",
                prompt_len + max_tokens,
                self.kv.num_blocks()
            ));
        }
        None
    }

    /// Nothing runs and the built-in FCFS, which admits the oldest request whenever it fits
    /// the free cache, admitted none: the oldest can never run. Failing it keeps the rest
    /// moving; waiting would spin forever.
    pub(super) fn fail_unschedulable(&mut self) {
        let Some(state) = self.requests.oldest_waiting() else {
            return;
        };
        let block_size = self.kv.block_size().max(1);
        let needed = (state.tokens().len() as u32).div_ceil(block_size);
        let message = format!(
            "the request cannot be scheduled: its {} tokens need {needed} KV blocks of \
             {block_size}, the cache has {} ({} free), at most {} tokens per step and {} \
             sequences",
            state.tokens().len(),
            self.kv.num_blocks(),
            self.kv.num_free_blocks(),
            self.limits.max_num_batched_tokens,
            self.limits.max_num_seqs,
        );
        let id = state.id;
        self.fail_requests(&[id], &message);
    }

    fn views(&self) -> Vec<RequestView> {
        self.requests
            .views(|id| self.kv.block_table(id).len() as u32)
    }

    /// The scheduler plugin's plan for this step, checked. A refused plan, a plugin fault, and a
    /// plan that neither runs nor preempts anything while requests are queued or running (it
    /// would stop the engine for good, since nothing changes between steps) are faults of the
    /// component. A faulted or backed-off scheduler gets its failure policy: under `fallback`
    /// the built-in FCFS decides the step; under `reject` the waiting requests fail and FCFS
    /// runs on the ones already running.
    pub(super) fn schedule(&mut self) -> Plan {
        let views = self.views();
        let resources = self.resources();
        let deployment = self.deployment.clone();
        let Some(component) = deployment.scheduler() else {
            return sched::fallback_plan(&views, &resources);
        };
        let failure = match Self::plan_from(component, self.num_steps, &views, &resources) {
            Ok(plan) => return plan,
            Err(failure) => failure,
        };
        self.metrics.scheduler_fallbacks.inc();
        if component.faults().on_failure() == OnFailure::Reject {
            let rejection = rejection(Slot::Scheduler, component.name(), failure.into());
            let waiting = self.requests.waiting().to_vec();
            for id in waiting {
                self.reject(id, rejection.clone());
            }
            return sched::fallback_plan(&self.views(), &resources);
        }
        sched::fallback_plan(&views, &resources)
    }

    /// The component's checked plan for step `step`; a fault is counted against its failure
    /// policy.
    fn plan_from(
        component: &LoadedComponent<SchedulerPlugin>,
        step: u64,
        views: &[RequestView],
        resources: &Resources,
    ) -> Result<Plan, PluginError> {
        let plan = match component.plugin().schedule(step, views, resources) {
            Ok(plan) => plan,
            Err(e) => {
                if e.is_unavailable() {
                    tracing::debug!("{e}; the scheduler's failure policy decides this step");
                } else {
                    tracing::warn!(
                        "scheduler plugin failed: {e}; its failure policy decides this step"
                    );
                }
                return Err(e);
            }
        };
        let refused = match sched::validate_plan(&plan, views, resources) {
            Err(e) => Some(format!("invalid plan: {e}")),
            Ok(()) if plan.run.is_empty() && plan.preempt.is_empty() && !views.is_empty() => {
                Some(format!(
                    "a plan that runs nothing with {} requests queued or running",
                    views.len()
                ))
            }
            Ok(()) => None,
        };
        match refused {
            None => Ok(plan),
            Some(message) => {
                let error = PluginError::Refused {
                    plugin: component.name(),
                    message,
                };
                tracing::warn!("{error}; its failure policy decides this step");
                component.faults().record_fault(&error);
                Err(error)
            }
        }
    }

    fn resources(&self) -> Resources {
        Resources {
            token_budget: self.limits.max_num_batched_tokens,
            max_running: self.limits.max_num_seqs,
            block_size: self.kv.block_size(),
            free_blocks: self.kv.num_free_blocks(),
            total_blocks: self.kv.num_blocks(),
        }
    }

    /// Frees the KV blocks of `ids` and puts them back in the waiting queue, to be recomputed
    /// (less what the prefix cache still holds) when admitted again.
    pub(super) fn preempt(&mut self, ids: &[u64]) {
        for &id in ids {
            self.kv.free(id);
            let Some(state) = self.requests.preempt(id) else {
                continue;
            };
            tracing::debug!(
                request = id,
                request_id = state.request_id(),
                "preempted: its KV blocks are freed and it waits to run again"
            );
            relookup_prefix(&mut self.kv, self.offload.as_mut(), &self.metrics, state);
            self.metrics.preemptions.inc();
        }
    }

    /// Allocates KV blocks for the plan's requests; returns (request, tokens) in batch order.
    pub(super) fn admit(&mut self, plan: &Plan) -> Vec<(u64, u32)> {
        let mut scheduled = Vec::with_capacity(plan.run.len());
        for s in &plan.run {
            let Some(state) = self.requests.get_mut(s.id) else {
                continue;
            };
            let total = state.num_computed + s.num_tokens;
            let prefix = state.pending_prefix.take();
            if self.kv.allocate(s.id, total, prefix.as_ref()).is_none() {
                // Validation counted the blocks, so this happens when the cached prefix found at
                // admission was evicted meanwhile: look it up again and wait for the next step.
                match prefix {
                    Some(p) if !self.kv.is_prefix_cached(&p) => {
                        relookup_prefix(&mut self.kv, self.offload.as_mut(), &self.metrics, state);
                    }
                    other => state.pending_prefix = other,
                }
                tracing::debug!(
                    request = s.id,
                    request_id = state.request_id(),
                    "no KV blocks for a planned request; it waits"
                );
                continue;
            }
            let first_time = state.first_scheduled.is_none();
            if self.requests.start_running(s.id)
                && first_time
                && let Some(state) = self.requests.get_mut(s.id)
            {
                state.first_scheduled = Some(Instant::now());
                self.metrics
                    .queue_time
                    .observe(state.arrival.elapsed().as_secs_f64());
            }
            // Blocks a lower tier supplied go into the device blocks just allocated for them.
            self.install_loaded(s.id);
            scheduled.push((s.id, s.num_tokens));
        }
        scheduled
    }
}
