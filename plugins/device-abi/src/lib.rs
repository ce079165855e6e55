//! The versioned C ABI between the plughost host and device libraries, and the shared pieces device authors build on.
//!
//! * [`abi`]: the `repr(C)` types and function table (mirrored by `include/plughost_device.h`);
//! * [`callables`]: the callables every device provides, with their signatures;
//! * [`validate`]: checking launch arguments against those signatures;
//! * [`elements`]: decoding tensor elements (f32, f16, bf16, i32) from buffer bytes;
//! * [`blocks`]: ggml's block-quantized weight formats and their dequantization;
//! * [`kv_cache`]: where a paged KV cache keeps each head's row for a slot;
//! * [`export`]: the ABI plumbing for devices written in Rust ([`export_device!`]);
//! * [`step_inputs`]: the device-maintained step inputs every device computes the same way;
//! * [`config`]: parsing a device's `key=value,...` open-config string;
//! * [`pages`]: anonymous memory mapped up front, in huge pages where the kernel allows.

pub mod abi;
pub mod blocks;
pub mod callables;
pub mod config;
pub mod elements;
pub mod export;
pub mod kv_cache;
pub mod pages;
pub mod step_inputs;
pub mod validate;

pub use abi::{
    ArgTag, CopyRange, DType, DeviceHandle, DeviceStats, ENTRY_SYMBOL, EntryFn, MAX_RANK,
    PLUGHOST_DEVICE_ABI_VERSION, PlughostDeviceHeader, PlughostDeviceV1, RankError, TensorArg,
    WORKER_RESTARTS_ENV, status,
};
