//! Runtime tests in one binary, so the test build links wasmtime once for them: the device C ABI on the mock device, the model runtime on it, the plan builder, and tokens that no schedule changes.

#[path = "../common/mod.rs"]
mod common;

mod determinism;
mod device_mock;
mod plan_builder;
mod runtime_mock;
