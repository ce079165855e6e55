//! Guest-side SDK: plugin authors implement a plain Rust trait and call one export macro.
//!
//! The types here mirror the WIT contract in `wit/plugin.wit` (the workspace's
//! `wit/0.2/`) as ordinary Rust values, so plugin logic compiles and is
//! unit-tested natively. The
//! world bindings are generated only under the matching cargo feature
//! (`scheduler`, `sampler`, `model-glue`); enable exactly one per plugin.
//!
//! ```ignore
//! struct Fcfs;
//! impl plughost_sdk::scheduler::Scheduler for Fcfs { /* ... */ }
//! plughost_sdk::export_scheduler!(Fcfs);
//! ```

pub mod sampler;
pub mod scheduler;

#[cfg(feature = "model-glue")]
pub mod model_glue;

/// The version of the WIT package this SDK implements.
pub const CONTRACT_VERSION: &str = "0.2.0";

#[doc(hidden)]
pub mod __private {
    pub use std::cell::RefCell;
}
