//! RMSNorm: `rms_norm` over rows of hidden states, `add_rms_norm` after a residual add, `rms_norm_heads` in place over each head of a row (Qwen3's q/k norm).
//!
//! As Hugging Face's `LlamaRMSNorm` in f32: `weight * (x * rsqrt(mean(x²) + eps))`, the
//! products in that order (float products are not associative).

use plughost_device_abi::export::{DeviceFailure, Launch};

use crate::Context;
use crate::isa::Isa;
use crate::vector::dot;
use crate::widen::widened;
use crate::workers::Workers;

/// Normalizes each `weight.len()`-wide row of `x` into the same row of `out`.
pub fn rms_norm(isa: Isa, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32], workers: &Workers) {
    let width = weight.len();
    if width == 0 {
        return;
    }
    let rows_per_task = workers.rows_per_task(x.len() / width, width);
    workers.for_each_chunk(out, rows_per_task * width, |task, out_rows| {
        let first = task * rows_per_task * width;
        let x_rows = &x[first..first + out_rows.len()];
        for (x_row, out_row) in x_rows
            .chunks_exact(width)
            .zip(out_rows.chunks_exact_mut(width))
        {
            normalize_row(isa, x_row, weight, eps, out_row);
        }
    });
}

/// One row of [`rms_norm`].
fn normalize_row(isa: Isa, x_row: &[f32], weight: &[f32], eps: f32, out_row: &mut [f32]) {
    let inverse_rms = inverse_rms(isa, x_row, eps);
    for ((out, &x), &w) in out_row.iter_mut().zip(x_row).zip(weight) {
        *out = w * (x * inverse_rms);
    }
}

/// `x += y`, then each row of `x` normalized into `out`: the residual add and the norm that
/// follows it in one launch and one pass over the rows, with the arithmetic of `add` followed
/// by [`rms_norm`].
pub fn add_rms_norm(
    isa: Isa,
    (x, y): (&mut [f32], &[f32]),
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
    workers: &Workers,
) {
    let width = weight.len();
    if width == 0 {
        return;
    }
    let rows_per_task = workers.rows_per_task(x.len() / width, width);
    workers.for_each_chunk_pair((x, out), rows_per_task * width, |task, x_rows, out_rows| {
        let first = task * rows_per_task * width;
        let y_rows = &y[first..first + x_rows.len()];
        for ((x_row, y_row), out_row) in x_rows
            .chunks_exact_mut(width)
            .zip(y_rows.chunks_exact(width))
            .zip(out_rows.chunks_exact_mut(width))
        {
            for (x, &y) in x_row.iter_mut().zip(y_row) {
                *x += y;
            }
            normalize_row(isa, x_row, weight, eps, out_row);
        }
    });
}

/// Normalizes each `weight.len()`-wide chunk of `x` (one head) in place.
pub fn rms_norm_in_place(isa: Isa, x: &mut [f32], weight: &[f32], eps: f32, workers: &Workers) {
    let width = weight.len();
    if width == 0 {
        return;
    }
    let chunks_per_task = workers.rows_per_task(x.len() / width, width);
    workers.for_each_chunk(x, chunks_per_task * width, |_, rows| {
        for row in rows.chunks_exact_mut(width) {
            let inverse_rms = inverse_rms(isa, row, eps);
            for (x, &w) in row.iter_mut().zip(weight) {
                *x = w * (*x * inverse_rms);
            }
        }
    });
}

fn inverse_rms(isa: Isa, row: &[f32], eps: f32) -> f32 {
    let mean_square = dot(isa, row, row) / row.len() as f32;
    1.0 / (mean_square + eps).sqrt()
}

pub(crate) fn run_rows(
    launch: &mut Launch<'_>,
    context: &mut Context,
) -> Result<(), DeviceFailure> {
    let eps = launch.param_f32("eps");
    let mut views = launch.views()?;
    let weight = widened(views.float("weight"), &mut context.scratch);
    let (x, out) = (views.f32("x"), views.f32_mut("out"));
    rms_norm(context.isa, x, weight, eps, out, &context.workers);
    Ok(())
}

pub(crate) fn run_add_rows(
    launch: &mut Launch<'_>,
    context: &mut Context,
) -> Result<(), DeviceFailure> {
    let eps = launch.param_f32("eps");
    let mut views = launch.views()?;
    let weight = widened(views.float("weight"), &mut context.scratch);
    let y = views.f32("y");
    let (x, out) = (views.f32_mut("x"), views.f32_mut("out"));
    add_rms_norm(context.isa, (x, y), weight, eps, out, &context.workers);
    Ok(())
}

pub(crate) fn run_heads(
    launch: &mut Launch<'_>,
    context: &mut Context,
) -> Result<(), DeviceFailure> {
    let eps = launch.param_f32("eps");
    let mut views = launch.views()?;
    let weight = widened(views.float("weight"), &mut context.scratch);
    rms_norm_in_place(
        context.isa,
        views.f32_mut("x"),
        weight,
        eps,
        &context.workers,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_close, noise};

    /// Each `width`-wide chunk: x / sqrt(mean(x²) + eps) * weight, in f64.
    fn reference(x: &[f32], weight: &[f32], eps: f32) -> Vec<f64> {
        let mut out = Vec::new();
        for row in x.chunks_exact(weight.len()) {
            let mean_square =
                row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / row.len() as f64;
            let inverse_rms = 1.0 / (mean_square + f64::from(eps)).sqrt();
            out.extend(
                row.iter()
                    .zip(weight)
                    .map(|(&v, &w)| f64::from(v) * inverse_rms * f64::from(w)),
            );
        }
        out
    }

    #[test]
    fn rows_and_heads_match_the_definition() {
        // (rows, width): a decode row, a few rows, and enough rows to split over threads.
        let cases = [(1, 64), (3, 200), (200, 128)];
        for (isa, threads) in Isa::every().into_iter().flat_map(|i| [(i, 1), (i, 2)]) {
            let workers = Workers::new(threads).unwrap();
            for (rows, width) in cases {
                let what = format!("{rows}x{width}, {isa:?}, {threads} threads");
                let x: Vec<f32> = (0..rows * width).map(|i| 3.0 * noise(1, i)).collect();
                let weight: Vec<f32> = (0..width).map(|i| 1.0 + noise(2, i)).collect();
                let expected = reference(&x, &weight, 1e-6);

                let mut out = vec![f32::NAN; x.len()];
                rms_norm(isa, &x, &weight, 1e-6, &mut out, &workers);
                assert_close(&out, &expected, 1e-6, &what);

                // The same data seen as rows of `rows` heads each `width` wide.
                let mut in_place = x.clone();
                rms_norm_in_place(isa, &mut in_place, &weight, 1e-6, &workers);
                assert_close(&in_place, &expected, 1e-6, &what);
            }
        }
    }

    #[test]
    fn add_then_norm_in_one_launch_gives_the_bits_of_two() {
        for (isa, threads) in Isa::every().into_iter().flat_map(|i| [(i, 1), (i, 2)]) {
            let workers = Workers::new(threads).unwrap();
            for (rows, width) in [(1, 64), (200, 128)] {
                let x: Vec<f32> = (0..rows * width).map(|i| 3.0 * noise(3, i)).collect();
                let y: Vec<f32> = (0..rows * width).map(|i| noise(4, i)).collect();
                let weight: Vec<f32> = (0..width).map(|i| 1.0 + noise(5, i)).collect();

                let mut fused_x = x.clone();
                let mut fused_out = vec![f32::NAN; x.len()];
                let (x_y, eps) = ((&mut fused_x[..], &y[..]), 1e-6);
                add_rms_norm(isa, x_y, &weight, eps, &mut fused_out, &workers);

                let mut added = x.clone();
                crate::elementwise::add(&mut added, &y, &workers);
                let mut out = vec![f32::NAN; x.len()];
                rms_norm(isa, &added, &weight, 1e-6, &mut out, &workers);

                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&fused_x), bits(&added), "{rows}x{width}");
                assert_eq!(bits(&fused_out), bits(&out), "{rows}x{width}");
                assert_ne!(fused_x, x);
            }
        }
    }

    #[test]
    fn eps_keeps_a_zero_row_finite() {
        let mut out = [f32::NAN; 4];
        rms_norm(
            Isa::detect(),
            &[0.0; 4],
            &[1.0; 4],
            1e-6,
            &mut out,
            &Workers::new(1).unwrap(),
        );
        assert_eq!(out, [0.0; 4]);
    }
}
