//! Elementwise kernels: `silu_mul` (the gated MLP activation), `add` (the residual add, in place) and `bias_add` (a projection's bias, added to every row).

use plughost_device_abi::export::{DeviceFailure, Launch};

use crate::Context;
use crate::isa::Isa;
#[cfg(target_arch = "x86_64")]
use crate::isa::IsaLevel;
use crate::widen::widened;
use crate::workers::Workers;

/// `out = silu(gate) * up` with `silu(g) = g / (1 + exp(-g))`, PyTorch's f32 formula.
pub fn silu_mul(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32], workers: &Workers) {
    let chunk_len = workers.rows_per_task(out.len(), 1);
    workers.for_each_chunk(out, chunk_len, |task, out| {
        let first = task * chunk_len;
        silu_mul_span(
            isa,
            &gate[first..first + out.len()],
            &up[first..first + out.len()],
            out,
        );
    });
}

/// [`silu_mul`] of equally long slices on the calling thread: the same instructions for each
/// element, so `silu_gate_linear`, which calls it on a tile at a time, matches it bit for bit.
pub(crate) fn silu_mul_span(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.has(IsaLevel::Avx512) {
        // SAFETY: the level has AVX-512 F and DQ (checked just above).
        return unsafe { silu_mul_avx512(gate, up, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has(IsaLevel::Avx2) {
        // SAFETY: the level has AVX2 and FMA (checked just above).
        return unsafe { silu_mul_avx2(gate, up, out) };
    }
    let _ = isa;
    for (out, (&g, &u)) in out.iter_mut().zip(gate.iter().zip(up)) {
        *out = g / (1.0 + (-g).exp()) * u;
    }
}

/// The same formula sixteen lanes at a time with the vectorized `exp`; every element, the
/// last partial chunk's too, goes through the same instructions, so a token's activations do
/// not depend on where its row falls.
///
/// # Safety
/// The CPU has AVX-512 F and DQ.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn silu_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::{
        _mm512_add_ps, _mm512_div_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_mul_ps,
        _mm512_set1_ps, _mm512_sub_ps,
    };
    let one = _mm512_set1_ps(1.0);
    for (index, out) in out.chunks_mut(16).enumerate() {
        let mask = ((1u32 << out.len()) - 1) as u16;
        let start = index * 16;
        // SAFETY: `mask` covers the chunk, and `gate` and `up` are as long as `out`.
        unsafe {
            let g = _mm512_maskz_loadu_ps(mask, gate[start..].as_ptr());
            let u = _mm512_maskz_loadu_ps(mask, up[start..].as_ptr());
            let e = crate::vector::avx512::exp(_mm512_sub_ps(_mm512_set1_ps(0.0), g));
            let silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
            _mm512_mask_storeu_ps(out.as_mut_ptr(), mask, _mm512_mul_ps(silu, u));
        }
    }
}

/// As [`silu_mul_avx512`], eight lanes at a time; the last partial chunk goes through a
/// zero-padded copy, by the same instructions.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_div_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps,
        _mm256_setzero_ps, _mm256_storeu_ps, _mm256_sub_ps,
    };
    let one = _mm256_set1_ps(1.0);
    let silu_times = |g, u| {
        let e = crate::vector::avx2::exp(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u)
    };
    let whole = out.len() / 8 * 8;
    let (body, tail) = out.split_at_mut(whole);
    for (index, out) in body.chunks_exact_mut(8).enumerate() {
        // SAFETY: `gate` and `up` are as long as `out`, so their chunk `index` holds 8 f32s.
        unsafe {
            let g = _mm256_loadu_ps(gate[index * 8..].as_ptr());
            let u = _mm256_loadu_ps(up[index * 8..].as_ptr());
            _mm256_storeu_ps(out.as_mut_ptr(), silu_times(g, u));
        }
    }
    if !tail.is_empty() {
        let (mut g, mut u, mut lanes) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
        g[..tail.len()].copy_from_slice(&gate[whole..]);
        u[..tail.len()].copy_from_slice(&up[whole..]);
        // SAFETY: the lane arrays hold 8 f32s.
        unsafe {
            let value = silu_times(_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr()));
            _mm256_storeu_ps(lanes.as_mut_ptr(), value);
        }
        tail.copy_from_slice(&lanes[..tail.len()]);
    }
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

/// `x[t, :] += bias` for every row `t`: each element one rounded f32 add, as PyTorch's.
pub fn bias_add(x: &mut [f32], bias: &[f32], workers: &Workers) {
    if bias.is_empty() {
        return;
    }
    let rows_per_task = workers.rows_per_task(x.len() / bias.len(), bias.len());
    workers.for_each_chunk(x, rows_per_task * bias.len(), |_, rows| {
        for row in rows.chunks_exact_mut(bias.len()) {
            for (x, &b) in row.iter_mut().zip(bias) {
                *x += b;
            }
        }
    });
}

pub(crate) fn run_bias_add(
    launch: &mut Launch<'_>,
    context: &mut Context,
) -> Result<(), DeviceFailure> {
    let mut views = launch.views()?;
    let bias = widened(views.float("bias"), &mut context.scratch);
    bias_add(views.f32_mut("x"), bias, &context.workers);
    Ok(())
}

pub(crate) fn run_silu_mul(
    launch: &mut Launch<'_>,
    context: &mut Context,
) -> Result<(), DeviceFailure> {
    let mut views = launch.views()?;
    let (gate, up) = (views.f32("gate"), views.f32("up"));
    silu_mul(
        context.isa,
        gate,
        up,
        views.f32_mut("out"),
        &context.workers,
    );
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
    fn bias_add_adds_the_bias_to_every_row() {
        for (rows, width, threads) in [(1, 3, 1), (7, 5, 2), (300, 64, 2)] {
            let workers = Workers::new(threads).unwrap();
            let x: Vec<f32> = (0..rows * width).map(|i| noise(3, i)).collect();
            let bias: Vec<f32> = (0..width).map(|i| noise(4, i)).collect();
            let mut got = x.clone();
            bias_add(&mut got, &bias, &workers);
            for (i, (&got, &x)) in got.iter().zip(&x).enumerate() {
                assert_eq!(got, x + bias[i % width], "rows {rows}, element {i}");
            }
        }
    }

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
            for isa in Isa::every() {
                let mut out = vec![f32::NAN; len];
                silu_mul(isa, &gate, &up, &mut out, &workers);
                assert_close(&out, &expected, 1e-6, &format!("silu_mul {isa:?}"));
            }

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
