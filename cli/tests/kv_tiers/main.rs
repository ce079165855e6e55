//! The tiered KV cache end to end: the device's batched block copies (in this process and through a worker, synchronous and in the background), and `plughost serve` with host-memory and disk tiers giving the same greedy tokens as a fresh run.

#[path = "../serve_support/mod.rs"]
mod serve_support;

mod background_copies;
mod device_copies;
mod offload;
