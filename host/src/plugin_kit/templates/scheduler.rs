//! __NAME__: a shortest-prompt-first scheduler plugin for plughost.
//!
//! Running requests decode first, so nothing already streaming stalls; then
//! waiting and preempted requests are admitted shortest prompt first, each
//! computing at most `max_prefill_chunk` prompt tokens per step.

use plughost_sdk::scheduler::{Phase, Plan, PlanBuilder, RequestView, Resources, Scheduler};
use serde::Deserialize;

/// The plugin's options: the `config` table of the deployment file, as JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The most prompt tokens one request computes in one step (chunked prefill).
    pub max_prefill_chunk: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_prefill_chunk: 512,
        }
    }
}

pub struct ShortestPromptFirst {
    config: Config,
}

impl Scheduler for ShortestPromptFirst {
    fn init(config: &str) -> Result<Self, String> {
        let config: Config = if config.trim().is_empty() {
            Config::default()
        } else {
            serde_json::from_str(config).map_err(|e| format!("invalid config: {e}"))?
        };
        if config.max_prefill_chunk == 0 {
            return Err("max_prefill_chunk must be at least 1".into());
        }
        Ok(ShortestPromptFirst { config })
    }

    // `step` numbers the engine's steps, counting up: the clock for a policy that needs time
    // (steps waited), the same on any machine. This one orders by prompt length alone.
    fn schedule(&mut self, _step: u64, requests: &[RequestView], resources: &Resources) -> Plan {
        let mut plan = PlanBuilder::new(requests, resources);
        for request in requests.iter().filter(|r| r.phase == Phase::Running) {
            plan.run(request, self.config.max_prefill_chunk);
        }
        let mut admitting: Vec<&RequestView> = requests
            .iter()
            .filter(|r| r.phase != Phase::Running)
            .collect();
        // Stable: equal prompts keep their arrival order.
        admitting.sort_by_key(|r| r.prompt_len);
        for request in admitting {
            plan.run(request, self.config.max_prefill_chunk);
        }
        plan.finish()
    }
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_scheduler!(ShortestPromptFirst);

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(id: u64, prompt_len: u32) -> RequestView {
        RequestView {
            id,
            phase: Phase::Waiting,
            priority: 0,
            arrival_us: id,
            prompt_len,
            computed_len: 0,
            cached_prefix_len: 0,
            output_len: 0,
            max_output: 16,
            blocks_held: 0,
        }
    }

    fn resources(token_budget: u32) -> Resources {
        Resources {
            token_budget,
            max_running: 8,
            block_size: 16,
            free_blocks: 64,
            total_blocks: 64,
        }
    }

    #[test]
    fn the_shortest_prompt_is_admitted_first() {
        let mut scheduler = ShortestPromptFirst::init("").unwrap();
        let requests = [waiting(1, 300), waiting(2, 20), waiting(3, 90)];
        let plan = scheduler.schedule(1, &requests, &resources(128));
        let order: Vec<(u64, u32)> = plan.run.iter().map(|s| (s.id, s.num_tokens)).collect();
        // 20 + 90 fit; the long prompt gets the rest of the budget as a first chunk.
        assert_eq!(order, [(2, 20), (3, 90), (1, 18)]);
    }

    #[test]
    fn the_config_is_checked() {
        assert!(ShortestPromptFirst::init(r#"{"max_prefill_chunk": 64}"#).is_ok());
        assert!(ShortestPromptFirst::init(r#"{"max_prefill_chunk": 0}"#).is_err());
        assert!(ShortestPromptFirst::init(r#"{"chunk": 64}"#).is_err());
    }
}
