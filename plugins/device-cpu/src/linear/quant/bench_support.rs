//! [`QuantizedBench`]: the quantized linear as `cargo bench` reaches it, one weight matrix at a time, without the device ABI around it.
//!
//! Launches reach the kernels through the ABI, whose export layer checks every shape; a
//! benchmark of the kernels alone needs a narrower door, and this is it: it checks what the
//! export layer would (whole rows of blocks, slices of the stated sizes) and runs
//! [`super::multiply`], the code every quantized launch runs.

use std::cell::RefCell;

use plughost_device_abi::DType;

use crate::Context;
use crate::isa::Isa;
use crate::workers::Workers;

use super::super::RowPrefetch;
use super::super::sink::SharedOut;
use super::dots::{activation_block, block_bytes};
use super::interleaved::{arrange_in_tasks, groups};
use super::{ActivationDigits, Outputs, QuantMatrix, multiply};

/// A device's worker threads, instruction-set level and row prefetch, for timing quantized
/// linears.
pub struct QuantizedBench {
    /// Borrowed mutably only by [`QuantizedBench::set_prefetch`], between launches.
    context: RefCell<Context>,
}

impl QuantizedBench {
    pub fn new(
        isa: Isa,
        digits: ActivationDigits,
        prefetch: RowPrefetch,
        threads: usize,
    ) -> Result<QuantizedBench, String> {
        Ok(QuantizedBench {
            context: RefCell::new(Context {
                workers: Workers::new(threads)?,
                scratch: Vec::new(),
                isa,
                bf16_products: Default::default(),
                activation_digits: digits,
                prefetch,
                attention: Default::default(),
            }),
        })
    }

    /// Which tiles hint their lines from the next launch on, so one benchmark can alternate
    /// two choices on the same weights and threads.
    pub fn set_prefetch(&self, prefetch: RowPrefetch) {
        self.context.borrow_mut().prefetch = prefetch;
    }

    /// Whether launches at this level keep `dtype` weights interleaved in groups of rows.
    pub fn reads_groups(&self, dtype: DType) -> bool {
        #[cfg(target_arch = "x86_64")]
        if groups(dtype) {
            return self.context.borrow().isa.has(crate::isa::IsaLevel::Avx2);
        }
        let _ = dtype;
        false
    }

    /// Interleaves `weights` (`rows` rows of `dtype` blocks) in place, as the first launch
    /// that reads them at a level where [`QuantizedBench::reads_groups`] does.
    pub fn arrange(&self, dtype: DType, weights: &mut [u8], rows: usize) -> Result<(), String> {
        let row_bytes = weights.len() / rows.max(1);
        let whole = groups(dtype)
            && rows > 0
            && row_bytes * rows == weights.len()
            && row_bytes.is_multiple_of(block_bytes(dtype));
        if !whole {
            return Err(format!(
                "{} bytes are not {rows} rows of {dtype} blocks kept in groups",
                weights.len()
            ));
        }
        let inner = row_bytes / block_bytes(dtype) * activation_block(dtype);
        arrange_in_tasks(dtype, weights, inner, &self.context.borrow());
        Ok(())
    }

    /// `out[T, N] = x[T, K] · w[N, K]ᵀ` for `weights`, `N = rows` rows of `dtype` blocks,
    /// interleaved by [`QuantizedBench::arrange`] when `grouped` says so.
    pub fn linear(
        &self,
        dtype: DType,
        (weights, grouped): (&[u8], bool),
        rows: usize,
        x: &[f32],
        out: &mut [f32],
    ) -> Result<(), String> {
        let tokens = out.len() / rows.max(1);
        let inner = x.len() / tokens.max(1);
        if !dtype.is_block_quantized() || tokens * rows != out.len() || tokens * inner != x.len() {
            return Err(format!(
                "{dtype}: {} activations and {} outputs are not T×K and T×{rows}",
                x.len(),
                out.len()
            ));
        }
        let w = QuantMatrix {
            dtype,
            bytes: weights,
            rows,
            grouped: grouped && self.reads_groups(dtype),
        };
        let outs = [SharedOut::new(out, rows)];
        multiply(
            &self.context.borrow(),
            x,
            (tokens, inner),
            &[w],
            &Outputs::Each(&outs),
        )
        .map_err(|failure| failure.message().to_string())
    }

    /// One launch of several matrices, as `qkv_linear` and `silu_gate_linear` run them:
    /// `weights` (each its interleaved bytes, see [`QuantizedBench::arrange`], and its rows)
    /// times `x` into `outs`, one output per matrix; with `gated`, two matrices (gate, up)
    /// into `silu(gate) * up` in `outs[0]`.
    pub fn fused(
        &self,
        dtype: DType,
        weights: &[(&[u8], usize)],
        x: &[f32],
        outs: &mut [&mut [f32]],
        gated: bool,
    ) -> Result<(), String> {
        let tokens = outs
            .first()
            .zip(weights.first())
            .map_or(0, |(out, &(_, rows))| out.len() / rows.max(1));
        let inner = x.len() / tokens.max(1);
        let shapes_fit = if gated {
            weights.len() == 2 && outs.len() == 1
        } else {
            weights.len() == outs.len()
        } && weights
            .iter()
            .zip(outs.iter().cycle())
            .all(|(&(_, rows), out)| out.len() == tokens * rows);
        if !dtype.is_block_quantized() || !shapes_fit || tokens * inner != x.len() {
            return Err(format!(
                "{dtype}: {} activations do not meet the outputs of {} matrices",
                x.len(),
                weights.len()
            ));
        }
        let matrices: Vec<QuantMatrix<'_>> = weights
            .iter()
            .map(|&(bytes, rows)| QuantMatrix {
                dtype,
                bytes,
                rows,
                grouped: self.reads_groups(dtype),
            })
            .collect();
        let shared: Vec<SharedOut<'_>> = outs
            .iter_mut()
            .zip(weights)
            .map(|(out, &(_, rows))| SharedOut::new(out, rows))
            .collect();
        let outputs = match (gated, shared.as_slice()) {
            (true, [out]) => Outputs::SiluGate(*out),
            _ => Outputs::Each(&shared),
        };
        multiply(
            &self.context.borrow(),
            x,
            (tokens, inner),
            &matrices,
            &outputs,
        )
        .map_err(|failure| failure.message().to_string())
    }
}
