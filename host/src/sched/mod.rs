//! The host side of scheduling: checking a plugin's plan against the engine's state, and the built-in FCFS fallback.
//!
//! A scheduler plugin only proposes. The host checks every plan against the
//! token budget, the running limit and the KV blocks actually free; an
//! invalid plan or a plugin fault makes the built-in FCFS (the same policy
//! as the `scheduler-fcfs` component, compiled natively) decide that step.

mod validate;

pub use plughost_sdk::scheduler::{Phase, Plan, RequestView, Resources, Scheduled};
pub use validate::{PlanError, validate_plan};

/// The built-in policy: FCFS with defaults, run natively.
pub fn fallback_plan(requests: &[RequestView], resources: &Resources) -> Plan {
    plughost_scheduler_fcfs::schedule(
        requests,
        resources,
        &plughost_scheduler_fcfs::FcfsConfig::default(),
    )
}
