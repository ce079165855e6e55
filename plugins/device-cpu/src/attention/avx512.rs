//! AVX-512 attention of one token's query heads over one KV head, for heads of 64 or 128: a query head and its output row live in registers while the keys and values stream past.
//!
//! Scores come sixteen positions at a time: sixteen 16-lane dot products, then one transposed
//! reduction (`sum_lanes_of_each`) that adds each product's lanes in a fixed tree. The
//! softmax is vectorized ([`exp`]); the output lanes are FMA chains over positions in order.
//! None of it depends on the rest of the batch, only on the token's query and its cached keys
//! and values. Cache rows in f16 or bf16 are widened sixteen elements per load, so decode reads
//! half the bytes of an f32 cache and computes the same way.

use std::arch::x86_64::{
    __m512, __mmask16, _mm512_add_ps, _mm512_div_ps, _mm512_fmadd_ps, _mm512_loadu_ps,
    _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_maskz_mov_ps, _mm512_mul_ps,
    _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps, _mm512_sub_ps,
};

use super::{PREFETCH_DISTANCE, Rows, prefetch_row, with_offsets};
use crate::kv_cache::CacheElement;
use crate::vector::avx512::{exp, reduce, sum_lanes_of_each};

/// Attention of the `G` query heads in `query` (`16 * C` wide each) over the positions of
/// `rows`, into `out` (same layout); `scores` holds `G * context_len` f32s. Every key and
/// value row is loaded once for all `G` heads, and the `G * C` output accumulators are
/// independent FMA chains.
///
/// # Safety
/// The CPU has AVX-512 F and DQ (isa level `avx512`); every block `rows` names exists in the caches (checked by
/// `check_blocks`); `query` and `out` hold `G * 16 * C` f32s.
#[target_feature(enable = "avx512f,avx512dq")]
pub unsafe fn attend<E: CacheElement, const C: usize, const G: usize>(
    query: &[f32],
    (keys, values): (&[E], &[E]),
    rows: &Rows<'_>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let head_dim = 16 * C;
    let context_len = rows.context_len;
    with_offsets(rows, |offsets| {
        let q: [[__m512; C]; G] =
            std::array::from_fn(|h| std::array::from_fn(|c| load(&query[h * head_dim..], c)));
        let prefetch = |cache: &[E], offsets: &[usize]| {
            if rows.prefetch {
                for &offset in offsets {
                    prefetch_row(cache, offset, head_dim);
                }
            }
        };
        prefetch(keys, &offsets[..offsets.len().min(PREFETCH_DISTANCE)]);
        for (chunk_index, chunk) in offsets.chunks(16).enumerate() {
            let first = chunk_index * 16;
            let ahead = (first + PREFETCH_DISTANCE).min(context_len);
            prefetch(keys, &offsets[ahead..(ahead + 16).min(context_len)]);
            for (h, q) in q.iter().enumerate() {
                let mut products = [_mm512_setzero_ps(); 16];
                for (product, &offset) in products.iter_mut().zip(chunk) {
                    let key = &keys[offset..offset + head_dim];
                    let mut acc = _mm512_mul_ps(q[0], load_cached(key, 0));
                    for (c, &q) in q.iter().enumerate().skip(1) {
                        acc = _mm512_fmadd_ps(q, load_cached(key, c), acc);
                    }
                    *product = acc;
                }
                let sums = _mm512_mul_ps(sum_lanes_of_each(&products), _mm512_set1_ps(scale));
                let start = h * context_len + first;
                store_first(&mut scores[start..start + chunk.len()], sums);
            }
        }
        prefetch(values, &offsets[..offsets.len().min(PREFETCH_DISTANCE)]);
        for head_scores in scores.chunks_exact_mut(context_len).take(G) {
            softmax(head_scores);
        }
        let mut acc = [[_mm512_setzero_ps(); C]; G];
        for (position, &offset) in offsets.iter().enumerate() {
            if let Some(ahead) = offsets.get(position + PREFETCH_DISTANCE) {
                prefetch(values, std::slice::from_ref(ahead));
            }
            let value = &values[offset..offset + head_dim];
            let v: [__m512; C] = std::array::from_fn(|c| load_cached(value, c));
            for (h, acc) in acc.iter_mut().enumerate() {
                let weight = _mm512_set1_ps(scores[h * context_len + position]);
                for (acc, &v) in acc.iter_mut().zip(&v) {
                    *acc = _mm512_fmadd_ps(weight, v, *acc);
                }
            }
        }
        for (out_row, acc) in out.chunks_exact_mut(head_dim).zip(&acc) {
            for (c, &sum) in acc.iter().enumerate() {
                let chunk = &mut out_row[16 * c..16 * c + 16];
                // SAFETY: `chunk` holds 16 f32s.
                unsafe { _mm512_storeu_ps(chunk.as_mut_ptr(), sum) };
            }
        }
    })
}

/// Sixteen f32s from element `16 * c` of `row`.
#[inline]
#[target_feature(enable = "avx512f")]
fn load(row: &[f32], c: usize) -> __m512 {
    let chunk = &row[16 * c..16 * c + 16];
    // SAFETY: `chunk` holds 16 f32s.
    unsafe { _mm512_loadu_ps(chunk.as_ptr()) }
}

/// Sixteen cache elements from element `16 * c` of `row`, widened to f32.
#[inline]
#[target_feature(enable = "avx512f")]
fn load_cached<E: CacheElement>(row: &[E], c: usize) -> __m512 {
    let chunk = &row[16 * c..16 * c + 16];
    // SAFETY: `chunk` holds 16 elements.
    unsafe { <E as crate::linear::avx512::Wide>::load(chunk.as_ptr()) }
}

/// The first `min(16, out.len())` lanes of `v` into `out`.
#[inline]
#[target_feature(enable = "avx512f")]
fn store_first(out: &mut [f32], v: __m512) {
    let mask = lanes_mask(out.len());
    // SAFETY: `mask` covers the elements of `out` only.
    unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr(), mask, v) };
}

/// A mask of the first `min(16, len)` lanes.
fn lanes_mask(len: usize) -> __mmask16 {
    ((1u32 << len.min(16)) - 1) as __mmask16
}

/// `exp(s - max) / Σ exp(s - max)` over `scores`, like the portable softmax but sixteen lanes
/// at a time: lane `l` sums the positions `≡ l` (mod 16) in order, then [`reduce`].
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
fn softmax(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let max = _mm512_set1_ps(max);
    let mut total = _mm512_setzero_ps();
    for chunk in scores.chunks_mut(16) {
        let mask = lanes_mask(chunk.len());
        // SAFETY: `mask` covers the chunk only; masked-off lanes load as 0.
        let x = unsafe { _mm512_maskz_loadu_ps(mask, chunk.as_ptr()) };
        let e = exp(_mm512_sub_ps(x, max));
        // SAFETY: as above.
        unsafe { _mm512_mask_storeu_ps(chunk.as_mut_ptr(), mask, e) };
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
    }
    let total = _mm512_set1_ps(reduce(total));
    for chunk in scores.chunks_mut(16) {
        let mask = lanes_mask(chunk.len());
        // SAFETY: `mask` covers the chunk only.
        unsafe {
            let e = _mm512_maskz_loadu_ps(mask, chunk.as_ptr());
            _mm512_mask_storeu_ps(chunk.as_mut_ptr(), mask, _mm512_div_ps(e, total));
        }
    }
}
