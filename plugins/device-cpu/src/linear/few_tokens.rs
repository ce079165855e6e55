//! One or two tokens on AVX2: a panel's weight columns go from the in-register transpose straight into the FMAs, with no tile in between.
//!
//! With so few tokens a packed tile would be read once or twice, so storing and reloading it
//! costs more than it saves. The arithmetic is the microkernel's, element for element: per K
//! block of [`KC`] a chain of FMAs in `k` order from 0, the block sums added to `out` in
//! block order.
//!
//! One panel per call: one token keeps two FMA chains going, so with the weights in cache the
//! FMA latency sets the pace (about 4 elements a cycle). Two panels per call were faster only
//! in cache, and only with their column loops skewed apart (with `K` a power of two all 32
//! rows fall into the same L1 sets); from DRAM, as in a real decode step, they measured the
//! same, so the simpler loop stays.

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_loadu_ps,
    _mm256_setzero_ps, _mm256_storeu_ps,
};

use plughost_device_abi::export::FloatSlice;

use super::columns::{Bf16, Columns, F16, Panel};
use super::tile::KC;

/// The most tokens this kernel takes; more share the packed tiles of the microkernel path.
pub const MAX_TOKENS: usize = 2;

/// One call: `tokens` rows of `x` against the full panel of `w` at row `first_row`.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// `1..=MAX_TOKENS`.
    pub tokens: usize,
    pub first_row: usize,
    /// `K`: the row length of `x` and of `w`.
    pub inner: usize,
    /// The first token row of `x`.
    pub x: *const f32,
    /// Element `[0, first_row]` of `out`: `NR` wide for each token.
    pub out: *mut f32,
    pub out_stride: usize,
}

/// # Safety
/// The CPU has AVX2, FMA and F16C; `tokens` is in range; rows `first_row..first_row + NR` of
/// `w` exist; `x` has `tokens` rows of `inner`; the block of `out` is valid and no other
/// thread touches it during the call.
pub unsafe fn run(w: FloatSlice<'_>, call: &Call) {
    const _: () = assert!(MAX_TOKENS == 2, "`run` dispatches on 1..=2 tokens");
    macro_rules! by_tokens {
        ($panel:expr) => {
            match call.tokens {
                1 => kernel::<_, 1>($panel, call),
                2 => kernel::<_, 2>($panel, call),
                other => unreachable!("a call for {other} tokens"),
            }
        };
    }
    let (start, inner) = (call.first_row * call.inner, call.inner);
    // SAFETY: the caller's contract; the panel's rows exist.
    unsafe {
        match w {
            FloatSlice::F32(values) => by_tokens!(Panel {
                w: values.as_ptr().add(start),
                inner
            }),
            FloatSlice::BF16(bits) => by_tokens!(Bf16(Panel {
                w: bits.as_ptr().add(start),
                inner
            })),
            FloatSlice::F16(bits) => by_tokens!(F16(Panel {
                w: bits.as_ptr().add(start),
                inner
            })),
        }
    }
}

/// `acc[m][h]` holds lanes `8h..8h + 8` of token `m`'s sums.
///
/// # Safety
/// As [`run`], with `panel` the call's panel.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<C: Columns, const M: usize>(panel: C, call: &Call) {
    let Call {
        inner,
        x,
        out,
        out_stride,
        ..
    } = *call;
    for k0 in (0..inner).step_by(KC) {
        let end = (k0 + KC).min(inner);
        let whole = k0 + (end - k0) / 8 * 8;
        let mut acc = [[_mm256_setzero_ps(); 2]; M];
        // SAFETY (all blocks): columns below `inner` of the panel's rows and of the `M` token
        // rows of `x` are readable; the output block is ours.
        for k in (k0..whole).step_by(8) {
            let x_k: [*const f32; M] = std::array::from_fn(|m| x.wrapping_add(m * inner + k));
            unsafe { panel.fma_eight(k, x_k, &mut acc) };
        }
        for k in whole..end {
            let column = unsafe { panel.one(k) };
            for (m, acc) in acc.iter_mut().enumerate() {
                let x_m = unsafe { _mm256_broadcast_ss(&*x.add(m * inner + k)) };
                for h in 0..2 {
                    acc[h] = _mm256_fmadd_ps(x_m, column[h], acc[h]);
                }
            }
        }
        for (m, acc) in acc.iter().enumerate() {
            for (h, &sum) in acc.iter().enumerate() {
                unsafe {
                    let out = out.add(m * out_stride + h * 8);
                    let total: __m256 = if k0 == 0 {
                        sum
                    } else {
                        _mm256_add_ps(_mm256_loadu_ps(out), sum)
                    };
                    _mm256_storeu_ps(out, total);
                }
            }
        }
    }
}
