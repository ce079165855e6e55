//! The WebAssembly plugin host: one wasmtime engine, a compiled-component cache, and contained instances per world.
//!
//! Plugins own decisions (scheduling, sampling, model description); the host
//! owns every resource. A plugin instance lives in its own `Store` with a
//! memory cap and a per-call deadline; a trap poisons only that instance,
//! which is dropped and re-made from its `InstancePre` on the next call.
//! Each component's failure policy (`policy`) backs it off after repeated faults.

mod cache;
mod contract;
mod deployment;
mod error;
pub mod generation;
pub mod glue;
mod history;
mod instance;
pub mod logits;
pub mod policy;
mod records;
mod runtime;
pub mod sampler;
mod sandbox;
pub mod scheduler;
mod versioned;

pub use contract::{ComponentContract, ContractError, ContractVersion, check_component};
pub use deployment::{
    DEFAULT_SAMPLER_NAME, Deployment, DeploymentError, NamedSamplers, PluginSpec,
};
pub use error::PluginError;
pub use generation::{ComponentStatus, Generation, GenerationError, Slot};
pub use instance::{DEFAULT_CALL_TIMEOUT, InstanceLimits, KEPT_MEMORY_BYTES, PluginStats};
pub use policy::{ComponentState, FaultPolicy, FaultSettings, OnFailure, PluginRejection};
pub use runtime::{PluginRuntime, RuntimeOptions};
