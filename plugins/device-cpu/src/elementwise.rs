//! Elementwise kernels: `silu_mul` (the gated MLP activation) and `add` (the residual add, in place).

use plughost_device_abi::export::{DeviceFailure, Launch};

use crate::Context;
use crate::workers::Workers;

/// `out = silu(gate) * up` with `silu(g) = g / (1 + exp(-g))`, PyTorch's f32 formula.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32], workers: &Workers) {
    let chunk_len = workers.rows_per_task(out.len(), 1);
    workers.for_each_chunk(out, chunk_len, |task, out| {
        let first = task * chunk_len;
        let inputs = gate[first..].iter().zip(&up[first..]);
        for (out, (&g, &u)) in out.iter_mut().zip(inputs) {
            *out = g / (1.0 + (-g).exp()) * u;
        }
    });
}

/// `x += y`.
pub fn add(x: &mut [f32], y: &[f32], workers: &Workers) {
    let chunk_len = workers.rows_per_task(x.len(), 1);
    workers.for_each_chunk(x, chunk_len, |task, x| {
        for (x, &y) in x.iter_mut().zip(&y[task * chunk_len..]) {
            *x += y;
        }
    });
}

pub(crate) fn run_silu_mul(
    launch: &mut Launch<'_>,
    context: &mut Context,
) -> Result<(), DeviceFailure> {
    let mut views = launch.views()?;
    let (gate, up) = (views.f32("gate"), views.f32("up"));
    silu_mul(gate, up, views.f32_mut("out"), &context.workers);
    Ok(())
}

pub(crate) fn run_add(launch: &mut Launch<'_>, context: &mut Context) -> Result<(), DeviceFailure> {
    let mut views = launch.views()?;
    let y = views.f32("y");
    add(views.f32_mut("x"), y, &context.workers);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_close, noise};

    #[test]
    fn silu_mul_and_add_match_the_definitions() {
        for (len, threads) in [(5, 1), (100_000, 2)] {
            let workers = Workers::new(threads).unwrap();
            let gate: Vec<f32> = (0..len).map(|i| 8.0 * noise(1, i)).collect();
            let up: Vec<f32> = (0..len).map(|i| noise(2, i)).collect();
            let expected: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| {
                    let g = f64::from(g);
                    g / (1.0 + (-g).exp()) * f64::from(u)
                })
                .collect();
            let mut out = vec![f32::NAN; len];
            silu_mul(&gate, &up, &mut out, &workers);
            assert_close(&out, &expected, 1e-6, "silu_mul");

            let mut x = gate.clone();
            add(&mut x, &up, &workers);
            let sums: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(&a, &b)| f64::from(a + b))
                .collect();
            assert_close(&x, &sums, 0.0, "add");
        }
    }
}
