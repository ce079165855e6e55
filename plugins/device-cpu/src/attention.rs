//! `paged_attention`: causal attention over a flattened batch of prefill chunks and decodes, reading keys and values through each sequence's block table.
//!
//! Sequence `i` owns rows `query_start[i]..query_start[i+1]` of `q`; its length `seq_lens[i]`
//! already counts them, and `kv_write` has already stored their keys and values. Query token
//! `j` of a sequence with `qlen` tokens sits at position `seq_lens[i] - qlen + j` and attends to
//! cache positions `0..=position`, position `p` living at slot
//! `block_table[i][p / bs] * bs + p % bs`. Query head `h` reads KV head `h / (Hq / Hk)`.
//! Like Hugging Face's eager attention: scores are `(q · k) * scale`, softmax in f32 after
//! subtracting the row maximum, probabilities divided by their sum, then weighted values.
//!
//! One task is one (token, KV head) pair: the query heads sharing a KV head are adjacent in
//! the row, so each task owns a contiguous slice of `out` and reads each key and value row once
//! for all of them.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
use std::cell::RefCell;

use plughost_device_abi::export::{DeviceFailure, FloatSlice, Launch};

use crate::Context;
use crate::isa::{Isa, Vectors};
use crate::kv_cache::{CacheElement, CacheLayout};
use crate::linear::{Bf16Bits, F16Bits, as_wide};
use crate::step_inputs::{SequenceSpan, sequence_span};
use crate::vector::{axpy, dot};
use crate::workers::{Workers, with_scratch};

/// Below this many multiply-adds a launch runs on the calling thread.
const MIN_PARALLEL_WORK: usize = 64 * 1024;

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

/// Where one token of the step attends: its sequence and position, or nothing (padding).
#[derive(Clone, Copy)]
struct RowOwner {
    seq: usize,
    position: usize,
    /// The sequence's only token of the step (a decode): it reads its cached rows once, from
    /// memory, where a prefill chunk's tokens share them in cache.
    alone: bool,
}

pub(crate) fn run(launch: &mut Launch<'_>, context: &mut Context) -> Result<(), DeviceFailure> {
    let shape = AttentionShape {
        num_heads: launch.dim("Hq"),
        num_kv_heads: launch.dim("Hk"),
        head_dim: launch.dim("D"),
        block_size: launch.dim("bs"),
        num_blocks: launch.dim("B"),
        blocks_per_seq: launch.dim("M"),
    };
    let scale = launch.param_f32("scale");
    let mut views = launch.views()?;
    let layout = StepLayout {
        block_table: views.i32("block_table"),
        seq_lens: views.i32("seq_lens"),
        query_start: views.i32("query_start"),
    };
    let (q, out) = (views.f32("q"), views.f32_mut("out"));
    let params = (shape, scale);
    let workers = &context.workers;
    // One match here, so each element type gets kernels of its own.
    let done = match (views.float("key_cache"), views.float("value_cache")) {
        (FloatSlice::F32(keys), FloatSlice::F32(values)) => {
            let cache = KvCache { keys, values };
            paged_attention(context.isa, q, &cache, &layout, out, params, workers)
        }
        (FloatSlice::BF16(keys), FloatSlice::BF16(values)) => {
            let cache = KvCache::<Bf16Bits> {
                keys: as_wide(keys),
                values: as_wide(values),
            };
            paged_attention(context.isa, q, &cache, &layout, out, params, workers)
        }
        (FloatSlice::F16(keys), FloatSlice::F16(values)) => {
            let cache = KvCache::<F16Bits> {
                keys: as_wide(keys),
                values: as_wide(values),
            };
            paged_attention(context.isa, q, &cache, &layout, out, params, workers)
        }
        // The ABI checks refuse this before a launch reaches the device.
        _ => Err("the key and value caches have different dtypes".to_string()),
    };
    done.map_err(DeviceFailure::launch_failed)
}

/// `q` and `out` are `[T, Hq*D]`. Rows that no sequence covers come out as zeros.
pub fn paged_attention<E: CacheElement>(
    isa: Isa,
    q: &[f32],
    cache: &KvCache<'_, E>,
    layout: &StepLayout<'_>,
    out: &mut [f32],
    (shape, scale): (AttentionShape, f32),
    workers: &Workers,
) -> Result<(), String> {
    // Heads of 64 or 128 run the vector kernels, other sizes portable code; chosen once per
    // launch, so every group of a step computes the same way.
    let kernel = isa.vectors();
    let q_width = shape.num_heads * shape.head_dim;
    let num_tokens = q.len().checked_div(q_width).unwrap_or(0);
    let owners = row_owners(layout, shape, num_tokens)?;
    let group_width = q_width / shape.num_kv_heads;
    let work: usize = owners
        .iter()
        .flatten()
        .map(|owner| owner.position + 1)
        .sum();
    let group_len = if work * 2 * q_width < MIN_PARALLEL_WORK {
        out.len()
    } else {
        group_width
    };
    workers.for_each_chunk(out, group_len, |chunk_index, chunk| {
        let first_group = chunk_index * group_len / group_width.max(1);
        for (offset, out_group) in chunk.chunks_mut(group_width).enumerate() {
            let group = first_group + offset;
            let (row, kv_head) = (group / shape.num_kv_heads, group % shape.num_kv_heads);
            let Some(owner) = owners[row] else {
                out_group.fill(0.0);
                continue;
            };
            let q_start = row * q_width + kv_head * group_width;
            let query = &q[q_start..q_start + group_width];
            let block_row = &layout.block_table
                [owner.seq * shape.blocks_per_seq..(owner.seq + 1) * shape.blocks_per_seq];
            let head = Head {
                cache,
                block_row,
                kv_head,
                shape,
                cold: owner.alone,
            };
            attend_group(
                (isa, kernel),
                query,
                &head,
                (owner.position, scale),
                out_group,
            );
        }
    });
    Ok(())
}

/// The owner of every row of the step, after checking that every block a sequence reads
/// exists in the block table and the caches.
fn row_owners(
    layout: &StepLayout<'_>,
    shape: AttentionShape,
    num_tokens: usize,
) -> Result<Vec<Option<RowOwner>>, String> {
    let mut owners = vec![None; num_tokens];
    for seq in 0..layout.seq_lens.len() {
        let span = sequence_span(layout.seq_lens, layout.query_start, num_tokens, seq)?;
        if span.tokens.is_empty() {
            continue;
        }
        check_blocks(layout, shape, seq, &span)?;
        let alone = span.tokens.len() == 1;
        for (row, position) in span.rows_and_positions() {
            owners[row] = Some(RowOwner {
                seq,
                position,
                alone,
            });
        }
    }
    Ok(owners)
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
struct Head<'a, E> {
    cache: &'a KvCache<'a, E>,
    block_row: &'a [i32],
    kv_head: usize,
    shape: AttentionShape,
    /// Whether the rows are likely in memory rather than cache (see `RowOwner::alone`); only
    /// the x86-64 kernels prefetch.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    cold: bool,
}

impl<E> Head<'_, E> {
    /// The element offset of this head's row at `position` in either cache.
    fn offset(&self, position: usize) -> usize {
        let block_size = self.shape.block_size;
        // Checked by `check_blocks`: the entry exists and is a block of the cache.
        let block = self.block_row[position / block_size] as usize;
        let slot = block * block_size + position % block_size;
        self.shape.cache_layout().row(slot, self.kv_head)
    }
}

/// Attention of the query heads in `query` (adjacent `head_dim`-wide heads sharing one KV
/// head) over positions `0..=position`, into `out` (same layout).
fn attend_group<E: CacheElement>(
    (isa, kernel): (Isa, Vectors),
    query: &[f32],
    head: &Head<'_, E>,
    (position, scale): (usize, f32),
    out: &mut [f32],
) {
    // Without x86-64 every kernel is the portable one.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernel;
    let head_dim = head.shape.head_dim;
    let num_heads = query.len() / head_dim;
    let context_len = position + 1;
    // The scores of every head, then one widened key or value row.
    with_scratch(num_heads * context_len + head_dim, |scratch| {
        #[cfg(target_arch = "x86_64")]
        if kernel != Vectors::Portable {
            let rows = Rows {
                block_row: head.block_row,
                layout: head.shape.cache_layout(),
                kv_head: head.kv_head,
                context_len,
                prefetch: head.cold,
            };
            let caches = (head.cache.keys, head.cache.values);
            macro_rules! attend {
                ($kernel:ident, $c:literal, $g:literal) => {{
                    // SAFETY: `Isa::vectors` chose the kernel from a level that has its
                    // instructions; `check_blocks` checked the blocks; the group holds `$g`
                    // heads of `head_dim`, which is `$c` vectors of the kernel's width.
                    unsafe {
                        $kernel::attend::<E, $c, $g>(query, caches, &rows, scale, scratch, out)
                    };
                    true
                }};
            }
            // Heads of 64 or 128 in groups whose rows fit the registers.
            let done = match (kernel, head_dim, num_heads) {
                (Vectors::Avx512, 64, 1) => attend!(avx512, 4, 1),
                (Vectors::Avx512, 64, 2) => attend!(avx512, 4, 2),
                (Vectors::Avx512, 64, 3) => attend!(avx512, 4, 3),
                (Vectors::Avx512, 64, 4) => attend!(avx512, 4, 4),
                (Vectors::Avx512, 128, 1) => attend!(avx512, 8, 1),
                (Vectors::Avx512, 128, 2) => attend!(avx512, 8, 2),
                (Vectors::Avx2, 64, 1) => attend!(avx2, 8, 1),
                (Vectors::Avx2, 64, 2) => attend!(avx2, 8, 2),
                (Vectors::Avx2, 64, 3) => attend!(avx2, 8, 3),
                (Vectors::Avx2, 64, 4) => attend!(avx2, 8, 4),
                (Vectors::Avx2, 128, 1) => attend!(avx2, 16, 1),
                (Vectors::Avx2, 128, 2) => attend!(avx2, 16, 2),
                _ => false,
            };
            if done {
                return;
            }
        }
        let (scores, row) = scratch.split_at_mut(num_heads * context_len);
        let widened = |cache: &[E], p: usize, row: &mut [f32]| {
            let offset = head.offset(p);
            for (x, &e) in row.iter_mut().zip(&cache[offset..offset + head_dim]) {
                *x = CacheElement::to_f32(e);
            }
        };
        for p in 0..context_len {
            widened(head.cache.keys, p, row);
            let key = &*row;
            for (h, q_head) in query.chunks_exact(head_dim).enumerate() {
                scores[h * context_len + p] = dot(isa, q_head, key) * scale;
            }
        }
        for head_scores in scores.chunks_exact_mut(context_len) {
            softmax_in_place(head_scores);
        }
        out.fill(0.0);
        for p in 0..context_len {
            widened(head.cache.values, p, row);
            let value = &*row;
            for (h, out_head) in out.chunks_exact_mut(head_dim).enumerate() {
                axpy(isa, out_head, scores[h * context_len + p], value);
            }
        }
    });
}

/// Where one KV head's rows for positions `0..context_len` live in the paged caches.
#[cfg(target_arch = "x86_64")]
struct Rows<'a> {
    block_row: &'a [i32],
    layout: CacheLayout,
    kv_head: usize,
    context_len: usize,
    /// Hint rows into L1 ahead of use ([`prefetch_row`]): for a lone decode, whose rows come
    /// from memory.
    prefetch: bool,
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The cache offsets of one call's positions; grows to the longest context and is reused.
    static OFFSETS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Positions between a row's prefetch hint and its use: enough to cover a memory access.
#[cfg(target_arch = "x86_64")]
const PREFETCH_DISTANCE: usize = 16;

/// Asks for the `head_dim` elements at `offset` of `cache` to be brought into L1: rows of a
/// sequence lie in blocks scattered over the cache, which the hardware prefetchers do not
/// follow from one block to the next.
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_row<E>(cache: &[E], offset: usize, head_dim: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let start = cache.as_ptr().wrapping_add(offset).cast::<i8>();
    for line in (0..head_dim * size_of::<E>()).step_by(64) {
        // SAFETY: a prefetch is a hint; it never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(line)) };
    }
}

/// Calls `f` with the element offset of the row of every position `0..context_len` in either
/// cache.
#[cfg(target_arch = "x86_64")]
fn with_offsets<R>(rows: &Rows<'_>, f: impl FnOnce(&[usize]) -> R) -> R {
    let layout = rows.layout;
    OFFSETS.with(|cell| {
        let mut offsets = cell.borrow_mut();
        offsets.clear();
        for &block in rows.block_row {
            let first = layout.row(block as usize * layout.block_size, rows.kv_head);
            let count = layout.block_size.min(rows.context_len - offsets.len());
            offsets.extend((0..count).map(|i| first + i * layout.head_dim));
            if offsets.len() == rows.context_len {
                break;
            }
        }
        f(&offsets)
    })
}

/// `exp(s - max) / Σ exp(s - max)`; the sum is accumulated in f64, which costs nothing next
/// to the exponentials and keeps long contexts from drifting.
fn softmax_in_place(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for score in scores.iter_mut() {
        *score = (*score - max).exp();
        sum += f64::from(*score);
    }
    let sum = sum as f32;
    for score in scores.iter_mut() {
        *score /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_close, noise};

    const HEAD_DIM: usize = 8;
    const NUM_HEADS: usize = 4;
    const NUM_KV_HEADS: usize = 2;
    const BLOCK_SIZE: usize = 4;
    const NUM_BLOCKS: usize = 64;

    /// One sequence of a test step: tokens cached before the step, tokens computed in it.
    #[derive(Clone, Copy)]
    struct Sequence {
        cached: usize,
        computed: usize,
    }

    /// The full K and V of a sequence, `[len, Hk, D]`, and its queries `[computed, Hq, D]`.
    struct Dense {
        keys: Vec<f32>,
        values: Vec<f32>,
        queries: Vec<f32>,
    }

    fn dense(seq: usize, sequence: &Sequence, head_dim: usize) -> Dense {
        let len = sequence.cached + sequence.computed;
        let kv_len = len * NUM_KV_HEADS * head_dim;
        let q_len = sequence.computed * NUM_HEADS * head_dim;
        Dense {
            keys: (0..kv_len).map(|i| noise(100 + seq as u64, i)).collect(),
            values: (0..kv_len).map(|i| noise(200 + seq as u64, i)).collect(),
            queries: (0..q_len)
                .map(|i| 2.0 * noise(300 + seq as u64, i))
                .collect(),
        }
    }

    /// Plain causal attention over the dense K/V with f64 arithmetic.
    fn reference(dense: &Dense, sequence: &Sequence, scale: f64, head_dim: usize) -> Vec<f64> {
        let group = NUM_HEADS / NUM_KV_HEADS;
        let mut out = Vec::new();
        for j in 0..sequence.computed {
            let position = sequence.cached + j;
            for h in 0..NUM_HEADS {
                let q = &dense.queries[(j * NUM_HEADS + h) * head_dim..][..head_dim];
                let kv = |p: usize| (p * NUM_KV_HEADS + h / group) * head_dim;
                let scores: Vec<f64> = (0..=position)
                    .map(|p| {
                        let k = &dense.keys[kv(p)..kv(p) + head_dim];
                        let dot: f64 = q
                            .iter()
                            .zip(k)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum();
                        dot * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..head_dim {
                    let value: f64 = (0..=position)
                        .map(|p| weights[p] / total * f64::from(dense.values[kv(p) + d]))
                        .sum();
                    out.push(value);
                }
            }
        }
        out
    }

    /// Lays the sequences out in a paged cache (blocks handed out in a scattered order, unused
    /// table entries -1), adds one padding row, and compares with dense attention. Returns the
    /// output of every kernel and thread count.
    fn check_batch(what: &str, sequences: &[Sequence], head_dim: usize) -> Vec<(String, Vec<f32>)> {
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (q_width, kv_width) = (NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim);
        let blocks_per_seq = sequences
            .iter()
            .map(|s| (s.cached + s.computed).div_ceil(BLOCK_SIZE))
            .max()
            .unwrap_or(0)
            + 1;
        let mut free_blocks = (0..NUM_BLOCKS as i32).map(|b| (b * 37) % NUM_BLOCKS as i32);

        let mut key_cache = vec![f32::NAN; NUM_BLOCKS * BLOCK_SIZE * kv_width];
        let mut value_cache = key_cache.clone();
        let (mut q, mut block_table, mut seq_lens) = (Vec::new(), Vec::new(), Vec::new());
        let (mut query_start, mut expected) = (vec![0], Vec::new());
        for (seq, sequence) in sequences.iter().enumerate() {
            let len = sequence.cached + sequence.computed;
            let mut blocks: Vec<i32> = free_blocks
                .by_ref()
                .take(len.div_ceil(BLOCK_SIZE))
                .collect();
            let dense = dense(seq, sequence, head_dim);
            for p in 0..len {
                let block = blocks[p / BLOCK_SIZE] as usize;
                for kv_head in 0..NUM_KV_HEADS {
                    // `[B, Hk, bs, D]`: a block holds each head's rows together.
                    let at =
                        ((block * NUM_KV_HEADS + kv_head) * BLOCK_SIZE + p % BLOCK_SIZE) * head_dim;
                    let row = (p * NUM_KV_HEADS + kv_head) * head_dim;
                    let row = row..row + head_dim;
                    key_cache[at..at + head_dim].copy_from_slice(&dense.keys[row.clone()]);
                    value_cache[at..at + head_dim].copy_from_slice(&dense.values[row]);
                }
            }
            blocks.resize(blocks_per_seq, -1);
            block_table.extend(blocks);
            q.extend_from_slice(&dense.queries);
            seq_lens.push(len as i32);
            query_start.push(query_start[seq] + sequence.computed as i32);
            expected.extend(reference(&dense, sequence, f64::from(scale), head_dim));
        }
        q.extend(std::iter::repeat_n(1.0, q_width));
        expected.extend(std::iter::repeat_n(0.0, q_width));

        let shape = AttentionShape {
            num_heads: NUM_HEADS,
            num_kv_heads: NUM_KV_HEADS,
            head_dim,
            block_size: BLOCK_SIZE,
            num_blocks: NUM_BLOCKS,
            blocks_per_seq,
        };
        let layout = StepLayout {
            block_table: &block_table,
            seq_lens: &seq_lens,
            query_start: &query_start,
        };
        let cache = KvCache {
            keys: &key_cache,
            values: &value_cache,
        };
        let mut outputs = Vec::new();
        for (isa, threads) in Isa::every().into_iter().flat_map(|i| [(i, 1), (i, 2)]) {
            let workers = Workers::new(threads).unwrap();
            let mut out = vec![f32::NAN; q.len()];
            let params = (shape, scale);
            paged_attention(isa, &q, &cache, &layout, &mut out, params, &workers).unwrap();
            let what = format!("{what}, {isa:?}, {threads} threads");
            assert_close(&out, &expected, 1e-5, &what);
            outputs.push((what, out));
        }
        // Work splits by (token, KV head), never by thread: two threads give one's bits.
        for pair in outputs.chunks_exact(2) {
            let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|x| x.to_bits()).collect() };
            assert_eq!(
                bits(&pair[0].1),
                bits(&pair[1].1),
                "{} and {}",
                pair[0].0,
                pair[1].0
            );
        }
        outputs
    }

    #[test]
    fn a_decode_gives_the_same_bits_alone_and_in_a_batch() {
        // What else a step computes changes nothing of a decode's output.
        let decode = Sequence {
            cached: 90,
            computed: 1,
        };
        let prefill = Sequence {
            cached: 0,
            computed: 40,
        };
        let alone = check_batch("a decode alone", &[decode], HEAD_DIM);
        let batched = check_batch("a decode and a prefill", &[decode, prefill], HEAD_DIM);
        let row = NUM_HEADS * HEAD_DIM;
        for ((what, alone), (_, batched)) in alone.iter().zip(&batched) {
            let bits = |v: &[f32]| -> Vec<u32> { v[..row].iter().map(|x| x.to_bits()).collect() };
            assert_eq!(bits(alone), bits(batched), "{what}");
        }
    }

    #[test]
    fn mixed_batches_match_dense_causal_attention() {
        let cases = [
            (
                // Small enough to run on the calling thread.
                "a 5-token chunk after 7 cached tokens, a fresh 4-token prefill, two decodes",
                vec![
                    Sequence {
                        cached: 7,
                        computed: 5,
                    },
                    Sequence {
                        cached: 0,
                        computed: 4,
                    },
                    Sequence {
                        cached: 9,
                        computed: 1,
                    },
                    Sequence {
                        cached: 2,
                        computed: 1,
                    },
                ],
            ),
            (
                // Long enough to be split over the workers.
                "longer contexts",
                vec![
                    Sequence {
                        cached: 57,
                        computed: 5,
                    },
                    Sequence {
                        cached: 0,
                        computed: 40,
                    },
                    Sequence {
                        cached: 90,
                        computed: 1,
                    },
                    Sequence {
                        cached: 30,
                        computed: 1,
                    },
                ],
            ),
        ];
        for (what, sequences) in cases {
            check_batch(what, &sequences, HEAD_DIM);
        }
    }

    #[test]
    fn heads_of_64_and_128_match_dense_causal_attention() {
        // The sizes with a vector kernel of their own (where the CPU has AVX-512): a chunk
        // after cached tokens, a prefill crossing several blocks, and a decode.
        let sequences = [
            Sequence {
                cached: 9,
                computed: 6,
            },
            Sequence {
                cached: 0,
                computed: 23,
            },
            Sequence {
                cached: 41,
                computed: 1,
            },
        ];
        for head_dim in [64, 128] {
            check_batch(&format!("head_dim {head_dim}"), &sequences, head_dim);
        }
    }

    /// Attention over caches of `E` equals attention over f32 caches of the same (widened)
    /// values, bit for bit: widening is exact and every other operation is the same.
    fn half_width_matches_f32<E: CacheElement>(what: &str) {
        // SmolLM2's heads (nine query heads on three KV heads of 64), heads of 128, and heads
        // only the portable kernels take.
        for (num_heads, num_kv_heads, head_dim) in [(9, 3, 64), (4, 2, 128), (4, 2, 8)] {
            let (block_size, num_blocks, blocks_per_seq) = (16, 12, 4);
            let kv_len = num_blocks * block_size * num_kv_heads * head_dim;
            let keys: Vec<E> = (0..kv_len).map(|i| E::from_f32(noise(7, i))).collect();
            let values: Vec<E> = (0..kv_len).map(|i| E::from_f32(noise(8, i))).collect();
            let widened = |cache: &[E]| {
                cache
                    .iter()
                    .map(|&e| CacheElement::to_f32(e))
                    .collect::<Vec<f32>>()
            };
            let (keys_f32, values_f32) = (widened(&keys), widened(&values));
            // A 20-token chunk after 9 cached tokens, and two decodes at 33 and 50 tokens.
            let block_table = [3, 7, 1, -1, 0, 5, 9, 2, 11, 4, 6, 8];
            let (seq_lens, query_start) = ([29, 33, 50], [0, 20, 21, 22]);
            let q: Vec<f32> = (0..22 * num_heads * head_dim)
                .map(|i| 2.0 * noise(9, i))
                .collect();
            let shape = AttentionShape {
                num_heads,
                num_kv_heads,
                head_dim,
                block_size,
                num_blocks,
                blocks_per_seq,
            };
            let layout = StepLayout {
                block_table: &block_table,
                seq_lens: &seq_lens,
                query_start: &query_start,
            };
            let workers = Workers::new(2).unwrap();
            let params = (shape, 1.0 / (head_dim as f32).sqrt());
            let half_cache = KvCache {
                keys: &keys[..],
                values: &values[..],
            };
            let full_cache = KvCache {
                keys: &keys_f32[..],
                values: &values_f32[..],
            };
            for isa in Isa::every() {
                let mut half = vec![f32::NAN; q.len()];
                paged_attention(isa, &q, &half_cache, &layout, &mut half, params, &workers)
                    .unwrap();
                let mut full = vec![f32::NAN; q.len()];
                paged_attention(isa, &q, &full_cache, &layout, &mut full, params, &workers)
                    .unwrap();
                let same = half
                    .iter()
                    .zip(&full)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{what}, {isa:?}, heads {num_heads}/{num_kv_heads} of {head_dim}"
                );
                assert!(half.iter().all(|x| x.is_finite()), "{what}, {isa:?}");
            }
        }
    }

    #[test]
    fn bf16_and_f16_caches_match_f32_caches_of_the_same_values() {
        half_width_matches_f32::<crate::linear::Bf16Bits>("bf16");
        half_width_matches_f32::<crate::linear::F16Bits>("f16");
    }

    #[test]
    fn bad_layouts_are_refused() {
        let shape = AttentionShape {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 2,
            block_size: 2,
            num_blocks: 3,
            blocks_per_seq: 2,
        };
        let cache = KvCache {
            keys: &[0.0; 12],
            values: &[0.0; 12],
        };
        let workers = Workers::new(1).unwrap();
        let cases: [(&[i32], &[i32], &str); 3] = [
            (
                &[0, 3],
                &[5],
                "sequence 0: 5 tokens need 3 blocks, but the block table has 2 columns",
            ),
            (
                &[0, 3],
                &[4],
                "sequence 0: block table entry 1 is 3, outside the 3 cache blocks",
            ),
            (&[-1, 1], &[2], "sequence 0: block table entry 0 is -1"),
        ];
        for (block_table, seq_lens, expected) in cases {
            let layout = StepLayout {
                block_table,
                seq_lens,
                query_start: &[0, 1],
            };
            let mut out = [0.0; 4];
            for isa in Isa::every() {
                let params = (shape, 1.0);
                let message =
                    paged_attention(isa, &[1.0; 4], &cache, &layout, &mut out, params, &workers)
                        .unwrap_err();
                assert!(message.contains(expected), "{message}");
            }
        }
    }

    #[test]
    fn softmax_is_stable_for_large_scores() {
        let mut scores = [1000.0, 1000.0, f32::NEG_INFINITY];
        softmax_in_place(&mut scores);
        assert_eq!(scores, [0.5, 0.5, 0.0]);
    }
}
