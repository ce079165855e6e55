//! The instruction-set and dtype dispatch of a launch ([`matmul`]): which tiles run it, with what the activations are first turned into, and the `SAFETY` argument for every call into `target_feature` code.

use std::cell::RefCell;

use plughost_device_abi::export::{DeviceFailure, FloatSlice};

#[cfg(target_arch = "x86_64")]
use super::elements::{Bf16Bits, F16Bits};
#[cfg(target_arch = "x86_64")]
use super::elements::{Typed, as_wide, bf16_bits, f16_bits, f32_values, typed};
use super::plan::Plan;
#[cfg(target_arch = "x86_64")]
use super::plan::token_block_len;
use super::sink::{Sink, drive};
use super::{Kernel, NR, WeightOrder, portable};
#[cfg(target_arch = "x86_64")]
use super::{RowPrefetch, avx2, avx512, bf16_dot_products, panels};
use crate::isa::{IsaLevel, Vectors};
use crate::widen::widen_into;
use crate::workers::{Workers, with_scratch};

thread_local! {
    /// The activations rounded to bf16 for the `vdpbf16ps` path; grows to the largest launch
    /// and is reused.
    static X_BF16: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
    /// The activations in the column order of the AVX2 bf16 tiles; grows likewise.
    static X_ORDERED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `x` times each of `weights` (one dtype) into `sink`, on the instruction set's tiles.
pub(super) fn matmul(
    (isa, bf16_products, order, prefetch): Kernel,
    x: &[f32],
    weights: &[FloatSlice<'_>],
    sink: &Sink<'_, '_>,
    plan: &Plan,
    workers: &Workers,
) -> Result<(), DeviceFailure> {
    // Only the x86-64 tiles tell bf16 products and row prefetches apart.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bf16_products, prefetch);
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
                        far_ahead: prefetch == RowPrefetch::Software,
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
                            prefetch_row_ahead: prefetch == RowPrefetch::Software,
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
            avx512_wide(plan, workers, x, typed(weights, f32_values), sink, prefetch)
        }
        #[cfg(target_arch = "x86_64")]
        (Vectors::Avx512, FloatSlice::BF16(_)) => avx512_wide(
            plan,
            workers,
            x,
            typed(weights, bf16_bits).map(as_wide::<Bf16Bits>),
            sink,
            prefetch,
        ),
        #[cfg(target_arch = "x86_64")]
        (Vectors::Avx512, FloatSlice::F16(_)) => avx512_wide(
            plan,
            workers,
            x,
            typed(weights, f16_bits).map(as_wide::<F16Bits>),
            sink,
            prefetch,
        ),
        #[cfg(target_arch = "x86_64")]
        (Vectors::Avx2, FloatSlice::F32(_)) => {
            avx2_wide(plan, workers, x, typed(weights, f32_values), sink, prefetch)
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
                    ([avx2::bf16::<1>, avx2::bf16::<2>], false),
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
            prefetch,
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
pub(super) use by_tokens;

/// The first element of each of the panel's `NR` weight rows; past the last of `columns`
/// rows it repeats that row (those outputs are computed but not stored).
#[cfg(target_arch = "x86_64")]
fn panel_rows<W>(w: &[W], n0: usize, columns: usize, inner: usize) -> [*const W; NR] {
    std::array::from_fn(|j| w[(n0 + j.min(columns - 1)) * inner..].as_ptr())
}

/// The AVX-512 FMA path: f32 activations times weights widened to f32.
#[cfg(target_arch = "x86_64")]
fn avx512_wide<W: avx512::Wide + Sync>(
    plan: &Plan,
    workers: &Workers,
    x: &[f32],
    w: Typed<'_, W>,
    sink: &Sink<'_, '_>,
    prefetch: RowPrefetch,
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
                prefetch_row_ahead: prefetch == RowPrefetch::Software,
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
    prefetch: RowPrefetch,
) {
    avx2_tiles(
        plan,
        workers,
        (x, w),
        sink,
        (
            [avx2::wide::<W, 1>, avx2::wide::<W, 2>],
            prefetch == RowPrefetch::Software,
        ),
    )
}

/// The AVX2 tile of each token count from 1 to `MR`.
#[cfg(target_arch = "x86_64")]
type Avx2Kernels<W> = [unsafe fn(&avx2::Tile<W>); avx2::MR];

/// The AVX2 tiles of one launch: `kernels[M - 1]` runs a tile of `M` tokens, and a tile of
/// one token hints its rows' lines ahead when `prefetch_row_ahead`.
#[cfg(target_arch = "x86_64")]
fn avx2_tiles<W: Sync>(
    plan: &Plan,
    workers: &Workers,
    (x, w): (&[f32], Typed<'_, W>),
    sink: &Sink<'_, '_>,
    (kernels, prefetch_row_ahead): (Avx2Kernels<W>, bool),
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
                prefetch_row_ahead,
            };
            // SAFETY: as in `avx512_wide`, with AVX2; token groups hold 1 to `MR`.
            unsafe { kernels[tokens.len() - 1](&tile) }
        },
    )
}
