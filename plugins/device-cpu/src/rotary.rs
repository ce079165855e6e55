//! `rotary`: rotate-half (NeoX) rotary position embedding of q and k, in place.
//!
//! The inverse frequencies come from the model glue, one f32 per pair of a head's dimensions,
//! so a rope variant (Llama 3 or YaRN scaling) is a different table, not a different kernel.
//! Matches Hugging Face's rope in f32 step by step: `angle = position * inv_freq[i]` in f32,
//! f32 `cos`/`sin`, then per head the pairs `(i, i + D/2)` become
//! `(x_i·cos − x_{i+D/2}·sin, x_{i+D/2}·cos + x_i·sin)`, each product rounded before the sum
//! (no fused multiply-add), as PyTorch's separate `mul` and `add` do.

use plughost_device_abi::export::{DeviceFailure, Launch};

use crate::Context;
use crate::workers::{Workers, with_scratch};

/// Rotates every `head_dim`-wide head of row `t` of `rows` by `positions[t]`.
pub fn rotate_rows(rows: &mut [f32], positions: &[i32], inv_freq: &[f32], workers: &Workers) {
    let head_dim = 2 * inv_freq.len();
    let num_rows = positions.len();
    if head_dim == 0 || num_rows == 0 || rows.is_empty() {
        return;
    }
    let width = rows.len() / num_rows;
    let rows_per_task = workers.rows_per_task(num_rows, width);
    workers.for_each_chunk(rows, rows_per_task * width, |task, chunk| {
        with_scratch(head_dim, |cos_sin| {
            let (cos, sin) = cos_sin.split_at_mut(inv_freq.len());
            let first_row = task * rows_per_task;
            for (row, &position) in chunk.chunks_exact_mut(width).zip(&positions[first_row..]) {
                for ((cos, sin), &inv_freq) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
                    (*sin, *cos) = (position as f32 * inv_freq).sin_cos();
                }
                for head in row.chunks_exact_mut(head_dim) {
                    rotate_head(head, cos, sin);
                }
            }
        })
    });
}

fn rotate_head(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let (first, second) = head.split_at_mut(cos.len());
    for (((x1, x2), &cos), &sin) in first.iter_mut().zip(second).zip(cos).zip(sin) {
        let (a, b) = (*x1, *x2);
        *x1 = a * cos - b * sin;
        *x2 = b * cos + a * sin;
    }
}

pub(crate) fn run(launch: &mut Launch<'_>, context: &mut Context) -> Result<(), DeviceFailure> {
    let inv_freq = launch.param_f32_table("inv_freq");
    let mut views = launch.views()?;
    let positions = views.i32("positions");
    rotate_rows(views.f32_mut("q"), positions, &inv_freq, &context.workers);
    rotate_rows(views.f32_mut("k"), positions, &inv_freq, &context.workers);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_close, inverse_frequencies, noise};

    /// The textbook formula in f64: pair (i, i + D/2) rotated by position · theta^(-2i/D).
    fn reference(rows: &[f32], positions: &[i32], head_dim: usize, theta: f64) -> Vec<f64> {
        let width = rows.len() / positions.len();
        let half = head_dim / 2;
        let mut out: Vec<f64> = rows.iter().map(|&v| f64::from(v)).collect();
        for (t, &position) in positions.iter().enumerate() {
            for head in (0..width).step_by(head_dim) {
                for i in 0..half {
                    let angle = f64::from(position) * theta.powf(-2.0 * i as f64 / head_dim as f64);
                    let base = t * width + head;
                    let (a, b) = (out[base + i], out[base + i + half]);
                    out[base + i] = a * angle.cos() - b * angle.sin();
                    out[base + i + half] = b * angle.cos() + a * angle.sin();
                }
            }
        }
        out
    }

    #[test]
    fn matches_the_direct_formula() {
        // (head_dim, heads, positions): small and large positions, where f32 angles lose
        // precision the same way Hugging Face's do.
        let cases: [(usize, usize, &[i32]); 3] = [
            (8, 2, &[0, 1, 2, 3]),
            (64, 3, &[5, 17, 100]),
            (128, 2, &[0, 1000, 4095]),
        ];
        for threads in [1, 2] {
            let workers = Workers::new(threads).unwrap();
            for (head_dim, heads, positions) in cases {
                let theta = 10_000.0;
                let rows: Vec<f32> = (0..positions.len() * heads * head_dim)
                    .map(|i| noise(5, i))
                    .collect();
                let mut rotated = rows.clone();
                rotate_rows(
                    &mut rotated,
                    positions,
                    &inverse_frequencies(head_dim, theta),
                    &workers,
                );
                let expected = reference(&rows, positions, head_dim, f64::from(theta));
                // An f32 angle near 4095 is off by up to ~2.4e-4 rad, so large positions get a
                // looser bound than the arithmetic alone would need.
                let max_position = positions.iter().copied().max().unwrap_or(0) as f64;
                let tolerance = 1e-6 + max_position * 2.0 * f32::EPSILON as f64;
                let what = format!("D={head_dim}, {threads} threads");
                assert_close(&rotated, &expected, tolerance, &what);
            }
        }
    }

    #[test]
    fn position_zero_is_identity() {
        let original: Vec<f32> = (0..16).map(|i| noise(9, i)).collect();
        let mut rows = original.clone();
        rotate_rows(
            &mut rows,
            &[0, 0],
            &inverse_frequencies(8, 1e6),
            &Workers::new(1).unwrap(),
        );
        assert_eq!(rows, original);
    }
}
