//! Runtime tests in one binary, so the test build links wasmtime once for them: the device C ABI on the mock device, the model runtime on it, and the plan builder.

#[path = "../common/mod.rs"]
mod common;

mod device_mock;
mod plan_builder;
mod runtime_mock;
