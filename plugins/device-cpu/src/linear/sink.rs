//! Where the tiles of a launch write: each weight matrix into its own output, or a gate and up pair through SiLU into one ([`Sink`]), over output memory shared by tasks that own disjoint columns ([`SharedOut`]).

use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::Range;

use plughost_device_abi::export::FloatSlice;

use super::plan::Plan;
use super::{NR, portable};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512, panels};
use crate::elementwise::silu_mul_span;
use crate::workers::Workers;

/// Where the tiles of a launch go.
pub(super) enum Sink<'s, 'a> {
    /// Weight matrix `p` into output `p`.
    Each(&'s [SharedOut<'a>]),
    /// Two weight matrices (gate, up) meet in `silu(gate) * up`.
    SiluGate(SharedOut<'a>),
}

impl Sink<'_, '_> {
    /// Checks the slices against the plan; the raw-pointer paths rely on these lengths.
    pub(super) fn check(&self, plan: &Plan, x: &[f32], weights: &[FloatSlice<'_>]) -> bool {
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
    pub(super) fn fill_zero(&self) {
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

/// Runs `kernel(part, tokens, n0, columns, out, out_stride)` over every tile of the plan,
/// sending its outputs where `sink` says.
pub(super) fn drive(
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

/// `out` shared by tasks that each write a disjoint set of its elements (their own columns),
/// for as long as the exclusive borrow it was made from.
#[derive(Clone, Copy)]
pub(super) struct SharedOut<'a> {
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
    pub(super) fn new(out: &'a mut [f32], width: usize) -> SharedOut<'a> {
        SharedOut {
            start: out.as_mut_ptr(),
            len: out.len(),
            width,
            _borrow: PhantomData,
        }
    }

    /// The start of columns `columns` of row `t`, checked to lie inside `out`.
    pub(super) fn columns(&self, t: usize, columns: Range<usize>) -> *mut f32 {
        self.block(t, columns.start, 1, columns.len())
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
