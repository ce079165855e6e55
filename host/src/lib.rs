//! plughost: an LLM serving host whose scheduling, sampling and model glue are WebAssembly plugins.
//!
//! Layout: `device` loads device backends through the C ABI; `plugins` runs
//! the WebAssembly components. See ARCHITECTURE.md for the code map.

pub mod api;
pub mod cli;
pub mod device;
pub mod engine;
pub mod grammar;
pub mod kv;
pub mod kv_tier_metrics;
pub mod load_metrics;
pub mod metrics;
pub mod model;
pub mod perplexity;
pub mod plugin_kit;
pub mod plugins;
pub mod profile;
pub mod runtime;
pub mod sched;
