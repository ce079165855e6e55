//! [`Bf16Bench`]: the bf16 linears as `cargo bench` reaches them, without the device ABI around them.

use plughost_device_abi::export::FloatSlice;

use crate::Context;
use crate::isa::Isa;
use crate::workers::Workers;

use super::{
    Bf16Products, LinearShape, RowPrefetch, WeightOrder, linear_on, qkv_linear, silu_gate_linear,
};

/// A device's worker threads, instruction-set level, bf16 products and row prefetch, for timing bf16 linears
/// over weights in the host's row order (the order of the `vdpbf16ps` path).
pub struct Bf16Bench {
    context: Context,
}

impl Bf16Bench {
    pub fn new(
        isa: Isa,
        products: Bf16Products,
        prefetch: RowPrefetch,
        threads: usize,
    ) -> Result<Bf16Bench, String> {
        Ok(Bf16Bench {
            context: Context {
                workers: Workers::new(threads)?,
                scratch: Vec::new(),
                isa,
                bf16_products: products,
                activation_digits: Default::default(),
                prefetch,
                attention: Default::default(),
            },
        })
    }

    fn kernel(&self) -> super::Kernel {
        (
            self.context.isa,
            self.context.bf16_products,
            WeightOrder::Rows,
            self.context.prefetch,
        )
    }

    /// `out[T, N] = x[T, K] · w[N, K]ᵀ`, `N = out.len() / T`.
    pub fn linear(
        &self,
        w: &[u16],
        x: &[f32],
        out: &mut [f32],
        tokens: usize,
    ) -> Result<(), String> {
        let shape = shape(tokens, x.len(), out.len())?;
        linear_on(
            self.kernel(),
            x,
            FloatSlice::BF16(w),
            out,
            shape,
            &self.context.workers,
        )
        .map_err(|failure| failure.message().to_string())
    }

    /// `out = silu(x · gateᵀ) * (x · upᵀ)`.
    pub fn silu_gate(
        &self,
        [gate, up]: [&[u16]; 2],
        x: &[f32],
        out: &mut [f32],
        tokens: usize,
    ) -> Result<(), String> {
        let shape = shape(tokens, x.len(), out.len())?;
        let weights = [FloatSlice::BF16(gate), FloatSlice::BF16(up)];
        silu_gate_linear(self.kernel(), x, weights, out, shape, &self.context.workers)
            .map_err(|failure| failure.message().to_string())
    }

    /// `q`, `k` and `v` of one `x` in one launch.
    pub fn qkv(
        &self,
        weights: [&[u16]; 3],
        x: &[f32],
        [q, k, v]: [&mut [f32]; 3],
        tokens: usize,
    ) -> Result<(), String> {
        let inner = x.len() / tokens.max(1);
        let widths = [q.len(), k.len(), v.len()].map(|len| len / tokens.max(1));
        let weights = weights.map(FloatSlice::BF16);
        qkv_linear(
            self.kernel(),
            x,
            weights,
            [q, k, v],
            (tokens, inner, widths),
            &self.context.workers,
        )
        .map_err(|failure| failure.message().to_string())
    }
}

fn shape(tokens: usize, x: usize, out: usize) -> Result<LinearShape, String> {
    let tokens = tokens.max(1);
    if !x.is_multiple_of(tokens) || !out.is_multiple_of(tokens) {
        return Err(format!(
            "{x} activations and {out} outputs are not {tokens} rows"
        ));
    }
    Ok(LinearShape {
        tokens,
        inner: x / tokens,
        outputs: out / tokens,
    })
}
