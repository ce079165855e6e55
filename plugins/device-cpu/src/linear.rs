//! `linear`: `out[T,N] = x[T,K] · w[N,K]ᵀ` in f32 over f32, f16 or bf16 weights, with results that do not depend on the batch.
//!
//! One arithmetic for every `T`. `w` is split into panels of `NR` rows and threads take
//! whole panels. Per K block of `KC` columns a panel is packed into a k-major f32 tile in
//! the thread's scratch (`tile`, widening f16/bf16), and the `MR`-token `microkernel`
//! runs over the tile for each group of tokens; above `MC` tokens the tokens go in blocks,
//! so the block of `x` a tile meets stays in L2. One or two tokens on AVX2 skip the tile:
//! `few_tokens` feeds the transposed columns (`columns`) straight into the same FMAs.
//!
//! Batch invariance: every output element is summed in one fixed order, `out = Σ_b (Σ_{k in
//! block b} x[t][k]·w[n][k])`, each K block of `KC` a chain of FMAs in `k` order from 0 and
//! the block sums added to `out` in block order. `KC` is a constant, so the order depends on
//! `K` alone: not on `T`, not on where token `t` sits in the batch, not on how the panels are
//! spread over threads, not on which kernel runs. Token groups and panels only choose which
//! register lane holds a chain; tails (fewer than `MR` tokens, fewer than `NR` outputs, a
//! last K block shorter than `KC`) run the same chain in a narrower kernel or a zero-padded
//! lane; partial sums pass through `out` as f32, exactly. So a prompt prefilled alone, in
//! chunks or inside a batch gets the same bits. (Blocking the sum also keeps its rounding
//! error nearer that of pairwise summation than one K-long chain would.)

#[cfg(target_arch = "x86_64")]
mod columns;
#[cfg(target_arch = "x86_64")]
mod few_tokens;
mod microkernel;
mod tile;

use std::marker::PhantomData;
use std::ops::Range;

use plughost_device_abi::export::{DeviceFailure, FloatSlice, Launch};

use crate::Context;
use crate::workers::{Workers, with_scratch};

use microkernel::{Call, Isa, MR};
use tile::{Block, KC, NR, TILE_LEN};

/// Most tokens one pass over a tile serves: an `MC × KC` block of `x` (240 KiB) stays in L2
/// while the panels stream past it. Larger batches repack `w` once per block, a small cost
/// next to `MC` tokens of arithmetic.
const MC: usize = 40 * MR;

/// Below this many multiply-adds a launch runs as one task on the calling thread: waking the
/// workers would take longer than the work.
const MIN_PARALLEL_WORK: usize = 128 * 1024;

/// Tasks per thread: enough to even out panels that finish at different speeds.
const TASKS_PER_THREAD: usize = 4;

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
    linear_on(Isa::detect(), x, w, out, shape, workers)
}

fn linear_on(
    isa: Isa,
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
    let num_panels = outputs.div_ceil(NR);
    // The split decides only which thread computes a panel, never how (see the module docs).
    let panels_per_task = if tokens * inner * outputs < MIN_PARALLEL_WORK {
        num_panels
    } else {
        num_panels.div_ceil(TASKS_PER_THREAD * workers.threads())
    };
    let work = Work {
        isa,
        x,
        w,
        out: SharedOut::new(out, outputs),
        shape,
    };
    workers.for_each(num_panels.div_ceil(panels_per_task), |task| {
        let first = task * panels_per_task;
        work.panels(first..(first + panels_per_task).min(num_panels));
    });
}

/// One launch's operands, as every task sees them.
#[derive(Clone, Copy)]
struct Work<'a> {
    isa: Isa,
    x: &'a [f32],
    w: FloatSlice<'a>,
    out: SharedOut<'a>,
    shape: LinearShape,
}

impl Work<'_> {
    /// `out[:, outputs of panels]`; the caller owns those columns of `out`.
    fn panels(&self, panels: Range<usize>) {
        #[cfg(target_arch = "x86_64")]
        if self.isa == Isa::Avx2Fma && self.shape.tokens <= few_tokens::MAX_TOKENS {
            return self.few_tokens(panels);
        }
        self.packed(panels);
    }

    /// The microkernel path: each panel packed K block by K block, every token group run
    /// over each tile.
    fn packed(&self, panels: Range<usize>) {
        with_scratch(TILE_LEN + TILE_ALIGN, |scratch| {
            let tile = aligned_tile(scratch);
            for tokens in token_blocks(self.shape.tokens) {
                for panel in panels.clone() {
                    self.panel_times_tokens(panel, tokens.clone(), tile);
                }
            }
        });
    }

    /// `out[tokens, panel's outputs]`, K block by K block.
    fn panel_times_tokens(&self, panel: usize, tokens: Range<usize>, tile: &mut [f32]) {
        let LinearShape { inner, outputs, .. } = self.shape;
        let n0 = panel * NR;
        let rows = NR.min(outputs - n0);
        for k0 in (0..inner).step_by(KC) {
            let kc = KC.min(inner - k0);
            let block = Block {
                first_row: n0,
                rows,
                k0,
                kc,
                inner,
            };
            tile::pack(self.isa, self.w, block, tile);
            for (t, group) in token_groups(tokens.clone()) {
                let call = Call {
                    tokens: group,
                    kc,
                    tile: tile.as_ptr(),
                    // In bounds: `t + group <= T` and `k0 + kc <= K`.
                    x: self.x[t * inner + k0..].as_ptr(),
                    x_stride: inner,
                    out: std::ptr::null_mut(),
                    out_stride: outputs,
                    first: k0 == 0,
                };
                // SAFETY: `isa` came from `Isa::detect`; the tile holds `kc * NR` packed values;
                // `group` token rows of `x` from `t` have `kc` elements from `k0`; this task
                // owns the panel's columns of `out`.
                unsafe { self.out.update_block(self.isa, call, t, n0, rows) };
            }
        }
    }

    /// One or two tokens: full panels one by one; a last, partial panel through the
    /// microkernel path.
    #[cfg(target_arch = "x86_64")]
    fn few_tokens(&self, panels: Range<usize>) {
        let LinearShape {
            tokens,
            inner,
            outputs,
        } = self.shape;
        let full = panels.start..panels.end.min(outputs / NR);
        for panel in full.clone() {
            let call = few_tokens::Call {
                tokens,
                first_row: panel * NR,
                inner,
                x: self.x.as_ptr(),
                out: self.out.block(0, panel * NR, tokens, NR),
                out_stride: outputs,
            };
            // SAFETY: `isa` vouches for AVX2, FMA and F16C; `tokens <= MAX_TOKENS` (checked by
            // the caller); the panel is full, so its rows exist; `x` holds `tokens` rows;
            // `block` checked the output block, whose columns this task owns.
            unsafe { few_tokens::run(self.w, &call) };
        }
        if full.end < panels.end {
            self.packed(full.end..panels.end);
        }
    }
}

/// f32s of slack in the scratch for aligning the tile to a cache line.
const TILE_ALIGN: usize = 64 / size_of::<f32>();

/// The [`TILE_LEN`] f32s of `scratch` that start on a cache line, so no load splits one.
fn aligned_tile(scratch: &mut [f32]) -> &mut [f32] {
    let offset = scratch.as_ptr().align_offset(64).min(TILE_ALIGN);
    &mut scratch[offset..offset + TILE_LEN]
}

/// `0..T` cut into at most [`MC`]-token blocks of nearly equal size (multiples of [`MR`] but
/// the last).
fn token_blocks(tokens: usize) -> impl Iterator<Item = Range<usize>> {
    let num_blocks = tokens.div_ceil(MC);
    let block = tokens.div_ceil(num_blocks).div_ceil(MR) * MR;
    (0..tokens)
        .step_by(block)
        .map(move |start| start..(start + block).min(tokens))
}

/// `tokens` cut into the fewest groups of at most [`MR`] tokens, of sizes differing by at most
/// one, as `(first token, size)`: 128 tokens make 18 groups of 6 and 4 of 5 rather than 21 of
/// 6 and one of 2, whose four FMA chains would leave the FMA units waiting.
fn token_groups(tokens: Range<usize>) -> impl Iterator<Item = (usize, usize)> {
    let num_groups = tokens.len().div_ceil(MR);
    let (size, larger) = match num_groups {
        0 => (0, 0),
        _ => (tokens.len() / num_groups, tokens.len() % num_groups),
    };
    (0..num_groups).map(move |group| {
        let first = tokens.start + group * size + group.min(larger);
        (first, size + usize::from(group < larger))
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
// (see `SharedOut::update_block`), so handing copies to other threads cannot make a data race.
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
    fn block(self, t: usize, n0: usize, tokens: usize, columns: usize) -> *mut f32 {
        assert!(
            tokens > 0 && n0 + columns <= self.width && (t + tokens) * self.width <= self.len,
            "block of {tokens} rows from {t}, {columns} columns from {n0}, outside {} rows of {}",
            self.len / self.width.max(1),
            self.width
        );
        // In bounds: row `t` lies inside `out`.
        self.start.wrapping_add(t * self.width + n0)
    }

    /// Runs `call` against the block of `out` at token row `t`, columns `n0..n0 + columns`
    /// (`call.out` and `call.out_stride` are set here). A block narrower than [`NR`] (a last,
    /// partial panel) goes through a full-width copy, so the microkernel never writes past it.
    ///
    /// # Safety
    /// [`microkernel::run`]'s contract for everything but `out`; no other thread reads or
    /// writes this block of `out` during the parallel section.
    unsafe fn update_block(self, isa: Isa, mut call: Call, t: usize, n0: usize, columns: usize) {
        assert!(columns <= NR);
        let start = self.block(t, n0, call.tokens, columns);
        if columns == NR {
            call.out = start;
            call.out_stride = self.width;
            // SAFETY: in bounds (checked); unshared and otherwise valid by the contract.
            unsafe { microkernel::run(isa, &call) };
            return;
        }
        let mut block = [0.0f32; MR * NR];
        let rows = |m: usize| start.wrapping_add(m * self.width);
        if !call.first {
            for m in 0..call.tokens {
                // SAFETY: in bounds (checked above) and unshared (the contract).
                let row = unsafe { std::slice::from_raw_parts(rows(m), columns) };
                block[m * NR..m * NR + columns].copy_from_slice(row);
            }
        }
        call.out = block.as_mut_ptr();
        call.out_stride = NR;
        // SAFETY: `block` has `NR` f32s for each of the `call.tokens <= MR` tokens.
        unsafe { microkernel::run(isa, &call) };
        for m in 0..call.tokens {
            // SAFETY: as above.
            let row = unsafe { std::slice::from_raw_parts_mut(rows(m), columns) };
            row.copy_from_slice(&block[m * NR..m * NR + columns]);
        }
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

    /// Every microkernel this machine can run: the portable one and, where present, AVX2+FMA.
    fn isas() -> Vec<Isa> {
        let mut isas = vec![Isa::Portable];
        if Isa::detect() != Isa::Portable {
            isas.push(Isa::detect());
        }
        isas
    }

    #[test]
    fn matches_the_reference_for_every_path_and_dtype() {
        // One token, token groups with a rest of 5, 3 and 5 tokens, a launch small enough to
        // stay on one thread, and 250 tokens (two token blocks). N is never a multiple of the
        // 16-row panels and K (up to eight K blocks) never one of 256, so every tail runs.
        let shapes = [
            (1, 1100, 300),
            (5, 300, 250),
            (3, 129, 53),
            (17, 515, 300),
            (64, 2000, 161),
            (250, 37, 40),
        ];
        for isa in isas() {
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
                        linear_on(isa, &x, w, &mut out, shape, &workers);
                        let expected = reference(&x, &w_exact, shape);
                        for (i, (&got, &want)) in out.iter().zip(&expected).enumerate() {
                            // Sums of K products of values below 1 in f32: error ~ sqrt(K) ulp.
                            assert!(
                                (f64::from(got) - want).abs() < 2e-6 * (inner as f64).sqrt(),
                                "{isa:?} {shape:?} {dtype} {threads} threads: \
                                 out[{i}] = {got}, expected {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// `x · wᵀ` for the token rows of `x` in one launch, as f32 bits.
    fn launch_bits(
        isa: Isa,
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
        linear_on(isa, x, w, &mut out, shape, workers);
        out.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn a_tokens_output_does_not_depend_on_its_batch() {
        const BATCH: usize = 9;
        // K blocks of 256, 256 and 91 (not a multiple of 8) and N of 20 full panels and one of
        // 5 rows, big enough that even one token is split over two threads; then 250 tokens
        // (two token blocks), K blocks of 256 and 44, N of two full panels and one of 8 rows.
        for (tokens, inner, outputs) in [(70, 603, 325), (250, 300, 40)] {
            let x: Vec<f32> = (0..tokens * inner).map(|i| noise(11, i)).collect();
            let weights = Weights::new(outputs * inner);
            let isa = Isa::detect();
            for threads in [1, 2] {
                let workers = Workers::new(threads).unwrap();
                for dtype in ["f32", "f16", "bf16"] {
                    let w = weights.slice(dtype);
                    let launch = |rows: &[f32]| launch_bits(isa, rows, w, inner, &workers);
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
                    let ways = [
                        ("one at a time", in_chunks_of(1)),
                        ("in pairs", in_chunks_of(2)),
                        ("in chunks of 3", in_chunks_of(3)),
                        ("inside batches of 9", inside_batches),
                    ];
                    for (way, bits) in ways {
                        if let Some(i) = (0..whole.len()).find(|&i| bits[i] != whole[i]) {
                            panic!(
                                "T={tokens} K={inner} N={outputs} {dtype} {threads} threads: \
                                 token {} output {} is {} {way}, {} in one batch",
                                i / outputs,
                                i % outputs,
                                f32::from_bits(bits[i]),
                                f32::from_bits(whole[i])
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn portable_and_vector_kernels_agree_bit_for_bit() {
        // A fused multiply-add is one correctly rounded operation on any path.
        let (tokens, inner, outputs) = (13, 300, 40);
        let x: Vec<f32> = (0..tokens * inner).map(|i| noise(17, i)).collect();
        let weights = Weights::new(outputs * inner);
        let workers = Workers::new(1).unwrap();
        for dtype in ["f32", "f16", "bf16"] {
            let w = weights.slice(dtype);
            let results: Vec<Vec<u32>> = isas()
                .into_iter()
                .map(|isa| launch_bits(isa, &x, w, inner, &workers))
                .collect();
            assert!(results.windows(2).all(|pair| pair[0] == pair[1]), "{dtype}");
        }
    }

    #[test]
    fn token_groups_cover_the_block_evenly() {
        type Groups = &'static [(usize, usize)];
        let cases: [(Range<usize>, Groups); 4] = [
            (0..0, &[]),
            (3..4, &[(3, 1)]),
            (0..7, &[(0, 4), (4, 3)]),
            (10..23, &[(10, 5), (15, 4), (19, 4)]),
        ];
        for (tokens, groups) in cases {
            assert_eq!(
                token_groups(tokens.clone()).collect::<Vec<_>>(),
                groups,
                "{tokens:?}"
            );
        }
        let sizes: Vec<usize> = token_groups(0..128).map(|(_, size)| size).collect();
        assert_eq!((sizes.len(), sizes.iter().sum::<usize>()), (22, 128));
        assert!(sizes.iter().all(|&size| size == 5 || size == 6));
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
