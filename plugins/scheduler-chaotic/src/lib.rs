//! A scheduler that plans at random: the order requests are considered in, how many tokens each computes, and which running requests it preempts.
//!
//! It exists to show that a scheduler decides only *when* work happens, never what the
//! tokens are: whatever this plan does, every request must produce the tokens it produces
//! alone. Every plan is valid (built with the SDK's `PlanBuilder`) and runs at least one
//! request, so the engine always moves. Each step draws from a stream keyed by the seed and
//! the host's step number, so a run's plans depend on the step, not on how many calls this
//! instance has seen.
//!
//! Config (JSON, all optional): `seed` (default 1) and `preempt_percent`, the chance that
//! a running request is preempted in a step (default 20; above 90 is refused).

use plughost_sdk::sampler::RowRng;
use plughost_sdk::scheduler::{Phase, Plan, PlanBuilder, RequestView, Resources, Scheduler};
use serde::Deserialize;

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct ChaoticConfig {
    seed: u64,
    preempt_percent: u32,
}

impl Default for ChaoticConfig {
    fn default() -> Self {
        ChaoticConfig {
            seed: 1,
            preempt_percent: 20,
        }
    }
}

pub struct Chaotic {
    config: ChaoticConfig,
}

impl Chaotic {
    pub fn new(seed: u64, preempt_percent: u32) -> Chaotic {
        Chaotic {
            config: ChaoticConfig {
                seed,
                preempt_percent,
            },
        }
    }
}

impl Scheduler for Chaotic {
    fn init(config: &str) -> Result<Self, String> {
        let config: ChaoticConfig = if config.trim().is_empty() {
            ChaoticConfig::default()
        } else {
            serde_json::from_str(config)
                .map_err(|e| format!("invalid chaotic scheduler config: {e}"))?
        };
        if config.preempt_percent > 90 {
            return Err(format!(
                "preempt_percent must be at most 90 (some request must keep running), got {}",
                config.preempt_percent
            ));
        }
        Ok(Chaotic::new(config.seed, config.preempt_percent))
    }

    fn schedule(&mut self, step: u64, requests: &[RequestView], resources: &Resources) -> Plan {
        // The step's own stream: its low bits key the position, its high bits the seed.
        let mut rng = RowRng::new(self.config.seed ^ (step >> 32), step as u32);
        let mut below = |n: u32| -> u32 { (rng.next().as_f64() * f64::from(n.max(1))) as u32 };
        let mut order: Vec<&RequestView> = requests.iter().collect();
        // Fisher-Yates with the step's stream.
        for i in (1..order.len()).rev() {
            let j = below(i as u32 + 1) as usize;
            order.swap(i, j);
        }
        let mut plan = PlanBuilder::new(requests, resources);
        let mut planned = 0;
        for request in &order {
            let preempt = request.phase == Phase::Running
                && below(100) < self.config.preempt_percent
                // Keep one request to run, so every step moves.
                && planned + 1 < order.len();
            if preempt && plan.preempt(request) {
                continue;
            }
            let pending = request.pending_len();
            if pending == 0 {
                continue;
            }
            let chunk = 1 + below(pending);
            if plan.run(request, chunk) > 0 {
                planned += 1;
            }
        }
        if planned == 0 {
            run_something(&mut plan, requests);
        }
        plan.finish()
    }
}

/// Nothing fitted at the sizes drawn: runs whatever fits, oldest first, preempting the
/// youngest running requests one by one while nothing does.
fn run_something(plan: &mut PlanBuilder, requests: &[RequestView]) {
    let mut oldest: Vec<&RequestView> = requests.iter().collect();
    oldest.sort_by_key(|r| (r.arrival_us, r.id));
    let mut victims = oldest.iter().rev();
    loop {
        for request in &oldest {
            if plan.run(request, request.pending_len()) > 0 {
                return;
            }
        }
        let Some(victim) = victims.next() else {
            return;
        };
        plan.preempt(victim);
    }
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_scheduler!(Chaotic);

#[cfg(test)]
mod tests {
    use super::*;

    fn view(id: u64, phase: Phase, prompt_len: u32, computed_len: u32) -> RequestView {
        RequestView {
            id,
            phase,
            priority: 0,
            arrival_us: id,
            prompt_len,
            computed_len,
            cached_prefix_len: 0,
            output_len: 0,
            max_output: 8,
            blocks_held: computed_len.div_ceil(4),
        }
    }

    #[test]
    fn plans_vary_but_always_run_something() {
        let resources = Resources {
            token_budget: 64,
            max_running: 8,
            block_size: 4,
            free_blocks: 32,
            total_blocks: 64,
        };
        let requests: Vec<RequestView> = (0..6)
            .map(|i| match i % 2 {
                0 => view(i, Phase::Waiting, 20, 0),
                _ => view(i, Phase::Running, 20, 8),
            })
            .collect();
        let mut scheduler = Chaotic::new(7, 50);
        let mut plans = Vec::new();
        for step in 1..=50 {
            let plan = scheduler.schedule(step, &requests, &resources);
            assert_eq!(
                plan,
                scheduler.schedule(step, &requests, &resources),
                "a step's plan depends on the step, not on the calls before it"
            );
            assert!(!plan.run.is_empty(), "every step runs a request: {plan:?}");
            for s in &plan.run {
                assert!(s.num_tokens >= 1);
                assert!(!plan.preempt.contains(&s.id), "{plan:?}");
            }
            plans.push(plan);
        }
        let chunk_sizes: std::collections::BTreeSet<u32> = plans
            .iter()
            .flat_map(|p| p.run.iter().map(|s| s.num_tokens))
            .collect();
        assert!(
            chunk_sizes.len() > 5,
            "chunks of many sizes: {chunk_sizes:?}"
        );
        assert!(
            plans.iter().any(|p| !p.preempt.is_empty()),
            "some steps preempt"
        );
        assert!(
            plans.iter().any(|p| p.run[0].id != plans[0].run[0].id),
            "the order changes"
        );
    }

    #[test]
    fn bad_config_is_refused() {
        assert!(Chaotic::init(r#"{"seed": "x"}"#).is_err());
        assert!(Chaotic::init(r#"{"sed": 1}"#).is_err());
        assert!(Chaotic::init(r#"{"preempt_percent": 95}"#).is_err());
        assert!(Chaotic::init("").is_ok());
    }
}
