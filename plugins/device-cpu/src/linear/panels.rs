//! bf16 weights in panels: the CPU device's own arrangement of a `[N, K]` weight matrix for the AVX2 tiles, [`ROWS`] rows at a time stored column by column, and those tiles.
//!
//! A panel is `ROWS` consecutive weight rows stored as `[K][ROWS]`: the `ROWS` weights that
//! multiply activation column `k` lie side by side, in the order unpacking a 32-byte load
//! against zeros widens them (see [`position`]). So one token reads each panel front to back
//! as one stream, and a tile broadcasts one activation per column against 16 outputs at a
//! time: every output is one FMA chain over `k` in order, held in one lane, with no
//! horizontal reduction. That sequence does not depend on which tile, token group or thread
//! computes the output, so results stay batch-invariant.
//!
//! The arrangement is made in place, a panel at a time, the first time a linear launch reads
//! the buffer (see [`arrangement`]), and undone before the host reads or writes it again.

use std::arch::x86_64::{
    _MM_HINT_T0, _mm_prefetch, _mm256_broadcast_ss, _mm256_castsi256_ps, _mm256_fmadd_ps,
    _mm256_loadu_si256, _mm256_setzero_ps, _mm256_setzero_si256, _mm256_storeu_ps,
    _mm256_unpackhi_epi16, _mm256_unpacklo_epi16,
};

use super::Bf16Bits;

/// Weight rows per panel: one 64-byte line per column.
pub const ROWS: usize = 32;

/// Columns (64-byte lines) ahead of the one being read that a one-token tile asks for when
/// the hardware prefetcher leads the stream ([`RowPrefetch::Hardware`]).
///
/// [`RowPrefetch::Hardware`]: super::RowPrefetch::Hardware
const STREAM_AHEAD: usize = 8;

/// Columns ahead a one-token tile asks for under [`RowPrefetch::Software`], the distance of
/// the rows ([`super::ROW_AHEAD_BYTES`]): on an Intel Xeon a SmolLM2 step at
/// `bf16_products=f32` served 1.2× faster than at [`STREAM_AHEAD`] (24 columns was half way).
///
/// [`RowPrefetch::Software`]: super::RowPrefetch::Software
const STREAM_FAR_AHEAD: usize = super::ROW_AHEAD_BYTES / 64;

/// Tokens per tile.
pub const MR: usize = 4;

/// Marks an arrangement code as panels of this module; the low 32 bits hold `K`.
const KIND: u64 = 0x7050 << 48;

/// The arrangement code for a `[N, K]` matrix in panels, when it can be arranged so: `N` a
/// multiple of [`ROWS`] (the panels fill the buffer exactly) and `K` small enough to encode.
pub fn arrangement(outputs: usize, inner: usize) -> Option<u64> {
    let inner = u32::try_from(inner).ok()?;
    (outputs.is_multiple_of(ROWS) && inner > 0).then_some(KIND | u64::from(inner))
}

/// The `K` of an arrangement code made by [`arrangement`].
pub fn inner_of(arrangement: u64) -> Option<usize> {
    (arrangement & !u64::from(u32::MAX) == KIND)
        .then_some((arrangement & u64::from(u32::MAX)) as usize)
}

/// Where row `j` of a panel (`j < ROWS`) sits among a column's `ROWS` weights: within each
/// 16, rows 4–7 and 8–11 swap places, so that unpacking the low halves of a 32-byte load
/// gives rows 0–7 in order and the high halves rows 8–15.
pub fn position(j: usize) -> usize {
    let quarter = (j / 4) % 4;
    let swapped = match quarter {
        1 => 2,
        2 => 1,
        other => other,
    };
    (j / 16) * 16 + swapped * 4 + j % 4
}

/// Element `[row, k]` of a `[N, K]` matrix stored in panels.
pub fn index(row: usize, k: usize, inner: usize) -> usize {
    (row / ROWS) * ROWS * inner + k * ROWS + position(row % ROWS)
}

/// Rearranges whole panels of row-major bits (`bits.len()` a multiple of `ROWS * inner`) into
/// panels, in place; `scratch` is reused.
pub fn arrange(bits: &mut [u16], inner: usize, scratch: &mut Vec<u16>) {
    for panel in bits.chunks_exact_mut(ROWS * inner) {
        scratch.clear();
        scratch.extend_from_slice(panel);
        for (j, row) in scratch.chunks_exact(inner).enumerate() {
            let at = position(j);
            for (k, &value) in row.iter().enumerate() {
                panel[k * ROWS + at] = value;
            }
        }
    }
}

/// Undoes [`arrange`].
pub fn restore(bits: &mut [u16], inner: usize, scratch: &mut Vec<u16>) {
    for panel in bits.chunks_exact_mut(ROWS * inner) {
        scratch.clear();
        scratch.extend_from_slice(panel);
        for (j, row) in panel.chunks_exact_mut(inner).enumerate() {
            let at = position(j);
            for (k, value) in row.iter_mut().enumerate() {
                *value = scratch[k * ROWS + at];
            }
        }
    }
}

/// One tile: `M` token rows of `x` (`x_stride` apart) against one panel, into its `ROWS`
/// outputs per token of `out` (`out_stride` apart).
#[derive(Clone, Copy)]
pub struct Tile {
    pub x: *const f32,
    pub x_stride: usize,
    /// The panel's first element.
    pub w: *const Bf16Bits,
    pub inner: usize,
    pub out: *mut f32,
    pub out_stride: usize,
    /// Whether to fetch the next panel in memory into cache, a line per column: a tile of
    /// several tokens spends longer computing than streaming its panel, so the next panel's
    /// reads hide behind this one's arithmetic. (A lone token streams at memory speed and
    /// asks a few lines ahead instead.)
    pub prefetch_next: bool,
    /// Whether a lone token asks [`STREAM_FAR_AHEAD`] columns ahead rather than
    /// [`STREAM_AHEAD`] (see [`super::RowPrefetch`]).
    pub far_ahead: bool,
}

/// # Safety
/// The CPU has AVX2 and FMA; `tile.x` covers `M` rows of `inner` activations, `tile.w` a whole
/// panel, and the output block is valid and touched by no other thread.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn tile<const M: usize>(tile: &Tile) {
    if M == 1 {
        // Both halves of the panel at once: four FMA chains and one stream of whole lines.
        // SAFETY: the contract.
        unsafe { halves::<M, 2, false>(tile, 0) }
    } else {
        // Eight accumulators, a broadcast and the widened weights fit the 16 registers.
        // SAFETY: the contract.
        unsafe {
            if tile.prefetch_next {
                halves::<M, 1, true>(tile, 0);
            } else {
                halves::<M, 1, false>(tile, 0);
            }
            halves::<M, 1, false>(tile, 1);
        }
    }
}

/// Outputs `16 * h0..16 * (h0 + H)` of the panel for `M` tokens, by the same instructions for
/// every `M` and `H`: per output, `acc = fma(w[k], x[k], acc)` for `k` in order from zero.
///
/// # Safety
/// As [`tile`], and `h0 + H <= 2`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn halves<const M: usize, const H: usize, const PREFETCH: bool>(tile: &Tile, h0: usize) {
    let Tile {
        x,
        x_stride,
        w,
        inner,
        out,
        out_stride,
        ..
    } = *tile;
    let next = w.wrapping_add(ROWS * inner);
    let ahead = ROWS
        * if tile.far_ahead {
            STREAM_FAR_AHEAD
        } else {
            STREAM_AHEAD
        };
    let zero = _mm256_setzero_si256();
    // `acc[h][m]`: the low and high eight outputs of half `h0 + h` for token `m`.
    let mut acc = [[[_mm256_setzero_ps(); 2]; M]; H];
    let mut column = w.wrapping_add(h0 * 16);
    for k in 0..inner {
        for (h, half) in acc.iter_mut().enumerate() {
            // SAFETY: column `k` of the panel lies inside it.
            let v = unsafe { _mm256_loadu_si256(column.wrapping_add(h * 16).cast()) };
            let low = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
            let high = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
            for (m, [low_acc, high_acc]) in half.iter_mut().enumerate() {
                // SAFETY: row `m` of `x` has `inner` elements.
                let xv = unsafe { _mm256_broadcast_ss(&*x.add(m * x_stride + k)) };
                *low_acc = _mm256_fmadd_ps(low, xv, *low_acc);
                *high_acc = _mm256_fmadd_ps(high, xv, *high_acc);
            }
        }
        if PREFETCH {
            // Never faults, even past the last panel.
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(k * ROWS).cast());
        }
        if M == 1 {
            // A lone token streams the panel at memory speed: asking a few lines ahead keeps
            // more reads in flight than the hardware prefetcher alone, across page
            // boundaries too (it stops at each).
            _mm_prefetch::<_MM_HINT_T0>(column.wrapping_add(ahead).cast());
        }
        column = column.wrapping_add(ROWS);
    }
    for (h, half) in acc.iter().enumerate() {
        for (m, [low, high]) in half.iter().enumerate() {
            let at = out.wrapping_add(m * out_stride + (h0 + h) * 16);
            // SAFETY: the output block of the contract holds the panel's `ROWS` outputs.
            unsafe {
                _mm256_storeu_ps(at, *low);
                _mm256_storeu_ps(at.wrapping_add(8), *high);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_a_permutation_that_unpacking_undoes() {
        let mut seen = [false; ROWS];
        for j in 0..ROWS {
            seen[position(j)] = true;
        }
        assert!(seen.iter().all(|&s| s));
        // Unpacking low halves reads, per 128-bit lane, elements 0–3 then 8–11 of the 16.
        let low: Vec<usize> = (0..4).chain(8..12).collect();
        for (lane, &element) in low.iter().enumerate() {
            assert_eq!(position(lane), element);
            assert_eq!(position(lane + 8), element + 4);
        }
    }

    #[test]
    fn arranging_then_restoring_gives_the_bits_back() {
        let inner = 7;
        let bits: Vec<u16> = (0..(2 * ROWS * inner) as u16).collect();
        let mut arranged = bits.clone();
        let mut scratch = Vec::new();
        arrange(&mut arranged, inner, &mut scratch);
        for row in 0..2 * ROWS {
            for k in 0..inner {
                assert_eq!(arranged[index(row, k, inner)], bits[row * inner + k]);
            }
        }
        restore(&mut arranged, inner, &mut scratch);
        assert_eq!(arranged, bits);
    }

    #[test]
    fn arrangement_codes_carry_k() {
        assert_eq!(arrangement(30, 8), None);
        let code = arrangement(64, 576).unwrap();
        assert_eq!(inner_of(code), Some(576));
        assert_eq!(inner_of(1), None);
    }
}
