//! The `plughost` binary serving, end to end: `serve` and `generate`, the model families, the
//! operational endpoints, the metrics contract, the system fingerprint, GGUF files, the Responses
//! API's store, and the deployment manifests that run it.

#[path = "../serve_support/mod.rs"]
mod serve_support;

mod cli_generate;
mod cli_serve;
mod deploy_manifests;
mod metrics_contract;
mod model_folders;
mod operational_endpoints;
mod response_store;
mod serve_gguf;
mod system_fingerprint;
