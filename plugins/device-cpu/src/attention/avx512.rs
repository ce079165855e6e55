//! AVX-512 online-softmax tile for heads of 64 or 128: a tile's keys and values widened once for every row of the block, then per row sixteen scores at a time and the output in registers.
//!
//! Scores are sixteen 16-lane dot products and one transposed reduction
//! (`sum_lanes_of_each`) that adds each product's lanes in a fixed tree; exponentials are
//! vectorized ([`exp`]); the output lanes are FMA chains over the tile's positions in order.
//! None of it depends on the other rows of the block.

use std::arch::x86_64::{
    __m512, __mmask16, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mask_mov_ps, _mm512_maskz_mov_ps,
    _mm512_mul_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps, _mm512_sub_ps,
};

use super::online::{KvTile, QueryBlock, TILE, state_len};
use crate::kv_cache::CacheElement;
use crate::vector::avx512::{exp, reduce, sum_lanes_of_each};

/// The rows of `block` (heads of `16 * C`) through one tile, into their states (see
/// `online::attend_tile`); `buffer` holds at least `2 * TILE * 16 * C` f32s.
///
/// # Safety
/// The CPU has AVX-512 F and DQ (isa level `avx512`).
#[target_feature(enable = "avx512f,avx512dq")]
pub unsafe fn attend_tile<E: CacheElement, const C: usize>(
    block: &QueryBlock<'_>,
    tile: &KvTile<'_, E>,
    scale: f32,
    (states, first): (&mut [f32], bool),
    buffer: &mut [f32],
) {
    let head_dim = 16 * C;
    let (keys, values) = buffer.split_at_mut(TILE * head_dim);
    for (j, &offset) in tile.offsets.iter().enumerate() {
        let (key, value) = (
            &tile.keys[offset..offset + head_dim],
            &tile.values[offset..offset + head_dim],
        );
        for c in 0..C {
            store(&mut keys[j * head_dim..], c, load_cached(key, c));
            store(&mut values[j * head_dim..], c, load_cached(value, c));
        }
    }
    let stride = state_len(head_dim);
    for token in 0..block.tokens {
        let valid = tile.valid(block.end(token));
        if valid == 0 {
            continue;
        }
        let mask = lanes_mask(valid);
        for head in 0..block.heads {
            let query = block.query(token, head, head_dim);
            let q: [__m512; C] = std::array::from_fn(|c| load(query, c));
            let mut products = [_mm512_setzero_ps(); TILE];
            for (product, key) in products[..valid]
                .iter_mut()
                .zip(keys.chunks_exact(head_dim))
            {
                let mut acc = _mm512_mul_ps(q[0], load(key, 0));
                for (c, &q) in q.iter().enumerate().skip(1) {
                    acc = _mm512_fmadd_ps(q, load(key, c), acc);
                }
                *product = acc;
            }
            let scores = _mm512_mul_ps(sum_lanes_of_each(&products), _mm512_set1_ps(scale));
            let lanes = to_array(_mm512_mask_mov_ps(
                _mm512_set1_ps(f32::NEG_INFINITY),
                mask,
                scores,
            ));
            let tile_max = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let state = &mut states[(token * block.heads + head) * stride..][..stride];
            let (old_max, old_sum) = (state[head_dim], state[head_dim + 1]);
            let (max, rescale) = if first {
                (tile_max, 0.0)
            } else {
                let max = old_max.max(tile_max);
                (max, (old_max - max).exp())
            };
            let weights =
                _mm512_maskz_mov_ps(mask, exp(_mm512_sub_ps(scores, _mm512_set1_ps(max))));
            let tile_sum = reduce(weights);
            let weights = to_array(weights);
            let mut acc: [__m512; C] = if first {
                [_mm512_setzero_ps(); C]
            } else {
                let rescale = _mm512_set1_ps(rescale);
                std::array::from_fn(|c| _mm512_mul_ps(load(state, c), rescale))
            };
            for (&weight, value) in weights[..valid].iter().zip(values.chunks_exact(head_dim)) {
                let weight = _mm512_set1_ps(weight);
                for (c, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_fmadd_ps(weight, load(value, c), *acc);
                }
            }
            for (c, &acc) in acc.iter().enumerate() {
                store(state, c, acc);
            }
            state[head_dim] = max;
            state[head_dim + 1] = if first {
                tile_sum
            } else {
                old_sum * rescale + tile_sum
            };
        }
    }
}

/// Sixteen f32s from element `16 * c` of `row`.
#[inline]
#[target_feature(enable = "avx512f")]
fn load(row: &[f32], c: usize) -> __m512 {
    let chunk = &row[16 * c..16 * c + 16];
    // SAFETY: `chunk` holds 16 f32s.
    unsafe { _mm512_loadu_ps(chunk.as_ptr()) }
}

/// `v` into the sixteen f32s from element `16 * c` of `row`.
#[inline]
#[target_feature(enable = "avx512f")]
fn store(row: &mut [f32], c: usize, v: __m512) {
    let chunk = &mut row[16 * c..16 * c + 16];
    // SAFETY: `chunk` holds 16 f32s.
    unsafe { _mm512_storeu_ps(chunk.as_mut_ptr(), v) }
}

/// Sixteen cache elements from element `16 * c` of `row`, widened to f32.
#[inline]
#[target_feature(enable = "avx512f")]
fn load_cached<E: CacheElement>(row: &[E], c: usize) -> __m512 {
    let chunk = &row[16 * c..16 * c + 16];
    // SAFETY: `chunk` holds 16 elements.
    unsafe { <E as crate::linear::avx512::Wide>::load(chunk.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn to_array(v: __m512) -> [f32; 16] {
    let mut lanes = [0.0f32; 16];
    store(&mut lanes, 0, v);
    lanes
}

/// A mask of the first `min(16, len)` lanes.
fn lanes_mask(len: usize) -> __mmask16 {
    ((1u32 << len.min(16)) - 1) as __mmask16
}
