//! The FCFS scheduler as a `plughost:plugin@0.1.0` component: the policy of `scheduler-fcfs`, exported through the 0.1 contract, whose `schedule` has no step number.
//!
//! It is a fixture: the host speaks 0.2 and runs this component through its 0.1 adapter, and
//! the tests check that it plans as the 0.2 build of the same policy does.

#![cfg(target_arch = "wasm32")]

#[path = "../../scheduler-fcfs/src/policy.rs"]
mod policy;

use std::cell::RefCell;

use plughost::plugin::scheduling as wit;
use plughost_sdk::scheduler as sdk;

wit_bindgen::generate!({
    path: "../../wit/0.1",
    world: "scheduler",
});

thread_local! {
    static CONFIG: RefCell<policy::FcfsConfig> = RefCell::new(policy::FcfsConfig::default());
}

struct Fcfs;

impl Guest for Fcfs {
    fn init(config: String) -> Result<(), String> {
        let config = policy::FcfsConfig::from_json(&config)?;
        CONFIG.with(|c| *c.borrow_mut() = config);
        Ok(())
    }

    fn schedule(requests: Vec<wit::RequestView>, resources: wit::Resources) -> wit::Plan {
        let requests: Vec<sdk::RequestView> = requests
            .into_iter()
            .map(|v| sdk::RequestView {
                id: v.id,
                phase: match v.phase {
                    wit::Phase::Waiting => sdk::Phase::Waiting,
                    wit::Phase::Running => sdk::Phase::Running,
                    wit::Phase::Preempted => sdk::Phase::Preempted,
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
            .collect();
        let resources = sdk::Resources {
            token_budget: resources.token_budget,
            max_running: resources.max_running,
            block_size: resources.block_size,
            free_blocks: resources.free_blocks,
            total_blocks: resources.total_blocks,
        };
        let plan = CONFIG.with(|c| policy::schedule(&requests, &resources, &c.borrow()));
        wit::Plan {
            run: plan
                .run
                .into_iter()
                .map(|s| wit::Scheduled {
                    id: s.id,
                    num_tokens: s.num_tokens,
                })
                .collect(),
            preempt: plan.preempt,
        }
    }
}

export!(Fcfs);
