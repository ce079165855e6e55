//! Tests of paged attention: every kernel path against dense causal attention at depths that cross many tiles, ranges and blocks, bit-exact batch invariance, half-width caches and refused layouts.

mod invariance;

use super::*;
use crate::kv_cache;
use crate::test_support::{assert_close, noise};

/// How far a path's output may be from the f64 reference, relative to `max(1, |expected|)`.
/// Every path multiplies and adds in f32 (unit roundoff 2^-24 ≈ 6e-8): a score is a sum of
/// `head_dim` products of size about 1, an output a weighted mean of values of size at most 1
/// whose weights sum to one, so the error is some tens of roundoffs; 2e-5 leaves headroom
/// while still catching a wrong position, weight or rescale (errors of 1e-2 and more).
const F32_TOLERANCE: f64 = 2e-5;

/// As [`F32_TOLERANCE`], for bf16 products: the query rounded to bf16 moves each score by
/// up to 2^-9 ≈ 2e-3 of its terms' size (about 1 here), so each weight `exp(score)` by as
/// much relatively, and rounding the weights to bf16 adds another 2^-9 relatively; an output,
/// a weighted mean of values of size at most 1, moves by a few times that. 1e-2 leaves
/// headroom and still catches a wrong position or weight.
const BF16_TOLERANCE: f64 = 1e-2;

/// One way a launch may compute: an isa level, and whether its cache is bf16 multiplied in
/// bf16 products (`avx512_bf16` only) or f32 multiplied in f32.
#[derive(Clone, Copy, Debug)]
struct Path {
    isa: Isa,
    bf16: bool,
}

impl Path {
    /// Every path this CPU has.
    fn every() -> Vec<Path> {
        let mut paths: Vec<Path> = Isa::every()
            .into_iter()
            .map(|isa| Path { isa, bf16: false })
            .collect();
        let top = Isa::detect();
        if top.has(crate::isa::IsaLevel::Avx512Bf16) {
            paths.push(Path {
                isa: top,
                bf16: true,
            });
        }
        paths
    }

    fn tolerance(self) -> f64 {
        if self.bf16 {
            BF16_TOLERANCE
        } else {
            F32_TOLERANCE
        }
    }
}

/// The heads and paging of a test step.
#[derive(Clone, Copy, Debug)]
struct Heads {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    /// Positions a token attends to at most (`usize::MAX`: its whole history).
    window: usize,
}

/// One sequence of a test step: `id` picks its keys, values and queries (the same for every
/// step it is part of), `cached` tokens come before the step and `computed` are in it.
#[derive(Clone, Copy, Debug)]
struct Sequence {
    id: u64,
    cached: usize,
    computed: usize,
}

impl Sequence {
    fn new(id: u64, cached: usize, computed: usize) -> Sequence {
        Sequence {
            id,
            cached,
            computed,
        }
    }

    fn len(&self) -> usize {
        self.cached + self.computed
    }
}

impl Heads {
    /// Element `d` of the key (`which` 0) or value (1) of KV head `kv_head` at `position`.
    fn kv(&self, which: u64, id: u64, (position, kv_head, d): (usize, usize, usize)) -> f32 {
        noise(
            100 * (which + 1) + id,
            (position * self.num_kv_heads + kv_head) * self.head_dim + d,
        )
    }

    /// The query of `head` at `position`, all `head_dim` elements.
    fn query(&self, id: u64, position: usize, head: usize) -> impl Iterator<Item = f32> {
        let start = (position * self.num_heads + head) * self.head_dim;
        (start..start + self.head_dim).map(move |i| 2.0 * noise(300 + id, i))
    }

    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// Plain causal attention of `sequence`'s computed tokens in f64, `[computed, Hq*D]`,
    /// each over the last `window` positions.
    fn reference(&self, sequence: &Sequence) -> Vec<f64> {
        let group = self.num_heads / self.num_kv_heads;
        let scale = f64::from(self.scale());
        let mut out = Vec::new();
        for position in sequence.cached..sequence.len() {
            for h in 0..self.num_heads {
                let q: Vec<f64> = self
                    .query(sequence.id, position, h)
                    .map(f64::from)
                    .collect();
                let kv = |which, p, d| f64::from(self.kv(which, sequence.id, (p, h / group, d)));
                let seen = (position + 1).saturating_sub(self.window)..position + 1;
                let scores: Vec<f64> = seen
                    .clone()
                    .map(|p| (0..self.head_dim).map(|d| q[d] * kv(0, p, d)).sum::<f64>() * scale)
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..self.head_dim {
                    let value: f64 = seen
                        .clone()
                        .zip(&weights)
                        .map(|(p, w)| w * kv(1, p, d))
                        .sum();
                    out.push(value / total);
                }
            }
        }
        out
    }
}

/// A step laid out as the device sees it: the sequences' keys and values in a paged cache
/// (blocks handed out in a scattered order, unused table entries -1, unused slots NaN), the
/// queries of their computed tokens and one padding row after them.
struct Step {
    heads: Heads,
    sequences: Vec<Sequence>,
    q: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
    /// The same caches in bf16.
    bf16: (Vec<Bf16Bits>, Vec<Bf16Bits>),
    block_table: Vec<i32>,
    seq_lens: Vec<i32>,
    query_start: Vec<i32>,
    num_blocks: usize,
    blocks_per_seq: usize,
}

impl Step {
    fn new(heads: Heads, sequences: &[Sequence]) -> Step {
        let bs = heads.block_size;
        let blocks_per_seq = sequences
            .iter()
            .map(|s| s.len().div_ceil(bs))
            .max()
            .unwrap_or(0)
            + 1;
        let num_blocks = sequences
            .iter()
            .map(|s| s.len().div_ceil(bs))
            .sum::<usize>()
            + 1;
        let mut order: Vec<usize> = (0..num_blocks).collect();
        order.sort_by_key(|&b| noise(77, b).to_bits());
        let mut free = order.into_iter();
        let row_width = heads.num_kv_heads * heads.head_dim;
        let mut keys = vec![f32::NAN; num_blocks * bs * row_width];
        let mut values = keys.clone();
        let (mut q, mut block_table, mut seq_lens) = (Vec::new(), Vec::new(), Vec::new());
        let mut query_start = vec![0];
        for sequence in sequences {
            let mut blocks: Vec<i32> = Vec::new();
            for position in 0..sequence.len() {
                if position % bs == 0 {
                    blocks.push(free.next().unwrap() as i32);
                }
                let block = blocks[position / bs] as usize;
                for kv_head in 0..heads.num_kv_heads {
                    // `[B, Hk, bs, D]`: a block holds each head's rows together.
                    let row = ((block * heads.num_kv_heads + kv_head) * bs + position % bs)
                        * heads.head_dim;
                    for d in 0..heads.head_dim {
                        let at = (position, kv_head, d);
                        keys[row + d] = heads.kv(0, sequence.id, at);
                        values[row + d] = heads.kv(1, sequence.id, at);
                    }
                }
            }
            blocks.resize(blocks_per_seq, -1);
            block_table.extend(blocks);
            for position in sequence.cached..sequence.len() {
                for h in 0..heads.num_heads {
                    q.extend(heads.query(sequence.id, position, h));
                }
            }
            seq_lens.push(sequence.len() as i32);
            query_start.push(query_start.last().unwrap() + sequence.computed as i32);
        }
        q.extend(std::iter::repeat_n(1.0, heads.num_heads * heads.head_dim));
        let narrow = |cache: &[f32]| cache.iter().map(|&x| Bf16Bits::from_f32(x)).collect();
        Step {
            heads,
            sequences: sequences.to_vec(),
            q,
            bf16: (narrow(&keys), narrow(&values)),
            keys,
            values,
            block_table,
            seq_lens,
            query_start,
            num_blocks,
            blocks_per_seq,
        }
    }

    /// The step with a block table of `columns` columns, as a model allowing histories of
    /// `columns` blocks has.
    fn with_columns(mut self, columns: usize) -> Step {
        assert!(columns >= self.blocks_per_seq);
        self.block_table = self
            .block_table
            .chunks_exact(self.blocks_per_seq)
            .flat_map(|row| {
                row.iter()
                    .copied()
                    .chain(std::iter::repeat_n(-1, columns - row.len()))
            })
            .collect();
        self.blocks_per_seq = columns;
        self
    }

    fn shape(&self) -> AttentionShape {
        AttentionShape {
            num_heads: self.heads.num_heads,
            num_kv_heads: self.heads.num_kv_heads,
            head_dim: self.heads.head_dim,
            block_size: self.heads.block_size,
            num_blocks: self.num_blocks,
            blocks_per_seq: self.blocks_per_seq,
        }
    }

    /// The output of every row on `path` and `workers`, through `scratch`.
    fn run(&self, path: Path, workers: &Workers, scratch: &mut AttentionScratch) -> Vec<f32> {
        let layout = StepLayout {
            block_table: &self.block_table,
            seq_lens: &self.seq_lens,
            query_start: &self.query_start,
        };
        let mut out = vec![f32::NAN; self.q.len()];
        let params = (self.shape(), self.heads.scale(), self.heads.window);
        let done = if path.bf16 {
            // The order `kv_write` keeps these caches in at this level.
            let cache_layout = self.shape().cache_layout();
            let order = kv_cache::arranged(path.isa, Bf16Products::Bf16, true, &cache_layout);
            let keys = kv_cache::in_order(&self.bf16.0, &cache_layout, order, false);
            let values = kv_cache::in_order(&self.bf16.1, &cache_layout, order, true);
            let cache = KvCache {
                keys: &keys[..],
                values: &values[..],
            };
            let device = ((path.isa, Bf16Products::Bf16), workers, scratch);
            attend(device, &self.q, &cache, &layout, &mut out, params)
        } else {
            let cache = KvCache {
                keys: &self.keys[..],
                values: &self.values[..],
            };
            let device = ((path.isa, Bf16Products::F32), workers, scratch);
            attend(device, &self.q, &cache, &layout, &mut out, params)
        };
        done.unwrap();
        out
    }

    /// The output row of sequence `index`'s computed token at `position`.
    fn row<'a>(&self, out: &'a [f32], index: usize, position: usize) -> &'a [f32] {
        let sequence = &self.sequences[index];
        assert!((sequence.cached..sequence.len()).contains(&position));
        let row = self.query_start[index] as usize + position - sequence.cached;
        let width = self.heads.num_heads * self.heads.head_dim;
        &out[row * width..(row + 1) * width]
    }

    /// Checks every path and thread count against the reference (zeros for the padding row)
    /// and returns the outputs.
    fn check(&self, what: &str) -> Vec<(String, Vec<f32>)> {
        let mut expected: Vec<f64> = self
            .sequences
            .iter()
            .flat_map(|s| self.heads.reference(s))
            .collect();
        expected.extend(std::iter::repeat_n(
            0.0,
            self.heads.num_heads * self.heads.head_dim,
        ));
        let mut outputs = Vec::new();
        for path in Path::every() {
            for threads in [1, 2] {
                let workers = Workers::new(threads).unwrap();
                let out = self.run(path, &workers, &mut AttentionScratch::default());
                let what = format!("{what}, {:?}, {path:?}, {threads} threads", self.heads);
                assert_close(&out, &expected, path.tolerance(), &what);
                outputs.push((what, out));
            }
        }
        // The bf16 path (last, where the CPU has it) really multiplies in bf16: it rounds the
        // queries, so it cannot match the f32 path at the same level bit for bit.
        if let [.., (_, f32_products), _, (what, bf16_products), _] = &outputs[..]
            && Path::every().last().is_some_and(|path| path.bf16)
        {
            assert_ne!(bits(f32_products), bits(bf16_products), "{what}");
        }
        outputs
    }
}

/// Bits of `values`, for exact comparisons.
fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|x| x.to_bits()).collect()
}

const SMALL: Heads = Heads {
    num_heads: 4,
    num_kv_heads: 2,
    head_dim: 8,
    block_size: 4,
    window: usize::MAX,
};

#[test]
fn mixed_batches_match_dense_causal_attention() {
    let cases = [
        // Small enough to run on the calling thread.
        (
            "a 5-token chunk after 7 cached tokens, a fresh 4-token prefill, two decodes",
            vec![
                Sequence::new(0, 7, 5),
                Sequence::new(1, 0, 4),
                Sequence::new(2, 9, 1),
                Sequence::new(3, 2, 1),
            ],
        ),
        // Long enough to be split over the workers.
        (
            "longer contexts",
            vec![
                Sequence::new(0, 57, 5),
                Sequence::new(1, 0, 40),
                Sequence::new(2, 90, 1),
                Sequence::new(3, 30, 1),
            ],
        ),
    ];
    for (what, sequences) in cases {
        let outputs = Step::new(SMALL, &sequences).check(what);
        // Work splits by block and range, never by thread: any thread count gives one's bits.
        for pair in outputs.chunks_exact(2) {
            assert_eq!(
                bits(&pair[0].1),
                bits(&pair[1].1),
                "{} and {}",
                pair[0].0,
                pair[1].0
            );
        }
    }
}

#[test]
fn every_depth_block_size_group_and_head_size_matches_dense_attention() {
    // Depths on both sides of a tile, a block and a range, and thousands of positions; for
    // each, the last tokens of a prompt as one chunk and a decode, in one step.
    for depth in [1, 15, 16, 17, 1000, 4100] {
        for block_size in [16, 32] {
            for group in [1, 3, 8] {
                for head_dim in [64, 128] {
                    let heads = Heads {
                        num_heads: 2 * group,
                        num_kv_heads: 2,
                        head_dim,
                        block_size,
                        window: usize::MAX,
                    };
                    let chunk = depth.min(if depth > 1000 { 12 } else { 70 });
                    let sequences = [
                        Sequence::new(0, depth - chunk, chunk),
                        Sequence::new(1, depth - 1, 1),
                    ];
                    Step::new(heads, &sequences).check(&format!("depth {depth}"));
                }
            }
        }
    }
}

#[test]
fn prefill_blocks_and_head_passes_of_every_remainder_match_dense_attention() {
    // A chunk of several prefill blocks with a shorter last one (blocks hold up to
    // `BLOCK_ROWS` query rows), and groups whose heads fill the AVX-512 kernel's passes (4
    // heads of 64, 2 of 128) unevenly, next to a decode whose tile ends mid-vector.
    for group in [1, 2, 5] {
        for head_dim in [64, 128] {
            let heads = Heads {
                num_heads: 2 * group,
                num_kv_heads: 2,
                head_dim,
                block_size: 16,
                window: usize::MAX,
            };
            let sequences = [Sequence::new(0, 100, 300), Sequence::new(1, 36, 1)];
            Step::new(heads, &sequences).check(&format!("group {group}"));
        }
    }
}

#[test]
fn a_sliding_window_matches_dense_attention_over_the_window() {
    // Windows shorter than a tile, across tiles, across a range, and longer than the history;
    // prompts and decodes whose windows start inside tiles, at a tile, and before position 0.
    for window in [1, 5, 64, 100, 700, 5000] {
        for (group, head_dim) in [(3, 64), (1, 128), (2, 8)] {
            let heads = Heads {
                num_heads: 2 * group,
                num_kv_heads: 2,
                head_dim,
                block_size: 16,
                window,
            };
            let sequences = [
                Sequence::new(0, 0, 90),
                Sequence::new(1, 1100, 40),
                Sequence::new(2, 1300, 1),
                Sequence::new(3, 63, 1),
                Sequence::new(4, 3, 1),
            ];
            Step::new(heads, &sequences).check(&format!("window {window}"));
        }
    }
}

#[test]
fn heads_of_other_sizes_take_the_portable_tile() {
    // 8 and 96 have no vector kernel; GQA 3 and a range boundary crossed.
    for head_dim in [8, 96] {
        let heads = Heads {
            num_heads: 6,
            num_kv_heads: 2,
            head_dim,
            block_size: 16,
            window: usize::MAX,
        };
        let sequences = [Sequence::new(0, 120, 20), Sequence::new(1, 300, 1)];
        Step::new(heads, &sequences).check("other head sizes");
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
        let params = (shape, 1.0 / (head_dim as f32).sqrt(), usize::MAX);
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
            let kernels = (isa, Bf16Products::F32);
            paged_attention(
                kernels,
                &q,
                &half_cache,
                &layout,
                &mut half,
                params,
                &workers,
            )
            .unwrap();
            let mut full = vec![f32::NAN; q.len()];
            paged_attention(
                kernels,
                &q,
                &full_cache,
                &layout,
                &mut full,
                params,
                &workers,
            )
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
            let params = (shape, 1.0, usize::MAX);
            let message = paged_attention(
                (isa, Bf16Products::F32),
                &[1.0; 4],
                &cache,
                &layout,
                &mut out,
                params,
                &workers,
            )
            .unwrap_err();
            assert!(message.contains(expected), "{message}");
        }
    }
}
