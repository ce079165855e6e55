//! AVX2 online-softmax tile for heads of 64 or 128: a tile's keys and values widened once for every row of the block, then per row its scores, their exponentials eight lanes at a time, and the output eight chunks at a time in registers.
//!
//! A score is one dot product in two 8-lane accumulators (alternate chunks), added and
//! reduced in a fixed tree; the output lanes are FMA chains over the tile's positions in
//! order. None of it depends on the other rows of the block.

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_and_ps, _mm256_and_si256, _mm256_castsi256_ps,
    _mm256_cmpgt_epi32, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_epi32,
    _mm256_set1_ps, _mm256_setr_epi32, _mm256_setzero_ps, _mm256_storeu_ps, _mm256_sub_ps,
};

use super::online::{KvTile, QueryBlock, RowSpan, TILE, TileStatistics, state_len};
use crate::kv_cache::CacheElement;
use crate::linear::avx2::{Wide, reduce};
use crate::vector::avx2::exp;

/// The rows of `block` (heads of `8 * C`, `C` a multiple of 8) through one tile, into their
/// states (see `online::attend_tile`); `buffer` holds at least `2 * TILE * 8 * C` f32s.
///
/// # Safety
/// The CPU has isa level `avx2`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend_tile<E: CacheElement, const C: usize>(
    block: &QueryBlock<'_>,
    tile: &KvTile<'_, E>,
    scale: f32,
    states: &mut [f32],
    buffer: &mut [f32],
) {
    // Compiled twice, so the tiles that fetch nothing (a range's last) carry no fetch points.
    if tile.ahead.is_empty() {
        attend_tile_with::<E, C>((block, tile, |_, _| {}), scale, states, buffer)
    } else {
        let fetch = |part, parts| tile.fetch_ahead(part, parts, 8 * C);
        attend_tile_with::<E, C>((block, tile, fetch), scale, states, buffer)
    }
}

/// [`attend_tile`], with `fetch(part, parts)` every sixteen keys of the first token's heads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn attend_tile_with<E: CacheElement, const C: usize>(
    (block, tile, fetch): (&QueryBlock<'_>, &KvTile<'_, E>, impl Fn(usize, usize)),
    scale: f32,
    states: &mut [f32],
    buffer: &mut [f32],
) {
    let head_dim = 8 * C;
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
        let RowSpan { skip, valid, first } = tile.span(block, token);
        if skip >= valid {
            continue;
        }
        for head in 0..block.heads {
            let query = block.query(token, head, head_dim);
            // Positions before the window score negative infinity and weigh nothing.
            let mut scores = [f32::NEG_INFINITY; TILE];
            let keys = keys.chunks_exact(head_dim).enumerate().skip(skip);
            for (score, (j, key)) in scores[skip..valid].iter_mut().zip(keys) {
                let mut acc = [_mm256_setzero_ps(); 2];
                for c in 0..C {
                    acc[c % 2] = _mm256_fmadd_ps(load(query, c), load(key, c), acc[c % 2]);
                }
                *score = reduce(_mm256_add_ps(acc[0], acc[1])) * scale;
                // The first token's heads fetch the next tile, a part every sixteen keys.
                if token == 0 && j % 16 == 15 {
                    fetch(head * TILE / 16 + j / 16, block.heads * TILE / 16);
                }
            }
            let tile_max = scores[skip..valid]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            let state = &mut states[(token * block.heads + head) * stride..][..stride];
            let statistics = TileStatistics::new(state, tile_max, first);
            let (max, rescale) = (statistics.max, statistics.rescale);
            let max_lanes = _mm256_set1_ps(max);
            let mut weights = [0.0f32; TILE];
            let mut total = _mm256_setzero_ps();
            for chunk in skip / 8..valid.div_ceil(8) {
                let x = load(&scores, chunk);
                let w = exp(_mm256_sub_ps(x, max_lanes));
                let w = lanes_between(w, skip.saturating_sub(8 * chunk), valid - 8 * chunk);
                total = _mm256_add_ps(total, w);
                store(&mut weights, chunk, w);
            }
            let tile_sum = reduce(total);
            let rescale_lanes = _mm256_set1_ps(rescale);
            // Eight chunks at a time: their accumulators and one value vector fit the registers.
            for c0 in (0..C).step_by(8) {
                let mut acc: [__m256; 8] = if first {
                    [_mm256_setzero_ps(); 8]
                } else {
                    std::array::from_fn(|i| _mm256_mul_ps(load(state, c0 + i), rescale_lanes))
                };
                let rows = values.chunks_exact(head_dim).skip(skip);
                for (&weight, value) in weights[skip..valid].iter().zip(rows) {
                    let weight = _mm256_set1_ps(weight);
                    for (i, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm256_fmadd_ps(weight, load(value, c0 + i), *acc);
                    }
                }
                for (i, &acc) in acc.iter().enumerate() {
                    store(state, c0 + i, acc);
                }
            }
            statistics.store(state, tile_sum);
        }
    }
}

/// Eight f32s from element `8 * c` of `row`.
#[inline]
#[target_feature(enable = "avx")]
fn load(row: &[f32], c: usize) -> __m256 {
    let chunk = &row[8 * c..8 * c + 8];
    // SAFETY: `chunk` holds 8 f32s.
    unsafe { _mm256_loadu_ps(chunk.as_ptr()) }
}

/// `v` into the eight f32s from element `8 * c` of `row`.
#[inline]
#[target_feature(enable = "avx")]
fn store(row: &mut [f32], c: usize, v: __m256) {
    let chunk = &mut row[8 * c..8 * c + 8];
    // SAFETY: `chunk` holds 8 f32s.
    unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), v) }
}

/// Eight cache elements from element `8 * c` of `row`, widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_cached<E: CacheElement>(row: &[E], c: usize) -> __m256 {
    let chunk = &row[8 * c..8 * c + 8];
    // SAFETY: `chunk` holds 8 elements; the CPU has level `avx2`.
    unsafe { <E as Wide>::load(chunk.as_ptr()) }
}

/// `x` in lanes `from..to`, zero in the others.
#[inline]
#[target_feature(enable = "avx2")]
fn lanes_between(x: __m256, from: usize, to: usize) -> __m256 {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let below_to = _mm256_cmpgt_epi32(_mm256_set1_epi32(to.min(8) as i32), lanes);
    let from_on = _mm256_cmpgt_epi32(lanes, _mm256_set1_epi32(from.min(8) as i32 - 1));
    let keep = _mm256_and_si256(below_to, from_on);
    _mm256_and_ps(x, _mm256_castsi256_ps(keep))
}
