//! `linear`, `qkv_linear` and `silu_gate_linear` over block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), read in their stored blocks or interleaved in place, with no dequantized copy.
//!
//! A launch quantizes its activation rows to int8 once (the threads each take spans of whole
//! tiles' rows; a lone token's row once on each thread, which beats handing it over from one),
//! in one or two int8 digits (the values
//! and, by default, their residual, see [`activations`]), then every output is the dot
//! product of one weight row and one activation row, defined once in [`dots`]: exact integer
//! sums, then the scales in one fixed float order. The tiles of each instruction set follow that definition:
//! `vpdpbusd` at `avx512_vnni` ([`avx512`]), `vpmaddubsw` at `avx2` and `avx512` ([`avx2`]),
//! plain Rust otherwise. The result of an output depends only on its weight row and its
//! token's row, so a prompt gives the same bits alone, in a batch and in chunks, and every
//! path gives the same bits.
//!
//! Weights of every block-quantized type are kept in groups of 16 interleaved rows on the
//! levels from `avx2` up (see [`interleaved`]): made in place by the first launch that reads
//! the buffer, like the bf16 panels, and read by group tiles that hold 16 rows × up to 8
//! tokens in registers with no horizontal sums, so batched decode and prefill share each
//! weight load among the tokens. The portable level reads the stored blocks a row at a time.
//!
//! Threads take ranges of groups of 16 weight rows; each group meets every token of the
//! launch while it is in cache, so a batch streams the weights from memory once.

mod activations;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod bench_support;
mod dots;
mod interleaved;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use plughost_device_abi::DType;
use plughost_device_abi::export::{DeviceFailure, Launch};

use crate::Context;
use crate::elementwise::silu_mul_span;
use crate::isa::Isa;
#[cfg(target_arch = "x86_64")]
use crate::isa::IsaLevel;
use crate::workers::{Workers, with_scratch};

use super::RowPrefetch;
use super::sink::SharedOut;
pub use activations::ActivationDigits;
use activations::{Q8Rows, Q8Tiles};
pub use bench_support::QuantizedBench;
use interleaved::GROUP;
pub(crate) use interleaved::{inner_of as interleaved_inner_of, restore as restore_interleaved};

thread_local! {
    /// This thread's quantized activations.
    static ROWS: RefCell<QuantizedActivations> = RefCell::new(Default::default());
}

/// Whether any of the launch's weight arguments is block-quantized: such a launch runs here.
pub(crate) fn takes(launch: &Launch<'_>, weights: &[&str]) -> bool {
    weights.iter().any(|w| launch.dtype(w).is_block_quantized())
}

/// One weight matrix of a launch: its type, bytes and rows, and whether its whole groups of
/// rows are interleaved (see [`interleaved`]) or all rows lie in the host's order.
#[derive(Clone, Copy)]
pub struct QuantMatrix<'a> {
    pub dtype: DType,
    pub bytes: &'a [u8],
    pub rows: usize,
    // Only the x86-64 group tiles read interleaved rows.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub grouped: bool,
}

/// What the outputs of a launch are made of.
enum Outputs<'s, 'a> {
    /// Matrix `p` into output `p`.
    Each(&'s [SharedOut<'a>]),
    /// `silu(x · gateᵀ) * (x · upᵀ)` into one output.
    SiluGate(SharedOut<'a>),
}

pub(crate) fn run(launch: &mut Launch<'_>, context: &mut Context) -> Result<(), DeviceFailure> {
    let (tokens, inner, n) = (launch.dim("T"), launch.dim("K"), launch.dim("N"));
    let [grouped] = interleaved::arrange_weights(launch, ["w"], inner, context)?;
    let mut views = launch.views()?;
    let x = views.f32("x");
    let w = matrix(&views, ("w", grouped), n)?;
    let out = views.f32_mut("out");
    let outs = [SharedOut::new(out, n)];
    multiply(context, x, (tokens, inner), &[w], &Outputs::Each(&outs))
}

pub(crate) fn run_qkv(launch: &mut Launch<'_>, context: &mut Context) -> Result<(), DeviceFailure> {
    let (tokens, inner) = (launch.dim("T"), launch.dim("K"));
    let (q, r) = (launch.dim("Q"), launch.dim("R"));
    let grouped = interleaved::arrange_weights(launch, ["wq", "wk", "wv"], inner, context)?;
    let mut views = launch.views()?;
    let x = views.f32("x");
    let weights = [
        matrix(&views, ("wq", grouped[0]), q)?,
        matrix(&views, ("wk", grouped[1]), r)?,
        matrix(&views, ("wv", grouped[2]), r)?,
    ];
    let outs = [
        SharedOut::new(views.f32_mut("q"), q),
        SharedOut::new(views.f32_mut("k"), r),
        SharedOut::new(views.f32_mut("v"), r),
    ];
    multiply(context, x, (tokens, inner), &weights, &Outputs::Each(&outs))
}

pub(crate) fn run_silu_gate(
    launch: &mut Launch<'_>,
    context: &mut Context,
) -> Result<(), DeviceFailure> {
    let (tokens, inner, i) = (launch.dim("T"), launch.dim("K"), launch.dim("I"));
    let grouped = interleaved::arrange_weights(launch, ["w_gate", "w_up"], inner, context)?;
    let mut views = launch.views()?;
    let x = views.f32("x");
    let weights = [
        matrix(&views, ("w_gate", grouped[0]), i)?,
        matrix(&views, ("w_up", grouped[1]), i)?,
    ];
    let out = SharedOut::new(views.f32_mut("out"), i);
    multiply(
        context,
        x,
        (tokens, inner),
        &weights,
        &Outputs::SiluGate(out),
    )
}

fn matrix<'a>(
    views: &plughost_device_abi::export::ArgViews<'a>,
    (name, grouped): (&str, bool),
    rows: usize,
) -> Result<QuantMatrix<'a>, DeviceFailure> {
    let dtype = views.dtype(name);
    if !dtype.is_block_quantized() {
        return Err(DeviceFailure::invalid_argument(format!(
            "`{name}` is {dtype}, but the launch's other weights are block-quantized: \
             the weights of one launch are all block-quantized or none is"
        )));
    }
    Ok(QuantMatrix {
        dtype,
        bytes: views.blocks(name),
        rows,
        grouped,
    })
}

/// Each weight's bytes hold `rows` rows of `inner` values: what the row loop relies on.
fn check_lengths(weights: &[QuantMatrix<'_>], inner: usize) -> Result<(), DeviceFailure> {
    for w in weights {
        let expected = w.dtype.tensor_bytes(w.rows as u64, inner as u64);
        if expected != Some(w.bytes.len() as u64) {
            return Err(DeviceFailure::internal(format!(
                "{} weights of {} bytes do not hold {} rows of {inner}",
                w.dtype,
                w.bytes.len(),
                w.rows
            )));
        }
    }
    Ok(())
}

/// `x` (`tokens` rows of `inner`) times each of `weights` into `outputs`.
fn multiply(
    context: &Context,
    x: &[f32],
    (tokens, inner): (usize, usize),
    weights: &[QuantMatrix<'_>],
    outputs: &Outputs<'_, '_>,
) -> Result<(), DeviceFailure> {
    check_lengths(weights, inner)?;
    if tokens == 0 {
        return Ok(());
    }
    let kernel = RowKernel {
        isa: context.isa,
        prefetch: context.prefetch,
    };
    let source = ActivationSource {
        x,
        tokens,
        inner,
        kernel,
        digits: context.activation_digits,
        weights,
    };
    let groups = match outputs {
        Outputs::Each(_) => weights.iter().map(|w| w.rows.div_ceil(GROUP)).sum(),
        Outputs::SiluGate(_) => weights[0].rows.div_ceil(GROUP),
    };
    let compute = |activations: &QuantizedActivations, range: std::ops::Range<usize>| {
        let rows_for = |dtype: DType| activations.of(dtype);
        match outputs {
            Outputs::Each(outs) => {
                // A range may cross from one matrix into the next.
                let mut first = 0;
                for (w, out) in weights.iter().zip(outs.iter()) {
                    let groups = w.rows.div_ceil(GROUP);
                    let mine = range.start.max(first)..range.end.min(first + groups);
                    if !mine.is_empty() {
                        let local = rows_of(mine.start - first..mine.end - first, w.rows);
                        kernel.rows_into(*w, rows_for(w.dtype), local, tokens, out);
                    }
                    first += groups;
                }
            }
            Outputs::SiluGate(out) => {
                let [gate, up] = [weights[0], weights[1]];
                let range = rows_of(range, gate.rows);
                kernel.gated_rows_into([gate, up], rows_for, range, tokens, out);
            }
        }
    };
    if tokens == 1 && context.workers.threads() > 1 {
        // A lone token's row is quantized by every thread for itself, in its own scratch: a
        // few hundred nanoseconds of work that on the calling thread alone kept the others
        // waiting, and whose output they then pulled over from its core.
        let launch = QUANTIZATIONS.fetch_add(1, Ordering::Relaxed);
        run_groups(&context.workers, groups, |range| {
            ROWS.with(|cell| {
                let mut activations = cell.borrow_mut();
                activations.prepare(&source, Some(launch), &context.workers);
                compute(&activations, range);
            })
        });
    } else {
        ROWS.with(|cell| {
            let mut activations = cell.borrow_mut();
            activations.prepare(&source, None, &context.workers);
            let activations = &*activations;
            run_groups(&context.workers, groups, |range| {
                compute(activations, range)
            });
        });
    }
    Ok(())
}

/// What a launch quantizes: its activation rows, for the weight types it meets.
struct ActivationSource<'a> {
    x: &'a [f32],
    tokens: usize,
    inner: usize,
    kernel: RowKernel,
    digits: ActivationDigits,
    weights: &'a [QuantMatrix<'a>],
}

/// Numbers the launches whose threads quantize for themselves, so a thread quantizes once per
/// launch however many ranges it takes.
static QUANTIZATIONS: AtomicU64 = AtomicU64::new(0);

/// A launch's activations quantized for each block size (slot 0 for the 32-value blocks, 1
/// for the K-quants' 256), and the same in the group tiles' order; grown to the largest
/// launch and reused.
#[derive(Default)]
struct QuantizedActivations {
    rows: [Q8Rows; 2],
    tiles: [Q8Tiles; 2],
    /// The launch (of [`QUANTIZATIONS`]) these hold, when it was quantized on each thread.
    launch: Option<u64>,
}

impl QuantizedActivations {
    /// Quantizes `source` for each block size its weights take, unless these already hold
    /// `launch`: in spans of whole tiles spread over `workers` (one span, on this thread, for
    /// a lone token).
    fn prepare(&mut self, source: &ActivationSource<'_>, launch: Option<u64>, workers: &Workers) {
        if launch.is_some() && self.launch == launch {
            return;
        }
        let kernel = source.kernel;
        let width = kernel.group_tokens();
        let per_span = span_tokens(source, width.unwrap_or(1), workers.threads());
        let mut quantized = [false; 2];
        for w in source.weights {
            let (slot, block) = (block_slot(w.dtype), dots::activation_block(w.dtype));
            if quantized[slot] {
                continue;
            }
            let QuantizedActivations { rows, tiles, .. } = self;
            let shape = (source.tokens, source.inner, block, source.digits);
            let tiles = width.map(|width| (&mut tiles[slot], width));
            let mut spans = activations::spans(&mut rows[slot], tiles, shape, per_span);
            workers.for_each_chunk(&mut spans, 1, |_, span| {
                for span in span {
                    span.fill_on(kernel.isa, source.x, source.digits);
                }
            });
            quantized[slot] = true;
        }
        self.launch = launch;
    }

    /// The activations `dtype`'s weights meet.
    fn of(&self, dtype: DType) -> Activations<'_> {
        let slot = block_slot(dtype);
        Activations {
            rows: &self.rows[slot],
            tiles: &self.tiles[slot],
        }
    }
}

/// The fewest activation values a span of [`QuantizedActivations::prepare`] quantizes: a few
/// microseconds of work, well above what handing a span to another thread costs.
const MIN_SPAN_VALUES: usize = 2048;

/// Tokens per span of `source`'s activations: a multiple of the tile `width`, about two spans
/// per thread, none smaller than [`MIN_SPAN_VALUES`] (so a lone token is one span).
fn span_tokens(source: &ActivationSource<'_>, width: usize, threads: usize) -> usize {
    let spans = (2 * threads).clamp(1, activations::MAX_SPANS);
    let even = source.tokens.div_ceil(spans);
    let least = MIN_SPAN_VALUES.div_ceil(source.inner.max(1));
    even.max(least).max(1).next_multiple_of(width)
}

/// Activation values a thread's quantization buffers hold from its start: a lone token of
/// every model this serves but the largest, whose first launches on a thread grow them once.
const THREAD_RESERVE_VALUES: usize = 16 * 1024;

/// Grows this thread's quantization buffers for a lone token of [`THREAD_RESERVE_VALUES`]
/// values in both block sizes. Each thread quantizes a lone token for itself, and a thread
/// first claims work of a launch whenever the others leave it some, which may be steps after
/// the server warmed up: without this its first claim would allocate mid-step.
pub(crate) fn reserve_thread_activations() {
    let zeros = vec![0.0; THREAD_RESERVE_VALUES];
    ROWS.with(|cell| {
        let mut activations = cell.borrow_mut();
        let QuantizedActivations { rows, tiles, .. } = &mut *activations;
        for ((rows, tiles), block) in rows.iter_mut().zip(tiles.iter_mut()).zip([32, 256]) {
            rows.quantize_on(
                Isa::portable(),
                &zeros,
                zeros.len(),
                block,
                ActivationDigits::Two,
            );
            // The tile width does not change the buffers' sizes.
            tiles.regroup(rows, 1, 1);
        }
        activations.launch = None;
    });
}

/// The slot of [`QuantizedActivations`] that `dtype`'s activation blocks use.
fn block_slot(dtype: DType) -> usize {
    usize::from(dots::activation_block(dtype) != 32)
}

/// Runs `task` over `0..groups` (of [`GROUP`] rows) in ranges spread over the workers: a task
/// starts at the start of a group, so the interleaved groups are never split.
fn run_groups(
    workers: &Workers,
    groups: usize,
    task: impl Fn(std::ops::Range<usize>) + Sync + Send,
) {
    workers.for_each_range(groups, task);
}

/// The rows of `groups` in a matrix of `rows` rows.
fn rows_of(groups: std::ops::Range<usize>, rows: usize) -> std::ops::Range<usize> {
    groups.start * GROUP..(groups.end * GROUP).min(rows)
}

/// Which tiles a launch runs.
#[derive(Clone, Copy)]
struct RowKernel {
    isa: Isa,
    /// Whether the AVX-512 Q8_0 tiles and the AVX2 Q6_K tiles hint their lines ahead.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    prefetch: RowPrefetch,
}

/// A launch's quantized activations for one weight type: the rows, and the group tiles'
/// regrouping of them (filled when a weight meets the group tiles).
#[derive(Clone, Copy)]
struct Activations<'r> {
    rows: &'r Q8Rows,
    tiles: &'r Q8Tiles,
}

/// Tokens that meet one group of weight rows before the next group: a chunk's activations
/// and the group stay in the core's own caches while the chunk's tiles run.
const CHUNK_TOKENS: usize = 64;

/// Tokens of one group tile: 16 rows × 8 tokens of accumulators in AVX-512's 32 registers;
/// in AVX2's 16, halves of eight rows × 8 tokens, whose float accumulators wait in L1 (they
/// are touched once a block): unpacking each block once for eight tokens rather than four
/// made prefill and batched tiles 1.1–1.25× faster, and 16 gained nothing more. Both divide
/// [`CHUNK_TOKENS`].
#[cfg(target_arch = "x86_64")]
const GROUP_TOKENS_AVX512: usize = 8;
#[cfg(target_arch = "x86_64")]
const GROUP_TOKENS_AVX2: usize = 8;

/// `dtype`'s group tile of the instruction set's module `$isa` for `M` tokens, both digits
/// or the first (`$two`), asking for its lines ahead or not (`$ahead`), called with
/// `($group, $tile)`.
#[cfg(target_arch = "x86_64")]
macro_rules! group_by_type {
    ($isa:ident, $dtype:expr, ($two:expr, $ahead:expr), $group:expr, $tile:expr) => {
        match ($two, $ahead) {
            (true, true) => group_by_type!(@ $isa, $dtype, true, true, $group, $tile),
            (true, false) => group_by_type!(@ $isa, $dtype, true, false, $group, $tile),
            (false, true) => group_by_type!(@ $isa, $dtype, false, true, $group, $tile),
            (false, false) => group_by_type!(@ $isa, $dtype, false, false, $group, $tile),
        }
    };
    (@ $isa:ident, $dtype:expr, $two:literal, $ahead:literal, $group:expr, $tile:expr) => {
        match $dtype {
            DType::Q8_0 => $isa::group::<M, 0, $two, $ahead>($group, $tile),
            DType::Q4_0 => $isa::group::<M, 1, $two, $ahead>($group, $tile),
            DType::Q4_1 => $isa::group::<M, 2, $two, $ahead>($group, $tile),
            DType::Q4_K => $isa::q4_k_group::<M, $two, $ahead>($group, $tile),
            DType::Q6_K => $isa::q6_k_group::<M, $two, $ahead>($group, $tile),
            _ => unreachable!("only the types kept in groups reach the group tiles"),
        }
    };
}

#[cfg(target_arch = "x86_64")]
impl RowPrefetch {
    /// Whether a group tile of `dtype` and `tokens` tokens asks for its lines ahead: AVX-512
    /// VNNI's when `vnni`, else AVX2's.
    fn group_hints(self, dtype: DType, vnni: bool, tokens: usize) -> bool {
        // On Zen 5 these two were faster without: AVX-512's Q8_0 (SmolLM2's small matrices
        // 7% slower with, Qwen3's no faster) and AVX2's Q6_K (0.6× on one thread).
        let rows_kind = vnni && dtype == DType::Q8_0 || !vnni && dtype == DType::Q6_K;
        match self {
            RowPrefetch::Hardware => false,
            RowPrefetch::Software => true,
            RowPrefetch::GroupTiles => !rows_kind,
            RowPrefetch::BatchedGroupTiles => !rows_kind && tokens > 1,
        }
    }
}

impl RowKernel {
    /// Tokens per group tile at this level, if it runs the group tiles.
    fn group_tokens(self) -> Option<usize> {
        #[cfg(target_arch = "x86_64")]
        if self.isa.has(IsaLevel::Avx512Vnni) {
            return Some(GROUP_TOKENS_AVX512);
        } else if self.isa.has(IsaLevel::Avx2) {
            return Some(GROUP_TOKENS_AVX2);
        }
        None
    }

    /// Outputs `rows` of `w` (at most one group, from a group's start) for the tokens
    /// `tokens` (from a multiple of [`CHUNK_TOKENS`]), token-major into `out` (a span of
    /// `rows.len()` per token): by the group tiles from `avx2` up, from the matrix's own group
    /// when it is interleaved and whole, else from the rows packed into one; on the portable
    /// level row by row, each row against all the tokens while it is in cache.
    fn group_into(
        self,
        w: QuantMatrix<'_>,
        (x, tiles): (&Q8Rows, &Q8Tiles),
        (tokens, rows): (std::ops::Range<usize>, std::ops::Range<usize>),
        out: &mut [f32],
    ) {
        let row_bytes = w.bytes.len() / w.rows.max(1);
        let width = rows.len();
        #[cfg(target_arch = "x86_64")]
        if interleaved::groups(w.dtype) && self.group_tokens().is_some() {
            let bytes = &w.bytes[rows.start * row_bytes..rows.end * row_bytes];
            let packed;
            let group = if w.grouped && width == GROUP {
                bytes
            } else {
                let mut scratch = vec![0; GROUP * row_bytes];
                let blocks = row_bytes / dots::block_bytes(w.dtype);
                interleaved::pack(w.dtype, bytes, blocks, &mut scratch);
                packed = scratch;
                &packed
            };
            return self.group_tiles((w.dtype, group), tiles, tokens, (out, width));
        }
        let _ = tiles;
        for (i, n) in rows.enumerate() {
            let row = &w.bytes[n * row_bytes..(n + 1) * row_bytes];
            for (j, t) in tokens.clone().enumerate() {
                out[j * width + i] = dots::dot_row(w.dtype, row, x.row(t));
            }
        }
    }

    /// One interleaved group of `dtype` rows against the tokens `tokens` (from a multiple of
    /// the tile width) of `tiles`, its first `width` outputs per token into `out`.
    #[cfg(target_arch = "x86_64")]
    fn group_tiles(
        self,
        (dtype, group): (DType, &[u8]),
        tiles: &Q8Tiles,
        tokens: std::ops::Range<usize>,
        (out, width): (&mut [f32], usize),
    ) {
        let mut store = |first: usize, values: &[[f32; GROUP]]| {
            for (t, values) in (first - tokens.start..).zip(values) {
                copy_outputs(&mut out[t * width..(t + 1) * width], &values[..width]);
            }
        };
        let vnni = self.isa.has(IsaLevel::Avx512Vnni);
        // With one digit the second is zero, and the tiles skip its products.
        let two = tiles.digits() == ActivationDigits::Two;
        for first in tokens.clone().step_by(tiles.width()) {
            let tile = tiles.tile(first);
            let ahead = self.prefetch.group_hints(dtype, vnni, tile.tokens);
            if vnni {
                super::dispatch::by_tokens!(tile.tokens, [1, 2, 3, 4, 5, 6, 7, 8], |M| {
                    let values = {
                        // SAFETY: the level has AVX-512 VNNI, which implies the rest of the
                        // tile's features (checked when the `Isa` was made).
                        unsafe { group_by_type!(avx512, dtype, (two, ahead), group, tile) }
                    };
                    store(first, &values);
                });
            } else {
                super::dispatch::by_tokens!(tile.tokens, [1, 2, 3, 4, 5, 6, 7, 8], |M| {
                    // SAFETY: the level has AVX2, FMA and F16C (checked when the `Isa` was
                    // made).
                    let values = unsafe { group_by_type!(avx2, dtype, (two, ahead), group, tile) };
                    store(first, &values);
                });
            }
        }
    }

    /// Outputs `range` of `w` (from a group's start) for every token into `out`: a chunk of
    /// tokens at a time, each against every group of the range.
    fn rows_into(
        self,
        w: QuantMatrix<'_>,
        x: Activations<'_>,
        range: std::ops::Range<usize>,
        tokens: usize,
        out: &SharedOut<'_>,
    ) {
        // A range is a few groups in decode and there are hundreds of ranges per step: the
        // outputs of a chunk wait in this thread's scratch, never in a fresh allocation.
        with_scratch(tokens.min(CHUNK_TOKENS) * GROUP, |values| {
            for chunk in (0..tokens).step_by(CHUNK_TOKENS) {
                let chunk = chunk..(chunk + CHUNK_TOKENS).min(tokens);
                for start in range.clone().step_by(GROUP) {
                    let group = start..(start + GROUP).min(range.end);
                    let width = group.len();
                    // `group_into` writes every value of the span before it is read.
                    let values = &mut values[..chunk.len() * width];
                    let at = (chunk.clone(), group.clone());
                    self.group_into(w, (x.rows, x.tiles), at, values);
                    for (i, t) in chunk.clone().enumerate() {
                        let start = out.columns(t, group.clone());
                        // SAFETY: `columns` checked the span lies inside `out`, and the task
                        // owns columns `range` of every row (the ranges of a launch are
                        // disjoint).
                        let columns = unsafe { std::slice::from_raw_parts_mut(start, width) };
                        copy_outputs(columns, &values[i * width..(i + 1) * width]);
                    }
                }
            }
        });
    }

    /// `silu(gate) * up` for outputs `range` (from a group's start) and every token, a chunk
    /// of tokens and a group at a time, through the same SiLU as `silu_mul`, so it matches
    /// two `linear`s and `silu_mul` bit for bit.
    fn gated_rows_into<'r>(
        self,
        [gate, up]: [QuantMatrix<'_>; 2],
        rows_for: impl Fn(DType) -> Activations<'r>,
        range: std::ops::Range<usize>,
        tokens: usize,
        out: &SharedOut<'_>,
    ) {
        let (x_gate, x_up) = (rows_for(gate.dtype), rows_for(up.dtype));
        // Token-major, so each token's outputs are one span for the SiLU; in this thread's
        // scratch, as in `rows_into`.
        let span_len = tokens.min(CHUNK_TOKENS) * GROUP;
        with_scratch(2 * span_len, |scratch| {
            let (g, u) = scratch.split_at_mut(span_len);
            for chunk in (0..tokens).step_by(CHUNK_TOKENS) {
                let chunk = chunk..(chunk + CHUNK_TOKENS).min(tokens);
                for start in range.clone().step_by(GROUP) {
                    let group = start..(start + GROUP).min(range.end);
                    let width = group.len();
                    // `group_into` writes every value of both spans before they are read.
                    let (g, u) = (&mut g[..chunk.len() * width], &mut u[..chunk.len() * width]);
                    let at = (chunk.clone(), group.clone());
                    self.group_into(gate, (x_gate.rows, x_gate.tiles), at.clone(), g);
                    self.group_into(up, (x_up.rows, x_up.tiles), at, u);
                    for (i, t) in chunk.clone().enumerate() {
                        let start = out.columns(t, group.clone());
                        // SAFETY: `columns` checked the span lies inside `out`, and the task
                        // owns columns `range` of every row (the ranges of a launch are
                        // disjoint).
                        let columns = unsafe { std::slice::from_raw_parts_mut(start, width) };
                        let span = i * width..(i + 1) * width;
                        silu_mul_span(self.isa, &g[span.clone()], &u[span], columns);
                    }
                }
            }
        });
    }
}

/// Copies one group's outputs of a token. At a whole group's width the copy has a fixed size,
/// which compiles to a few vector moves rather than a call to `memcpy`: a decode step copies
/// thousands of groups, each after a few hundred nanoseconds of arithmetic.
#[inline(always)]
fn copy_outputs(out: &mut [f32], values: &[f32]) {
    match (
        <&mut [f32; GROUP]>::try_from(&mut *out),
        <&[f32; GROUP]>::try_from(values),
    ) {
        (Ok(out), Ok(values)) => *out = *values,
        _ => out.copy_from_slice(values),
    }
}

/// Gathers rows of a block-quantized table into f32 (`embedding_gather`).
///
/// A table the linears interleaved (`arrangement`, its code, not `AS_WRITTEN`) is read in
/// place, each gathered row put back in the host's order first.
pub(crate) fn gather_rows(
    (dtype, arrangement): (DType, u64),
    table: &[u8],
    width: usize,
    indices: &[i32],
    out: &mut [f32],
    workers: &Workers,
) -> Result<(), String> {
    let row_bytes = dtype
        .tensor_bytes(1, width as u64)
        .map(|b| b as usize)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("rows of {width} are not whole {dtype} blocks"))?;
    let num_rows = table.len() / row_bytes;
    for (position, &index) in indices.iter().enumerate() {
        if usize::try_from(index).map_or(true, |index| index >= num_rows) {
            return Err(format!(
                "ids[{position}] = {index} is outside 0..{num_rows}"
            ));
        }
    }
    let interleaved = interleaved::inner_of(arrangement);
    if arrangement != plughost_device_abi::export::AS_WRITTEN && interleaved != Some((dtype, width))
    {
        return Err(format!(
            "a {dtype} table of rows of {width} is in arrangement {arrangement}"
        ));
    }
    let rows_per_task = workers.rows_per_task(indices.len(), width);
    workers.for_each_chunk(out, rows_per_task * width, |task, out_rows| {
        let first = task * rows_per_task;
        let mut unpacked = Vec::new();
        for (out_row, &index) in out_rows.chunks_exact_mut(width).zip(&indices[first..]) {
            let index = index as usize;
            let row = if interleaved.is_some() {
                unpacked.resize(row_bytes, 0);
                interleaved::row_of(dtype, table, width, index, &mut unpacked);
                &unpacked[..]
            } else {
                &table[index * row_bytes..(index + 1) * row_bytes]
            };
            // Whole blocks of the right count (checked above): this cannot fail.
            let _ = plughost_device_abi::blocks::dequantize_into(dtype, row, out_row);
        }
    });
    Ok(())
}
