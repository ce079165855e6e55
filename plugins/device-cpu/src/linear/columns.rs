//! AVX2 reads of a full panel of `w` ([`NR`] rows) as f32 columns: eight at a time, transposed and widened in registers, for packing tiles and for the one- and two-token kernel.
//!
//! A column `k` comes back as two 8-lane vectors, rows 0..8 and rows 8..16. f32 rows are
//! transposed as two 8×8 blocks of 4×4 in-lane transposes; f16/bf16 rows as 16-bit values
//! (one 8×8 transpose per 128-bit lane, both lanes at once) and widened afterwards, which
//! takes fewer shuffles than widening first.
//!
//! Reading prefetches twice over, since a panel is 16 interleaved streams, more than the
//! hardware prefetchers follow: each row a few cache lines ahead into L1, and the next panel
//! (the next `NR * K` elements, contiguous) into L2 as one sequential stream, a share per 8
//! columns so a full pass over the columns covers it. The sequential stream is what reaches
//! DRAM bandwidth: measured on a Zen 5 with one token and bf16 weights, it took a cold
//! 1024×3072 matrix from 260 to 170–200 µs on two threads.

use std::arch::x86_64::{
    __m128i, __m256, __m256i, _MM_HINT_T0, _MM_HINT_T1, _mm_loadu_ps, _mm_loadu_si128,
    _mm_prefetch, _mm256_blend_ps, _mm256_broadcast_ps, _mm256_broadcast_ss, _mm256_castpd_ps,
    _mm256_castps_pd, _mm256_castsi128_si256, _mm256_castsi256_ps, _mm256_castsi256_si128,
    _mm256_cvtph_ps, _mm256_extracti128_si256, _mm256_fmadd_ps, _mm256_inserti128_si256,
    _mm256_loadu_ps, _mm256_setzero_ps, _mm256_setzero_si256, _mm256_unpackhi_epi16,
    _mm256_unpackhi_epi32, _mm256_unpackhi_epi64, _mm256_unpackhi_pd, _mm256_unpackhi_ps,
    _mm256_unpacklo_epi16, _mm256_unpacklo_epi32, _mm256_unpacklo_epi64, _mm256_unpacklo_pd,
    _mm256_unpacklo_ps,
};

use super::tile::NR;
use crate::widen::bf16_to_f32;

/// How far ahead of the element being read each row is prefetched: four cache lines per row,
/// 4 KiB across a panel, about what one core's share of DRAM bandwidth times its latency
/// keeps in flight.
const PREFETCH_BYTES: usize = 256;

/// The [`NR`] rows of a full panel: `w` points at `w[first_row][0]`, rows are `inner`
/// elements apart, and columns are counted from 0. `E` is the stored element type.
#[derive(Clone, Copy)]
pub struct Panel<E> {
    pub w: *const E,
    pub inner: usize,
}

/// Eight columns: `[2j]` holds rows 0..8 of column `k + j`, `[2j + 1]` rows 8..16.
pub type Eight = [__m256; 16];

/// A panel whose columns can be read as f32.
pub trait Columns: Copy {
    /// Columns `k..k + 8`, prefetching ahead of them.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; columns `k..k + 8` of all [`NR`] rows are readable.
    unsafe fn eight(self, k: usize) -> Eight;

    /// Column `k` as rows 0..8 and 8..16.
    ///
    /// # Safety
    /// As [`Columns::eight`], for column `k` alone.
    unsafe fn one(self, k: usize) -> [__m256; 2];

    /// For `j` in `0..8` in order: `acc[m][h] = fma(x[m][j], rows 8h..8h + 8 of column k + j,
    /// acc[m][h])`, consuming columns in the order the transpose makes them, so few are live.
    ///
    /// # Safety
    /// As [`Columns::eight`], and each `x[m]` has 8 readable f32s.
    unsafe fn fma_eight<const M: usize>(
        self,
        k: usize,
        x: [*const f32; M],
        acc: &mut [[__m256; 2]; M],
    );
}

/// `acc[m] = fma(x[m][j], column, acc[m])` for every token.
///
/// # Safety
/// AVX2 and FMA; each `x[m]` has element `j`.
#[inline(always)]
unsafe fn fma_column<const M: usize>(
    x: [*const f32; M],
    j: usize,
    column: __m256,
    acc: &mut [[__m256; 2]; M],
    h: usize,
) {
    for m in 0..M {
        // SAFETY: the caller's bounds and features.
        unsafe {
            let x_m = _mm256_broadcast_ss(&*x[m].add(j));
            acc[m][h] = _mm256_fmadd_ps(x_m, column, acc[m][h]);
        }
    }
}

impl<E: Copy> Panel<E> {
    /// # Safety
    /// `r < NR` and column `k` is inside the panel's block.
    #[inline(always)]
    unsafe fn at(self, r: usize, k: usize) -> *const E {
        // SAFETY: the caller's bounds.
        unsafe { self.w.add(r * self.inner + k) }
    }

    /// Prefetches every row [`PREFETCH_BYTES`] past column `k`, once per cache line, and the
    /// share of the next panel that goes with columns `k..k + 8` (see the module docs).
    #[inline(always)]
    fn prefetch(self, k: usize) {
        if (k * size_of::<E>()).is_multiple_of(64) {
            for r in 0..NR {
                let target = self
                    .w
                    .wrapping_add(r * self.inner + k)
                    .wrapping_byte_add(PREFETCH_BYTES);
                // SAFETY: a prefetch never faults, wherever it points.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(target.cast::<i8>()) };
            }
        }
        // Every 8 columns take 8 * NR elements' worth of the next panel: 2 * size_of::<E>()
        // cache lines.
        let lines = 2 * size_of::<E>();
        let next = self
            .w
            .wrapping_add(NR * self.inner)
            .wrapping_byte_add(k / 8 * lines * 64);
        for line in 0..lines {
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(next.wrapping_byte_add(64 * line).cast::<i8>()) };
        }
    }

    /// Column `k` widened element by element.
    ///
    /// # Safety
    /// AVX2; column `k` of all rows is readable.
    #[inline(always)]
    unsafe fn gather(self, k: usize, widen: impl Fn(E) -> f32) -> [__m256; 2] {
        let mut lanes = [0.0f32; NR];
        for (r, lane) in lanes.iter_mut().enumerate() {
            // SAFETY: `r < NR`, column `k` (the caller's bounds).
            *lane = widen(unsafe { *self.at(r, k) });
        }
        // SAFETY: `lanes` holds 16 f32s.
        unsafe {
            [
                _mm256_loadu_ps(lanes.as_ptr()),
                _mm256_loadu_ps(lanes.as_ptr().add(8)),
            ]
        }
    }
}

/// `out[j]` holds element `j` of `r[0..4]`, in each 128-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose_4x4_lanes(r: [__m256; 4]) -> [__m256; 4] {
    let t0 = _mm256_castps_pd(_mm256_unpacklo_ps(r[0], r[1]));
    let t1 = _mm256_castps_pd(_mm256_unpackhi_ps(r[0], r[1]));
    let t2 = _mm256_castps_pd(_mm256_unpacklo_ps(r[2], r[3]));
    let t3 = _mm256_castps_pd(_mm256_unpackhi_ps(r[2], r[3]));
    [
        _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2)),
        _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2)),
        _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3)),
        _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3)),
    ]
}

/// `out[j]` holds 16-bit element `j` of `v[0..8]`, in each 128-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose_8x8_u16_lanes(v: [__m256i; 8]) -> [__m256i; 8] {
    let a0 = _mm256_unpacklo_epi16(v[0], v[1]);
    let a1 = _mm256_unpackhi_epi16(v[0], v[1]);
    let a2 = _mm256_unpacklo_epi16(v[2], v[3]);
    let a3 = _mm256_unpackhi_epi16(v[2], v[3]);
    let a4 = _mm256_unpacklo_epi16(v[4], v[5]);
    let a5 = _mm256_unpackhi_epi16(v[4], v[5]);
    let a6 = _mm256_unpacklo_epi16(v[6], v[7]);
    let a7 = _mm256_unpackhi_epi16(v[6], v[7]);
    // bJ: elements 2J and 2J + 1 of v[0..4] (b0..b3) or of v[4..8] (b4..b7).
    let b0 = _mm256_unpacklo_epi32(a0, a2);
    let b1 = _mm256_unpackhi_epi32(a0, a2);
    let b2 = _mm256_unpacklo_epi32(a1, a3);
    let b3 = _mm256_unpackhi_epi32(a1, a3);
    let b4 = _mm256_unpacklo_epi32(a4, a6);
    let b5 = _mm256_unpackhi_epi32(a4, a6);
    let b6 = _mm256_unpacklo_epi32(a5, a7);
    let b7 = _mm256_unpackhi_epi32(a5, a7);
    [
        _mm256_unpacklo_epi64(b0, b4),
        _mm256_unpackhi_epi64(b0, b4),
        _mm256_unpacklo_epi64(b1, b5),
        _mm256_unpackhi_epi64(b1, b5),
        _mm256_unpacklo_epi64(b2, b6),
        _mm256_unpackhi_epi64(b2, b6),
        _mm256_unpacklo_epi64(b3, b7),
        _mm256_unpackhi_epi64(b3, b7),
    ]
}

/// 16-bit columns `k..k + 8`: register `i` starts with row `low[i]` in its low lane and row
/// `high[i]` in its high lane; after the transpose register `j` holds column `k + j` of the
/// same rows in the same places.
///
/// # Safety
/// AVX2; columns `k..k + 8` of all rows are readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn columns_u16(
    panel: Panel<u16>,
    k: usize,
    low: [usize; 8],
    high: [usize; 8],
) -> [__m256i; 8] {
    panel.prefetch(k);
    let mut v = [_mm256_setzero_si256(); 8];
    for (i, v) in v.iter_mut().enumerate() {
        // SAFETY: 8 elements from column `k` of rows below `NR` (the caller's bounds).
        unsafe {
            let low = _mm_loadu_si128(panel.at(low[i], k).cast::<__m128i>());
            let high = _mm_loadu_si128(panel.at(high[i], k).cast::<__m128i>());
            *v = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(low), high);
        }
    }
    transpose_8x8_u16_lanes(v)
}

impl Panel<f32> {
    /// Columns `k..k + 8` of rows `8 * octet..8 * octet + 8`.
    ///
    /// # Safety
    /// As [`Columns::eight`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn octet(self, k: usize, octet: usize) -> [__m256; 8] {
        // Register `i` of `blocks[h]` holds columns `k + 4h..k + 4h + 4` of row
        // `8 * octet + i` in its low lane and of row `8 * octet + i + 4` in its high lane.
        let mut blocks = [[_mm256_setzero_ps(); 4]; 2];
        for (half, block) in blocks.iter_mut().enumerate() {
            for (i, rows) in block.iter_mut().enumerate() {
                // SAFETY: 4 elements from column `k + 4 * half` of rows below `NR`.
                unsafe {
                    let low = _mm_loadu_ps(self.at(8 * octet + i, k + 4 * half));
                    let high = _mm_loadu_ps(self.at(8 * octet + i + 4, k + 4 * half));
                    *rows = _mm256_blend_ps::<0xF0>(
                        _mm256_broadcast_ps(&low),
                        _mm256_broadcast_ps(&high),
                    );
                }
            }
        }
        let (first, second) = (
            transpose_4x4_lanes(blocks[0]),
            transpose_4x4_lanes(blocks[1]),
        );
        [
            first[0], first[1], first[2], first[3], second[0], second[1], second[2], second[3],
        ]
    }
}

impl Columns for Panel<f32> {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn eight(self, k: usize) -> Eight {
        self.prefetch(k);
        let mut out = [_mm256_setzero_ps(); 16];
        for octet in [0, 1] {
            // SAFETY: the caller's contract.
            for (j, column) in unsafe { self.octet(k, octet) }.into_iter().enumerate() {
                out[2 * j + octet] = column;
            }
        }
        out
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn one(self, k: usize) -> [__m256; 2] {
        // SAFETY: the caller's contract.
        unsafe { self.gather(k, |v| v) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fma_eight<const M: usize>(
        self,
        k: usize,
        x: [*const f32; M],
        acc: &mut [[__m256; 2]; M],
    ) {
        self.prefetch(k);
        for octet in [0, 1] {
            // SAFETY: the caller's contract.
            let columns = unsafe { self.octet(k, octet) };
            for (j, column) in columns.into_iter().enumerate() {
                // SAFETY: as above.
                unsafe { fma_column(x, j, column, acc, octet) };
            }
        }
    }
}

/// Interleaving 16-bit values with zeros widens bf16 to f32, within each 128-bit lane: rows
/// placed so in the registers of [`columns_u16`], the low halves come out as rows 0..8 and
/// the high as 8..16.
const BF16_LOW: [usize; 8] = [0, 1, 2, 3, 8, 9, 10, 11];
const BF16_HIGH: [usize; 8] = [4, 5, 6, 7, 12, 13, 14, 15];

/// f16 rows in natural order: each column's low lane converts to rows 0..8, its high to 8..16.
const F16_LOW: [usize; 8] = [0, 1, 2, 3, 4, 5, 6, 7];
const F16_HIGH: [usize; 8] = [8, 9, 10, 11, 12, 13, 14, 15];

/// A panel of bf16 bits.
#[derive(Clone, Copy)]
pub struct Bf16(pub Panel<u16>);

impl Columns for Bf16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn eight(self, k: usize) -> Eight {
        let zero = _mm256_setzero_si256();
        // SAFETY: the caller's contract.
        let columns = unsafe { columns_u16(self.0, k, BF16_LOW, BF16_HIGH) };
        let mut out = [_mm256_setzero_ps(); 16];
        for (j, column) in columns.into_iter().enumerate() {
            out[2 * j] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, column));
            out[2 * j + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, column));
        }
        out
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn one(self, k: usize) -> [__m256; 2] {
        // SAFETY: the caller's contract.
        unsafe { self.0.gather(k, bf16_to_f32) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fma_eight<const M: usize>(
        self,
        k: usize,
        x: [*const f32; M],
        acc: &mut [[__m256; 2]; M],
    ) {
        let zero = _mm256_setzero_si256();
        // SAFETY: the caller's contract.
        let columns = unsafe { columns_u16(self.0, k, BF16_LOW, BF16_HIGH) };
        for (j, column) in columns.into_iter().enumerate() {
            let low = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, column));
            let high = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, column));
            // SAFETY: as above.
            unsafe {
                fma_column(x, j, low, acc, 0);
                fma_column(x, j, high, acc, 1);
            }
        }
    }
}

/// A panel of f16 bits.
#[derive(Clone, Copy)]
pub struct F16(pub Panel<u16>);

impl Columns for F16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn eight(self, k: usize) -> Eight {
        // SAFETY: the caller's contract.
        let columns = unsafe { columns_u16(self.0, k, F16_LOW, F16_HIGH) };
        let mut out = [_mm256_setzero_ps(); 16];
        for (j, column) in columns.into_iter().enumerate() {
            out[2 * j] = _mm256_cvtph_ps(_mm256_castsi256_si128(column));
            out[2 * j + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(column));
        }
        out
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn one(self, k: usize) -> [__m256; 2] {
        // SAFETY: the caller's contract.
        unsafe { self.0.gather(k, |b| half::f16::from_bits(b).to_f32()) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fma_eight<const M: usize>(
        self,
        k: usize,
        x: [*const f32; M],
        acc: &mut [[__m256; 2]; M],
    ) {
        // SAFETY: the caller's contract.
        let columns = unsafe { columns_u16(self.0, k, F16_LOW, F16_HIGH) };
        for (j, column) in columns.into_iter().enumerate() {
            let low = _mm256_cvtph_ps(_mm256_castsi256_si128(column));
            let high = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(column));
            // SAFETY: as above.
            unsafe {
                fma_column(x, j, low, acc, 0);
                fma_column(x, j, high, acc, 1);
            }
        }
    }
}
