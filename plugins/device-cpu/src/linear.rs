//! `linear` (`out[T,N] = x[T,K] · w[N,K]ᵀ`), `qkv_linear` and `silu_gate_linear` in f32 over f32, f16 or bf16 weights, with results that do not depend on the batch.
//!
//! Every output is a dot product of a token row and a weight row, both contiguous in `k`: the
//! weights are read where they lie, in their stored precision, with no widened copy.
//! Threads take panels of [`NR`] weight rows; a panel meets the tokens `MR` at a time (`MR`
//! per instruction set), so one pass over a weight row serves several tokens. With one token
//! (decode) the AVX-512 tiles stream the `NR` rows side by side; the AVX2 tiles read them one
//! after the other, as one stream (see `avx2`).
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

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub mod panels;
mod portable;

use std::cell::RefCell;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use plughost_device_abi::abi::DType;
use plughost_device_abi::export::{AS_WRITTEN, DeviceFailure, FloatSlice, Launch};

use crate::Context;
use crate::elementwise::silu_mul_span;
use crate::isa::{Isa, IsaLevel, Vectors};
use crate::widen::widen_into;
use crate::workers::{Workers, with_scratch};

/// Weight rows per panel: the outputs of one tile.
pub const NR: usize = 6;

/// Most tokens one pass over a panel serves: their activation rows (`64 × K`) stay in L2
/// while the panels of a task stream past them.
const MC: usize = 64;

/// Below this many multiply-adds (64 KiB of bf16 weights for one token) a launch runs as one
/// task on the calling thread: handing half of it to a worker would save less than it costs.
/// Above it, even a decode's small projections stream their weights faster on every core.
const MIN_PARALLEL_WORK: usize = 32 * 1024;

/// Tokens per tile of the tiles in `vectors`.
fn tile_tokens(vectors: Vectors) -> usize {
    match vectors {
        #[cfg(target_arch = "x86_64")]
        Vectors::Avx512 => avx512::MR,
        #[cfg(target_arch = "x86_64")]
        Vectors::Avx2 => avx2::MR,
        Vectors::Portable => portable::MR,
    }
}

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

/// How the weight matrices of a launch lie in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightOrder {
    /// Row-major `[N, K]`, as the host wrote them.
    #[default]
    Rows,
    /// bf16 in the panels of `panels`, read by the AVX2 panel tiles in f32; every `N` a
    /// multiple of 32.
    Panels,
}

/// Tokens and weight rows of one tile.
fn tile_shape(isa: Isa, order: WeightOrder) -> (usize, usize) {
    match order {
        #[cfg(target_arch = "x86_64")]
        WeightOrder::Panels => (panels::MR, panels::ROWS),
        _ => (tile_tokens(isa.vectors()), NR),
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
    let shape = LinearShape {
        tokens: launch.dim("T"),
        inner: launch.dim("K"),
        outputs: launch.dim("N"),
    };
    let order = arrange_weights(launch, &[("w", shape.outputs)], shape.inner, context)?;
    let mut views = launch.views()?;
    let (x, w) = (views.f32("x"), views.float("w"));
    let out = views.f32_mut("out");
    let kernel = (context.isa, context.bf16_products, order);
    linear_on(kernel, x, w, out, shape, &context.workers)
}

pub(crate) fn run_qkv(launch: &mut Launch<'_>, context: &mut Context) -> Result<(), DeviceFailure> {
    let (tokens, inner) = (launch.dim("T"), launch.dim("K"));
    let widths = [launch.dim("Q"), launch.dim("R"), launch.dim("R")];
    let named = [("wq", widths[0]), ("wk", widths[1]), ("wv", widths[2])];
    let order = arrange_weights(launch, &named, inner, context)?;
    let mut views = launch.views()?;
    let x = views.f32("x");
    let weights = [views.float("wq"), views.float("wk"), views.float("wv")];
    let outs = [views.f32_mut("q"), views.f32_mut("k"), views.f32_mut("v")];
    qkv_linear(
        (context.isa, context.bf16_products, order),
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
        (context.isa, context.bf16_products, order),
        x,
        weights,
        out,
        shape,
        &context.workers,
    )
}

/// Puts the weight arguments `(name, N)` of a launch in the order its tiles read: panels when
/// bf16 weights are multiplied in f32 at a level from `avx2` up and every weight can be
/// arranged so (bf16, spanning its own buffer, `N` a multiple of 32), the host's order
/// otherwise. A buffer stays arranged across launches,
/// so only the first launch that reads it pays for the arrangement.
fn arrange_weights(
    launch: &mut Launch<'_>,
    weights: &[(&str, usize)],
    inner: usize,
    context: &Context,
) -> Result<WeightOrder, DeviceFailure> {
    #[cfg(target_arch = "x86_64")]
    {
        let in_f32 = !bf16_dot_products(context.isa, context.bf16_products);
        let target = |name: &str, outputs: usize| {
            let fits = context.isa.has(IsaLevel::Avx2)
                && in_f32
                && launch.dtype(name) == DType::BF16
                && launch.spans_buffer(name);
            panels::arrangement(outputs, inner).filter(|_| fits)
        };
        // One per weight of the launch: at most `MAX_MATRICES`, so no allocation per launch.
        let mut targets = [None; MAX_MATRICES];
        for (target_of, &(name, outputs)) in targets.iter_mut().zip(weights) {
            *target_of = target(name, outputs);
        }
        let targets = &targets[..weights.len().min(MAX_MATRICES)];
        let all = weights.len() <= MAX_MATRICES && targets.iter().all(Option::is_some);
        for (&(name, _), target) in weights.iter().zip(targets) {
            let target = target.filter(|_| all).unwrap_or(AS_WRITTEN);
            let current = launch.arrangement(name);
            if current == target {
                continue;
            }
            if current != AS_WRITTEN {
                restore_arrangement(launch, name)?;
            }
            if target != AS_WRITTEN {
                launch.rearrange(name, target, |bytes| {
                    let bits = half_bits_mut(bytes);
                    let panel = panels::ROWS * inner;
                    // Some sixteen tasks: every thread gets a share, and none waits long on
                    // the last.
                    let panels_per_task = (bits.len() / panel).div_ceil(16).max(1);
                    context
                        .workers
                        .for_each_chunk(bits, panels_per_task * panel, |_, chunk| {
                            panels::arrange(chunk, inner, &mut Vec::new())
                        });
                });
            }
        }
        if all {
            return Ok(WeightOrder::Panels);
        }
    }
    let _ = (launch, weights, inner, context);
    Ok(WeightOrder::Rows)
}

/// Whether bf16 weights in the host's order meet bf16 activations in `vdpbf16ps`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn bf16_dot_products(isa: Isa, products: Bf16Products) -> bool {
    products == Bf16Products::Bf16 && isa.has(IsaLevel::Avx512Bf16)
}

/// Puts the buffer under `arg` back in the host's order if a launch arranged it.
pub(crate) fn restore_arrangement(launch: &mut Launch<'_>, arg: &str) -> Result<(), DeviceFailure> {
    let current = launch.arrangement(arg);
    if current == AS_WRITTEN {
        return Ok(());
    }
    let mut outcome = Ok(());
    launch.rearrange(arg, AS_WRITTEN, |bytes| outcome = restore(current, bytes));
    outcome
}

/// Undoes an arrangement of this module's on a buffer's bytes.
pub(crate) fn restore(arrangement: u64, bytes: &mut [u8]) -> Result<(), DeviceFailure> {
    #[cfg(target_arch = "x86_64")]
    if let Some(inner) = panels::inner_of(arrangement) {
        panels::restore(half_bits_mut(bytes), inner, &mut Vec::new());
        return Ok(());
    }
    let _ = bytes;
    Err(DeviceFailure::internal(format!(
        "the CPU device has no arrangement {arrangement}"
    )))
}

/// A buffer's bytes as 16-bit elements: buffers are 64-byte aligned and hold whole elements.
#[cfg(target_arch = "x86_64")]
fn half_bits_mut(bytes: &mut [u8]) -> &mut [u16] {
    // SAFETY: every bit pattern is a valid u16; `align_to_mut` puts only whole, aligned
    // elements in the middle part.
    let (head, bits, _) = unsafe { bytes.align_to_mut::<u16>() };
    debug_assert!(head.is_empty(), "device buffers are aligned");
    bits
}

/// Slices hold exactly `T*K`, `N*K` and `T*N` elements (the export layer checked the shapes).
pub fn linear(
    (x, w): (&[f32], FloatSlice<'_>),
    out: &mut [f32],
    shape: LinearShape,
    (isa, bf16_products): (Isa, Bf16Products),
    workers: &Workers,
) {
    let kernel = (isa, bf16_products, WeightOrder::Rows);
    // One weight matrix in the host's order has one dtype and fits every tile: this cannot fail.
    let _ = linear_on(kernel, x, w, out, shape, workers);
}

/// Which tiles run a launch: the instruction-set level, what bf16 weights meet (bf16 products
/// below `avx512_bf16` are f32 products), and the order the weights lie in.
pub type Kernel = (Isa, Bf16Products, WeightOrder);

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

thread_local! {
    /// The activations rounded to bf16 for the `vdpbf16ps` path; grows to the largest launch
    /// and is reused.
    static X_BF16: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
    /// The activations in the column order of the AVX2 bf16 tiles; grows likewise.
    static X_ORDERED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
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

/// Where the tiles of a launch go.
enum Sink<'s, 'a> {
    /// Weight matrix `p` into output `p`.
    Each(&'s [SharedOut<'a>]),
    /// Two weight matrices (gate, up) meet in `silu(gate) * up`.
    SiluGate(SharedOut<'a>),
}

impl Sink<'_, '_> {
    /// Checks the slices against the plan; the raw-pointer paths rely on these lengths.
    fn check(&self, plan: &Plan, x: &[f32], weights: &[FloatSlice<'_>]) -> bool {
        let (tokens, inner) = (plan.tokens, plan.inner);
        let fits = |out: &SharedOut, width: usize| {
            out.width == width && Some(out.len) == tokens.checked_mul(width)
        };
        let weight_fits = |w: &FloatSlice, rows: usize| Some(w.len()) == rows.checked_mul(inner);
        let sink_fits = match self {
            Sink::Each(outs) => {
                outs.len() == plan.widths.len()
                    && weights.len() == outs.len()
                    && outs.iter().zip(plan.widths).all(|(o, &w)| fits(o, w))
                    && weights
                        .iter()
                        .zip(plan.widths)
                        .all(|(w, &n)| weight_fits(w, n))
            }
            Sink::SiluGate(out) => {
                plan.widths == [out.width]
                    && fits(out, out.width)
                    && weights.len() == 2
                    && weights.iter().all(|w| weight_fits(w, out.width))
            }
        };
        Some(x.len()) == tokens.checked_mul(inner) && sink_fits
    }

    /// Every output element set to what an empty inner dimension gives: zero (and
    /// `silu(0) * 0` is zero too).
    fn fill_zero(&self) {
        let fill = |o: &SharedOut| {
            // SAFETY: `o` stands for an exclusive borrow of `len` elements, and no task runs.
            unsafe { std::slice::from_raw_parts_mut(o.start, o.len) }.fill(0.0)
        };
        match self {
            Sink::Each(outs) => outs.iter().for_each(fill),
            Sink::SiluGate(out) => fill(out),
        }
    }
}

/// Tokens per tile at most, over every instruction set: the gated epilogue's buffers hold a
/// tile of each projection.
const MAX_TILE_TOKENS: usize = 4;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(avx512::MR <= MAX_TILE_TOKENS && avx2::MR <= MAX_TILE_TOKENS);
const _: () = assert!(portable::MR <= MAX_TILE_TOKENS);

/// Weight rows of the gate (then of the up projection) one gated tile reads in a row: whole
/// panels, as many as fit.
const GATE_RUN_ROWS: usize = 64;
const _: () = assert!(GATE_RUN_ROWS >= NR);
#[cfg(target_arch = "x86_64")]
const _: () = assert!(GATE_RUN_ROWS >= panels::ROWS && panels::MR <= MAX_TILE_TOKENS);

/// `x` times each of `weights` (one dtype) into `sink`, on the instruction set's tiles.
fn matmul(
    (isa, bf16_products, order): Kernel,
    x: &[f32],
    weights: &[FloatSlice<'_>],
    sink: &Sink<'_, '_>,
    plan: &Plan,
    workers: &Workers,
) -> Result<(), DeviceFailure> {
    // Only the x86-64 tiles tell bf16 products apart.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bf16_products;
    assert!(
        sink.check(plan, x, weights),
        "linear: slices of {} and {:?} elements do not match T={} K={} N={:?}",
        x.len(),
        weights.iter().map(|w| w.len()).collect::<Vec<_>>(),
        plan.tokens,
        plan.inner,
        plan.widths
    );
    let Some(&first) = weights.first() else {
        return Ok(());
    };
    let dtype = std::mem::discriminant(&first);
    if weights.iter().any(|w| std::mem::discriminant(w) != dtype) {
        return Err(DeviceFailure::invalid_argument(
            "the weights of one launch must share a dtype",
        ));
    }
    let inner = plan.inner;
    if inner == 0 {
        sink.fill_zero();
        return Ok(());
    }
    if plan.tokens == 0 || plan.widths.iter().all(|&w| w == 0) {
        return Ok(());
    }
    if order == WeightOrder::Panels {
        let runs = cfg!(target_arch = "x86_64") && isa.has(IsaLevel::Avx2);
        let fits = plan.widths.iter().all(|w| w % plan.panel_rows == 0);
        if !(runs && matches!(first, FloatSlice::BF16(_)) && fits) {
            return Err(DeviceFailure::invalid_argument(format!(
                "weights in panels need isa avx2 or higher, bf16 and widths that are multiples \
                 of {} (widths {:?})",
                plan.panel_rows, plan.widths
            )));
        }
    }
    match (isa.vectors(), first) {
        #[cfg(target_arch = "x86_64")]
        (_, FloatSlice::BF16(_)) if order == WeightOrder::Panels => {
            let w = typed(weights, bf16_bits).map(as_wide::<Bf16Bits>);
            let block = token_block_len(plan.tokens, plan.tile_tokens);
            drive(
                plan,
                workers,
                sink,
                &|part, tokens, n0, _, out, out_stride| {
                    // The first group of a block reads the panel from memory; the others
                    // find it in cache. While the first computes, the next panel streams in.
                    let first_group = tokens.start % block == 0;
                    let tile = panels::Tile {
                        x: x[tokens.start * inner..].as_ptr(),
                        x_stride: inner,
                        // Panel `n0 / 32` starts at row `n0`.
                        w: w[part][n0 * inner..].as_ptr(),
                        inner,
                        out,
                        out_stride,
                        prefetch_next: first_group,
                    };
                    // SAFETY: `isa` has AVX2 (checked above); every width is a multiple of the
                    // panel, so the panel and its outputs are whole; the task owns the output
                    // block.
                    unsafe { by_tokens!(tokens.len(), [1, 2, 3, 4], |M| panels::tile::<M>(&tile)) }
                },
            )
        }
        #[cfg(target_arch = "x86_64")]
        (Vectors::Avx512, FloatSlice::BF16(_)) if bf16_dot_products(isa, bf16_products) => {
            let bits = typed(weights, bf16_bits);
            X_BF16.with(|cell| {
                let mut buffer = cell.borrow_mut();
                // Grown, never shrunk: every launch overwrites the part it uses, so a launch
                // after a larger one clears nothing.
                if buffer.len() < x.len() {
                    buffer.resize(x.len(), 0);
                }
                let rounded = &mut buffer[..x.len()];
                // A prefill's activations are megabytes: both threads round them.
                let rows_per_task = workers.rows_per_task(plan.tokens, inner);
                workers.for_each_chunk(rounded, rows_per_task * inner, |task, bits| {
                    let rows = &x[task * rows_per_task * inner..];
                    for (row, row_bits) in rows.chunks(inner).zip(bits.chunks_mut(inner)) {
                        // SAFETY: `isa` has AVX-512 BF16 (the arm's guard).
                        unsafe { avx512::round_row_to_bf16(row, row_bits) };
                    }
                });
                let rounded: &[u16] = rounded;
                drive(
                    plan,
                    workers,
                    sink,
                    &|part, tokens, n0, columns, out, out_stride| {
                        let tile = avx512::Tile {
                            x: rounded[tokens.start * inner..].as_ptr(),
                            x_stride: inner,
                            w: panel_rows(bits[part], n0, columns, inner),
                            inner,
                            out,
                            out_stride,
                            columns,
                            prefetch_next_panel: plan.reads_panels_once(),
                        };
                        // SAFETY: `isa` has AVX-512 BF16 (the arm's guard); `panel_rows` and the
                        // token range keep every row in bounds; the task owns the output block.
                        unsafe {
                            by_tokens!(tokens.len(), [1, 2, 3, 4], |M| avx512::bf16::<M>(&tile))
                        }
                    },
                )
            })
        }
        #[cfg(target_arch = "x86_64")]
        (Vectors::Avx512, FloatSlice::F32(_)) => {
            avx512_wide(plan, workers, x, typed(weights, f32_values), sink)
        }
        #[cfg(target_arch = "x86_64")]
        (Vectors::Avx512, FloatSlice::BF16(_)) => avx512_wide(
            plan,
            workers,
            x,
            typed(weights, bf16_bits).map(as_wide::<Bf16Bits>),
            sink,
        ),
        #[cfg(target_arch = "x86_64")]
        (Vectors::Avx512, FloatSlice::F16(_)) => avx512_wide(
            plan,
            workers,
            x,
            typed(weights, f16_bits).map(as_wide::<F16Bits>),
            sink,
        ),
        #[cfg(target_arch = "x86_64")]
        (Vectors::Avx2, FloatSlice::F32(_)) => {
            avx2_wide(plan, workers, x, typed(weights, f32_values), sink)
        }
        #[cfg(target_arch = "x86_64")]
        (Vectors::Avx2, FloatSlice::BF16(_)) => {
            let w = typed(weights, bf16_bits).map(as_wide::<Bf16Bits>);
            X_ORDERED.with(|cell| {
                let mut buffer = cell.borrow_mut();
                // Grown, never shrunk, as `X_BF16`.
                if buffer.len() < x.len() {
                    buffer.resize(x.len(), 0.0);
                }
                let ordered = &mut buffer[..x.len()];
                for (row, out) in x.chunks(inner).zip(ordered.chunks_mut(inner)) {
                    avx2::order_for_bf16(row, out);
                }
                avx2_tiles(
                    plan,
                    workers,
                    (ordered, w),
                    sink,
                    [avx2::bf16::<1>, avx2::bf16::<2>],
                )
            })
        }
        #[cfg(target_arch = "x86_64")]
        (Vectors::Avx2, FloatSlice::F16(_)) => avx2_wide(
            plan,
            workers,
            x,
            typed(weights, f16_bits).map(as_wide::<F16Bits>),
            sink,
        ),
        (Vectors::Portable, _) => drive(
            plan,
            workers,
            sink,
            &|part, tokens, n0, columns, out, out_stride| {
                with_scratch(NR * inner, |rows| {
                    for j in 0..NR {
                        // Past the last row, repeat it: those outputs are not stored.
                        let row = n0 + j.min(columns - 1);
                        widen_into(
                            weights[part],
                            row * inner,
                            &mut rows[j * inner..(j + 1) * inner],
                        );
                    }
                    let tile = portable::Tile {
                        x: &x[tokens.start * inner..tokens.end * inner],
                        tokens: tokens.len(),
                        w: std::array::from_fn(|j| &rows[j * inner..(j + 1) * inner]),
                        out,
                        out_stride,
                        columns,
                    };
                    // SAFETY: the task owns the output block.
                    unsafe { portable::run(&tile) }
                })
            },
        ),
    }
    Ok(())
}

/// The most weight matrices one launch multiplies (`qkv_linear`'s three).
#[cfg(target_arch = "x86_64")]
const MAX_MATRICES: usize = 3;

/// The weights of a launch as one element type, unused entries empty.
#[cfg(target_arch = "x86_64")]
type Typed<'a, T> = [&'a [T]; MAX_MATRICES];

#[cfg(target_arch = "x86_64")]
fn f32_values(w: FloatSlice<'_>) -> &[f32] {
    match w {
        FloatSlice::F32(values) => values,
        _ => &[],
    }
}

#[cfg(target_arch = "x86_64")]
fn bf16_bits(w: FloatSlice<'_>) -> &[u16] {
    match w {
        FloatSlice::BF16(bits) => bits,
        _ => &[],
    }
}

#[cfg(target_arch = "x86_64")]
fn f16_bits(w: FloatSlice<'_>) -> &[u16] {
    match w {
        FloatSlice::F16(bits) => bits,
        _ => &[],
    }
}

/// `weights` (which share a dtype, checked by [`matmul`]) as that dtype's elements.
#[cfg(target_arch = "x86_64")]
fn typed<'a, T>(weights: &[FloatSlice<'a>], pick: fn(FloatSlice<'a>) -> &'a [T]) -> Typed<'a, T> {
    std::array::from_fn(|p| weights.get(p).map_or(&[][..], |w| pick(*w)))
}

/// Runs `kernel(part, tokens, n0, columns, out, out_stride)` over every tile of the plan,
/// sending its outputs where `sink` says.
fn drive(
    plan: &Plan,
    workers: &Workers,
    sink: &Sink<'_, '_>,
    kernel: &(impl Fn(usize, Range<usize>, usize, usize, *mut f32, usize) + Sync),
) {
    match sink {
        Sink::Each(outs) => plan.run(workers, 1, |part, tokens, n0, columns| {
            let out = &outs[part];
            let block = out.block(tokens.start, n0, tokens.len(), columns);
            kernel(part, tokens, n0, columns, block, out.width);
        }),
        Sink::SiluGate(out) => plan.run(
            workers,
            GATE_RUN_ROWS / plan.panel_rows,
            |_, tokens, n0, columns| {
                // A run of gate panels, then the same run of up panels: each matrix is read in
                // long contiguous stretches, which streams faster than alternating panel by panel.
                // Not zeroed: the kernels write every element that is read below.
                let mut gate = [MaybeUninit::<f32>::uninit(); MAX_TILE_TOKENS * GATE_RUN_ROWS];
                let mut up = [MaybeUninit::<f32>::uninit(); MAX_TILE_TOKENS * GATE_RUN_ROWS];
                for (matrix, values) in [(0, &mut gate), (1, &mut up)] {
                    for first in (0..columns).step_by(plan.panel_rows) {
                        let panel_columns = plan.panel_rows.min(columns - first);
                        let at = values.as_mut_ptr().wrapping_add(first).cast::<f32>();
                        kernel(
                            matrix,
                            tokens.clone(),
                            n0 + first,
                            panel_columns,
                            at,
                            columns,
                        );
                    }
                }
                let filled = tokens.len() * columns;
                // SAFETY: the tiles above wrote `columns` outputs of each of the `tokens` rows, rows
                // `columns` apart: exactly the first `filled` elements.
                let (gate, up) = unsafe {
                    (
                        std::slice::from_raw_parts(gate.as_ptr().cast::<f32>(), filled),
                        std::slice::from_raw_parts(up.as_ptr().cast::<f32>(), filled),
                    )
                };
                let block = out.block(tokens.start, n0, tokens.len(), columns);
                for m in 0..tokens.len() {
                    // SAFETY: `block` checked that the block's rows lie inside `out`; the task owns
                    // these `columns` elements of each row, so no one else touches them.
                    let row = unsafe {
                        std::slice::from_raw_parts_mut(block.wrapping_add(m * out.width), columns)
                    };
                    let span = m * columns..(m + 1) * columns;
                    silu_mul_span(plan.isa, &gate[span.clone()], &up[span], row);
                }
            },
        ),
    }
}

/// Evaluates `$call` with the const `$m` set to `$tokens`, one of the listed tile sizes.
#[cfg(target_arch = "x86_64")]
macro_rules! by_tokens {
    ($tokens:expr, [$($n:literal),+], |$m:ident| $call:expr) => {
        match $tokens {
            $($n => {
                const $m: usize = $n;
                $call
            })+
            other => unreachable!("a tile of {other} tokens"),
        }
    };
}
#[cfg(target_arch = "x86_64")]
use by_tokens;

/// The first element of each of the panel's `NR` weight rows; past the last of `columns`
/// rows it repeats that row (those outputs are computed but not stored).
#[cfg(target_arch = "x86_64")]
fn panel_rows<W>(w: &[W], n0: usize, columns: usize, inner: usize) -> [*const W; NR] {
    std::array::from_fn(|j| w[(n0 + j.min(columns - 1)) * inner..].as_ptr())
}

/// f16 weight bits, a type of their own so kernels widen them as f16.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct F16Bits(u16);

impl F16Bits {
    pub fn to_f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }

    /// Rounded to the nearest f16, ties to even.
    pub fn from_f32(value: f32) -> F16Bits {
        F16Bits(half::f16::from_f32(value).to_bits())
    }
}

/// bf16 weight bits, a type of their own so kernels widen them as bf16.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Bf16Bits(u16);

impl Bf16Bits {
    pub fn to_f32(self) -> f32 {
        crate::widen::bf16_to_f32(self.0)
    }

    /// Rounded to the nearest bf16, ties to even.
    pub fn from_f32(value: f32) -> Bf16Bits {
        Bf16Bits(half::bf16::from_f32(value).to_bits())
    }
}

/// The same bits seen as the weight type a kernel widens.
pub(crate) fn as_wide<W: HalfBits>(bits: &[u16]) -> &[W] {
    const { assert!(size_of::<W>() == size_of::<u16>() && align_of::<W>() == align_of::<u16>()) };
    // SAFETY: `W` is a `repr(transparent)` newtype of `u16` (same size and alignment, checked
    // above), valid for every bit pattern.
    unsafe { std::slice::from_raw_parts(bits.as_ptr().cast(), bits.len()) }
}

/// As [`as_wide`], for bits a kernel writes.
pub(crate) fn as_wide_mut<W: HalfBits>(bits: &mut [u16]) -> &mut [W] {
    const { assert!(size_of::<W>() == size_of::<u16>() && align_of::<W>() == align_of::<u16>()) };
    // SAFETY: as in `as_wide`; the exclusive borrow moves to the result.
    unsafe { std::slice::from_raw_parts_mut(bits.as_mut_ptr().cast(), bits.len()) }
}

/// The `repr(transparent)` newtypes of `u16` that [`as_wide`] may produce.
pub(crate) trait HalfBits: Copy {}
impl HalfBits for F16Bits {}
impl HalfBits for Bf16Bits {}

/// The AVX-512 FMA path: f32 activations times weights widened to f32.
#[cfg(target_arch = "x86_64")]
fn avx512_wide<W: avx512::Wide + Sync>(
    plan: &Plan,
    workers: &Workers,
    x: &[f32],
    w: Typed<'_, W>,
    sink: &Sink<'_, '_>,
) {
    let inner = plan.inner;
    drive(
        plan,
        workers,
        sink,
        &|part, tokens, n0, columns, out, out_stride| {
            let tile = avx512::Tile {
                x: x[tokens.start * inner..].as_ptr(),
                x_stride: inner,
                w: panel_rows(w[part], n0, columns, inner),
                inner,
                out,
                out_stride,
                columns,
                prefetch_next_panel: plan.reads_panels_once(),
            };
            // SAFETY: `Vectors::Avx512` comes from an `Isa` with AVX-512; `panel_rows` and the token
            // range keep every row in bounds; the task owns the output block.
            unsafe { by_tokens!(tokens.len(), [1, 2, 3, 4], |M| avx512::wide::<W, M>(&tile)) }
        },
    )
}

/// The AVX2 path: f32 activations times weights widened to f32.
#[cfg(target_arch = "x86_64")]
fn avx2_wide<W: avx2::Wide + Sync>(
    plan: &Plan,
    workers: &Workers,
    x: &[f32],
    w: Typed<'_, W>,
    sink: &Sink<'_, '_>,
) {
    avx2_tiles(
        plan,
        workers,
        (x, w),
        sink,
        [avx2::wide::<W, 1>, avx2::wide::<W, 2>],
    )
}

/// The AVX2 tiles of one launch: `kernels[M - 1]` runs a tile of `M` tokens.
#[cfg(target_arch = "x86_64")]
fn avx2_tiles<W: Sync>(
    plan: &Plan,
    workers: &Workers,
    (x, w): (&[f32], Typed<'_, W>),
    sink: &Sink<'_, '_>,
    kernels: [unsafe fn(&avx2::Tile<W>); avx2::MR],
) {
    let inner = plan.inner;
    drive(
        plan,
        workers,
        sink,
        &|part, tokens, n0, columns, out, out_stride| {
            let tile = avx2::Tile {
                x: x[tokens.start * inner..].as_ptr(),
                x_stride: inner,
                w: panel_rows(w[part], n0, columns, inner),
                inner,
                out,
                out_stride,
                columns,
            };
            // SAFETY: as in `avx512_wide`, with AVX2; token groups hold 1 to `MR`.
            unsafe { kernels[tokens.len() - 1](&tile) }
        },
    )
}

/// How one launch is cut into tasks, panels and token groups.
struct Plan<'w> {
    tokens: usize,
    inner: usize,
    /// Outputs of each panel space: one per output matrix (`qkv_linear` has three), one for
    /// a gate and up pair.
    widths: &'w [usize],
    /// Weight matrices a panel reads: two for a gate and up pair.
    matrices_per_panel: usize,
    tile_tokens: usize,
    /// Weight rows per panel: [`NR`], or 32 for weights in panels.
    panel_rows: usize,
    /// The level the gated epilogue runs at.
    isa: Isa,
}

impl<'w> Plan<'w> {
    fn new(
        (isa, _, order): Kernel,
        tokens: usize,
        inner: usize,
        widths: &'w [usize],
        matrices_per_panel: usize,
    ) -> Plan<'w> {
        let (tile_tokens, panel_rows) = tile_shape(isa, order);
        Plan {
            tokens,
            inner,
            widths,
            matrices_per_panel,
            tile_tokens,
            panel_rows,
            isa,
        }
    }

    /// Whether every panel meets all the tokens in one pass (one token block), so its weights
    /// are read once, from memory, rather than again from cache for later blocks.
    #[cfg(target_arch = "x86_64")]
    fn reads_panels_once(&self) -> bool {
        self.tokens <= MC
    }

    /// Calls `tile(part, tokens, n0, columns)` for every token group and run of up to
    /// `run_panels` panels of every panel space, spread over the workers by panels: each task
    /// owns the columns of its panels. The panel spaces are laid end to end, so one task may
    /// finish one and start the next.
    fn run(
        &self,
        workers: &Workers,
        run_panels: usize,
        tile: impl Fn(usize, Range<usize>, usize, usize) + Sync,
    ) {
        let tokens = self.tokens;
        let rows = self.panel_rows;
        let panel_counts = self.widths.iter().map(|w| w.div_ceil(rows));
        let num_panels: usize = panel_counts.clone().sum();
        let work =
            tokens * self.inner * self.widths.iter().sum::<usize>() * self.matrices_per_panel;
        let body = |panels: Range<usize>| {
            for block in token_blocks(tokens, self.tile_tokens) {
                // Cut once per block: the panel loop below is the hot path of decode.
                let groups = token_groups(block, self.tile_tokens);
                let mut space_start = 0;
                for (part, count) in panel_counts.clone().enumerate() {
                    let width = self.widths[part];
                    let own = panels.start.max(space_start)..panels.end.min(space_start + count);
                    for panel in own.clone().step_by(run_panels.max(1)) {
                        let n0 = (panel - space_start) * rows;
                        let panels = run_panels.max(1).min(own.end - panel);
                        let columns = (panels * rows).min(width - n0);
                        for group in groups.clone() {
                            tile(part, group, n0, columns);
                        }
                    }
                    space_start += count;
                }
            }
        };
        // The split decides only which thread computes a panel, never how (see the module docs).
        if work < MIN_PARALLEL_WORK {
            body(0..num_panels);
        } else {
            workers.for_each_range(num_panels, body);
        }
    }
}

/// `0..T` cut into at most [`MC`]-token blocks of nearly equal size (multiples of
/// `tile_tokens` but the last).
fn token_blocks(tokens: usize, tile_tokens: usize) -> impl Iterator<Item = Range<usize>> {
    let block = token_block_len(tokens, tile_tokens);
    (0..tokens)
        .step_by(block)
        .map(move |start| start..(start + block).min(tokens))
}

/// The length of every block of [`token_blocks`] but the last.
fn token_block_len(tokens: usize, tile_tokens: usize) -> usize {
    let num_blocks = tokens.div_ceil(MC);
    tokens
        .div_ceil(num_blocks.max(1))
        .div_ceil(tile_tokens)
        .max(1)
        * tile_tokens
}

/// `tokens` cut into the fewest groups of at most `tile_tokens`, of sizes differing by at most
/// one: 13 tokens in tiles of 4 make 4, 3, 3, 3 rather than 4, 4, 4, 1, whose one-token tile
/// would read its weights for a single token.
fn token_groups(
    tokens: Range<usize>,
    tile_tokens: usize,
) -> impl Iterator<Item = Range<usize>> + Clone {
    let num_groups = tokens.len().div_ceil(tile_tokens);
    let (size, larger) = match num_groups {
        0 => (0, 0),
        _ => (tokens.len() / num_groups, tokens.len() % num_groups),
    };
    (0..num_groups).map(move |group| {
        let first = tokens.start + group * size + group.min(larger);
        first..first + size + usize::from(group < larger)
    })
}

/// `out` shared by tasks that each write a disjoint set of its elements (their own columns),
/// for as long as the exclusive borrow it was made from.
#[derive(Clone, Copy)]
struct SharedOut<'a> {
    start: *mut f32,
    len: usize,
    /// Row length: `N`.
    width: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: a `SharedOut` stands for an exclusive borrow, and its users write disjoint elements
// (each task its own panels' columns), so handing copies to other threads cannot make a data
// race.
unsafe impl Send for SharedOut<'_> {}
// SAFETY: as above.
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    fn new(out: &'a mut [f32], width: usize) -> SharedOut<'a> {
        SharedOut {
            start: out.as_mut_ptr(),
            len: out.len(),
            width,
            _borrow: PhantomData,
        }
    }

    /// Element `[t, n0]` of the block of rows `t..t + tokens`, columns `n0..n0 + columns`,
    /// checked to lie inside `out`.
    fn block(&self, t: usize, n0: usize, tokens: usize, columns: usize) -> *mut f32 {
        assert!(
            tokens > 0 && n0 + columns <= self.width && (t + tokens) * self.width <= self.len,
            "block of {tokens} rows from {t}, {columns} columns from {n0}, outside {} rows of {}",
            self.len / self.width.max(1),
            self.width
        );
        // In bounds: row `t` lies inside `out`.
        self.start.wrapping_add(t * self.width + n0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::noise;
    use crate::widen::widen_into;
    use half::{bf16, f16};

    /// The weights of one case in every dtype, and their exact f32 values for the reference.
    struct Weights {
        f32s: Vec<f32>,
        f16_bits: Vec<u16>,
        bf16_bits: Vec<u16>,
    }

    impl Weights {
        fn new(len: usize) -> Weights {
            let raw: Vec<f32> = (0..len).map(|i| noise(7, i)).collect();
            Weights {
                f16_bits: raw.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
                bf16_bits: raw.iter().map(|&v| bf16::from_f32(v).to_bits()).collect(),
                f32s: raw,
            }
        }

        /// The weights stored in `dtype`.
        fn slice(&self, dtype: &str) -> FloatSlice<'_> {
            match dtype {
                "f32" => FloatSlice::F32(&self.f32s),
                "f16" => FloatSlice::F16(&self.f16_bits),
                "bf16" => FloatSlice::BF16(&self.bf16_bits),
                other => panic!("no dtype {other}"),
            }
        }

        /// The `dtype` weights as `order` stores them, for `K = inner`: panels hold bf16 only.
        fn stored(&self, order: WeightOrder, dtype: &str, inner: usize) -> Option<Stored<'_>> {
            match order {
                WeightOrder::Rows => Some(Stored::Rows(self.slice(dtype))),
                #[cfg(target_arch = "x86_64")]
                WeightOrder::Panels => {
                    let mut bits = self.bf16_bits.clone();
                    panels::arrange(&mut bits, inner, &mut Vec::new());
                    (dtype == "bf16").then_some(Stored::Panels(bits))
                }
                #[cfg(not(target_arch = "x86_64"))]
                WeightOrder::Panels => {
                    let _ = inner;
                    None
                }
            }
        }

        /// The exact f32 values the `dtype` weights hold.
        fn exact(&self, dtype: &str) -> Vec<f32> {
            let mut values = vec![0.0; self.f32s.len()];
            widen_into(self.slice(dtype), 0, &mut values);
            values
        }
    }

    /// Weights as a kernel reads them.
    enum Stored<'a> {
        Rows(FloatSlice<'a>),
        #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
        Panels(Vec<u16>),
    }

    impl Stored<'_> {
        fn slice(&self) -> FloatSlice<'_> {
            match self {
                Stored::Rows(slice) => *slice,
                Stored::Panels(bits) => FloatSlice::BF16(bits),
            }
        }
    }

    /// Widths for a kernel's tests: the panels need multiples of 32, the rest get widths
    /// that leave partial panels.
    fn width(kernel: Kernel, rows: usize) -> usize {
        match kernel.2 {
            WeightOrder::Rows => rows,
            WeightOrder::Panels => rows.div_ceil(32) * 32,
        }
    }

    /// Plain triple loop with f64 accumulation: each output, and the sum of its products'
    /// magnitudes.
    fn reference(x: &[f32], w: &[f32], shape: LinearShape) -> Vec<(f64, f64)> {
        let LinearShape {
            tokens,
            inner,
            outputs,
        } = shape;
        let mut out = vec![(0.0, 0.0); tokens * outputs];
        for t in 0..tokens {
            for n in 0..outputs {
                let (mut sum, mut magnitude) = (0.0f64, 0.0f64);
                for k in 0..inner {
                    let product = f64::from(x[t * inner + k]) * f64::from(w[n * inner + k]);
                    sum += product;
                    magnitude += product.abs();
                }
                out[t * outputs + n] = (sum, magnitude);
            }
        }
        out
    }

    /// Every kernel this machine can run: at each of its levels, f32 products on weights in
    /// the host's order and (from `avx2` up) in panels, and bf16 products where the level has
    /// them.
    fn kernels() -> Vec<Kernel> {
        let mut kernels = Vec::new();
        for isa in Isa::every() {
            kernels.push((isa, Bf16Products::F32, WeightOrder::Rows));
            if cfg!(target_arch = "x86_64") && isa.has(IsaLevel::Avx2) {
                kernels.push((isa, Bf16Products::F32, WeightOrder::Panels));
            }
            if isa.has(IsaLevel::Avx512Bf16) {
                kernels.push((isa, Bf16Products::Bf16, WeightOrder::Rows));
            }
        }
        kernels
    }

    /// The activations a kernel multiplies `dtype` weights with: rounded to bf16 on the
    /// `vdpbf16ps` path, as they are otherwise.
    fn activations_seen(kernel: Kernel, dtype: &str, x: &[f32]) -> Vec<f32> {
        if bf16_dot_products(kernel.0, kernel.1) && kernel.2 == WeightOrder::Rows && dtype == "bf16"
        {
            return x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        }
        x.to_vec()
    }

    #[test]
    fn matches_the_reference_for_every_path_and_dtype() {
        // One token, token groups with a rest of 5, 3 and 5 tokens, a launch small enough to
        // stay on one thread, and 250 tokens (two token blocks). N is never a multiple of the
        // 6-row panels (but rounded up to 32 for weights in panels) and K never one of 8 or 16,
        // so every tail runs.
        let shapes = [
            (1, 1100, 300),
            (5, 300, 250),
            (3, 129, 53),
            (17, 515, 300),
            (64, 2000, 161),
            (250, 37, 40),
        ];
        for kernel in kernels() {
            for threads in [1, 2] {
                let workers = Workers::new(threads).unwrap();
                for (tokens, inner, outputs) in shapes {
                    let outputs = width(kernel, outputs);
                    let shape = LinearShape {
                        tokens,
                        inner,
                        outputs,
                    };
                    let x: Vec<f32> = (0..tokens * inner).map(|i| noise(3, i)).collect();
                    let weights = Weights::new(outputs * inner);
                    for dtype in ["f32", "f16", "bf16"] {
                        let Some(w) = weights.stored(kernel.2, dtype, inner) else {
                            continue;
                        };
                        let w_exact = weights.exact(dtype);
                        let mut out = vec![f32::NAN; tokens * outputs];
                        linear_on(kernel, &x, w.slice(), &mut out, shape, &workers).unwrap();
                        let x_seen = activations_seen(kernel, dtype, &x);
                        let expected = reference(&x_seen, &w_exact, shape);
                        for (i, (&got, &(want, magnitude))) in out.iter().zip(&expected).enumerate()
                        {
                            // Sums of K products in f32: error ~ sqrt(K) ulp of the partial sums.
                            // The 8-lane dot products keep partial sums an eighth of the total
                            // of values below 1; weights in panels add an output in one chain,
                            // whose partial sums grow to the size of all its products.
                            let root = (inner as f64).sqrt();
                            let tolerance = match kernel.2 {
                                WeightOrder::Rows => 2e-6 * root,
                                WeightOrder::Panels => f64::from(f32::EPSILON) * root * magnitude,
                            };
                            assert!(
                                (f64::from(got) - want).abs() < tolerance,
                                "{kernel:?} {shape:?} {dtype} {threads} threads: \
                                 out[{i}] = {got}, expected {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// `x · wᵀ` for the token rows of `x` in one launch, as f32 bits.
    #[test]
    fn fused_launches_give_the_bits_of_the_launches_they_replace() {
        let inner = 300;
        for kernel in kernels() {
            // Widths that leave partial panels of 6 rows: 40 = 6·6 + 4, 13 = 2·6 + 1; 103 =
            // 17·6 + 1 makes gated runs of 10 and 7 panels on one thread. In panels of 32: 64,
            // 32 and 128 (gated runs of 2, 2).
            let [q_width, kv_width, i_width] = [40, 13, 103].map(|rows| width(kernel, rows));
            let weights: Vec<Weights> = [q_width, kv_width, kv_width, i_width, i_width]
                .iter()
                .map(|n| Weights::new(n * inner))
                .collect();
            for threads in [1, 2] {
                let workers = Workers::new(threads).unwrap();
                for tokens in [1, 5, 70] {
                    let x: Vec<f32> = (0..tokens * inner).map(|i| noise(17, i)).collect();
                    for dtype in ["f32", "f16", "bf16"] {
                        let Some(stored) = weights
                            .iter()
                            .map(|w| w.stored(kernel.2, dtype, inner))
                            .collect::<Option<Vec<_>>>()
                        else {
                            continue;
                        };
                        let w: Vec<FloatSlice<'_>> = stored.iter().map(Stored::slice).collect();
                        let alone = |w: FloatSlice<'_>| launch_bits(kernel, &x, w, inner, &workers);
                        let bits =
                            |v: &[f32]| -> Vec<u32> { v.iter().map(|v| v.to_bits()).collect() };
                        let case = format!("{kernel:?} {threads} threads T={tokens} {dtype}");

                        let mut q = vec![f32::NAN; tokens * q_width];
                        let mut k = vec![f32::NAN; tokens * kv_width];
                        let mut v = vec![f32::NAN; tokens * kv_width];
                        qkv_linear(
                            kernel,
                            &x,
                            [w[0], w[1], w[2]],
                            [&mut q, &mut k, &mut v],
                            (tokens, inner, [q_width, kv_width, kv_width]),
                            &workers,
                        )
                        .unwrap();
                        assert_eq!(bits(&q), alone(w[0]), "q, {case}");
                        assert_eq!(bits(&k), alone(w[1]), "k, {case}");
                        assert_eq!(bits(&v), alone(w[2]), "v, {case}");

                        let shape = LinearShape {
                            tokens,
                            inner,
                            outputs: i_width,
                        };
                        let mut fused = vec![f32::NAN; tokens * i_width];
                        silu_gate_linear(kernel, &x, [w[3], w[4]], &mut fused, shape, &workers)
                            .unwrap();
                        let as_f32 = |b: Vec<u32>| -> Vec<f32> {
                            b.into_iter().map(f32::from_bits).collect()
                        };
                        let (gate, up) = (as_f32(alone(w[3])), as_f32(alone(w[4])));
                        let mut expected = vec![f32::NAN; tokens * i_width];
                        let isa = kernel.0;
                        crate::elementwise::silu_mul(isa, &gate, &up, &mut expected, &workers);
                        assert_eq!(bits(&fused), bits(&expected), "silu gate, {case}");
                    }
                }
            }
        }
    }

    #[test]
    fn weights_of_one_launch_in_different_dtypes_are_refused() {
        let inner = 8;
        let (a, b) = (Weights::new(6 * inner), Weights::new(6 * inner));
        let x = vec![1.0; inner];
        let mut out = vec![0.0; 6];
        let shape = LinearShape {
            tokens: 1,
            inner,
            outputs: 6,
        };
        let workers = Workers::new(1).unwrap();
        let result = silu_gate_linear(
            (Isa::detect(), Bf16Products::default(), WeightOrder::Rows),
            &x,
            [a.slice("f32"), b.slice("bf16")],
            &mut out,
            shape,
            &workers,
        );
        assert!(result.is_err());
    }

    fn launch_bits(
        kernel: Kernel,
        x: &[f32],
        w: FloatSlice<'_>,
        inner: usize,
        workers: &Workers,
    ) -> Vec<u32> {
        let shape = LinearShape {
            tokens: x.len() / inner,
            inner,
            outputs: w.len() / inner,
        };
        let mut out = vec![f32::NAN; shape.tokens * shape.outputs];
        linear_on(kernel, x, w, &mut out, shape, workers).unwrap();
        out.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn a_tokens_output_does_not_depend_on_its_batch() {
        const BATCH: usize = 16;
        // K blocks of 256, 256 and 91 (not a multiple of 8) and N of 20 full panels and one of
        // 5 rows, big enough that even one token is split over two threads; then 250 tokens
        // (two token blocks), K blocks of 256 and 44, N of two full panels and one of 8 rows.
        // In panels, N is 11 and 2 panels of 32.
        for (tokens, inner, rows) in [(70, 603, 325), (250, 300, 40)] {
            let x: Vec<f32> = (0..tokens * inner).map(|i| noise(11, i)).collect();
            for (kernel, dtype) in kernels()
                .into_iter()
                .flat_map(|k| ["f32", "f16", "bf16"].map(|dtype| (k, dtype)))
            {
                let outputs = width(kernel, rows);
                let weights = Weights::new(outputs * inner);
                let Some(stored) = weights.stored(kernel.2, dtype, inner) else {
                    continue;
                };
                let w = stored.slice();
                let mut on_one_thread = None;
                for threads in [1, 2] {
                    let workers = Workers::new(threads).unwrap();
                    let launch = |rows: &[f32]| launch_bits(kernel, rows, w, inner, &workers);
                    let in_chunks_of =
                        |n: usize| -> Vec<u32> { x.chunks(n * inner).flat_map(launch).collect() };
                    // Token `t` at position `t % BATCH` among other tokens.
                    let inside_batches: Vec<u32> = (0..tokens)
                        .flat_map(|t| {
                            let position = t % BATCH;
                            let mut batch: Vec<f32> = (0..BATCH * inner)
                                .map(|i| noise(13 + t as u64, i))
                                .collect();
                            batch[position * inner..(position + 1) * inner]
                                .copy_from_slice(&x[t * inner..(t + 1) * inner]);
                            launch(&batch)[position * outputs..(position + 1) * outputs].to_vec()
                        })
                        .collect();
                    let whole = launch(&x);
                    let mut ways = vec![
                        ("one at a time", in_chunks_of(1)),
                        ("in pairs", in_chunks_of(2)),
                        ("in chunks of 3", in_chunks_of(3)),
                        ("inside batches of 16", inside_batches),
                    ];
                    if let Some(bits) = on_one_thread.take() {
                        ways.push(("on one thread", bits));
                    }
                    for (way, bits) in ways {
                        if let Some(i) = (0..whole.len()).find(|&i| bits[i] != whole[i]) {
                            panic!(
                                "{kernel:?} T={tokens} K={inner} N={outputs} {dtype} \
                                 {threads} threads: token {} output {} is {} {way}, {} in one batch",
                                i / outputs,
                                i % outputs,
                                f32::from_bits(bits[i]),
                                f32::from_bits(whole[i])
                            );
                        }
                    }
                    on_one_thread = Some(whole);
                }
            }
        }
    }

    #[test]
    fn rounding_to_bf16_matches_round_to_nearest_even() {
        #[cfg(target_arch = "x86_64")]
        if Isa::detect().has(IsaLevel::Avx512Bf16) {
            // 37 values: two full vectors and a masked tail; ties, signs and tiny values.
            let x: Vec<f32> = (0..37)
                .map(|i| match i {
                    0 => f32::from_bits(0x3f80_8000), // a tie, rounds to even (down)
                    1 => f32::from_bits(0x3f81_8000), // a tie, rounds to even (up)
                    _ => noise(19, i) * 10f32.powi(i as i32 % 7 - 3),
                })
                .collect();
            let mut bits = vec![0u16; x.len()];
            // SAFETY: checked above.
            unsafe { avx512::round_row_to_bf16(&x, &mut bits) };
            let expected: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            assert_eq!(bits, expected);
        }
    }

    #[test]
    fn token_groups_cover_the_block_evenly() {
        type Groups = &'static [Range<usize>];
        let cases: [(Range<usize>, Groups); 4] = [
            (0..0, &[]),
            (3..4, &[Range { start: 3, end: 4 }]),
            (0..7, &[0..4, 4..7]),
            (10..23, &[10..14, 14..17, 17..20, 20..23]),
        ];
        for (tokens, groups) in cases {
            assert_eq!(
                token_groups(tokens.clone(), 4).collect::<Vec<_>>(),
                groups,
                "{tokens:?}"
            );
        }
        let sizes: Vec<usize> = token_groups(0..130, 4).map(|group| group.len()).collect();
        assert_eq!((sizes.len(), sizes.iter().sum::<usize>()), (33, 130));
        assert!(sizes.iter().all(|&size| size == 3 || size == 4));
    }

    #[test]
    fn an_empty_inner_dimension_gives_zeros() {
        let mut out = vec![f32::NAN; 6];
        let shape = LinearShape {
            tokens: 2,
            inner: 0,
            outputs: 3,
        };
        linear(
            (&[], FloatSlice::F32(&[])),
            &mut out,
            shape,
            (Isa::detect(), Bf16Products::default()),
            &Workers::new(1).unwrap(),
        );
        assert_eq!(out, vec![0.0; 6]);
    }

    /// Weight bandwidth (T=1), a 16-stream decode step (T=16) and arithmetic rate (T=128) of an
    /// MLP-sized `linear` (SmolLM2's 576 → 1536), single- and two-thread.
    /// `cargo test --release -p plughost-device-cpu -- --ignored --nocapture`
    ///
    /// "hot" runs one weight matrix over and over (it stays in the 32 MiB L3 of the test
    /// machine); "cold" cycles through copies adding up to 256 MiB, so weights come from DRAM as
    /// in a real decode step.
    #[test]
    #[ignore = "timing, not a test"]
    fn linear_timing() {
        use std::time::Instant;
        let (inner, outputs) = (576, 1536);
        let weights = Weights::new(outputs * inner);
        for threads in [1, 2] {
            let workers = Workers::new(threads).unwrap();
            let rows = WeightOrder::Rows;
            let cases = [
                ("f32", Bf16Products::F32, rows),
                ("bf16", Bf16Products::F32, rows),
                ("bf16", Bf16Products::F32, WeightOrder::Panels),
                ("bf16", Bf16Products::Bf16, rows),
                ("f16", Bf16Products::F32, rows),
            ];
            for (dtype, products, order) in cases {
                let kernel = (Isa::detect(), products, order);
                if !kernels().contains(&kernel) {
                    continue;
                }
                let element_bytes = if dtype == "f32" { 4 } else { 2 };
                let weight_bytes = (outputs * inner * element_bytes) as f64;
                let sources: Vec<Weights> = (0..(256 << 20) / (outputs * inner * element_bytes))
                    .map(|_| Weights {
                        f32s: weights.f32s.clone(),
                        f16_bits: weights.f16_bits.clone(),
                        bf16_bits: weights.bf16_bits.clone(),
                    })
                    .collect();
                let copies: Vec<Stored> = sources
                    .iter()
                    .filter_map(|w| w.stored(order, dtype, inner))
                    .collect();
                let Some(hot) = weights.stored(order, dtype, inner) else {
                    continue;
                };
                for (tokens, temperature) in [(1, "hot"), (1, "cold"), (16, "cold"), (128, "hot")] {
                    let shape = LinearShape {
                        tokens,
                        inner,
                        outputs,
                    };
                    let x: Vec<f32> = (0..tokens * inner).map(|i| noise(3, i)).collect();
                    let mut out = vec![0.0; tokens * outputs];
                    let pick = |i: usize| match temperature {
                        "hot" => hot.slice(),
                        _ => copies[i % copies.len()].slice(),
                    };
                    let run = |w, out: &mut [f32]| {
                        linear_on(kernel, &x, w, out, shape, &workers).unwrap();
                    };
                    run(pick(0), &mut out);
                    let repeats = if tokens == 1 { 400 } else { 10 };
                    let started = Instant::now();
                    for i in 0..repeats {
                        run(pick(i + 1), &mut out);
                    }
                    let seconds = started.elapsed().as_secs_f64() / repeats as f64;
                    let flops = 2.0 * (tokens * inner * outputs) as f64;
                    println!(
                        "linear T={tokens:<3} K={inner} N={outputs} {dtype:<4} {products:?} {order:?} \
                         {temperature:<4} threads={threads}: {:8.1} us {:6.1} GB/s of weights {:6.1} GFLOP/s",
                        seconds * 1e6,
                        weight_bytes / seconds / 1e9,
                        flops / seconds / 1e9
                    );
                }
            }
        }
    }
}
