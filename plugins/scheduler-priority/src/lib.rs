//! The priority scheduler plugin with aging: admits waiting requests by priority plus the priority they gained while waiting, so nothing starves.
//!
//! A request's effective priority is its `priority` (the request body's extra
//! field) plus `aging_rate` for every engine step it has spent waiting or
//! preempted. Running requests decode before anything is admitted and are
//! never displaced by a higher priority: a request, once running, finishes
//! within its `max_tokens`, and any waiting one eventually outranks every
//! newcomer, so each request runs in bounded time. When a running request's
//! next token needs a KV block and none is free, the running request with
//! the lowest effective priority is preempted to make room.
//!
//! The aging clock is the engine step number the host passes with every plan:
//! a step is the service every running request gets, so "steps waited"
//! measures how long others were served first, whatever the speed of the
//! device, and steps the host decided without this plugin count too. When
//! each request started waiting lives in the plugin instance; if the host
//! replaces the instance after a fault, waiting requests start aging afresh.

use std::collections::HashMap;

use plughost_sdk::scheduler::{
    Phase, Plan, PlanBuilder, RequestId, RequestView, Resources, Scheduler,
};
use serde::Deserialize;

/// The scheduler's options, from the deployment file's `config` table.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PriorityConfig {
    /// Priority a request gains per engine step spent waiting; 0 turns aging off.
    pub aging_rate: f64,
    /// The most prompt tokens one request computes in one step (chunked prefill).
    pub max_prefill_chunk: u32,
}

impl Default for PriorityConfig {
    fn default() -> Self {
        PriorityConfig {
            aging_rate: 0.05,
            max_prefill_chunk: 512,
        }
    }
}

impl PriorityConfig {
    /// Parses the JSON config; an empty string gives the defaults.
    pub fn from_json(config: &str) -> Result<PriorityConfig, String> {
        let config: PriorityConfig = if config.trim().is_empty() {
            PriorityConfig::default()
        } else {
            serde_json::from_str(config)
                .map_err(|e| format!("invalid priority scheduler config: {e}"))?
        };
        if !(config.aging_rate.is_finite() && config.aging_rate >= 0.0) {
            return Err(format!(
                "aging_rate must be a finite number >= 0, got {}",
                config.aging_rate
            ));
        }
        if config.max_prefill_chunk == 0 {
            return Err("max_prefill_chunk must be at least 1".into());
        }
        Ok(config)
    }
}

/// Priority order with aging; see the module documentation.
#[derive(Debug, Clone, Default)]
pub struct PriorityAging {
    config: PriorityConfig,
    /// The engine step being decided: the aging clock.
    step: u64,
    /// The step at which each waiting or preempted request was first seen waiting.
    waiting_since: HashMap<RequestId, u64>,
}

impl PriorityAging {
    pub fn new(config: PriorityConfig) -> PriorityAging {
        PriorityAging {
            config,
            ..PriorityAging::default()
        }
    }

    /// The request's priority plus what it gained while waiting.
    pub fn effective_priority(&self, request: &RequestView) -> f64 {
        let waited = self
            .waiting_since
            .get(&request.id)
            .map_or(0, |&since| self.step.saturating_sub(since));
        f64::from(request.priority) + self.config.aging_rate * waited as f64
    }

    /// Sets the aging clock to engine step `step` for this step's requests: waiting ones keep
    /// the step they started waiting at, running ones and requests that are gone are forgotten.
    fn observe(&mut self, step: u64, requests: &[RequestView]) {
        self.step = step;
        let mut seen = HashMap::with_capacity(requests.len());
        for request in requests {
            if request.phase != Phase::Running {
                let since = self.waiting_since.get(&request.id).copied().unwrap_or(step);
                seen.insert(request.id, since);
            }
        }
        self.waiting_since = seen;
    }

    /// Requests ordered highest effective priority first; ties go to the earliest arrival.
    fn ranked<'a>(&self, requests: impl Iterator<Item = &'a RequestView>) -> Vec<&'a RequestView> {
        let mut ranked: Vec<&RequestView> = requests.collect();
        ranked.sort_by(|a, b| {
            self.effective_priority(b)
                .total_cmp(&self.effective_priority(a))
                .then(a.arrival_us.cmp(&b.arrival_us))
                .then(a.id.cmp(&b.id))
        });
        ranked
    }
}

impl Scheduler for PriorityAging {
    fn init(config: &str) -> Result<PriorityAging, String> {
        PriorityConfig::from_json(config).map(PriorityAging::new)
    }

    fn schedule(&mut self, step: u64, requests: &[RequestView], resources: &Resources) -> Plan {
        self.observe(step, requests);
        let chunk = self.config.max_prefill_chunk;
        let mut plan = PlanBuilder::new(requests, resources);
        let running = self.ranked(requests.iter().filter(|r| r.phase == Phase::Running));
        // Lowest first: the candidates to preempt when a decode finds no free block.
        let mut victims: Vec<&RequestView> = running.iter().rev().copied().collect();
        for request in &running {
            if plan.is_planned(request.id) || !victims.iter().any(|v| v.id == request.id) {
                continue;
            }
            while plan.run(request, chunk) == 0 && request.pending_len() > 0 {
                // Out of blocks (the budget and slots cannot refuse a running request's first
                // token): free the lowest-ranked running request, possibly this one.
                let Some(victim) = victims.first().copied() else {
                    break;
                };
                victims.remove(0);
                plan.preempt(victim);
                if victim.id == request.id || plan.tokens_left() == 0 {
                    break;
                }
            }
            victims.retain(|v| v.id != request.id);
        }
        for request in self.ranked(requests.iter().filter(|r| r.phase != Phase::Running)) {
            plan.run(request, chunk);
        }
        plan.finish()
    }
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_scheduler!(PriorityAging);

#[cfg(test)]
mod tests {
    use super::*;

    fn request(id: u64, phase: Phase, priority: i32) -> RequestView {
        RequestView {
            id,
            phase,
            priority,
            arrival_us: id * 10,
            prompt_len: 8,
            computed_len: if phase == Phase::Running { 8 } else { 0 },
            cached_prefix_len: 0,
            output_len: if phase == Phase::Running { 1 } else { 0 },
            max_output: 16,
            blocks_held: if phase == Phase::Running { 2 } else { 0 },
        }
    }

    fn resources(max_running: u32, free_blocks: u32) -> Resources {
        Resources {
            token_budget: 256,
            max_running,
            block_size: 4,
            free_blocks,
            total_blocks: 64,
        }
    }

    fn admitted(plan: &Plan) -> Vec<u64> {
        plan.run.iter().map(|s| s.id).collect()
    }

    #[test]
    fn higher_priority_is_admitted_first_and_ties_keep_arrival_order() {
        let mut scheduler = PriorityAging::init(r#"{"aging_rate": 0}"#).unwrap();
        let requests: Vec<RequestView> = [(1, 1), (2, 10), (3, -2), (4, 5), (5, 3), (6, 5)]
            .into_iter()
            .map(|(id, priority)| request(id, Phase::Waiting, priority))
            .collect();
        // One slot per step: the order of admission is the order of the plan's single entry.
        let mut order = Vec::new();
        let mut left = requests.clone();
        for step in 1.. {
            if left.is_empty() {
                break;
            }
            let plan = scheduler.schedule(step, &left, &resources(1, 64));
            let id = admitted(&plan)[0];
            order.push(id);
            left.retain(|r| r.id != id);
        }
        assert_eq!(order, [2, 4, 6, 5, 1, 3]);
    }

    #[test]
    fn a_waiting_request_outranks_newer_higher_priorities_after_enough_steps() {
        // A low-priority request waits behind a running one while priority-5 requests keep
        // arriving: at 0.5 per step it outranks a fresh priority-5 request after 10 steps.
        let mut scheduler = PriorityAging::init(r#"{"aging_rate": 0.5}"#).unwrap();
        let low = request(1, Phase::Waiting, 0);
        let busy = request(2, Phase::Running, 0);
        let mut admitted_low_at = None;
        for step in 0..40u64 {
            let newcomer = request(100 + step, Phase::Waiting, 5);
            let plan = scheduler.schedule(
                step + 1,
                &[busy.clone(), low.clone(), newcomer],
                &resources(2, 64),
            );
            let ids = admitted(&plan);
            assert_eq!(ids[0], 2, "the running request decodes first");
            if ids[1] == 1 {
                admitted_low_at = Some(step);
                break;
            }
        }
        // After 10 steps of waiting it ties (0.5 * 10 = 5), and the earlier arrival wins.
        assert_eq!(admitted_low_at, Some(10));

        let mut without_aging = PriorityAging::init(r#"{"aging_rate": 0}"#).unwrap();
        for step in 0..40u64 {
            let newcomer = request(100 + step, Phase::Waiting, 5);
            let plan = without_aging.schedule(
                step + 1,
                &[busy.clone(), low.clone(), newcomer],
                &resources(2, 64),
            );
            assert_ne!(
                admitted(&plan)[1],
                1,
                "without aging the low request starves"
            );
        }
    }

    #[test]
    fn out_of_blocks_the_lowest_running_request_is_preempted() {
        let mut scheduler = PriorityAging::init("").unwrap();
        // Both running requests hold 2 full blocks; each next token needs a third.
        let high = request(1, Phase::Running, 9);
        let low = request(2, Phase::Running, 1);
        let plan = scheduler.schedule(1, &[high, low], &resources(4, 0));
        assert_eq!(admitted(&plan), [1]);
        // The freed blocks go to the high one's token; the low one recomputes later.
        assert_eq!(plan.preempt, [2]);
    }

    #[test]
    fn the_config_is_checked() {
        assert!(PriorityAging::init("").is_ok());
        assert!(PriorityAging::init(r#"{"aging_rate": -1}"#).is_err());
        assert!(PriorityAging::init(r#"{"max_prefill_chunk": 0}"#).is_err());
        assert!(PriorityAging::init(r#"{"aging": 1}"#).is_err());
    }
}
