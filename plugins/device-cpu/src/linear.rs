//! `linear`: `out[T,N] = x[T,K] · w[N,K]ᵀ` in f32 over f32, f16 or bf16 weights.
//!
//! Two paths, both split over panels of output columns (rows of `w`) so every weight byte is
//! read once per launch, by one thread:
//! * few tokens (decodes): a GEMV that streams each weight row once and dots it with every
//!   token, four tokens per pass; for one token half-precision weights are widened inside the
//!   dot product, for more each row is widened once into L1-resident scratch;
//! * more tokens (prefill): `matrixmultiply::sgemm` per panel; half-precision panels are
//!   widened into a per-thread f32 scratch of [`PANEL_BYTES`], never the whole matrix.

use std::marker::PhantomData;
use std::ops::Range;

use plughost_device_abi::export::{DeviceFailure, FloatSlice, Launch};

use crate::Context;
use crate::vector::{dot, dot_bf16, dot_f16, dot_rows, has_fast_f16};
use crate::widen::widen_into;
use crate::workers::{Workers, with_scratch};

/// Up to this many tokens a launch takes the GEMV path: the weight stream dominates, and
/// sgemm's packing of `w` (a second pass over the whole matrix) costs more than it saves.
/// Measured crossover with K=1024, N=3072 on a Zen 4: between 8 and 12 tokens.
const MAX_GEMV_TOKENS: usize = 8;

/// The size of one weight panel in f32. Each sgemm call packs all of `x` again and allocates
/// its packing buffers, so panels are large: measured on a Zen 4 with T=128, K=1024, 1 MiB
/// panels run ~1.4x faster than 256 KiB ones.
const PANEL_BYTES: usize = 1024 * 1024;

/// Weight rows per GEMV task: enough work to amortize scheduling, small enough to balance.
const GEMV_ROWS_PER_TASK: usize = 32;

/// Below this many multiply-adds a launch runs as one task on the calling thread: waking the
/// workers would take longer than the work.
const MIN_PARALLEL_WORK: usize = 128 * 1024;

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
    let mut views = launch.views()?;
    let (x, w) = (views.f32("x"), views.float("w"));
    linear(x, w, views.f32_mut("out"), shape, &context.workers);
    Ok(())
}

/// Slices hold exactly `T*K`, `N*K` and `T*N` elements (the export layer checked the shapes).
pub fn linear(
    x: &[f32],
    w: FloatSlice<'_>,
    out: &mut [f32],
    shape: LinearShape,
    workers: &Workers,
) {
    let LinearShape {
        tokens,
        inner,
        outputs,
    } = shape;
    // The raw-pointer paths below rely on these lengths.
    assert!(
        Some(x.len()) == tokens.checked_mul(inner)
            && Some(w.len()) == outputs.checked_mul(inner)
            && Some(out.len()) == tokens.checked_mul(outputs),
        "linear: slices of {}, {} and {} elements do not match {shape:?}",
        x.len(),
        w.len(),
        out.len()
    );
    if inner == 0 {
        out.fill(0.0);
        return;
    }
    if tokens == 0 || outputs == 0 {
        return;
    }
    let rows_per_task = if tokens * inner * outputs < MIN_PARALLEL_WORK {
        outputs
    } else if tokens <= MAX_GEMV_TOKENS {
        GEMV_ROWS_PER_TASK
    } else {
        panel_rows(inner, outputs, workers.threads())
    };
    let num_tasks = outputs.div_ceil(rows_per_task);
    let out = SharedOut::new(out);
    workers.for_each(num_tasks, |task| {
        let first = task * rows_per_task;
        let rows = first..(first + rows_per_task).min(outputs);
        if tokens <= MAX_GEMV_TOKENS {
            gemv_rows(x, w, out, shape, rows);
        } else {
            gemm_panel(x, w, out, shape, rows);
        }
    });
}

/// Weight rows per sgemm panel: at most [`PANEL_BYTES`] of f32, few enough that every thread
/// gets two panels, and a multiple of 16 (sgemm's micro-tile widths divide it), at least 16 so
/// the repeated packing of `x` stays a small part of each panel's work.
fn panel_rows(inner: usize, outputs: usize, threads: usize) -> usize {
    let by_size = PANEL_BYTES / (4 * inner);
    let by_threads = outputs.div_ceil(2 * threads);
    (by_size.min(by_threads).div_ceil(16) * 16).clamp(16, 1024)
}

/// `out[t, n]` for every token `t` and every weight row `n` in `rows`.
fn gemv_rows(
    x: &[f32],
    w: FloatSlice<'_>,
    out: SharedOut<'_>,
    shape: LinearShape,
    rows: Range<usize>,
) {
    let LinearShape { inner, outputs, .. } = shape;
    let each_row = |n: usize, w_row: &[f32]| {
        dot_every_token(x, inner, w_row, |t, value| {
            // SAFETY: tasks own disjoint ranges of `n`, and `t * outputs + n < T * N`.
            unsafe { out.write(t * outputs + n, value) };
        });
    };
    match w {
        FloatSlice::F32(values) => {
            for n in rows {
                each_row(n, &values[n * inner..(n + 1) * inner]);
            }
        }
        // One token: widen while dotting, saving the scratch round trip.
        FloatSlice::BF16(bits) if shape.tokens == 1 => {
            for n in rows {
                let value = dot_bf16(x, &bits[n * inner..(n + 1) * inner]);
                // SAFETY: tasks own disjoint ranges of `n`, and `n < N`.
                unsafe { out.write(n, value) };
            }
        }
        FloatSlice::F16(bits) if shape.tokens == 1 && has_fast_f16() => {
            for n in rows {
                let value = dot_f16(x, &bits[n * inner..(n + 1) * inner]);
                // SAFETY: as above.
                unsafe { out.write(n, value) };
            }
        }
        FloatSlice::F16(_) | FloatSlice::BF16(_) => with_scratch(inner, |w_row| {
            for n in rows {
                widen_into(w, n * inner, w_row);
                each_row(n, w_row);
            }
        }),
    }
}

/// `emit(t, x[t] · w_row)` for every token row of `x`, four tokens per pass over `w_row` so
/// each loaded weight element feeds four products. Grouping does not change the results:
/// [`dot_rows`] matches [`dot`] bit for bit, so a token's output does not depend on the batch.
fn dot_every_token(x: &[f32], inner: usize, w_row: &[f32], mut emit: impl FnMut(usize, f32)) {
    const GROUP: usize = 4;
    let mut groups = x.chunks_exact(GROUP * inner);
    for (index, group) in groups.by_ref().enumerate() {
        let rows: [&[f32]; GROUP] = std::array::from_fn(|r| &group[r * inner..(r + 1) * inner]);
        for (r, value) in dot_rows(rows, w_row).into_iter().enumerate() {
            emit(index * GROUP + r, value);
        }
    }
    let first = x.len() / inner / GROUP * GROUP;
    for (t, row) in groups.remainder().chunks_exact(inner).enumerate() {
        emit(first + t, dot(row, w_row));
    }
}

/// `out[:, rows] = x · w[rows, :]ᵀ` with one sgemm.
fn gemm_panel(
    x: &[f32],
    w: FloatSlice<'_>,
    out: SharedOut<'_>,
    shape: LinearShape,
    rows: Range<usize>,
) {
    let LinearShape {
        tokens,
        inner,
        outputs,
    } = shape;
    let panel = |b: &[f32]| {
        assert_eq!(b.len(), rows.len() * inner);
        // SAFETY: `a` is `x`, T×K row-major; `b` is the panel read as K×rows with column stride
        // K (`w` rows are the columns of wᵀ); `c` starts at column `rows.start` of `out`, T×N
        // row-major, so sgemm writes only elements `[t, rows]`, which no other task touches.
        // `linear` checked the lengths of `x` and `out`, and `rows` lies inside `0..N`.
        // beta = 0 lets `c` hold anything beforehand. All strides fit isize: the slices exist.
        unsafe {
            matrixmultiply::sgemm(
                tokens,
                inner,
                rows.len(),
                1.0,
                x.as_ptr(),
                inner as isize,
                1,
                b.as_ptr(),
                1,
                inner as isize,
                0.0,
                out.start.add(rows.start),
                outputs as isize,
                1,
            );
        }
    };
    match w {
        FloatSlice::F32(values) => panel(&values[rows.start * inner..rows.end * inner]),
        FloatSlice::F16(_) | FloatSlice::BF16(_) => with_scratch(rows.len() * inner, |scratch| {
            widen_into(w, rows.start * inner, scratch);
            panel(scratch);
        }),
    }
}

/// `out` shared by tasks that each write a disjoint set of its elements (their own columns),
/// for as long as the exclusive borrow it was made from.
#[derive(Clone, Copy)]
struct SharedOut<'a> {
    start: *mut f32,
    len: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: a `SharedOut` stands for an exclusive borrow, and its users write disjoint elements
// (see `SharedOut::write`), so handing copies to other threads cannot make a data race.
unsafe impl Send for SharedOut<'_> {}
// SAFETY: as above.
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    fn new(out: &'a mut [f32]) -> SharedOut<'a> {
        SharedOut {
            start: out.as_mut_ptr(),
            len: out.len(),
            _borrow: PhantomData,
        }
    }

    /// # Safety
    /// No other thread reads or writes element `index` during the parallel section.
    unsafe fn write(self, index: usize, value: f32) {
        assert!(index < self.len);
        // SAFETY: in bounds (checked) and unshared (the caller's guarantee).
        unsafe { self.start.add(index).write(value) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::noise;
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

        /// The exact f32 values the `dtype` weights hold.
        fn exact(&self, dtype: &str) -> Vec<f32> {
            let mut values = vec![0.0; self.f32s.len()];
            widen_into(self.slice(dtype), 0, &mut values);
            values
        }
    }

    /// Plain triple loop with f64 accumulation.
    fn reference(x: &[f32], w: &[f32], shape: LinearShape) -> Vec<f64> {
        let LinearShape {
            tokens,
            inner,
            outputs,
        } = shape;
        let mut out = vec![0.0; tokens * outputs];
        for t in 0..tokens {
            for n in 0..outputs {
                let mut sum = 0.0f64;
                for k in 0..inner {
                    sum += f64::from(x[t * inner + k]) * f64::from(w[n * inner + k]);
                }
                out[t * outputs + n] = sum;
            }
        }
        out
    }

    #[test]
    fn matches_the_reference_for_every_path_and_dtype() {
        // GEMV with one token, with a group of four tokens and a rest, and small enough to stay
        // on one thread; sgemm panels. N and K are not multiples of the GEMV task (32 rows) or
        // of the panels (e.g. 80 rows for N = 300 on two threads, 128 for K = 2000), so the
        // parallel paths end on a partial task or panel.
        let shapes = [
            (1, 1100, 300),
            (5, 300, 250),
            (3, 129, 53),
            (17, 515, 300),
            (64, 2000, 161),
        ];
        for threads in [1, 2] {
            let workers = Workers::new(threads).unwrap();
            for (tokens, inner, outputs) in shapes {
                let shape = LinearShape {
                    tokens,
                    inner,
                    outputs,
                };
                let x: Vec<f32> = (0..tokens * inner).map(|i| noise(3, i)).collect();
                let weights = Weights::new(outputs * inner);
                for dtype in ["f32", "f16", "bf16"] {
                    let (w, w_exact) = (weights.slice(dtype), weights.exact(dtype));
                    let mut out = vec![f32::NAN; tokens * outputs];
                    linear(&x, w, &mut out, shape, &workers);
                    let expected = reference(&x, &w_exact, shape);
                    for (i, (&got, &want)) in out.iter().zip(&expected).enumerate() {
                        // Sums of K products of values below 1 in f32: error ~ sqrt(K) ulp.
                        assert!(
                            (f64::from(got) - want).abs() < 2e-6 * (inner as f64).sqrt(),
                            "{shape:?} {dtype} {threads} threads: out[{i}] = {got}, expected {want}"
                        );
                    }
                }
            }
        }
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
            &[],
            FloatSlice::F32(&[]),
            &mut out,
            shape,
            &Workers::new(1).unwrap(),
        );
        assert_eq!(out, vec![0.0; 6]);
    }

    /// Weight bandwidth (T=1) and arithmetic rate (T=128) of `linear`, single- and two-thread.
    /// `cargo test --release -p plughost-device-cpu -- --ignored --nocapture`
    ///
    /// "hot" runs one weight matrix over and over (it stays in the 32 MiB L3 of the test
    /// machine); "cold" cycles through copies adding up to 256 MiB, so weights come from DRAM as
    /// in a real decode step.
    #[test]
    #[ignore = "timing, not a test"]
    fn linear_timing() {
        use std::time::Instant;
        let (inner, outputs) = (1024, 3072);
        let weights = Weights::new(outputs * inner);
        for threads in [1, 2] {
            let workers = Workers::new(threads).unwrap();
            for dtype in ["f32", "bf16", "f16"] {
                let element_bytes = if dtype == "f32" { 4 } else { 2 };
                let weight_bytes = (outputs * inner * element_bytes) as f64;
                let copies: Vec<Weights> = (0..(256 << 20) / (outputs * inner * element_bytes))
                    .map(|_| Weights {
                        f32s: weights.f32s.clone(),
                        f16_bits: weights.f16_bits.clone(),
                        bf16_bits: weights.bf16_bits.clone(),
                    })
                    .collect();
                for (tokens, temperature) in [(1, "hot"), (1, "cold"), (128, "hot")] {
                    let shape = LinearShape {
                        tokens,
                        inner,
                        outputs,
                    };
                    let x: Vec<f32> = (0..tokens * inner).map(|i| noise(3, i)).collect();
                    let mut out = vec![0.0; tokens * outputs];
                    let pick = |i: usize| match temperature {
                        "hot" => weights.slice(dtype),
                        _ => copies[i % copies.len()].slice(dtype),
                    };
                    linear(&x, pick(0), &mut out, shape, &workers);
                    let repeats = if tokens == 1 { 400 } else { 10 };
                    let started = Instant::now();
                    for i in 0..repeats {
                        linear(&x, pick(i + 1), &mut out, shape, &workers);
                    }
                    let seconds = started.elapsed().as_secs_f64() / repeats as f64;
                    let flops = 2.0 * (tokens * inner * outputs) as f64;
                    println!(
                        "linear T={tokens:<3} K={inner} N={outputs} {dtype:<4} {temperature:<4} \
                         threads={threads}: {:8.1} us {:6.1} GB/s of weights {:6.1} GFLOP/s",
                        seconds * 1e6,
                        weight_bytes / seconds / 1e9,
                        flops / seconds / 1e9
                    );
                }
            }
        }
    }
}
