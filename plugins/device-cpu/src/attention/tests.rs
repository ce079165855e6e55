//! Tests of paged attention: every kernel path against dense causal attention, bit-exact batch invariance, half-width caches and refused layouts.

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
            paged_attention(isa, &q, &half_cache, &layout, &mut half, params, &workers).unwrap();
            let mut full = vec![f32::NAN; q.len()];
            paged_attention(isa, &q, &full_cache, &layout, &mut full, params, &workers).unwrap();
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
