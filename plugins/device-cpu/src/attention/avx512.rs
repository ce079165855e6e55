//! AVX-512 attention of one token's query heads over one KV head, for heads of 64 or 128: a query head and its output row live in registers while the keys and values stream past.
//!
//! The arithmetic of a token depends on its query and its cached keys and values only, never
//! on the rest of the batch: each score is one 16-lane dot product with the `linear`
//! reduction tree, each output lane one FMA chain over positions in order.

use std::arch::x86_64::{
    __m512, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_mul_ps, _mm512_set1_ps, _mm512_setzero_ps,
    _mm512_storeu_ps,
};

use crate::linear::avx512::reduce;

/// Whether this CPU runs these kernels.
pub fn supported() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512dq")
}

/// Where one KV head's rows for positions `0..context_len` live in the paged caches.
pub struct Rows<'a> {
    pub block_row: &'a [i32],
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub kv_head: usize,
    pub context_len: usize,
}

/// Attention of the query heads in `query` (`16 * C` wide each) over the positions of `rows`,
/// into `out` (same layout); `scores` holds `heads * context_len` f32s.
///
/// # Safety
/// The CPU is [`supported`]; every block `rows` names exists in the caches (checked by
/// `check_blocks`).
#[target_feature(enable = "avx512f,avx512dq")]
pub unsafe fn attend<const C: usize>(
    query: &[f32],
    (keys, values): (&[f32], &[f32]),
    rows: &Rows<'_>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let head_dim = 16 * C;
    let context_len = rows.context_len;
    let load = |row: &[f32], c: usize| -> __m512 {
        let chunk = &row[16 * c..16 * c + 16];
        // SAFETY: `chunk` holds 16 f32s.
        unsafe { _mm512_loadu_ps(chunk.as_ptr()) }
    };
    for (q_row, head_scores) in query
        .chunks_exact(head_dim)
        .zip(scores.chunks_exact_mut(context_len))
    {
        let q: [__m512; C] = std::array::from_fn(|c| load(q_row, c));
        let mut position = 0;
        for &block in rows.block_row {
            let first_slot = block as usize * rows.block_size;
            for slot in first_slot..first_slot + rows.block_size.min(context_len - position) {
                let offset = (slot * rows.num_kv_heads + rows.kv_head) * head_dim;
                let key = &keys[offset..offset + head_dim];
                let mut acc = _mm512_mul_ps(q[0], load(key, 0));
                for (c, &q) in q.iter().enumerate().skip(1) {
                    acc = _mm512_fmadd_ps(q, load(key, c), acc);
                }
                head_scores[position] = reduce(acc) * scale;
                position += 1;
            }
            if position == context_len {
                break;
            }
        }
        super::softmax_in_place(head_scores);
    }
    for (out_row, head_scores) in out
        .chunks_exact_mut(head_dim)
        .zip(scores.chunks_exact(context_len))
    {
        let mut acc = [_mm512_setzero_ps(); C];
        let mut position = 0;
        for &block in rows.block_row {
            let first_slot = block as usize * rows.block_size;
            for slot in first_slot..first_slot + rows.block_size.min(context_len - position) {
                let offset = (slot * rows.num_kv_heads + rows.kv_head) * head_dim;
                let value = &values[offset..offset + head_dim];
                let weight = _mm512_set1_ps(head_scores[position]);
                for (c, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_fmadd_ps(weight, load(value, c), *acc);
                }
                position += 1;
            }
            if position == context_len {
                break;
            }
        }
        for (c, &sum) in acc.iter().enumerate() {
            let chunk = &mut out_row[16 * c..16 * c + 16];
            // SAFETY: `chunk` holds 16 f32s.
            unsafe { _mm512_storeu_ps(chunk.as_mut_ptr(), sum) };
        }
    }
}
