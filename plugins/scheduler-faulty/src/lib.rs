//! A scheduler that misbehaves on request: it traps, loops forever, grows memory without bound, or plans nothing.
//!
//! The fault is chosen by the input, not the config, so a fresh instance made
//! after a fault serves the next ordinary call: that is what the host's
//! fault-containment tests check. With ordinary input it runs every request
//! for one token. One fault comes from the config instead: `{"trap_in_init": true}` makes
//! `init` trap, for the tests of a deployment that cannot even start.

use plughost_sdk::scheduler::{Plan, RequestView, Resources, Scheduled, Scheduler};

/// A request with this priority makes the call trap.
pub const PRIORITY_TRAP: i32 = -1001;
/// A request with this priority makes the call loop forever.
pub const PRIORITY_LOOP: i32 = -1002;
/// A request with this priority makes the call allocate until memory runs out.
pub const PRIORITY_GROW: i32 = -1003;
/// A request with this priority makes the call return a plan that runs nothing: valid, but
/// an engine that followed it would never move again.
pub const PRIORITY_IDLE: i32 = -1004;
/// A request with this priority makes the call plan nothing unless the step number is larger
/// than every one this instance saw before: a host whose step does not count up gets faults.
pub const PRIORITY_STEP_CHECK: i32 = -1005;

pub struct Faulty {
    /// The largest step number seen so far.
    last_step: Option<u64>,
}

impl Scheduler for Faulty {
    fn init(config: &str) -> Result<Self, String> {
        if config.contains("\"trap_in_init\":true") {
            panic!("asked to trap in init");
        }
        Ok(Faulty { last_step: None })
    }

    fn schedule(&mut self, step: u64, requests: &[RequestView], _resources: &Resources) -> Plan {
        let counted_up = self.last_step.is_none_or(|last| step > last);
        self.last_step = Some(self.last_step.map_or(step, |last| last.max(step)));
        for r in requests {
            match r.priority {
                PRIORITY_TRAP => panic!("asked to trap"),
                PRIORITY_LOOP => spin_forever(),
                PRIORITY_GROW => grow_forever(),
                PRIORITY_IDLE => return Plan::default(),
                PRIORITY_STEP_CHECK if !counted_up => return Plan::default(),
                _ => {}
            }
        }
        Plan {
            run: requests
                .iter()
                .map(|r| Scheduled {
                    id: r.id,
                    num_tokens: 1,
                })
                .collect(),
            preempt: Vec::new(),
        }
    }
}

fn spin_forever() -> ! {
    let mut counter = 0u64;
    loop {
        counter = std::hint::black_box(counter.wrapping_add(1));
    }
}

fn grow_forever() -> ! {
    let mut hoard: Vec<Vec<u8>> = Vec::new();
    loop {
        // Touch every page so the memory is really committed, not just reserved.
        hoard.push(vec![1u8; 1 << 20]);
        std::hint::black_box(&hoard);
    }
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_scheduler!(Faulty);
