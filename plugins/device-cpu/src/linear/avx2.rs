//! AVX2 tiles: up to [`MR`] tokens by [`NR`] outputs as 8-lane dot products over weights
//! widened to f32.
//!
//! Lane `l` of an output's accumulator takes the products at `k ≡ l` (mod 8) in `k` order;
//! the last `K mod 8` columns go through zero-padded copies; [`reduce`] adds the lanes in one
//! fixed tree. As on AVX-512, an output element's instructions do not depend on its batch.

use std::arch::x86_64::{
    __m256, _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_loadu_si128, _mm_movehl_ps, _mm_shuffle_ps,
    _mm256_castps256_ps128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
    _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_setzero_ps,
    _mm256_setzero_si256, _mm256_slli_epi32, _mm256_unpackhi_epi16, _mm256_unpacklo_epi16,
};

use super::{Bf16Bits, F16Bits, NR};

/// Tokens per tile: 12 accumulators, two activation vectors and one weight vector fill 15 of
/// the 16 ymm registers.
pub const MR: usize = 2;

/// One tile, as in the AVX-512 module: `M` token rows of `x` (`x_stride` apart) against the
/// weight rows `w[0..NR]`, into `columns` outputs per token.
#[derive(Clone, Copy)]
pub struct Tile<W> {
    pub x: *const f32,
    pub x_stride: usize,
    pub w: [*const W; NR],
    pub inner: usize,
    pub out: *mut f32,
    pub out_stride: usize,
    pub columns: usize,
    /// A [`wide`] tile of one token also hints each row's line some kilobytes on (see
    /// [`super::RowPrefetch`]).
    pub prefetch_row_ahead: bool,
}

/// Weights that widen to f32 eight at a time.
pub trait Wide: Copy {
    /// # Safety
    /// `p` starts 8 readable elements; the CPU has isa level `avx2`.
    unsafe fn load(p: *const Self) -> __m256;
    fn to_f32(self) -> f32;
}

impl Wide for f32 {
    /// # Safety
    /// As [`Wide::load`].
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: the trait's contract.
        unsafe { _mm256_loadu_ps(p) }
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Wide for Bf16Bits {
    /// # Safety
    /// As [`Wide::load`].
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load(p: *const Bf16Bits) -> __m256 {
        // SAFETY: the trait's contract. bf16 is the top half of an f32.
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p.cast()),
            )))
        }
    }
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
}

impl Wide for F16Bits {
    /// # Safety
    /// As [`Wide::load`].
    #[inline]
    #[target_feature(enable = "avx,f16c")]
    unsafe fn load(p: *const F16Bits) -> __m256 {
        // SAFETY: the trait's contract.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
}

/// The 8 lanes of `v` added halves first, then pairs: always the same tree.
#[inline]
#[target_feature(enable = "avx")]
pub(crate) fn reduce(v: __m256) -> f32 {
    let four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps::<1>(two, two)))
}

/// # Safety
/// The CPU has isa level `avx2`; every pointer of `tile` covers `inner` elements (`M` token rows);
/// the output block is valid and touched by no other thread.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn wide<W: Wide, const M: usize>(tile: &Tile<W>) {
    if M == 1 {
        // One row after the other: the panel's rows lie end to end, so decode reads the panel
        // front to back as one stream, which the hardware prefetcher follows far better than
        // six short streams side by side.
        for j in 0..tile.columns {
            // SAFETY: the contract, for row `j`.
            unsafe {
                if tile.prefetch_row_ahead {
                    rows::<W, M, 1, true>(tile, j)
                } else {
                    rows::<W, M, 1, false>(tile, j)
                }
            };
        }
    } else {
        // SAFETY: the contract.
        unsafe { rows::<W, M, NR, false>(tile, 0) };
    }
}

/// Outputs `j0..j0 + R` of the tile (those below `tile.columns` stored), by the same
/// instructions for every `M` and `R`; with `AHEAD`, each 64 bytes of a row also hint the
/// line [`super::hint_row_ahead`] asks for.
///
/// # Safety
/// As [`wide`], and `j0 + R <= NR`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows<W: Wide, const M: usize, const R: usize, const AHEAD: bool>(
    tile: &Tile<W>,
    j0: usize,
) {
    let w: [*const W; R] = std::array::from_fn(|j| tile.w[j0 + j]);
    // SAFETY: the contract.
    unsafe { finish::<W, M, R, AHEAD>(tile, j0, w, 0, [[_mm256_setzero_ps(); R]; M]) }
}

/// Takes `acc` (rows `j0..j0 + R`, columns before `k`) through the remaining 8-column steps and
/// the zero-padded tail, then stores the sums.
///
/// # Safety
/// As [`rows`]; `w` are the tile's rows from `j0`, and `k` is a multiple of 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn finish<W: Wide, const M: usize, const R: usize, const AHEAD: bool>(
    tile: &Tile<W>,
    j0: usize,
    w: [*const W; R],
    mut k: usize,
    mut acc: [[__m256; R]; M],
) {
    let Tile {
        x, x_stride, inner, ..
    } = *tile;
    let whole = inner / 8 * 8;
    // Elements of `W` in one 64-byte line.
    let line = 64 / std::mem::size_of::<W>();
    // Full steps stay below `whole`; the tail reads only the row's rest.
    while k < whole {
        if AHEAD && k.is_multiple_of(line) {
            for row in w {
                super::hint_row_ahead(row.wrapping_add(k));
            }
        }
        let xv: [__m256; M] = std::array::from_fn(|m| {
            // SAFETY: row `m` of `x` has `inner` elements, and `k + 8 <= whole <= inner`.
            unsafe { _mm256_loadu_ps(x.wrapping_add(m * x_stride + k)) }
        });
        for j in 0..R {
            // SAFETY: row `j` has `inner` elements, and `k + 8 <= inner`; the CPU has AVX2.
            let wv = unsafe { W::load(w[j].wrapping_add(k)) };
            for m in 0..M {
                acc[m][j] = _mm256_fmadd_ps(xv[m], wv, acc[m][j]);
            }
        }
        k += 8;
    }
    if whole < inner {
        let rest = inner - whole;
        let padded = |read: &dyn Fn(usize) -> f32| -> __m256 {
            let mut lanes = [0.0f32; 8];
            for (i, lane) in lanes.iter_mut().enumerate().take(rest) {
                *lane = read(i);
            }
            // SAFETY: `lanes` holds the 8 elements loaded.
            unsafe { _mm256_loadu_ps(lanes.as_ptr()) }
        };
        let xv: [__m256; M] = std::array::from_fn(|m| {
            padded(&|i| {
                // SAFETY: `whole + i < inner`, inside row `m`.
                unsafe { *x.add(m * x_stride + whole + i) }
            })
        });
        for j in 0..R {
            let wv = padded(&|i| {
                // SAFETY: `whole + i < inner`, inside row `j`.
                unsafe { (*w[j].add(whole + i)).to_f32() }
            });
            for m in 0..M {
                acc[m][j] = _mm256_fmadd_ps(xv[m], wv, acc[m][j]);
            }
        }
    }
    for (m, row) in acc.iter().enumerate() {
        for (j, &sum) in row.iter().enumerate() {
            if j0 + j < tile.columns {
                // SAFETY: the output block of the contract.
                unsafe { *tile.out.add(m * tile.out_stride + j0 + j) = reduce(sum) };
            }
        }
    }
}

/// Where [`bf16`] wants the activations of each 16-column block: the order in which unpacking
/// a 32-byte load of bf16 weights against zeros widens them (columns 0–3 and 8–11 from the low
/// halves of the two 128-bit lanes, then 4–7 and 12–15). The last `K mod 16` columns keep
/// their place.
pub fn order_for_bf16(row: &[f32], ordered: &mut [f32]) {
    let mut blocks = row.chunks_exact(16);
    let mut out = ordered.chunks_exact_mut(16);
    for (block, out) in (&mut blocks).zip(&mut out) {
        out[..4].copy_from_slice(&block[..4]);
        out[4..8].copy_from_slice(&block[8..12]);
        out[8..12].copy_from_slice(&block[4..8]);
        out[12..].copy_from_slice(&block[12..]);
    }
    out.into_remainder().copy_from_slice(blocks.remainder());
}

/// bf16 weights widened by unpacking against zeros (bf16 is the top half of an f32): one
/// shuffle per eight weights, where [`Wide`] spends a zero-extension and a shift. `tile.x`
/// holds the activations in the order of [`order_for_bf16`]. Rows are read one after the
/// other for one token, as in [`wide`], and three at a time for two: with six, the unpacked
/// weights and the zero vector no longer fit in the registers beside the accumulators.
///
/// # Safety
/// As [`wide`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn bf16<const M: usize>(tile: &Tile<Bf16Bits>) {
    if M == 1 {
        for j in 0..tile.columns {
            // SAFETY: the contract, for row `j`.
            unsafe { bf16_rows::<M, 1>(tile, j) };
        }
    } else {
        for j0 in (0..NR).step_by(NR / 2) {
            // SAFETY: the contract, for rows `j0..j0 + NR / 2`.
            unsafe { bf16_rows::<M, { NR / 2 }>(tile, j0) };
        }
    }
}

/// Outputs `j0..j0 + R` of a [`bf16`] tile, by the same instructions for every `M` and `R`:
/// lane `l` of an output's accumulator takes, per 16-column block, the columns its lane holds
/// in the low then the high unpacked half; the last `K mod 16` columns go as in [`wide`].
///
/// # Safety
/// As [`wide`], and `j0 + R <= NR`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bf16_rows<const M: usize, const R: usize>(tile: &Tile<Bf16Bits>, j0: usize) {
    let Tile {
        x,
        x_stride,
        w,
        inner,
        ..
    } = *tile;
    let w: [*const Bf16Bits; R] = std::array::from_fn(|j| w[j0 + j]);
    let zero = _mm256_setzero_si256();
    let mut acc = [[_mm256_setzero_ps(); R]; M];
    let blocks = inner / 16 * 16;
    let mut k = 0;
    // Full blocks stay below `blocks`.
    while k < blocks {
        // The low halves, then the high ones: the weights are loaded again for the second
        // pass (from L1) so six rows' widened halves need not all be held in registers.
        for high in [false, true] {
            let at = k + if high { 8 } else { 0 };
            let xv: [__m256; M] = std::array::from_fn(|m| {
                // SAFETY: `at + 8 <= k + 16 <= blocks <= inner`, inside row `m` of `x`.
                unsafe { _mm256_loadu_ps(x.wrapping_add(m * x_stride + at)) }
            });
            for j in 0..R {
                // SAFETY: `k + 16 <= inner`, inside row `j`: 16 bf16 weights, 32 bytes.
                let v = unsafe { _mm256_loadu_si256(w[j].wrapping_add(k).cast()) };
                let wv = _mm256_castsi256_ps(if high {
                    _mm256_unpackhi_epi16(zero, v)
                } else {
                    _mm256_unpacklo_epi16(zero, v)
                });
                for m in 0..M {
                    acc[m][j] = _mm256_fmadd_ps(xv[m], wv, acc[m][j]);
                }
            }
        }
        k += 16;
    }
    // SAFETY: the contract; `k` is a multiple of 16.
    unsafe { finish::<Bf16Bits, M, R, false>(tile, j0, w, k, acc) }
}
