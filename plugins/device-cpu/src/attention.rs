//! `paged_attention`: causal attention over a flattened batch of prefill chunks and decodes, reading keys and values through each sequence's block table.
//!
//! Sequence `i` owns rows `query_start[i]..query_start[i+1]` of `q`; its length `seq_lens[i]`
//! already counts them, and `kv_write` has already stored their keys and values. Query token
//! `j` of a sequence with `qlen` tokens sits at position `seq_lens[i] - qlen + j` and attends to
//! cache positions `0..=position`, position `p` living at slot
//! `block_table[i][p / bs] * bs + p % bs`. Query head `h` reads KV head `h / (Hq / Hk)`.
//! What Hugging Face's eager attention computes, in another order: scores `(q · k) * scale`,
//! their exponentials after subtracting a running maximum, the weighted values divided by the
//! exponentials' sum at the end, all in f32; with `bf16_products=bf16` over a bf16 cache at
//! `avx512_bf16`, scores and weighted values are bf16 products with f32 sums (see
//! `online::TileKernel`).
//!
//! The work is tiled flash-attention style ([`online`]): the query heads sharing a KV head
//! are adjacent in a row, and a block of a sequence's query tokens meets its keys and values
//! one tile of [`online::TILE`] positions at a time, so each tile is read once per block, not
//! once per token. A token's history is cut into ranges of [`RANGE_POSITIONS`] (whole blocks,
//! counted from position 0): a prefill block walks the ranges in order; a lone token (a
//! decode) whose history is a large share of the launch's work ([`SPLIT_SHARES`]) and spans
//! more than one range has each range computed as a task of its own, spread over the
//! threads, and the ranges' states merged in range order, while the lone tokens of a large batch walk their ranges as a
//! block does (the batch already has a task per thread). All fold the same states in the same
//! order, so a row's bits depend neither on the rest of the step, nor on how its sequence was
//! chunked, nor on the number of threads. Tasks go to the threads largest first, so they
//! finish together whatever the mix of depths; the task list and the ranges' states live in
//! [`AttentionScratch`], the states sized at the first launch for the longest history.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod bench_support;
mod online;
#[cfg(test)]
mod tests;

use std::marker::PhantomData;
use std::ops::Range;

use plughost_device_abi::export::{DeviceFailure, FloatSlice, Launch};

use crate::Context;
use crate::isa::Isa;
use crate::kv_cache::{self, CacheElement, CacheLayout};
use crate::linear::{Bf16Bits, Bf16Products, F16Bits, as_wide};
use crate::step_inputs::{SequenceSpan, sequence_span};
use crate::workers::{Workers, with_scratch};
pub use bench_support::{AttentionBench, BenchHeads, BenchLayout};
use online::{QueryBlock, TileKernel, attend_range, finish, merge, state_len, tile_buffer_len};

/// Below this many multiply-adds a launch runs on the calling thread.
const MIN_PARALLEL_WORK: usize = 64 * 1024;

/// The positions of one range of a token's history, rounded down to whole blocks (at least
/// one): short enough that a lone sequence's history makes tasks for every thread (after a
/// 512-token prompt, two large ranges per KV head, where 512 left SmolLM2's three KV heads as
/// three tasks for two threads), long enough that merging their states costs little next to
/// computing them.
const RANGE_POSITIONS: usize = 256;

/// Query rows (tokens times the heads of a KV head) of one prefill task, at most: the rows
/// that share each tile once it is laid out (widened or transposed) for the kernel.
const BLOCK_ROWS: usize = 128;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// `B`: blocks in each cache.
    pub num_blocks: usize,
    /// `M`: columns of the block table.
    pub blocks_per_seq: usize,
}

impl AttentionShape {
    pub fn cache_layout(&self) -> CacheLayout {
        CacheLayout {
            block_size: self.block_size,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }
}

/// The step's layout: which sequence each token belongs to, and where its keys live.
pub struct StepLayout<'a> {
    /// `[S, M]` row-major.
    pub block_table: &'a [i32],
    pub seq_lens: &'a [i32],
    pub query_start: &'a [i32],
}

/// The paged caches, each `[B, Hk, bs, D]` (see `kv_cache`), in f32 or a half-width element
/// type.
pub struct KvCache<'a, E> {
    pub keys: &'a [E],
    pub values: &'a [E],
}

/// Lone tokens whose history is more than `1 / (SPLIT_SHARES * threads)` of a launch's work
/// have their ranges computed as tasks of their own, as long as their states fit a scratch of
/// `SPLIT_SHARES` longest histories' states, sized once (the others walk their ranges in one
/// task each, with the same bits). Beyond a few such tokens the launch has tasks enough.
const SPLIT_SHARES: usize = 2;

/// What one row of the step computes: nothing (padding), a row of a prefill block (or a
/// lone token computed whole), or a lone token whose ranges' states start at `partials` in
/// [`AttentionScratch::partials`].
#[derive(Clone, Copy)]
enum RowOwner {
    Block,
    /// A lone token: `ranges` states per KV head from `partials` on, in range order.
    Lone {
        ranges: usize,
        partials: usize,
    },
}

/// One task of a launch's first pass.
#[derive(Clone, Copy)]
enum Task {
    /// `tokens` query tokens of sequence `seq` from step row `first_row` (at position
    /// `first_position`) over their whole history, written to `out`.
    Block {
        seq: usize,
        first_row: usize,
        tokens: usize,
        first_position: usize,
        kv_head: usize,
    },
    /// Range `range` of the history of the lone token at step row `row`, into its state slot
    /// at `slot` of the partials.
    Range {
        seq: usize,
        row: usize,
        position: usize,
        kv_head: usize,
        range: usize,
        slot: usize,
    },
}

impl Task {
    /// Query rows times key positions, up to a constant factor shared by every task.
    fn cost(&self, range_len: usize) -> usize {
        match *self {
            Task::Block {
                tokens,
                first_position,
                ..
            } => tokens * (first_position + tokens),
            Task::Range {
                position, range, ..
            } => (position + 1 - range * range_len).min(range_len),
        }
    }
}

/// What attention keeps from launch to launch: the rows' owners, the task list and the lone
/// tokens' range states. The states are sized at the first launch for the longest history
/// its block table allows; the owners and tasks grow with the step's tokens to the largest
/// step's, whatever the depth. So once a server has run its largest step no launch
/// allocates.
#[derive(Default)]
pub struct AttentionScratch {
    owners: Vec<Option<RowOwner>>,
    tasks: Vec<Task>,
    partials: Vec<f32>,
}

/// How a launch cuts its work: positions per range, tokens per prefill block.
#[derive(Clone, Copy)]
struct Cuts {
    range_len: usize,
    block_tokens: usize,
}

impl Cuts {
    fn new(shape: AttentionShape) -> Cuts {
        let group = shape.num_heads / shape.num_kv_heads.max(1);
        Cuts {
            range_len: shape.block_size * (RANGE_POSITIONS / shape.block_size.max(1)).max(1),
            block_tokens: (BLOCK_ROWS / group.max(1)).max(1),
        }
    }

    /// The ranges holding the history a token at `position` attends to within `window`.
    fn ranges(self, position: usize, window: usize) -> Range<usize> {
        let start = (position + 1).saturating_sub(window);
        start / self.range_len..(position + 1).div_ceil(self.range_len)
    }
}

impl AttentionScratch {
    /// Fills the owners and the tasks (largest first, so the threads finish together) after
    /// checking every sequence's span and blocks; lone tokens with a large share of the work
    /// and more than one range of history are split into ranges while their states fit (see
    /// [`SPLIT_SHARES`]), the others computed whole.
    fn plan(
        &mut self,
        layout: &StepLayout<'_>,
        (shape, window): (AttentionShape, usize),
        (num_tokens, threads): (usize, usize),
        cuts: Cuts,
    ) -> Result<(), String> {
        self.owners.clear();
        self.owners.resize(num_tokens, None);
        self.tasks.clear();
        self.reserve_partials(shape, cuts);
        let span = |seq| sequence_span(layout.seq_lens, layout.query_start, num_tokens, seq);
        let mut work = 0;
        for seq in 0..layout.seq_lens.len() {
            let span = span(seq)?;
            if !span.tokens.is_empty() {
                check_blocks(layout, shape, seq, &span)?;
                work += span.tokens.len() * (span.first_position + span.tokens.len());
            }
        }
        let split_above = work / (SPLIT_SHARES * threads.max(1));
        let state_len = state_len(shape.head_dim);
        let mut partials = 0;
        for seq in 0..layout.seq_lens.len() {
            let span = span(seq)?;
            if span.tokens.is_empty() {
                continue;
            }
            let first_position = span.first_position;
            let lone = span.tokens.len() == 1;
            let held = cuts.ranges(first_position, window);
            let ranges = held.len();
            let fits = partials + shape.num_heads * ranges * state_len <= self.partials.len();
            // A history of one range is computed whole: as a range of its own it would be the
            // same one task per KV head, with a second pass to finish it.
            if lone && ranges > 1 && first_position + 1 > split_above && fits {
                let (row, position) = (span.tokens.start, first_position);
                self.owners[row] = Some(RowOwner::Lone { ranges, partials });
                let group_states = (shape.num_heads / shape.num_kv_heads) * state_len;
                for kv_head in 0..shape.num_kv_heads {
                    for (index, range) in held.clone().enumerate() {
                        let slot = partials + (kv_head * ranges + index) * group_states;
                        self.tasks.push(Task::Range {
                            seq,
                            row,
                            position,
                            kv_head,
                            range,
                            slot,
                        });
                    }
                }
                partials += shape.num_heads * ranges * state_len;
                continue;
            }
            self.owners[span.tokens.clone()].fill(Some(RowOwner::Block));
            for offset in (0..span.tokens.len()).step_by(cuts.block_tokens) {
                let tokens = cuts.block_tokens.min(span.tokens.len() - offset);
                for kv_head in 0..shape.num_kv_heads {
                    self.tasks.push(Task::Block {
                        seq,
                        first_row: span.tokens.start + offset,
                        tokens,
                        first_position: first_position + offset,
                        kv_head,
                    });
                }
            }
        }
        self.tasks
            .sort_unstable_by_key(|task| std::cmp::Reverse(task.cost(cuts.range_len)));
        Ok(())
    }

    /// Makes room for the states of [`SPLIT_SHARES`] lone tokens, each over as many ranges
    /// as a history of the block table's length holds: the same for every launch of a
    /// model, so the first launch sizes it.
    fn reserve_partials(&mut self, shape: AttentionShape, cuts: Cuts) {
        let ranges = (shape.blocks_per_seq * shape.block_size).div_ceil(cuts.range_len);
        let len = SPLIT_SHARES * shape.num_heads * ranges * state_len(shape.head_dim);
        if self.partials.len() < len {
            self.partials.resize(len, 0.0);
        }
    }
}

/// `windowed`: the launch is `paged_attention_window`, whose `window` param bounds how many
/// positions a token attends to.
pub(crate) fn run(
    launch: &mut Launch<'_>,
    context: &mut Context,
    windowed: bool,
) -> Result<(), DeviceFailure> {
    let shape = AttentionShape {
        num_heads: launch.dim("Hq"),
        num_kv_heads: launch.dim("Hk"),
        head_dim: launch.dim("D"),
        block_size: launch.dim("bs"),
        num_blocks: launch.dim("B"),
        blocks_per_seq: launch.dim("M"),
    };
    let scale = launch.param_f32("scale");
    let window = if windowed {
        launch.dim("W")
    } else {
        usize::MAX
    };
    let mut views = launch.views()?;
    let layout = StepLayout {
        block_table: views.i32("block_table"),
        seq_lens: views.i32("seq_lens"),
        query_start: views.i32("query_start"),
    };
    let (q, out) = (views.f32("q"), views.f32_mut("out"));
    let params = (shape, scale, window);
    let device = (
        (context.isa, context.bf16_products),
        &context.workers,
        &mut context.attention,
    );
    // One match here, so each element type gets kernels of its own.
    let done = match (views.float("key_cache"), views.float("value_cache")) {
        (FloatSlice::F32(keys), FloatSlice::F32(values)) => {
            let cache = KvCache { keys, values };
            attend(device, q, &cache, &layout, out, params)
        }
        (FloatSlice::BF16(keys), FloatSlice::BF16(values)) => {
            let cache = KvCache::<Bf16Bits> {
                keys: as_wide(keys),
                values: as_wide(values),
            };
            attend(device, q, &cache, &layout, out, params)
        }
        (FloatSlice::F16(keys), FloatSlice::F16(values)) => {
            let cache = KvCache::<F16Bits> {
                keys: as_wide(keys),
                values: as_wide(values),
            };
            attend(device, q, &cache, &layout, out, params)
        }
        // The ABI checks refuse this before a launch reaches the device.
        _ => Err("the key and value caches have different dtypes".to_string()),
    };
    done.map_err(DeviceFailure::launch_failed)
}

/// `q` and `out` are `[T, Hq*D]`. Rows that no sequence covers come out as zeros. (The
/// device keeps one [`AttentionScratch`] for all its launches; this makes one per call.)
#[cfg(test)]
pub fn paged_attention<E: CacheElement>(
    kernels: (Isa, Bf16Products),
    q: &[f32],
    cache: &KvCache<'_, E>,
    layout: &StepLayout<'_>,
    out: &mut [f32],
    params: (AttentionShape, f32, usize),
    workers: &Workers,
) -> Result<(), String> {
    let mut scratch = AttentionScratch::default();
    attend(
        (kernels, workers, &mut scratch),
        q,
        cache,
        layout,
        out,
        params,
    )
}

/// `q` and `out` are `[T, Hq*D]`. Rows that no sequence covers come out as zeros.
fn attend<E: CacheElement>(
    ((isa, products), workers, scratch): ((Isa, Bf16Products), &Workers, &mut AttentionScratch),
    q: &[f32],
    cache: &KvCache<'_, E>,
    layout: &StepLayout<'_>,
    out: &mut [f32],
    (shape, scale, window): (AttentionShape, f32, usize),
) -> Result<(), String> {
    // Heads of 64 or 128 run the vector kernels, other sizes portable code; chosen once per
    // launch, so every row of a step computes the same way.
    let bf16_cache = E::bf16_bits(cache.keys).is_some();
    let bf16_keys = products == Bf16Products::Bf16 && bf16_cache;
    let order = kv_cache::arranged(isa, products, bf16_cache, &shape.cache_layout());
    let kernel = TileKernel::new(isa, shape.head_dim, bf16_keys, order);
    let q_width = shape.num_heads * shape.head_dim;
    let num_tokens = q.len().checked_div(q_width).unwrap_or(0);
    let cuts = Cuts::new(shape);
    let threads = workers.threads();
    scratch.plan(layout, (shape, window), (num_tokens, threads), cuts)?;
    let AttentionScratch {
        owners,
        tasks,
        partials,
    } = scratch;
    let work: usize = tasks.iter().map(|task| task.cost(cuts.range_len)).sum();
    let parallel = work * 2 * q_width >= MIN_PARALLEL_WORK;
    let shared = Work {
        kernel,
        q,
        cache,
        layout,
        shape,
        scale,
        cuts,
        window,
    };
    {
        let (outputs, states) = (Disjoint::new(out), Disjoint::new(partials));
        let run = |index: usize| shared.run(&tasks[index], &outputs, &states);
        if parallel {
            workers.for_each(tasks.len(), run);
        } else {
            (0..tasks.len()).for_each(run);
        }
    }
    // Rows computed whole are finished by their tasks; only padding rows and split lone
    // tokens need the second pass.
    if owners
        .iter()
        .all(|owner| matches!(owner, Some(RowOwner::Block)))
    {
        return Ok(());
    }
    let group_width = q_width / shape.num_kv_heads.max(1);
    let num_groups = num_tokens * shape.num_kv_heads;
    let chunk_len = if parallel {
        workers.rows_per_task(num_groups, group_width) * group_width
    } else {
        out.len()
    };
    let partials = &partials[..];
    workers.for_each_chunk(out, chunk_len, |chunk_index, chunk| {
        let first_group = chunk_index * chunk_len / group_width.max(1);
        for (offset, out_group) in chunk.chunks_mut(group_width).enumerate() {
            let group = first_group + offset;
            let (row, kv_head) = (group / shape.num_kv_heads, group % shape.num_kv_heads);
            match owners[row] {
                None => out_group.fill(0.0),
                Some(RowOwner::Block) => {}
                Some(RowOwner::Lone {
                    ranges,
                    partials: first,
                }) => {
                    let group_states = out_group.len() / shape.head_dim * state_len(shape.head_dim);
                    let states = &partials[first + kv_head * ranges * group_states..]
                        [..ranges * group_states];
                    merge_ranges(states, group_states, out_group, shape.head_dim);
                }
            }
        }
    });
    Ok(())
}

/// The outputs of one KV head's query heads from their states over consecutive ranges
/// (`group_states` f32s per range), merged in range order.
fn merge_ranges(states: &[f32], group_states: usize, out: &mut [f32], head_dim: usize) {
    let state_len = state_len(head_dim);
    with_scratch(group_states, |acc| {
        let mut ranges = states.chunks_exact(group_states);
        if let Some(first) = ranges.next() {
            acc.copy_from_slice(first);
        }
        for range in ranges {
            for (acc, part) in acc
                .chunks_exact_mut(state_len)
                .zip(range.chunks_exact(state_len))
            {
                merge(acc, part);
            }
        }
        for (acc, out) in acc
            .chunks_exact(state_len)
            .zip(out.chunks_exact_mut(head_dim))
        {
            finish(acc, out);
        }
    })
}

/// What every task of one launch reads.
struct Work<'a, E> {
    kernel: TileKernel,
    q: &'a [f32],
    cache: &'a KvCache<'a, E>,
    layout: &'a StepLayout<'a>,
    shape: AttentionShape,
    scale: f32,
    cuts: Cuts,
    /// Positions a token attends to at most (`usize::MAX`: no sliding window).
    window: usize,
}

impl<E: CacheElement> Work<'_, E> {
    fn head(&self, seq: usize, kv_head: usize) -> Head<'_, E> {
        let columns = self.shape.blocks_per_seq;
        Head {
            cache: self.cache,
            block_row: &self.layout.block_table[seq * columns..(seq + 1) * columns],
            kv_head,
            shape: self.shape,
        }
    }

    /// The query heads of `kv_head` from step row `row` on.
    fn queries(&self, row: usize, kv_head: usize) -> &[f32] {
        let q_width = self.shape.num_heads * self.shape.head_dim;
        let group_width = q_width / self.shape.num_kv_heads;
        &self.q[row * q_width + kv_head * group_width..]
    }

    fn run(&self, task: &Task, outputs: &Disjoint<'_>, states: &Disjoint<'_>) {
        let head_dim = self.shape.head_dim;
        let heads = self.shape.num_heads / self.shape.num_kv_heads;
        let state_len = state_len(head_dim);
        let q_width = self.shape.num_heads * head_dim;
        match *task {
            Task::Range {
                seq,
                row,
                position,
                kv_head,
                range,
                slot,
            } => {
                let block = QueryBlock {
                    queries: self.queries(row, kv_head),
                    stride: q_width,
                    tokens: 1,
                    heads,
                    first_end: position + 1,
                    window: self.window,
                };
                let head = self.head(seq, kv_head);
                let range_len = self.cuts.range_len;
                let positions = range * range_len..(range + 1) * range_len;
                // SAFETY: `plan` gave every (row, KV head, range) a slot of its own.
                let states = unsafe { states.part(slot..slot + heads * state_len) };
                with_scratch(tile_buffer_len(head_dim), |buffer| {
                    attend_range(
                        self.kernel,
                        &block,
                        &head,
                        (positions, self.scale),
                        states,
                        buffer,
                    )
                });
            }
            Task::Block {
                seq,
                first_row,
                tokens,
                first_position,
                kv_head,
            } => {
                let block = QueryBlock {
                    queries: self.queries(first_row, kv_head),
                    stride: q_width,
                    tokens,
                    heads,
                    first_end: first_position + 1,
                    window: self.window,
                };
                let head = self.head(seq, kv_head);
                let rows = tokens * heads;
                let len = 2 * rows * state_len + tile_buffer_len(head_dim);
                with_scratch(len, |scratch| {
                    let (acc, rest) = scratch.split_at_mut(rows * state_len);
                    let (state, buffer) = rest.split_at_mut(rows * state_len);
                    self.attend_block(&block, &head, (acc, state), buffer);
                    for token in 0..tokens {
                        let start = (first_row + token) * q_width + kv_head * heads * head_dim;
                        // SAFETY: each (row, KV head) belongs to one task, which writes it once.
                        let out = unsafe { outputs.part(start..start + heads * head_dim) };
                        let acc = &acc[token * heads * state_len..][..heads * state_len];
                        for (acc, out) in acc
                            .chunks_exact(state_len)
                            .zip(out.chunks_exact_mut(head_dim))
                        {
                            finish(acc, out);
                        }
                    }
                });
            }
        }
    }

    /// The states of `block`'s rows over the history they attend to into `acc`: range by
    /// range, each range's states (in `state`) taken as they are by the rows it is the first
    /// range of, merged in order by the others, as a lone token's ranges are.
    fn attend_block(
        &self,
        block: &QueryBlock<'_>,
        head: &Head<'_, E>,
        (acc, state): (&mut [f32], &mut [f32]),
        buffer: &mut [f32],
    ) {
        let range_len = self.cuts.range_len;
        let state_len = state_len(self.shape.head_dim);
        let row_states = block.heads * state_len;
        let last = block.tokens - 1;
        let first_range = block.start(0) / range_len;
        for range in first_range..block.end(last).div_ceil(range_len) {
            let positions = range * range_len..(range + 1) * range_len;
            // The tokens that end at or before the range's start have nothing in it, nor do
            // those whose window starts at or after its end.
            let skip = positions.start.saturating_sub(block.first_end - 1);
            let reaching = (skip..block.tokens)
                .take_while(|&t| block.start(t) < positions.end)
                .count();
            if reaching == 0 {
                continue;
            }
            let sub = QueryBlock {
                queries: &block.queries[skip * block.stride..],
                tokens: reaching,
                first_end: block.first_end + skip,
                ..*block
            };
            let state = &mut state[skip * row_states..][..reaching * row_states];
            attend_range(
                self.kernel,
                &sub,
                head,
                (positions, self.scale),
                state,
                buffer,
            );
            let acc = &mut acc[skip * row_states..][..reaching * row_states];
            for (token, (acc, part)) in acc
                .chunks_exact_mut(row_states)
                .zip(state.chunks_exact(row_states))
                .enumerate()
            {
                if sub.start(token) / range_len == range {
                    acc.copy_from_slice(part);
                    continue;
                }
                for (acc, part) in acc
                    .chunks_exact_mut(state_len)
                    .zip(part.chunks_exact(state_len))
                {
                    merge(acc, part);
                }
            }
        }
    }
}

/// Memory the tasks of a launch write in disjoint parts.
struct Disjoint<'a> {
    start: *mut f32,
    len: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: tasks write disjoint parts only (see `Disjoint::part`).
unsafe impl Sync for Disjoint<'_> {}
// SAFETY: as above.
unsafe impl Send for Disjoint<'_> {}

impl<'a> Disjoint<'a> {
    fn new(slice: &'a mut [f32]) -> Disjoint<'a> {
        Disjoint {
            start: slice.as_mut_ptr(),
            len: slice.len(),
            _borrow: PhantomData,
        }
    }

    /// The elements of `range` (which must lie inside the slice).
    ///
    /// # Safety
    /// No other reference to any element of `range` is alive while the result is.
    #[allow(clippy::mut_from_ref)]
    unsafe fn part(&self, range: Range<usize>) -> &mut [f32] {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: inside the borrowed slice (checked above); exclusive by the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.start.add(range.start), range.len()) }
    }
}

fn check_blocks(
    layout: &StepLayout<'_>,
    shape: AttentionShape,
    seq: usize,
    span: &SequenceSpan,
) -> Result<(), String> {
    let num_blocks_read = span.seq_len().div_ceil(shape.block_size);
    if num_blocks_read > shape.blocks_per_seq {
        return Err(format!(
            "sequence {seq}: {} tokens need {num_blocks_read} blocks, but the block table has {} columns",
            span.seq_len(),
            shape.blocks_per_seq
        ));
    }
    let row = &layout.block_table[seq * shape.blocks_per_seq..];
    for (index, &block) in row[..num_blocks_read].iter().enumerate() {
        if block < 0 || block as usize >= shape.num_blocks {
            return Err(format!(
                "sequence {seq}: block table entry {index} is {block}, outside the {} cache blocks",
                shape.num_blocks
            ));
        }
    }
    Ok(())
}

/// One KV head of one sequence: where its keys and values are.
pub struct Head<'a, E> {
    cache: &'a KvCache<'a, E>,
    block_row: &'a [i32],
    kv_head: usize,
    shape: AttentionShape,
}

impl<E> Head<'_, E> {
    /// The element offsets, in either cache, of this head's rows at positions `start..` (one
    /// per element of `offsets`): a division per call, not per position.
    fn offsets(&self, start: usize, offsets: &mut [usize]) {
        let (block_size, head_dim) = (self.shape.block_size, self.shape.head_dim);
        let layout = self.shape.cache_layout();
        let (mut index, mut within) = (start / block_size, start % block_size);
        // Checked by `check_blocks`: the entries read exist and are blocks of the cache.
        let block_start =
            |index: usize| layout.row(self.block_row[index] as usize * block_size, self.kv_head);
        let mut base = block_start(index);
        for (i, offset) in offsets.iter_mut().enumerate() {
            if i > 0 && within == 0 {
                base = block_start(index);
            }
            *offset = base + within * head_dim;
            within += 1;
            if within == block_size {
                (index, within) = (index + 1, 0);
            }
        }
    }
}

/// Asks for the `head_dim` elements at `offset` of `cache` to be brought into L2: rows of a
/// sequence lie in blocks scattered over the cache, which the hardware prefetchers do not
/// follow from one block to the next. L2, not L1: a tile's widened keys and values (the AVX2
/// kernel's buffer) fill L1 by themselves, and would evict the next tile's rows before use.
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_row<E>(cache: &[E], offset: usize, head_dim: usize) {
    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
    let start = cache.as_ptr().wrapping_add(offset).cast::<i8>();
    for line in (0..head_dim * size_of::<E>()).step_by(64) {
        // SAFETY: a prefetch is a hint; it never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(start.wrapping_add(line)) };
    }
}
