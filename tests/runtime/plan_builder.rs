//! The SDK's `PlanBuilder` and the plans of the priority scheduler against the host's plan validation, over many random steps.

use plughost::sched::{Phase, Plan, RequestView, Resources, validate_plan};
use plughost_scheduler_priority::PriorityAging;
use plughost_sdk::scheduler::{PlanBuilder, Scheduler};

/// xorshift64*: a fixed sequence, so a failure reproduces.
struct Random(u64);

impl Random {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }
}

/// A consistent step: running requests hold the blocks their computed tokens need; waiting
/// ones hold none; preempted ones hold none and recompute from zero.
fn random_step(random: &mut Random) -> (Vec<RequestView>, Resources) {
    let block_size = [1, 4, 16][random.below(3) as usize];
    let total_blocks = 8 + random.below(64) as u32;
    let mut held = 0;
    let mut requests = Vec::new();
    for id in 0..random.below(12) {
        let prompt_len = 1 + random.below(80) as u32;
        let phase = [Phase::Waiting, Phase::Running, Phase::Preempted][random.below(3) as usize];
        let (computed_len, output_len, blocks_held) = if phase == Phase::Running {
            let output_len = random.below(20) as u32;
            let computed = prompt_len + output_len.saturating_sub(1);
            let blocks = computed.div_ceil(block_size);
            if held + blocks > total_blocks {
                continue;
            }
            held += blocks;
            (computed, output_len, blocks)
        } else {
            (0, 0, 0)
        };
        requests.push(RequestView {
            id,
            phase,
            priority: random.below(7) as i32 - 3,
            arrival_us: id * 100,
            prompt_len,
            computed_len,
            cached_prefix_len: 0,
            output_len,
            max_output: output_len + 16,
            blocks_held,
        });
    }
    let running = requests
        .iter()
        .filter(|r| r.phase == Phase::Running)
        .count() as u32;
    let resources = Resources {
        token_budget: 1 + random.below(256) as u32,
        max_running: running + random.below(4) as u32,
        block_size,
        free_blocks: total_blocks - held,
        total_blocks,
    };
    (requests, resources)
}

fn check(plan: &Plan, requests: &[RequestView], resources: &Resources, what: &str) {
    if let Err(e) = validate_plan(plan, requests, resources) {
        panic!("{what}: {e}\nplan {plan:?}\nrequests {requests:?}\nresources {resources:?}");
    }
}

#[test]
fn plans_built_with_plan_builder_always_pass_the_host_checks() {
    let mut random = Random(0x9E37_79B9_7F4A_7C15);
    let mut scheduler = PriorityAging::init("").expect("defaults");
    let mut ran = 0;
    for step in 1..=5_000 {
        let (requests, resources) = random_step(&mut random);
        let mut builder = PlanBuilder::new(&requests, &resources);
        for request in &requests {
            if random.below(5) == 0 && builder.preempt(request) {
                continue;
            }
            builder.run(request, 1 + random.below(64) as u32);
        }
        let plan = builder.finish();
        ran += plan.run.len();
        check(&plan, &requests, &resources, "PlanBuilder");
        let plan = scheduler.schedule(step, &requests, &resources);
        check(&plan, &requests, &resources, "priority scheduler");
    }
    assert!(ran > 5_000, "the random steps ran requests ({ran})");
}
