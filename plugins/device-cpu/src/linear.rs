//! `linear` (`out[T,N] = x[T,K] · w[N,K]ᵀ`), `qkv_linear` and `silu_gate_linear` in f32 over f32, f16 or bf16 weights, with results that do not depend on the batch.
//!
//! Every output is a dot product of a token row and a weight row, both contiguous in `k`: the
//! weights are read where they lie, in their stored precision, with no widened copy.
//! Threads take panels of [`NR`] weight rows; a panel meets the tokens `MR` at a time (`MR`
//! per instruction set), so one pass over a weight row serves several tokens. With one token
//! (decode) the tiles read their `NR` rows one after the other, as one stream the hardware
//! prefetcher follows (see `avx512` and `avx2`): side by side, six streams of one short
//! row each reached about three quarters of the rate.
//!
//! On AVX2, bf16 weights whose launches allow it are kept in an arrangement of their own
//! instead (see `panels`): the launch that first reads a weight buffer turns it, in place, into
//! panels of 32 rows stored column by column, which one token reads as one stream and a tile
//! multiplies by broadcasting activations, every output one FMA chain in `k` order.
//!
//! The fused forms share the activations and the threads of one launch: `qkv_linear` lays the
//! panels of its three matrices end to end, and `silu_gate_linear` reads a run of gate panels,
//! then the same run of up panels, and stores `silu(gate) * up` straight from the tiles.
//!
//! At `avx512_bf16` with bf16 products (`vdpbf16ps`), bf16 weights meet the activations
//! rounded to bf16, the precision llama.cpp's BF16 path uses; every other weight, at every
//! level, meets f32 activations in f32 FMAs. bf16 weights multiplied in f32 go into panels at
//! every level from `avx2` up.
//!
//! Batch invariance: an output element is one vector accumulator whose lanes take the
//! products of their residue class of `k` in `k` order, then one fixed reduction tree (see
//! `avx512` and `avx2`), or, for weights in panels, one lane's FMA chain over `k` in order;
//! which tile, which token group and which thread computes it changes no instruction of that
//! sequence. So a prompt prefilled alone, in chunks or inside a batch
//! gets the same bits. One device always runs one instruction-set level, its [`Isa`].
//!
//! Block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) take their own path,
//! [`quant`]: integer dot products with activations quantized per row to int8.
//!
//! One concept per file: [`arrangement`] (weights kept in panels), [`dispatch`] (which tiles
//! run a launch), [`plan`] (cutting a launch into tasks and token groups), [`sink`] (where
//! the tiles write, and the gated epilogue), [`elements`] (the weight element types), the
//! tiles of each instruction set ([`avx512`], [`avx2`], [`panels`], [`portable`]) and
//! `tests`.

mod arrangement;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
mod bf16_bench;
mod dispatch;
mod elements;
#[cfg(target_arch = "x86_64")]
pub(crate) mod panels;
mod plan;
mod portable;
mod quant;
mod sink;
#[cfg(test)]
mod tests;

use plughost_device_abi::export::{DeviceFailure, FloatSlice, Launch};

use arrangement::arrange_weights;
#[cfg(test)]
pub(crate) use arrangement::faults;
pub(crate) use arrangement::{WeightOrder, restore, restore_arrangement};
pub use bf16_bench::Bf16Bench;
use dispatch::matmul;
#[cfg(test)]
pub(crate) use elements::HalfBits;
#[cfg(target_arch = "x86_64")]
pub(crate) use elements::as_bits;
pub(crate) use elements::{Bf16Bits, F16Bits, as_wide, as_wide_mut};
use plan::Plan;
pub(crate) use quant::gather_rows as gather_quantized_rows;
pub(crate) use quant::reserve_thread_activations;
pub use quant::{ActivationDigits, QuantizedBench};
use sink::{SharedOut, Sink};

use crate::Context;
use crate::isa::{Isa, IsaLevel};
use crate::workers::Workers;

/// Weight rows per panel: the outputs of one tile.
pub const NR: usize = 6;

/// What bf16 weights are multiplied with at `avx512_bf16` (below it, and for weights in
/// panels: f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bf16Products {
    /// f32 activations times the widened weights in f32 FMAs, as for f32 and f16 weights.
    F32,
    /// Activations rounded to bf16 and pairs of products summed by `vdpbf16ps`: the weights
    /// are read as stored, with no widening, so decode streams them faster and batches and
    /// prefill run at twice the arithmetic rate; the precision of llama.cpp's BF16 path.
    #[default]
    Bf16,
}

impl std::str::FromStr for Bf16Products {
    type Err = String;

    fn from_str(text: &str) -> Result<Bf16Products, String> {
        match text {
            "f32" => Ok(Bf16Products::F32),
            "bf16" => Ok(Bf16Products::Bf16),
            other => Err(format!("`{other}` is neither `f32` nor `bf16`")),
        }
    }
}

/// Bytes past the one a one-token row is reading that [`RowPrefetch::Software`] asks the
/// caches for: 3.5 KB. On an Intel Xeon 7 KB was as fast and 14 KB slower.
#[cfg(target_arch = "x86_64")]
const ROW_AHEAD_BYTES: usize = 3584;

/// Asks the caches for the line [`ROW_AHEAD_BYTES`] past `at`, a row's element being read.
/// Past the row's end the hint lands in the next row or nowhere: a prefetch never faults.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn hint_row_ahead<W>(at: *const W) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let ahead = at.cast::<i8>().wrapping_add(ROW_AHEAD_BYTES);
    // SAFETY: every x86-64 CPU has SSE, and a prefetch reads nothing a program sees.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead) };
}

/// Which weight streams ask the caches for lines some kilobytes ahead of the one they read,
/// rather than leave them to the hardware prefetcher. A hint changes when bytes arrive, never
/// a result.
///
/// Two kinds of tile ask. The rows: the AVX-512 bf16 rows through `vdpbf16ps` and rows widened
/// to f32 for FMAs, the AVX2 rows widened to f32 and the AVX2 bf16 panels (which otherwise ask
/// a few lines ahead), and the Q8_0 group tiles of AVX-512 and the Q6_K ones of AVX2. And the
/// other group tiles of block-quantized weights, which ask for each line as they first read
/// it ([`GroupTiles`](RowPrefetch::GroupTiles)).
///
/// Measured per CPU family, so the default follows the CPU (see docs/benchmarks.md):
/// - on an Intel Xeon with AVX-512 BF16 every hint helps: a one-token bf16 step of SmolLM2
///   went from 16–19 ms to 12.5–13.6, the same step with f32 products about 1.7× faster, its
///   Q8_0 step about 1.25× faster, and the AVX2 Q6_K tile streams only with them;
/// - on AMD Zen 5 the group tiles need theirs (without, a lone token read Q6_K at a third of
///   the bandwidth and Q4_K at 0.7×), and the rows' were slower than the hardware's stream;
/// - on AMD Zen 4 the rows' were slower, and so were the group tiles' for a lone token: they
///   made the Qwen3 shape's Q4_K and Q6_K decode steps 1.04–1.32× slower alone and a served
///   Q4_K_M step's linear launches about 1.25× slower; a tile of several tokens, which
///   computes longer on each line, needs them (16 tokens through the Qwen3 shape's head at
///   Q4_K or Q6_K took 1.17–1.31× longer without).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowPrefetch {
    /// The hardware prefetcher alone follows every stream.
    #[default]
    Hardware,
    /// The group tiles but the two kinds named above ask; the rows leave it to the hardware.
    GroupTiles,
    /// As [`GroupTiles`](RowPrefetch::GroupTiles), but only the tiles of more than one token.
    BatchedGroupTiles,
    /// Every tile asks.
    Software,
}

impl RowPrefetch {
    /// Every choice, for the tests that each gives the same bits.
    pub const ALL: [RowPrefetch; 4] = [
        RowPrefetch::Hardware,
        RowPrefetch::GroupTiles,
        RowPrefetch::BatchedGroupTiles,
        RowPrefetch::Software,
    ];

    /// Every hint on Intel CPUs, the group tiles' of several tokens on AMD Zen 4, the group
    /// tiles' on every other x86-64 CPU, none elsewhere.
    pub fn for_this_cpu() -> RowPrefetch {
        #[cfg(target_arch = "x86_64")]
        {
            let vendor = std::arch::x86_64::__cpuid(0);
            // "GenuineIntel" and "AuthenticAMD" in the order CPUID returns them: EBX, EDX, ECX.
            let vendor = [vendor.ebx, vendor.edx, vendor.ecx];
            if vendor == [0x756e_6547, 0x4965_6e69, 0x6c65_746e] {
                return RowPrefetch::Software;
            }
            // Zen 4 is family 19h with AVX-512 (Zen 3, the same family, has none).
            let zen_4 = vendor == [0x6874_7541, 0x6974_6e65, 0x444d_4163]
                && cpu_family() == 0x19
                && std::arch::is_x86_feature_detected!("avx512f");
            if zen_4 {
                return RowPrefetch::BatchedGroupTiles;
            }
            RowPrefetch::GroupTiles
        }
        // Only the x86-64 tiles take hints.
        #[cfg(not(target_arch = "x86_64"))]
        RowPrefetch::Hardware
    }
}

/// The CPU's family as CPUID leaf 1 gives it: the base family, plus the extended family when
/// the base is 0xF.
#[cfg(target_arch = "x86_64")]
fn cpu_family() -> u32 {
    let eax = std::arch::x86_64::__cpuid(1).eax;
    let base = (eax >> 8) & 0xF;
    if base == 0xF {
        base + ((eax >> 20) & 0xFF)
    } else {
        base
    }
}

impl std::str::FromStr for RowPrefetch {
    type Err = String;

    fn from_str(text: &str) -> Result<RowPrefetch, String> {
        match text {
            "auto" => Ok(RowPrefetch::for_this_cpu()),
            "on" => Ok(RowPrefetch::Software),
            "groups" => Ok(RowPrefetch::GroupTiles),
            "groups_batched" => Ok(RowPrefetch::BatchedGroupTiles),
            "off" => Ok(RowPrefetch::Hardware),
            other => Err(format!(
                "`{other}` is none of `auto`, `on`, `groups`, `groups_batched` and `off`"
            )),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearShape {
    /// `T`: rows of `x` and `out`.
    pub tokens: usize,
    /// `K`: the reduced dimension.
    pub inner: usize,
    /// `N`: rows of `w`, columns of `out`.
    pub outputs: usize,
}

pub(crate) fn run(launch: &mut Launch<'_>, context: &mut Context) -> Result<(), DeviceFailure> {
    if quant::takes(launch, &["w"]) {
        return quant::run(launch, context);
    }
    let shape = LinearShape {
        tokens: launch.dim("T"),
        inner: launch.dim("K"),
        outputs: launch.dim("N"),
    };
    let order = arrange_weights(launch, &[("w", shape.outputs)], shape.inner, context)?;
    let mut views = launch.views()?;
    let (x, w) = (views.f32("x"), views.float("w"));
    let out = views.f32_mut("out");
    let kernel = (context.isa, context.bf16_products, order, context.prefetch);
    linear_on(kernel, x, w, out, shape, &context.workers)
}

pub(crate) fn run_qkv(launch: &mut Launch<'_>, context: &mut Context) -> Result<(), DeviceFailure> {
    if quant::takes(launch, &["wq", "wk", "wv"]) {
        return quant::run_qkv(launch, context);
    }
    let (tokens, inner) = (launch.dim("T"), launch.dim("K"));
    let widths = [launch.dim("Q"), launch.dim("R"), launch.dim("R")];
    let named = [("wq", widths[0]), ("wk", widths[1]), ("wv", widths[2])];
    let order = arrange_weights(launch, &named, inner, context)?;
    let mut views = launch.views()?;
    let x = views.f32("x");
    let weights = [views.float("wq"), views.float("wk"), views.float("wv")];
    let outs = [views.f32_mut("q"), views.f32_mut("k"), views.f32_mut("v")];
    qkv_linear(
        (context.isa, context.bf16_products, order, context.prefetch),
        x,
        weights,
        outs,
        (tokens, inner, widths),
        &context.workers,
    )
}

pub(crate) fn run_silu_gate(
    launch: &mut Launch<'_>,
    context: &mut Context,
) -> Result<(), DeviceFailure> {
    if quant::takes(launch, &["w_gate", "w_up"]) {
        return quant::run_silu_gate(launch, context);
    }
    let shape = LinearShape {
        tokens: launch.dim("T"),
        inner: launch.dim("K"),
        outputs: launch.dim("I"),
    };
    let named = [("w_gate", shape.outputs), ("w_up", shape.outputs)];
    let order = arrange_weights(launch, &named, shape.inner, context)?;
    let mut views = launch.views()?;
    let x = views.f32("x");
    let weights = [views.float("w_gate"), views.float("w_up")];
    let out = views.f32_mut("out");
    silu_gate_linear(
        (context.isa, context.bf16_products, order, context.prefetch),
        x,
        weights,
        out,
        shape,
        &context.workers,
    )
}

/// Whether bf16 weights in the host's order meet bf16 activations in `vdpbf16ps`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn bf16_dot_products(isa: Isa, products: Bf16Products) -> bool {
    products == Bf16Products::Bf16 && isa.has(IsaLevel::Avx512Bf16)
}

/// Slices hold exactly `T*K`, `N*K` and `T*N` elements (the export layer checked the shapes).
/// The plain form the tests check launches against; launches go through [`run`].
#[cfg(test)]
pub(crate) fn linear(
    (x, w): (&[f32], FloatSlice<'_>),
    out: &mut [f32],
    shape: LinearShape,
    (isa, bf16_products): (Isa, Bf16Products),
    workers: &Workers,
) {
    let kernel = (isa, bf16_products, WeightOrder::Rows, RowPrefetch::Hardware);
    // One weight matrix in the host's order has one dtype and fits every tile: this cannot fail.
    let _ = linear_on(kernel, x, w, out, shape, workers);
}

/// Which tiles run a launch: the instruction-set level, what bf16 weights meet (bf16 products
/// below `avx512_bf16` are f32 products), the order the weights lie in, and whether one-token
/// rows hint their lines ahead.
pub type Kernel = (Isa, Bf16Products, WeightOrder, RowPrefetch);

/// `q`, `k` and `v` from one `x`: three linears in one launch, so the activations are rounded
/// once and the small key and value projections share the threads with the query's.
/// `(T, K, [Q, R, R])` gives the shapes.
pub fn qkv_linear(
    kernel: Kernel,
    x: &[f32],
    weights: [FloatSlice<'_>; 3],
    [q, k, v]: [&mut [f32]; 3],
    (tokens, inner, widths): (usize, usize, [usize; 3]),
    workers: &Workers,
) -> Result<(), DeviceFailure> {
    let outs = [
        SharedOut::new(q, widths[0]),
        SharedOut::new(k, widths[1]),
        SharedOut::new(v, widths[2]),
    ];
    let plan = Plan::new(kernel, tokens, inner, &widths, 1);
    matmul(kernel, x, &weights, &Sink::Each(&outs), &plan, workers)
}

/// `out = silu(x · w_gateᵀ) * (x · w_upᵀ)`: a task computes a run of panels of both
/// projections into stack buffers and applies the activation to them there, so neither
/// projection is written out and read back. Bit for bit what two `linear`s and `silu_mul` give.
pub fn silu_gate_linear(
    kernel: Kernel,
    x: &[f32],
    weights: [FloatSlice<'_>; 2],
    out: &mut [f32],
    shape: LinearShape,
    workers: &Workers,
) -> Result<(), DeviceFailure> {
    let LinearShape {
        tokens,
        inner,
        outputs,
    } = shape;
    let out = SharedOut::new(out, outputs);
    let widths = [outputs];
    let plan = Plan::new(kernel, tokens, inner, &widths, 2);
    matmul(kernel, x, &weights, &Sink::SiluGate(out), &plan, workers)
}

fn linear_on(
    kernel: Kernel,
    x: &[f32],
    w: FloatSlice<'_>,
    out: &mut [f32],
    shape: LinearShape,
    workers: &Workers,
) -> Result<(), DeviceFailure> {
    let LinearShape {
        tokens,
        inner,
        outputs,
    } = shape;
    let outs = [SharedOut::new(out, outputs)];
    let widths = [outputs];
    let plan = Plan::new(kernel, tokens, inner, &widths, 1);
    matmul(kernel, x, &[w], &Sink::Each(&outs), &plan, workers)
}
