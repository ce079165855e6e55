//! The FCFS policy: which requests run this step, how many tokens each computes, and who is preempted.
//!
//! The rules, in the order [`schedule`] applies them:
//!
//! * **Order.** Running requests first, in the order the host lists them;
//!   then waiting and preempted requests by arrival time (ties keep the
//!   host's order). Priority is ignored: this is first come, first served.
//! * **Tokens.** A request computes its `pending_len()` tokens: 1 for a plain
//!   decode, the rest of its prompt for a prefill, everything it lost for a
//!   preempted request (recompute). That count is cut to the token budget
//!   left (chunked prefill: the rest runs in later steps) and, when
//!   `long_prefill_token_threshold` is non-zero, to that threshold, so one
//!   long prompt cannot take a whole step from the requests behind it.
//!   Requests with nothing to compute are skipped.
//! * **Budget.** The tokens of the plan sum to at most `token_budget`.
//! * **KV blocks.** Computing `n` tokens needs
//!   `ceil((computed_len + n) / block_size)` blocks in total; the request
//!   holds `blocks_held` already, and the rest come out of the free blocks.
//!   The prefix cache is the host's business: a cached prefix is already part
//!   of `computed_len`, so only the tokens after it are prefilled.
//! * **Preemption.** When a running request cannot get its blocks, the newest
//!   running request (latest arrival) is preempted and the request retries.
//!   Preemption is by recompute: the victim goes into `plan.preempt`, its
//!   blocks count as free from then on, and it prefills again once
//!   readmitted. A victim scheduled earlier in the step leaves the plan and
//!   returns its tokens and blocks. A request that is itself the newest
//!   preempts itself.
//! * **Admission.** A waiting or preempted request is admitted only while
//!   fewer than `max_running` requests hold blocks and only if its blocks fit
//!   in the free blocks left. A waiting request never preempts a running one,
//!   so a step that had to preempt admits nobody (the blocks it freed belong
//!   to the running requests). The first request that does not fit ends
//!   admission, so later arrivals never overtake it.
//! * **Waiting.** Requests that do not fit are simply not in the plan; they
//!   keep their place for the next step.
//!
//! The host enforces the same limits and rejects a plan that breaks one;
//! following them here keeps the plugin's plans from ever being rejected.

use plughost_sdk::scheduler::{Phase, Plan, RequestView, Resources, Scheduled};
use serde::Deserialize;

/// The scheduler's options, read from the deployment's JSON config.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FcfsConfig {
    /// The most tokens one request may compute in one step; 0 means no cap
    /// beyond the token budget.
    pub long_prefill_token_threshold: u32,
}

impl FcfsConfig {
    /// Parses the JSON config; an empty string gives the defaults and an
    /// unknown key is an error, so a typo cannot silently change nothing.
    pub fn from_json(config: &str) -> Result<FcfsConfig, String> {
        if config.trim().is_empty() {
            return Ok(FcfsConfig::default());
        }
        serde_json::from_str(config).map_err(|e| format!("invalid fcfs scheduler config: {e}"))
    }
}

/// Decides one step by the rules in the module documentation.
pub fn schedule(requests: &[RequestView], resources: &Resources, config: &FcfsConfig) -> Plan {
    // No request can be given blocks of size zero; the host would reject
    // any plan, so return the one plan that is always valid.
    if resources.block_size == 0 {
        return Plan::default();
    }
    let running: Vec<&RequestView> = requests
        .iter()
        .filter(|r| r.phase == Phase::Running)
        .collect();
    let mut queued: Vec<&RequestView> = requests
        .iter()
        .filter(|r| r.phase != Phase::Running)
        .collect();
    // The host already lists them by arrival; sorting (stably) keeps FCFS
    // true even if it does not.
    queued.sort_by_key(|r| r.arrival_us);

    let mut step = Step::new(resources, config, running.len());
    step.run_running(&running);
    if step.plan.preempt.is_empty() {
        step.admit_queued(&queued);
    }
    step.plan
}

/// What happened to one running request so far this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Idle,
    Scheduled {
        num_tokens: u32,
        num_new_blocks: u64,
    },
    Preempted,
}

/// The resources left while one step's plan is built.
struct Step {
    budget_left: u32,
    // u64: blocks freed by preemption are added to the host's count and must
    // not overflow on odd input.
    num_free_blocks: u64,
    num_holding: u32,
    max_running: u32,
    block_size: u32,
    long_prefill_token_threshold: u32,
    plan: Plan,
}

impl Step {
    fn new(resources: &Resources, config: &FcfsConfig, num_running: usize) -> Step {
        Step {
            budget_left: resources.token_budget,
            num_free_blocks: u64::from(resources.free_blocks),
            num_holding: u32::try_from(num_running).unwrap_or(u32::MAX),
            max_running: resources.max_running,
            block_size: resources.block_size,
            long_prefill_token_threshold: config.long_prefill_token_threshold,
            plan: Plan::default(),
        }
    }

    /// Tokens `request` computes this step, 0 if it cannot run.
    fn num_tokens(&self, request: &RequestView) -> u32 {
        let num_tokens = request.pending_len().min(self.budget_left);
        match self.long_prefill_token_threshold {
            0 => num_tokens,
            threshold => num_tokens.min(threshold),
        }
    }

    /// Blocks `request` needs beyond those it holds to compute `num_tokens`.
    fn num_new_blocks(&self, request: &RequestView, num_tokens: u32) -> u64 {
        let total_len = u64::from(request.computed_len) + u64::from(num_tokens);
        let num_blocks = total_len.div_ceil(u64::from(self.block_size));
        num_blocks.saturating_sub(u64::from(request.blocks_held))
    }

    fn take(&mut self, request: &RequestView, num_tokens: u32, num_new_blocks: u64) {
        self.budget_left -= num_tokens;
        self.num_free_blocks -= num_new_blocks;
        self.plan.run.push(Scheduled {
            id: request.id,
            num_tokens,
        });
    }

    /// Schedules the running requests in order, preempting the newest when
    /// one of them runs out of blocks.
    fn run_running(&mut self, running: &[&RequestView]) {
        let mut slots = vec![Slot::Idle; running.len()];
        for i in 0..running.len() {
            if slots[i] != Slot::Idle {
                continue;
            }
            let request = running[i];
            let num_tokens = self.num_tokens(request);
            if num_tokens == 0 {
                continue;
            }
            loop {
                let num_new_blocks = self.num_new_blocks(request, num_tokens);
                if num_new_blocks <= self.num_free_blocks {
                    self.take(request, num_tokens, num_new_blocks);
                    slots[i] = Slot::Scheduled {
                        num_tokens,
                        num_new_blocks,
                    };
                    break;
                }
                // `i` itself is not preempted, so a victim always exists.
                let Some(victim) = newest(running, &slots) else {
                    break;
                };
                self.preempt(running[victim], slots[victim]);
                slots[victim] = Slot::Preempted;
                if victim == i {
                    break;
                }
            }
        }
    }

    fn preempt(&mut self, victim: &RequestView, slot: Slot) {
        if let Slot::Scheduled {
            num_tokens,
            num_new_blocks,
        } = slot
        {
            if let Some(pos) = self.plan.run.iter().position(|s| s.id == victim.id) {
                self.plan.run.remove(pos);
            }
            self.budget_left += num_tokens;
            self.num_free_blocks += num_new_blocks;
        }
        self.num_free_blocks += u64::from(victim.blocks_held);
        self.num_holding = self.num_holding.saturating_sub(1);
        self.plan.preempt.push(victim.id);
    }

    /// Admits waiting and preempted requests in arrival order while they fit.
    fn admit_queued(&mut self, queued: &[&RequestView]) {
        for &request in queued {
            if self.budget_left == 0 || self.num_holding >= self.max_running {
                break;
            }
            let num_tokens = self.num_tokens(request);
            if num_tokens == 0 {
                continue;
            }
            let num_new_blocks = self.num_new_blocks(request, num_tokens);
            if num_new_blocks > self.num_free_blocks {
                break;
            }
            self.take(request, num_tokens, num_new_blocks);
            self.num_holding += 1;
        }
    }
}

/// The index of the latest-arriving running request not yet preempted
/// (the later one in the host's order on equal arrival times).
fn newest(running: &[&RequestView], slots: &[Slot]) -> Option<usize> {
    (0..running.len())
        .filter(|&j| slots[j] != Slot::Preempted)
        .max_by_key(|&j| (running[j].arrival_us, j))
}

#[cfg(test)]
mod tests {
    use super::*;
    use plughost_sdk::scheduler::RequestId;

    /// A running request that has computed `computed` of `prompt + output` tokens.
    fn running(
        id: RequestId,
        arrival_us: u64,
        prompt: u32,
        output: u32,
        computed: u32,
        held: u32,
    ) -> RequestView {
        RequestView {
            id,
            phase: Phase::Running,
            priority: 0,
            arrival_us,
            prompt_len: prompt,
            computed_len: computed,
            cached_prefix_len: 0,
            output_len: output,
            max_output: 256,
            blocks_held: held,
        }
    }

    /// A waiting request whose first `cached` prompt tokens hit the prefix cache.
    fn waiting(id: RequestId, arrival_us: u64, prompt: u32, cached: u32) -> RequestView {
        RequestView {
            id,
            phase: Phase::Waiting,
            priority: 0,
            arrival_us,
            prompt_len: prompt,
            computed_len: cached,
            cached_prefix_len: cached,
            output_len: 0,
            max_output: 256,
            blocks_held: 0,
        }
    }

    /// A request preempted after generating `output` tokens: everything is recomputed.
    fn preempted(id: RequestId, arrival_us: u64, prompt: u32, output: u32) -> RequestView {
        RequestView {
            phase: Phase::Preempted,
            computed_len: 0,
            output_len: output,
            ..waiting(id, arrival_us, prompt, 0)
        }
    }

    fn resources(
        token_budget: u32,
        max_running: u32,
        block_size: u32,
        free_blocks: u32,
    ) -> Resources {
        Resources {
            token_budget,
            max_running,
            block_size,
            free_blocks,
            total_blocks: 1024,
        }
    }

    struct Case {
        name: &'static str,
        requests: Vec<RequestView>,
        resources: Resources,
        threshold: u32,
        run: &'static [(RequestId, u32)],
        preempt: &'static [RequestId],
    }

    fn cases() -> Vec<Case> {
        vec![
            Case {
                name: "decodes first, the prefill takes the rest of the budget",
                requests: vec![
                    running(1, 1, 8, 1, 8, 1),
                    running(2, 2, 8, 1, 8, 1),
                    waiting(3, 3, 100, 0),
                ],
                resources: resources(50, 8, 16, 100),
                threshold: 0,
                run: &[(1, 1), (2, 1), (3, 48)],
                preempt: &[],
            },
            Case {
                name: "the budget splits across two prefills in arrival order",
                requests: vec![waiting(1, 1, 6, 0), waiting(2, 2, 6, 0)],
                resources: resources(10, 8, 16, 100),
                threshold: 0,
                run: &[(1, 6), (2, 4)],
                preempt: &[],
            },
            Case {
                name: "a zero budget schedules nothing",
                requests: vec![running(1, 1, 8, 1, 8, 1), waiting(2, 2, 6, 0)],
                resources: resources(0, 8, 16, 100),
                threshold: 0,
                run: &[],
                preempt: &[],
            },
            Case {
                name: "no requests, empty plan",
                requests: vec![],
                resources: resources(64, 8, 16, 100),
                threshold: 0,
                run: &[],
                preempt: &[],
            },
            Case {
                name: "a zero block size schedules nothing",
                requests: vec![waiting(1, 1, 6, 0)],
                resources: resources(64, 8, 0, 100),
                threshold: 0,
                run: &[],
                preempt: &[],
            },
            Case {
                name: "max running caps admission",
                requests: vec![
                    running(1, 1, 8, 1, 8, 1),
                    waiting(2, 2, 4, 0),
                    waiting(3, 3, 4, 0),
                    waiting(4, 4, 4, 0),
                ],
                resources: resources(64, 2, 16, 100),
                threshold: 0,
                run: &[(1, 1), (2, 4)],
                preempt: &[],
            },
            Case {
                name: "max running already reached admits nobody",
                requests: vec![
                    running(1, 1, 8, 1, 8, 1),
                    running(2, 2, 8, 1, 8, 1),
                    waiting(3, 3, 4, 0),
                ],
                resources: resources(64, 2, 16, 100),
                threshold: 0,
                run: &[(1, 1), (2, 1)],
                preempt: &[],
            },
            Case {
                name: "the threshold chunks a long prefill, short ones pass whole",
                requests: vec![waiting(1, 1, 40, 0), waiting(2, 2, 10, 0)],
                resources: resources(100, 8, 16, 100),
                threshold: 16,
                run: &[(1, 16), (2, 10)],
                preempt: &[],
            },
            Case {
                name: "a running prefill continues by threshold-sized chunks",
                requests: vec![running(1, 1, 40, 0, 16, 1)],
                resources: resources(100, 8, 16, 100),
                threshold: 16,
                run: &[(1, 16)],
                preempt: &[],
            },
            Case {
                name: "the budget cuts below the threshold",
                requests: vec![waiting(1, 1, 40, 0)],
                resources: resources(10, 8, 16, 100),
                threshold: 16,
                run: &[(1, 10)],
                preempt: &[],
            },
            Case {
                name: "admission stops at the first request whose blocks do not fit",
                // 32 tokens = 2 blocks each; 3 free: the second does not fit,
                // and the small third may not overtake it.
                requests: vec![
                    waiting(1, 1, 32, 0),
                    waiting(2, 2, 32, 0),
                    waiting(3, 3, 4, 0),
                ],
                resources: resources(100, 8, 16, 3),
                threshold: 0,
                run: &[(1, 32)],
                preempt: &[],
            },
            Case {
                name: "a decode inside its last block needs no free block",
                requests: vec![running(1, 1, 5, 1, 5, 2)],
                resources: resources(100, 8, 4, 0),
                threshold: 0,
                run: &[(1, 1)],
                preempt: &[],
            },
            Case {
                name: "out of blocks, the newest running request is preempted",
                // Both decodes cross a block boundary (8 → 9 tokens, block 4).
                requests: vec![running(1, 1, 8, 1, 8, 2), running(2, 2, 8, 1, 8, 2)],
                resources: resources(100, 8, 4, 0),
                threshold: 0,
                run: &[(1, 1)],
                preempt: &[2],
            },
            Case {
                name: "the newest running request preempts itself",
                requests: vec![running(1, 1, 8, 1, 8, 2)],
                resources: resources(100, 8, 4, 0),
                threshold: 0,
                run: &[],
                preempt: &[1],
            },
            Case {
                name: "a self-preempted request's blocks serve the older one after it",
                requests: vec![running(1, 9, 8, 1, 8, 2), running(2, 1, 8, 1, 8, 2)],
                resources: resources(100, 8, 4, 0),
                threshold: 0,
                run: &[(2, 1)],
                preempt: &[1],
            },
            Case {
                name: "a victim scheduled earlier leaves the plan and returns its blocks",
                // 1 is newest and listed first: it takes the only free block,
                // then 2 runs short and preempts it.
                requests: vec![running(1, 9, 8, 1, 8, 2), running(2, 1, 8, 1, 8, 2)],
                resources: resources(100, 8, 4, 1),
                threshold: 0,
                run: &[(2, 1)],
                preempt: &[1],
            },
            Case {
                name: "preemption frees as many victims as needed",
                // 1 prefills 12 more tokens (3 blocks); 2 and 3 hold one each.
                requests: vec![
                    running(1, 1, 20, 0, 8, 2),
                    running(2, 2, 4, 1, 4, 1),
                    running(3, 3, 4, 1, 4, 1),
                ],
                resources: resources(100, 8, 4, 1),
                threshold: 0,
                run: &[(1, 12)],
                preempt: &[3, 2],
            },
            Case {
                name: "a waiting request never preempts a running one",
                requests: vec![running(1, 1, 5, 1, 5, 2), waiting(2, 2, 4, 0)],
                resources: resources(100, 8, 4, 0),
                threshold: 0,
                run: &[(1, 1)],
                preempt: &[],
            },
            Case {
                name: "a step that preempted admits nobody",
                // Preempting 2 frees 3 blocks, 1 takes one; the two left
                // would fit 3, but they are not for waiting requests.
                requests: vec![
                    running(1, 1, 8, 1, 8, 2),
                    running(2, 2, 12, 0, 12, 3),
                    waiting(3, 3, 4, 0),
                ],
                resources: resources(100, 8, 4, 0),
                threshold: 0,
                run: &[(1, 1)],
                preempt: &[2],
            },
            Case {
                name: "a cached prefix is not prefilled again",
                requests: vec![waiting(1, 1, 100, 64)],
                resources: resources(1000, 8, 16, 100),
                threshold: 0,
                run: &[(1, 36)],
                preempt: &[],
            },
            Case {
                name: "blocks for a cached prefix are counted from computed_len",
                // ceil(100 / 16) = 7 blocks in all; only 6 free.
                requests: vec![waiting(1, 1, 100, 64)],
                resources: resources(1000, 8, 16, 6),
                threshold: 0,
                run: &[],
                preempt: &[],
            },
            Case {
                name: "a preempted request recomputes prompt and output",
                requests: vec![preempted(1, 1, 10, 3)],
                resources: resources(100, 8, 16, 100),
                threshold: 0,
                run: &[(1, 13)],
                preempt: &[],
            },
            Case {
                name: "queued requests run by arrival whatever the listing order",
                requests: vec![waiting(2, 20, 4, 0), preempted(1, 10, 4, 1)],
                resources: resources(100, 8, 16, 100),
                threshold: 0,
                run: &[(1, 5), (2, 4)],
                preempt: &[],
            },
            Case {
                name: "a request with nothing to compute is skipped",
                requests: vec![
                    running(1, 1, 8, 1, 9, 1),
                    waiting(2, 2, 4, 4),
                    waiting(3, 3, 4, 0),
                ],
                resources: resources(100, 8, 16, 100),
                threshold: 0,
                run: &[(3, 4)],
                preempt: &[],
            },
            Case {
                name: "huge lengths do not overflow",
                requests: vec![
                    running(1, 1, u32::MAX, 0, u32::MAX - 1, u32::MAX),
                    waiting(2, 2, u32::MAX, 0),
                ],
                resources: resources(u32::MAX, u32::MAX, 1, u32::MAX),
                threshold: 0,
                run: &[(1, 1), (2, u32::MAX - 1)],
                preempt: &[],
            },
        ]
    }

    #[test]
    fn schedules_by_the_rules() {
        for case in cases() {
            let config = FcfsConfig {
                long_prefill_token_threshold: case.threshold,
            };
            let plan = schedule(&case.requests, &case.resources, &config);
            let run: Vec<(RequestId, u32)> =
                plan.run.iter().map(|s| (s.id, s.num_tokens)).collect();
            assert_eq!(run, case.run, "{}: run", case.name);
            assert_eq!(plan.preempt, case.preempt, "{}: preempt", case.name);
        }
    }

    #[test]
    fn plans_stay_inside_the_budget_and_blocks() {
        for case in cases() {
            let config = FcfsConfig {
                long_prefill_token_threshold: case.threshold,
            };
            let plan = schedule(&case.requests, &case.resources, &config);
            let num_tokens: u64 = plan.run.iter().map(|s| u64::from(s.num_tokens)).sum();
            assert!(
                num_tokens <= u64::from(case.resources.token_budget),
                "{}",
                case.name
            );
            if case.resources.block_size == 0 {
                continue;
            }
            let block_size = u64::from(case.resources.block_size);
            let view = |id| case.requests.iter().find(|r| r.id == id);
            let num_freed: u64 = plan
                .preempt
                .iter()
                .filter_map(|&id| view(id))
                .map(|r| u64::from(r.blocks_held))
                .sum();
            let num_needed: u64 = plan
                .run
                .iter()
                .filter_map(|s| view(s.id).map(|r| (r, s.num_tokens)))
                .map(|(r, n)| {
                    (u64::from(r.computed_len) + u64::from(n))
                        .div_ceil(block_size)
                        .saturating_sub(u64::from(r.blocks_held))
                })
                .sum();
            assert!(
                num_needed <= u64::from(case.resources.free_blocks) + num_freed,
                "{}",
                case.name
            );
        }
    }

    #[test]
    fn config_parses_and_rejects_unknown_keys() {
        let cases: &[(&str, Result<u32, &str>)] = &[
            ("", Ok(0)),
            ("  ", Ok(0)),
            ("{}", Ok(0)),
            (r#"{"long_prefill_token_threshold": 512}"#, Ok(512)),
            (
                r#"{"long_prefill_threshold": 512}"#,
                Err("unknown field `long_prefill_threshold`"),
            ),
            (
                r#"{"long_prefill_token_threshold": -1}"#,
                Err("invalid value"),
            ),
            ("not json", Err("invalid fcfs scheduler config")),
        ];
        for (json, expected) in cases {
            match (FcfsConfig::from_json(json), expected) {
                (Ok(config), Ok(threshold)) => {
                    assert_eq!(config.long_prefill_token_threshold, *threshold, "{json}")
                }
                (Err(message), Err(needle)) => {
                    assert!(message.contains(needle), "{json}: {message}")
                }
                (got, _) => panic!("{json}: unexpected {got:?}"),
            }
        }
    }
}
