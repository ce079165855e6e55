//! Checks a plan against the step's views and resources before the engine acts on it.

use std::collections::{HashMap, HashSet};

use super::{Phase, Plan, RequestView, Resources};

/// Why a plan was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("plan names unknown request {0}")]
    UnknownRequest(u64),
    #[error("plan schedules request {0} twice")]
    Duplicate(u64),
    #[error("plan runs request {id} for {num_tokens} tokens, it has {pending} to compute")]
    BadTokenCount {
        id: u64,
        num_tokens: u32,
        pending: u32,
    },
    #[error("plan uses {used} tokens, the budget is {budget}")]
    OverBudget { used: u64, budget: u32 },
    #[error("plan keeps {running} requests running, at most {max_running} may run")]
    TooManyRunning { running: u32, max_running: u32 },
    #[error("plan needs {needed} KV blocks, {free} are free")]
    OutOfBlocks { needed: u64, free: u64 },
    #[error("plan preempts request {0}, which is not running")]
    PreemptNotRunning(u64),
    #[error("plan both preempts and runs request {0}")]
    PreemptAndRun(u64),
}

/// Blocks a request holds in total after computing `num_tokens` more.
fn blocks_after(view: &RequestView, num_tokens: u32, block_size: u32) -> u64 {
    let tokens = view.computed_len as u64 + num_tokens as u64;
    tokens.div_ceil(block_size.max(1) as u64)
}

/// Checks `plan`; `Ok` means the engine can carry it out exactly.
pub fn validate_plan(
    plan: &Plan,
    views: &[RequestView],
    resources: &Resources,
) -> Result<(), PlanError> {
    let by_id: HashMap<u64, &RequestView> = views.iter().map(|v| (v.id, v)).collect();
    let mut preempted = HashSet::new();
    let mut freed = 0u64;
    for &id in &plan.preempt {
        let view = by_id.get(&id).ok_or(PlanError::UnknownRequest(id))?;
        if view.phase != Phase::Running {
            return Err(PlanError::PreemptNotRunning(id));
        }
        if !preempted.insert(id) {
            return Err(PlanError::Duplicate(id));
        }
        freed += view.blocks_held as u64;
    }
    let mut seen = HashSet::new();
    let mut used = 0u64;
    let mut needed = 0u64;
    for s in &plan.run {
        let view = by_id.get(&s.id).ok_or(PlanError::UnknownRequest(s.id))?;
        if preempted.contains(&s.id) {
            return Err(PlanError::PreemptAndRun(s.id));
        }
        if !seen.insert(s.id) {
            return Err(PlanError::Duplicate(s.id));
        }
        let pending = view.pending_len();
        if s.num_tokens == 0 || s.num_tokens > pending {
            return Err(PlanError::BadTokenCount {
                id: s.id,
                num_tokens: s.num_tokens,
                pending,
            });
        }
        used += s.num_tokens as u64;
        needed += blocks_after(view, s.num_tokens, resources.block_size)
            .saturating_sub(view.blocks_held as u64);
    }
    if used > resources.token_budget as u64 {
        return Err(PlanError::OverBudget {
            used,
            budget: resources.token_budget,
        });
    }
    // Running requests that are neither preempted nor scheduled still hold their blocks.
    let still_running = views
        .iter()
        .filter(|v| v.phase == Phase::Running && !preempted.contains(&v.id))
        .count() as u32;
    let newly_running = plan
        .run
        .iter()
        .filter(|s| by_id.get(&s.id).is_some_and(|v| v.phase != Phase::Running))
        .count() as u32;
    let running = still_running + newly_running;
    if running > resources.max_running {
        return Err(PlanError::TooManyRunning {
            running,
            max_running: resources.max_running,
        });
    }
    let free = resources.free_blocks as u64 + freed;
    if needed > free {
        return Err(PlanError::OutOfBlocks { needed, free });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::Scheduled;

    fn view(
        id: u64,
        phase: Phase,
        prompt: u32,
        computed: u32,
        output: u32,
        blocks: u32,
    ) -> RequestView {
        RequestView {
            id,
            phase,
            priority: 0,
            arrival_us: id,
            prompt_len: prompt,
            computed_len: computed,
            cached_prefix_len: 0,
            output_len: output,
            max_output: 16,
            blocks_held: blocks,
        }
    }

    const RES: Resources = Resources {
        token_budget: 8,
        max_running: 2,
        block_size: 4,
        free_blocks: 2,
        total_blocks: 8,
    };

    fn plan(run: &[(u64, u32)], preempt: &[u64]) -> Plan {
        Plan {
            run: run
                .iter()
                .map(|&(id, num_tokens)| Scheduled { id, num_tokens })
                .collect(),
            preempt: preempt.to_vec(),
        }
    }

    #[test]
    fn plans_are_checked_against_state_and_resources() {
        let views = [
            view(1, Phase::Running, 4, 4, 1, 1),
            view(2, Phase::Running, 8, 8, 1, 3),
            view(3, Phase::Waiting, 6, 0, 0, 0),
        ];
        let cases: Vec<(Plan, Result<(), PlanError>)> = vec![
            (plan(&[(1, 1), (2, 1)], &[]), Ok(())),
            (plan(&[(9, 1)], &[]), Err(PlanError::UnknownRequest(9))),
            (plan(&[(1, 1), (1, 1)], &[]), Err(PlanError::Duplicate(1))),
            (
                plan(&[(1, 2)], &[]),
                Err(PlanError::BadTokenCount {
                    id: 1,
                    num_tokens: 2,
                    pending: 1,
                }),
            ),
            (
                plan(&[(1, 0)], &[]),
                Err(PlanError::BadTokenCount {
                    id: 1,
                    num_tokens: 0,
                    pending: 1,
                }),
            ),
            (
                plan(&[(3, 6)], &[]),
                Err(PlanError::TooManyRunning {
                    running: 3,
                    max_running: 2,
                }),
            ),
            (plan(&[(3, 6)], &[2]), Ok(())),
            (
                plan(&[(1, 1), (3, 6)], &[]),
                Err(PlanError::TooManyRunning {
                    running: 3,
                    max_running: 2,
                }),
            ),
            (plan(&[], &[3]), Err(PlanError::PreemptNotRunning(3))),
            (plan(&[(2, 1)], &[2]), Err(PlanError::PreemptAndRun(2))),
        ];
        for (p, want) in cases {
            assert_eq!(validate_plan(&p, &views, &RES), want, "{p:?}");
        }
    }

    #[test]
    fn budget_and_blocks_are_enforced() {
        let views = [view(3, Phase::Waiting, 12, 0, 0, 0)];
        let res = Resources {
            max_running: 4,
            ..RES
        };
        assert_eq!(
            validate_plan(&plan(&[(3, 9)], &[]), &views, &res),
            Err(PlanError::OverBudget { used: 9, budget: 8 })
        );
        assert_eq!(validate_plan(&plan(&[(3, 8)], &[]), &views, &res), Ok(()));
        let tight = Resources {
            free_blocks: 1,
            ..res
        };
        assert_eq!(
            validate_plan(&plan(&[(3, 8)], &[]), &views, &tight),
            Err(PlanError::OutOfBlocks { needed: 2, free: 1 })
        );
    }
}
