//! The FCFS scheduler as a `plughost:plugin@0.1.0` component: the policy of `scheduler-fcfs`, exported through the 0.1 contract, whose `schedule` has no step number.
//!
//! It is a fixture: the host speaks 0.2 and runs this component through its 0.1 adapter, and
//! the tests check that it plans as the 0.2 build of the same policy does.

#![cfg(target_arch = "wasm32")]

#[path = "../../scheduler-fcfs/src/policy.rs"]
mod policy;

use std::cell::RefCell;

wit_bindgen::generate!({
    path: "../../wit/0.1",
    world: "scheduler",
});

/// The SDK's conversions, over this component's 0.1 records.
mod adapter {
    use super::plughost::plugin::scheduling as wit;

    plughost_sdk::__scheduling_adapter!();
}

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

    fn schedule(requests: Vec<RequestView>, resources: Resources) -> Plan {
        let requests: Vec<_> = requests.into_iter().map(adapter::request_view).collect();
        let resources = adapter::resources(resources);
        let plan = CONFIG.with(|c| policy::schedule(&requests, &resources, &c.borrow()));
        adapter::plan(plan)
    }
}

export!(Fcfs);
