//! The CPU device: the math of a decoder-only transformer (Llama/Qwen3) in f32 over f32, f16 or bf16 weights, exported through the plughost device C ABI.
//!
//! Config (the `open` string): `threads=N` worker threads per launch (default: the machine's
//! available parallelism), `isa=` the instruction-set level (default: the highest the CPU
//! has, see [`isa`]), `bf16_products=`, `activation_digits=` and `prefetch=`, see `config`. Launches run synchronously on those threads, so the
//! device time `synchronize` reports is the time spent inside launches.
//!
//! Layout, one kernel family per module: `gather` (embedding and row gathers), `norm`
//! (RMSNorm over rows, after a residual add, and per head), `linear` (plain, q/k/v in one launch, and the gated MLP's gate and up with SiLU; batch-invariant: a token's output does not
//! depend on the rest of its batch), `rotary`, `kv_cache` (writing the paged
//! cache), `attention` (paged attention), `elementwise` (SiLU-and-mul, residual add),
//! `step_inputs` (device-maintained seq lens, positions and slot mappings). Shared pieces:
//! `vector` (dot products and axpy, AVX2 when the CPU has it), `widen` (f16/bf16 to f32)
//! and `workers` (threads and scratch).
//!
//! Kernels borrow their arguments in place through `Launch::views` instead of copying them,
//! and never panic on input: the export layer has checked every shape, and data-dependent
//! problems (an out-of-range token id, slot or block) come back as LAUNCH_FAILED before any
//! output is written.

// Private to the crate: the kernels are reached through the device ABI, whose export layer
// checks every shape, and the instruction-set-specific code only through an `Isa` the crate
// made. `isa` is public so tools can name and detect the levels `isa=` takes.
pub(crate) mod attention;
pub(crate) mod config;
pub(crate) mod elementwise;
pub(crate) mod gather;
pub mod isa;
pub(crate) mod kv_cache;
pub(crate) mod linear;
pub(crate) mod norm;
pub(crate) mod rotary;
pub(crate) mod step_inputs;
pub(crate) mod vector;
pub(crate) mod widen;
pub(crate) mod workers;

/// Paged attention for `cargo bench` (`benches/attention.rs`); not an interface.
#[doc(hidden)]
pub use attention::{AttentionBench, BenchHeads, BenchLayout};
/// The quantized linear for `cargo bench` (`benches/quantized_linear.rs`); not an interface.
#[doc(hidden)]
pub use linear::{ActivationDigits, QuantizedBench};
/// The bf16 linears for `cargo bench` (`benches/bf16_decode.rs`); not an interface.
#[doc(hidden)]
pub use linear::{Bf16Bench, Bf16Products, RowPrefetch};

#[cfg(test)]
mod abi_tests;
#[cfg(test)]
mod hf_reference_tests;
#[cfg(test)]
mod test_support;

use plughost_device_abi::callables::CallableId;
use plughost_device_abi::export::{DeviceBackend, DeviceFailure, Launch};

use crate::config::CpuConfig;
use crate::workers::Workers;

// Typed views reinterpret buffer bytes in native order; the ABI's byte order is little-endian.
const _: () = assert!(cfg!(target_endian = "little"));

pub struct CpuDevice {
    context: Context,
}

/// What kernels share across launches: the worker threads and reusable scratch.
pub(crate) struct Context {
    pub workers: Workers,
    /// Small per-launch conversions (a norm weight widened to f32) reuse this buffer.
    pub scratch: Vec<f32>,
    /// The instruction-set level every kernel runs at.
    pub isa: isa::Isa,
    pub bf16_products: linear::Bf16Products,
    /// The int8 digits activations keep for block-quantized weights.
    pub activation_digits: linear::ActivationDigits,
    /// Whether the AVX-512 one-token rows hint their lines ahead.
    pub prefetch: linear::RowPrefetch,
    /// Attention's task list and partial states, reused from launch to launch.
    pub attention: attention::AttentionScratch,
}

impl DeviceBackend for CpuDevice {
    fn open(config: &str) -> Result<CpuDevice, DeviceFailure> {
        isa::environment_cap().map_err(DeviceFailure::invalid_argument)?;
        let config = CpuConfig::parse(config)
            .map_err(|error| DeviceFailure::invalid_argument(error.to_string()))?;
        let workers = Workers::new(config.threads.get()).map_err(DeviceFailure::internal)?;
        Ok(CpuDevice {
            context: Context {
                workers,
                scratch: Vec::new(),
                isa: config.isa,
                bf16_products: config.bf16_products,
                activation_digits: config.activation_digits,
                prefetch: config.prefetch,
                attention: attention::AttentionScratch::default(),
            },
        })
    }

    fn launch(&mut self, launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
        let context = &mut self.context;
        let id = launch.spec().id;
        let reads_arranged = matches!(
            id,
            CallableId::Linear
                | CallableId::QkvLinear
                | CallableId::SiluGateLinear
                | CallableId::EmbeddingGather
        );
        if !reads_arranged && !launch.all_as_written() {
            // Only the linears and the embedding read weights the linears arranged; any
            // other kernel handed such a buffer gets it back in the host's order.
            for arg in launch.spec().args {
                linear::restore_arrangement(launch, arg.name)?;
            }
        }
        match id {
            CallableId::EmbeddingGather => gather::run_embedding(launch, context),
            CallableId::RmsNorm => norm::run_rows(launch, context),
            CallableId::RmsNormHeads => norm::run_heads(launch, context),
            CallableId::Linear => linear::run(launch, context),
            CallableId::Rotary => rotary::run(launch, context),
            CallableId::KvWrite => kv_cache::run(launch, context),
            CallableId::PagedAttention => attention::run(launch, context, false),
            CallableId::PagedAttentionWindow => attention::run(launch, context, true),
            CallableId::SiluMul => elementwise::run_silu_mul(launch, context),
            CallableId::Add => elementwise::run_add(launch, context),
            CallableId::GatherRows => gather::run_rows(launch, context),
            CallableId::AdvanceSeqLens => step_inputs::run_advance_seq_lens(launch),
            CallableId::DerivePositions => step_inputs::run_derive_positions(launch),
            CallableId::DeriveSlotMapping => step_inputs::run_derive_slot_mapping(launch),
            CallableId::QkvLinear => linear::run_qkv(launch, context),
            CallableId::SiluGateLinear => linear::run_silu_gate(launch, context),
            CallableId::AddRmsNorm => norm::run_add_rows(launch, context),
            CallableId::BiasAdd => elementwise::run_bias_add(launch, context),
        }
    }

    fn restore(&mut self, arrangement: u64, bytes: &mut [u8]) -> Result<(), DeviceFailure> {
        linear::restore(arrangement, bytes)
    }
}

plughost_device_abi::export_device!(CpuDevice);
