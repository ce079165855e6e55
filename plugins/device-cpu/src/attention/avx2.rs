//! AVX2 attention of one token's query heads over one KV head, for heads of 64 or 128: each key row is widened once for all the heads, then the values stream past one head's output row held in registers.
//!
//! A score is one dot product in two 8-lane accumulators (alternate chunks), added and
//! reduced in a fixed tree; the softmax is vectorized (`vector::avx2::exp`); the output lanes are FMA
//! chains over positions in order. None of it depends on the rest of the batch.

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_and_ps, _mm256_castsi256_ps, _mm256_cmpgt_epi32, _mm256_div_ps,
    _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setr_epi32,
    _mm256_setzero_ps, _mm256_storeu_ps, _mm256_sub_ps,
};

use super::{PREFETCH_DISTANCE, Rows, prefetch_row, with_offsets};
use crate::kv_cache::CacheElement;
use crate::linear::avx2::{Wide, reduce};
use crate::vector::avx2::exp;

/// Attention of the `G` query heads in `query` (`8 * C` wide each) over the positions of
/// `rows`, into `out` (same layout); `scores` holds `G * context_len` f32s.
///
/// # Safety
/// The CPU has isa level `avx2`; every block `rows` names exists in the caches (checked by
/// `check_blocks`); `query` and `out` hold `G * 8 * C` f32s; `C` is a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend<E: CacheElement, const C: usize, const G: usize>(
    query: &[f32],
    (keys, values): (&[E], &[E]),
    rows: &Rows<'_>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let head_dim = 8 * C;
    let context_len = rows.context_len;
    with_offsets(rows, |offsets| {
        for (position, &offset) in offsets.iter().enumerate() {
            if rows.prefetch
                && let Some(&ahead) = offsets.get(position + PREFETCH_DISTANCE)
            {
                prefetch_row(keys, ahead, head_dim);
            }
            let key = &keys[offset..offset + head_dim];
            let k: [__m256; C] = std::array::from_fn(|c| load_cached(key, c));
            for h in 0..G {
                let q = &query[h * head_dim..(h + 1) * head_dim];
                let mut acc = [_mm256_setzero_ps(); 2];
                for (c, &k) in k.iter().enumerate() {
                    acc[c % 2] = _mm256_fmadd_ps(load(q, c), k, acc[c % 2]);
                }
                scores[h * context_len + position] = reduce(_mm256_add_ps(acc[0], acc[1])) * scale;
            }
        }
        for head_scores in scores.chunks_exact_mut(context_len).take(G) {
            softmax(head_scores);
        }
        for (h, out_row) in out.chunks_exact_mut(head_dim).take(G).enumerate() {
            let weights = &scores[h * context_len..(h + 1) * context_len];
            // Eight chunks at a time: their accumulators and one value vector fit the registers.
            for c0 in (0..C).step_by(8) {
                let mut acc = [_mm256_setzero_ps(); 8];
                // The first pass over the values brings them in; later ones find them cached.
                let first_pass = h == 0 && c0 == 0 && rows.prefetch;
                for (position, (&offset, &weight)) in offsets.iter().zip(weights).enumerate() {
                    if first_pass && let Some(&ahead) = offsets.get(position + PREFETCH_DISTANCE) {
                        prefetch_row(values, ahead, head_dim);
                    }
                    let value = &values[offset..offset + head_dim];
                    let weight = _mm256_set1_ps(weight);
                    for (i, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm256_fmadd_ps(weight, load_cached(value, c0 + i), *acc);
                    }
                }
                for (i, &sum) in acc.iter().enumerate() {
                    let chunk = &mut out_row[8 * (c0 + i)..8 * (c0 + i) + 8];
                    // SAFETY: `chunk` holds 8 f32s.
                    unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), sum) };
                }
            }
        }
    })
}

/// Eight f32s from element `8 * c` of `row`.
#[inline]
#[target_feature(enable = "avx")]
fn load(row: &[f32], c: usize) -> __m256 {
    let chunk = &row[8 * c..8 * c + 8];
    // SAFETY: `chunk` holds 8 f32s.
    unsafe { _mm256_loadu_ps(chunk.as_ptr()) }
}

/// Eight cache elements from element `8 * c` of `row`, widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_cached<E: CacheElement>(row: &[E], c: usize) -> __m256 {
    let chunk = &row[8 * c..8 * c + 8];
    // SAFETY: `chunk` holds 8 elements; the CPU has level `avx2`.
    unsafe { <E as Wide>::load(chunk.as_ptr()) }
}

/// `x` where fewer than `len` lanes precede the lane, else zero.
#[inline]
#[target_feature(enable = "avx2")]
fn first_lanes(x: __m256, len: usize) -> __m256 {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(len.min(8) as i32), lanes);
    _mm256_and_ps(x, _mm256_castsi256_ps(keep))
}

/// `exp(s - max) / Σ exp(s - max)` over `scores`, eight lanes at a time: lane `l` sums the
/// positions `≡ l` (mod 8) in order, then [`reduce`].
#[inline]
#[target_feature(enable = "avx2,fma")]
fn softmax(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let max = _mm256_set1_ps(max);
    let mut total = _mm256_setzero_ps();
    let mut lanes = [0.0f32; 8];
    for chunk in scores.chunks_mut(8) {
        lanes[..chunk.len()].copy_from_slice(chunk);
        // SAFETY: `lanes` holds 8 f32s.
        let x = unsafe { _mm256_loadu_ps(lanes.as_ptr()) };
        let e = first_lanes(exp(_mm256_sub_ps(x, max)), chunk.len());
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), e) };
        chunk.copy_from_slice(&lanes[..chunk.len()]);
        total = _mm256_add_ps(total, e);
    }
    let total = _mm256_set1_ps(reduce(total));
    for chunk in scores.chunks_mut(8) {
        lanes[..chunk.len()].copy_from_slice(chunk);
        // SAFETY: `lanes` holds 8 f32s.
        unsafe {
            let e = _mm256_loadu_ps(lanes.as_ptr());
            _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_div_ps(e, total));
        }
        chunk.copy_from_slice(&lanes[..chunk.len()]);
    }
}
