//! AVX-512 tiles: up to [`MR`] tokens by [`NR`] outputs as 16-lane dot products, bf16 weights
//! through `vdpbf16ps`, f32 and f16 weights through FMAs.
//!
//! Lane `l` of an output's accumulator takes the products at `k ≡ l` (mod 16; for bf16, the
//! pairs at `k ≡ 2l, 2l + 1` mod 32) in `k` order, the tail masked to zeros, and
//! [`reduce`] adds the lanes in one fixed tree. The instruction sequence of an output element
//! does not depend on `M`, on the other outputs of its tile or on where its token sits, which
//! is what keeps `linear` batch-invariant.

use std::arch::x86_64::{
    __m256bh, __m512, __m512bh, __m512i, __mmask16, __mmask32, _mm256_loadu_si256,
    _mm256_mask_storeu_epi16, _mm256_maskz_loadu_epi16, _mm512_castsi512_ps, _mm512_cvtepu16_epi32,
    _mm512_cvtneps_pbh, _mm512_cvtph_ps, _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_loadu_ps,
    _mm512_loadu_si512, _mm512_maskz_loadu_epi16, _mm512_maskz_loadu_ps, _mm512_setzero_ps,
    _mm512_slli_epi32,
};

use super::{Bf16Bits, F16Bits, NR};
use crate::vector::avx512::reduce;
use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};

/// Tokens per tile: `MR × NR` = 24 accumulators, `MR` activation vectors and one weight
/// vector fill 29 of the 32 zmm registers.
pub const MR: usize = 4;

/// One tile: token rows `x`, `x + x_stride`, … against weight rows `w[0..NR]`, each `inner`
/// long; `out[m * out_stride + j]` for `j < columns` receives output `j` of token `m`.
#[derive(Clone, Copy)]
pub struct Tile<X, W> {
    pub x: *const X,
    pub x_stride: usize,
    pub w: [*const W; NR],
    pub inner: usize,
    pub out: *mut f32,
    pub out_stride: usize,
    pub columns: usize,
    /// Hint the next panel's rows into L1 while a tile of several tokens runs: set when the
    /// launch reads each panel once, so its weights come from memory. (A tile of one token
    /// reads its rows one after the other, one stream the hardware prefetcher follows.)
    pub prefetch_next_panel: bool,
    /// A tile of one token also hints each row's line some kilobytes on (see
    /// [`super::RowPrefetch`]).
    pub prefetch_row_ahead: bool,
}

/// # Safety
/// The CPU has isa level `avx512_bf16`; every pointer of `tile` covers `inner` elements (`M` token rows);
/// the output block is valid and touched by no other thread.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
pub unsafe fn bf16<const M: usize>(tile: &Tile<u16, u16>) {
    if M == 1 {
        // One token reads each weight row once: row after row is one stream from memory,
        // which the hardware prefetcher follows better than `NR` streams side by side.
        for j in 0..tile.columns {
            // SAFETY: the contract, for row `j` and its output.
            unsafe {
                *tile.out.add(j) = if tile.prefetch_row_ahead {
                    bf16_row::<true>(tile.x, tile.w[j], tile.inner)
                } else {
                    bf16_row::<false>(tile.x, tile.w[j], tile.inner)
                }
            };
        }
        return;
    }
    let Tile {
        x,
        x_stride,
        w,
        inner,
        ..
    } = *tile;
    // SAFETY: at every call `p` starts 32 readable elements (the caller's contract).
    let load = |p: *const u16| unsafe { bf16_lanes(p) };
    let mut acc = [[_mm512_setzero_ps(); NR]; M];
    let whole = inner / 32 * 32;
    let mut k = 0;
    while k < whole {
        // SAFETY (this loop): `k + 32 <= inner`.
        let xv: [__m512bh; M] = std::array::from_fn(|m| load(x.wrapping_add(m * x_stride + k)));
        for j in 0..NR {
            if tile.prefetch_next_panel {
                // The next panel's rows follow this one's in memory; without the hint decode
                // stalls on them at the start of every panel instead of streaming them while
                // it computes.
                _mm_prefetch::<_MM_HINT_T0>(w[j].wrapping_add(k + NR * inner).cast());
            }
            let wv = load(w[j].wrapping_add(k));
            for m in 0..M {
                acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv[m], wv);
            }
        }
        k += 32;
    }
    if whole < inner {
        let mask: __mmask32 = (1u32 << (inner - whole)) - 1;
        // SAFETY: at every call the masked lanes are the `inner - whole` elements left in the row.
        let load = |p: *const u16| unsafe { bf16_lanes_masked(p, mask) };
        let xv: [__m512bh; M] = std::array::from_fn(|m| load(x.wrapping_add(m * x_stride + k)));
        for j in 0..NR {
            let wv = load(w[j].wrapping_add(k));
            for m in 0..M {
                acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv[m], wv);
            }
        }
    }
    // SAFETY: the output block of the contract.
    unsafe { store::<M>(&acc, tile.out, tile.out_stride, tile.columns) };
}

/// The 32 bf16 at `p`.
///
/// # Safety
/// `p` starts 32 readable elements; the CPU has isa level `avx512_bf16`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn bf16_lanes(p: *const u16) -> __m512bh {
    // SAFETY: the caller's contract.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.cast())) }
}

/// The 32 bf16 at `p` whose bits `mask` sets, zeros elsewhere.
///
/// # Safety
/// The elements `mask` selects are readable; the CPU has isa level `avx512_bf16`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn bf16_lanes_masked(p: *const u16, mask: __mmask32) -> __m512bh {
    // SAFETY: the caller's contract; masked-off lanes are not read.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(mask, p.cast())) }
}

/// Weights that widen to f32 sixteen at a time.
pub trait Wide: Copy {
    /// # Safety
    /// `p` starts 16 readable elements; the CPU has isa level `avx512`.
    unsafe fn load(p: *const Self) -> __m512;
    /// # Safety
    /// `p` starts as many readable elements as `mask` has bits set, from bit 0; the CPU has
    /// isa level `avx512`.
    unsafe fn load_masked(p: *const Self, mask: __mmask16) -> __m512;
}

impl Wide for f32 {
    /// # Safety
    /// As [`Wide::load`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: the trait's contract.
        unsafe { _mm512_loadu_ps(p) }
    }
    /// # Safety
    /// As [`Wide::load_masked`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_masked(p: *const f32, mask: __mmask16) -> __m512 {
        // SAFETY: the trait's contract.
        unsafe { _mm512_maskz_loadu_ps(mask, p) }
    }
}

impl Wide for Bf16Bits {
    /// # Safety
    /// As [`Wide::load`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load(p: *const Bf16Bits) -> __m512 {
        // SAFETY: the trait's contract. bf16 is the top half of an f32.
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            )))
        }
    }
    /// # Safety
    /// As [`Wide::load_masked`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_masked(p: *const Bf16Bits, mask: __mmask16) -> __m512 {
        // SAFETY: the trait's contract.
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_maskz_loadu_epi16(mask, p.cast()),
            )))
        }
    }
}

impl Wide for F16Bits {
    /// # Safety
    /// As [`Wide::load`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load(p: *const F16Bits) -> __m512 {
        // SAFETY: the trait's contract.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    /// # Safety
    /// As [`Wide::load_masked`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_masked(p: *const F16Bits, mask: __mmask16) -> __m512 {
        // SAFETY: the trait's contract.
        unsafe { _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.cast())) }
    }
}

/// # Safety
/// As [`bf16`].
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
pub unsafe fn wide<W: Wide, const M: usize>(tile: &Tile<f32, W>) {
    if M == 1 {
        // As in `bf16`: one stream, with the same hints.
        for j in 0..tile.columns {
            // SAFETY: the contract, for row `j` and its output.
            unsafe {
                *tile.out.add(j) = if tile.prefetch_row_ahead {
                    wide_row::<W, true>(tile.x, tile.w[j], tile.inner)
                } else {
                    wide_row::<W, false>(tile.x, tile.w[j], tile.inner)
                }
            };
        }
        return;
    }
    let Tile {
        x,
        x_stride,
        w,
        inner,
        ..
    } = *tile;
    let mut acc = [[_mm512_setzero_ps(); NR]; M];
    let whole = inner / 16 * 16;
    let mut k = 0;
    // Full steps stay below `whole`, the tail is masked to the row.
    while k < whole {
        let xv: [__m512; M] = std::array::from_fn(|m| {
            // SAFETY: row `m` of `x` has `inner` elements, and `k + 16 <= whole <= inner`.
            unsafe { _mm512_loadu_ps(x.wrapping_add(m * x_stride + k)) }
        });
        for j in 0..NR {
            if tile.prefetch_next_panel && k % 32 == 0 {
                _mm_prefetch::<_MM_HINT_T0>(w[j].wrapping_add(k + NR * inner).cast());
            }
            // SAFETY: row `j` has `inner` elements, and `k + 16 <= inner`; the CPU has AVX-512.
            let wv = unsafe { W::load(w[j].wrapping_add(k)) };
            for m in 0..M {
                acc[m][j] = _mm512_fmadd_ps(xv[m], wv, acc[m][j]);
            }
        }
        k += 16;
    }
    if whole < inner {
        let mask: __mmask16 = ((1u32 << (inner - whole)) - 1) as __mmask16;
        let xv: [__m512; M] = std::array::from_fn(|m| {
            // SAFETY: the mask covers the `inner - whole` elements left in row `m`.
            unsafe { _mm512_maskz_loadu_ps(mask, x.wrapping_add(m * x_stride + k)) }
        });
        for j in 0..NR {
            // SAFETY: the mask covers the `inner - whole` elements left in row `j`.
            let wv = unsafe { W::load_masked(w[j].wrapping_add(k), mask) };
            for m in 0..M {
                acc[m][j] = _mm512_fmadd_ps(xv[m], wv, acc[m][j]);
            }
        }
    }
    // SAFETY: the output block of the contract.
    unsafe { store::<M>(&acc, tile.out, tile.out_stride, tile.columns) };
}

/// One output of a one-token [`bf16`] tile: the instructions of an output of the tile, one
/// 16-lane accumulator over `k` in order, the tail masked, then [`reduce`]; with `AHEAD`,
/// each step (64 bytes) also hints the line [`super::hint_row_ahead`] asks for.
///
/// # Safety
/// As [`bf16`], for the token row `x` and the weight row `w`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
unsafe fn bf16_row<const AHEAD: bool>(x: *const u16, w: *const u16, inner: usize) -> f32 {
    // SAFETY: at every call `p` starts 32 readable elements (the caller's contract).
    let load = |p: *const u16| unsafe { bf16_lanes(p) };
    let mut acc = _mm512_setzero_ps();
    let whole = inner / 32 * 32;
    let mut k = 0;
    while k < whole {
        if AHEAD {
            super::hint_row_ahead(w.wrapping_add(k));
        }
        // SAFETY (this loop): `k + 32 <= inner`.
        acc = _mm512_dpbf16_ps(acc, load(x.wrapping_add(k)), load(w.wrapping_add(k)));
        k += 32;
    }
    if whole < inner {
        let mask: __mmask32 = (1u32 << (inner - whole)) - 1;
        // SAFETY: at every call the masked lanes are the `inner - whole` elements left in the row.
        let load = |p: *const u16| unsafe { bf16_lanes_masked(p, mask) };
        acc = _mm512_dpbf16_ps(acc, load(x.wrapping_add(k)), load(w.wrapping_add(k)));
    }
    reduce(acc)
}

/// One output of a one-token [`wide`] tile, by the instructions of an output of the tile;
/// with `AHEAD`, each 64 bytes of the row also hint the line [`super::hint_row_ahead`] asks
/// for.
///
/// # Safety
/// As [`wide`], for the token row `x` and the weight row `w`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
unsafe fn wide_row<W: Wide, const AHEAD: bool>(x: *const f32, w: *const W, inner: usize) -> f32 {
    let mut acc = _mm512_setzero_ps();
    let whole = inner / 16 * 16;
    let mut k = 0;
    // Elements of `W` in one 64-byte line.
    let line = 64 / std::mem::size_of::<W>();
    while k < whole {
        if AHEAD && k.is_multiple_of(line) {
            super::hint_row_ahead(w.wrapping_add(k));
        }
        // SAFETY: both rows have `inner` elements, and `k + 16 <= inner`.
        acc = unsafe {
            _mm512_fmadd_ps(
                _mm512_loadu_ps(x.wrapping_add(k)),
                W::load(w.wrapping_add(k)),
                acc,
            )
        };
        k += 16;
    }
    if whole < inner {
        let mask: __mmask16 = ((1u32 << (inner - whole)) - 1) as __mmask16;
        // SAFETY: the mask covers the `inner - whole` elements left in each row.
        acc = unsafe {
            _mm512_fmadd_ps(
                _mm512_maskz_loadu_ps(mask, x.wrapping_add(k)),
                W::load_masked(w.wrapping_add(k), mask),
                acc,
            )
        };
    }
    reduce(acc)
}

/// # Safety
/// `out` has `M` rows of `columns` writable f32s, `out_stride` apart.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn store<const M: usize>(
    acc: &[[__m512; NR]; M],
    out: *mut f32,
    out_stride: usize,
    columns: usize,
) {
    for (m, row) in acc.iter().enumerate() {
        for (j, &sum) in row.iter().enumerate().take(columns) {
            // SAFETY: the contract.
            unsafe { *out.add(m * out_stride + j) = reduce(sum) };
        }
    }
}

/// `bits[i] = bf16(x[i])`, rounding to nearest even, for one row; the same instructions for
/// every element whatever the row's length, so a token's rounding does not depend on its batch.
///
/// # Safety
/// The CPU has isa level `avx512_bf16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn round_row_to_bf16(x: &[f32], bits: &mut [u16]) {
    assert_eq!(x.len(), bits.len());
    for (x, bits) in x.chunks(16).zip(bits.chunks_mut(16)) {
        let mask: __mmask16 = ((1u32 << x.len()) - 1) as __mmask16;
        // SAFETY: `mask` covers the chunk's elements only.
        unsafe {
            let rounded: __m256bh = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x.as_ptr()));
            _mm256_mask_storeu_epi16(
                bits.as_mut_ptr().cast(),
                mask,
                std::mem::transmute::<__m256bh, std::arch::x86_64::__m256i>(rounded),
            );
        }
    }
}
