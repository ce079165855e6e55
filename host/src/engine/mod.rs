//! The serving engine: request lifecycle and the engine loop on its own thread, reached through a handle.
//!
//! Each step: schedule (the scheduler plugin, checked, with the built-in
//! FCFS as fallback) → admit and allocate KV blocks → execute one flattened
//! batch on the runtime → sample every emitting row in one sampler call →
//! detokenize, check stops and stream each request's delta.
//!
//! `handle` is what the host holds; `start` loads the model and builds the
//! core on the engine thread, which `thread` runs. `core` is the step; the
//! request table (`queues`), the KV cache and the output processor (`output`)
//! each own their part of the state.

mod callable_times;
mod core;
mod fingerprint;
mod handle;
mod health;
mod output;
mod prompt_scores;
mod queues;
mod recovery;
pub mod reload;
mod request;
mod start;
mod state;
mod stop;
mod thread;
pub mod triggers;

pub use fingerprint::ModelIdentity;
pub use handle::{EngineError, EngineHandle, PinnedDeployment};
pub use health::{EngineFault, HealthReport};
pub use recovery::RestartBudget;
pub use request::{
    FinishReason, GenerationEvent, GenerationRequest, PromptLogprob, RequestId, StopConditions,
    TokenLogprob, Usage,
};
pub use start::{EngineOptions, EngineSetup, EngineStartError, ModelSummary};
pub use stop::{StopMatcher, StopOutcome};
