//! Laying a tile out for the AVX-512 kernel, once for every row of a block: the keys transposed sixteen to a vector (in pairs of bf16 dimensions, or widened), the bf16 values interleaved by pairs of positions.

use std::arch::x86_64::{
    __m512i, _mm512_castps_si512, _mm512_castsi512_ps, _mm512_loadu_si512,
    _mm512_permutex2var_epi16, _mm512_setzero_si512, _mm512_shuffle_i32x4, _mm512_unpackhi_epi32,
    _mm512_unpackhi_epi64, _mm512_unpacklo_epi32, _mm512_unpacklo_epi64,
};

use super::{SCORE_VECTORS, load_cached, store};
use crate::attention::online::KvTile;
use crate::kv_cache::CacheElement;

/// Lays the tile's keys out in `columns` (at least `TILE * 16 * C` f32s), sixteen keys at a
/// time transposed, once for every row of the block: those of a bf16 cache as
/// [`PairColumns`] (returns true), others widened as [`WideColumns`]. Keys past the tile's
/// end are zeros. `fetch(part, parts)` runs after each part of the work.
#[target_feature(enable = "avx512f,avx512dq")]
pub(super) fn lay_out_keys<E: CacheElement, const C: usize>(
    tile: &KvTile<'_, E>,
    columns: &mut [f32],
    fetch: impl Fn(usize, usize),
) -> bool {
    let head_dim = 16 * C;
    let rows_of = |group: usize| &tile.offsets[(16 * group).min(tile.offsets.len())..];
    let mut put = |index: usize, v: __m512i| {
        store(&mut columns[index * 16..], 0, _mm512_castsi512_ps(v));
    };
    if let Some(bits) = E::bf16_bits(tile.keys) {
        for group in 0..SCORE_VECTORS {
            for chunk in 0..C / 2 {
                let load_row = |offset: usize| {
                    let row = &bits[offset + 32 * chunk..offset + 32 * chunk + 32];
                    // SAFETY: `row` holds 32 u16s.
                    unsafe { _mm512_loadu_si512(row.as_ptr().cast()) }
                };
                let transposed = transpose(sixteen_rows(rows_of(group), load_row));
                for (p, &pair) in transposed.iter().enumerate() {
                    put(group * head_dim / 2 + 16 * chunk + p, pair);
                }
                fetch(group * C / 2 + chunk, SCORE_VECTORS * C / 2);
            }
        }
        return true;
    }
    for group in 0..SCORE_VECTORS {
        for chunk in 0..C {
            let load_row = |offset: usize| {
                _mm512_castps_si512(load_cached(&tile.keys[offset..offset + head_dim], chunk))
            };
            let transposed = transpose(sixteen_rows(rows_of(group), load_row));
            for (p, &dim) in transposed.iter().enumerate() {
                put(group * head_dim + 16 * chunk + p, dim);
            }
            fetch(group * C + chunk, SCORE_VECTORS * C);
        }
    }
    false
}

/// `load_row(offset)` for the first sixteen of `offsets`, zeros past their end.
#[inline]
#[target_feature(enable = "avx512f")]
fn sixteen_rows(offsets: &[usize], load_row: impl Fn(usize) -> __m512i) -> [__m512i; 16] {
    let mut rows = [_mm512_setzero_si512(); 16];
    for (row, &offset) in rows.iter_mut().zip(offsets) {
        *row = load_row(offset);
    }
    rows
}

/// The 16 × 16 matrix of 32-bit lanes `rows` transposed: lane `j` of vector `l` is lane `l`
/// of row `j`.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose(rows: [__m512i; 16]) -> [__m512i; 16] {
    // Per 128-bit block: pairs of rows interleaved by lanes, then by lane pairs, so vector
    // `4m + s` holds, in block `q`, lane `4q + s` of rows `4m..4m + 4`.
    let mut t = [_mm512_setzero_si512(); 16];
    for k in 0..8 {
        t[2 * k] = _mm512_unpacklo_epi32(rows[2 * k], rows[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(rows[2 * k], rows[2 * k + 1]);
    }
    let mut u = [_mm512_setzero_si512(); 16];
    for m in 0..4 {
        for half in 0..2 {
            let (a, b) = (t[4 * m + half], t[4 * m + 2 + half]);
            u[4 * m + 2 * half] = _mm512_unpacklo_epi64(a, b);
            u[4 * m + 2 * half + 1] = _mm512_unpackhi_epi64(a, b);
        }
    }
    // Then the 4 × 4 blocks of each `s` transposed.
    let mut out = [_mm512_setzero_si512(); 16];
    for s in 0..4 {
        let v0 = _mm512_shuffle_i32x4::<0x44>(u[s], u[4 + s]);
        let v1 = _mm512_shuffle_i32x4::<0xEE>(u[s], u[4 + s]);
        let v2 = _mm512_shuffle_i32x4::<0x44>(u[8 + s], u[12 + s]);
        let v3 = _mm512_shuffle_i32x4::<0xEE>(u[8 + s], u[12 + s]);
        out[s] = _mm512_shuffle_i32x4::<0x88>(v0, v2);
        out[4 + s] = _mm512_shuffle_i32x4::<0xDD>(v0, v2);
        out[8 + s] = _mm512_shuffle_i32x4::<0x88>(v1, v3);
        out[12 + s] = _mm512_shuffle_i32x4::<0xDD>(v1, v3);
    }
    out
}

/// The value rows of a bf16 tile (`bits` at `offsets`) interleaved in pairs of positions
/// into `pairs`, as [`PairedValues`] reads them; an odd last row stays out.
///
/// # Safety
/// The CPU has isa level `avx512_bf16`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
pub(super) unsafe fn pair_values<const C: usize>(
    bits: &[u16],
    offsets: &[usize],
    pairs: &mut [f32],
) {
    let head_dim = 16 * C;
    // Lanes of the first and second rows, alternately: elements 0..16, then 16..32.
    let low: [i16; 32] = std::array::from_fn(|i| (i / 2 + 32 * (i % 2)) as i16);
    let high: [i16; 32] = std::array::from_fn(|i| (16 + i / 2 + 32 * (i % 2)) as i16);
    // SAFETY: both arrays hold 32 i16s.
    let (low, high) = unsafe {
        (
            _mm512_loadu_si512(low.as_ptr().cast()),
            _mm512_loadu_si512(high.as_ptr().cast()),
        )
    };
    for (pair, rows) in offsets.chunks_exact(2).enumerate() {
        let (a, b) = (
            &bits[rows[0]..rows[0] + head_dim],
            &bits[rows[1]..rows[1] + head_dim],
        );
        for half in 0..C / 2 {
            let (a, b) = (&a[32 * half..32 * half + 32], &b[32 * half..32 * half + 32]);
            // SAFETY: `a` and `b` hold 32 u16s each.
            let (a, b) = unsafe {
                (
                    _mm512_loadu_si512(a.as_ptr().cast()),
                    _mm512_loadu_si512(b.as_ptr().cast()),
                )
            };
            for (i, index) in [low, high].into_iter().enumerate() {
                let c = 2 * half + i;
                let lanes = _mm512_permutex2var_epi16(a, index, b);
                store(
                    &mut pairs[(pair * C + c) * 16..],
                    0,
                    _mm512_castsi512_ps(lanes),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::{Isa, IsaLevel};
    use crate::linear::{Bf16Bits, as_wide};

    #[test]
    fn sixteen_rows_transpose() {
        if !Isa::detect().has(IsaLevel::Avx512) {
            return;
        }
        let rows: Vec<u32> = (0..256).collect();
        // SAFETY: the CPU has AVX-512 (checked above); each load reads 16 u32s of `rows`.
        let columns: [[u32; 16]; 16] = unsafe {
            let load = |j: usize| _mm512_loadu_si512(rows[16 * j..].as_ptr().cast());
            std::mem::transmute(transpose(sixteen_rows(
                &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
                load,
            )))
        };
        for (l, column) in columns.iter().enumerate() {
            let expected: Vec<u32> = (0..16).map(|j| 16 * j + l as u32).collect();
            assert_eq!(column[..], expected[..], "column {l}");
        }
    }

    /// A partial tile of bf16 keys at scattered offsets: pair `i` of key `k` in lane `k % 16`
    /// of vector `(k / 16) * D / 2 + i`, zeros past the tile's end.
    #[test]
    fn bf16_keys_are_laid_out_in_pairs_with_zeros_past_the_tile() {
        if !Isa::detect().has(IsaLevel::Avx512) {
            return;
        }
        const C: usize = 4;
        let head_dim = 16 * C;
        let bits: Vec<u16> = (0..100 * head_dim)
            .map(|i| (i % 65_521) as u16 + 1)
            .collect();
        let offsets: Vec<usize> = (0..37).map(|k| ((k * 7 + 3) % 100) * head_dim).collect();
        let tile = tile_of(as_wide::<Bf16Bits>(&bits), &offsets);
        let mut columns = vec![f32::NAN; TILE_F32S];
        // SAFETY: the CPU has AVX-512 (checked above).
        let paired = unsafe { lay_out_keys::<Bf16Bits, C>(&tile, &mut columns, |_, _| {}) };
        assert!(paired);
        let lanes: Vec<u32> = columns.iter().map(|x| x.to_bits()).collect();
        for key in 0..64 {
            for i in 0..head_dim / 2 {
                let lane = lanes[((key / 16) * head_dim / 2 + i) * 16 + key % 16];
                let expected = offsets.get(key).map_or(0, |&offset| {
                    u32::from(bits[offset + 2 * i]) | u32::from(bits[offset + 2 * i + 1]) << 16
                });
                assert_eq!(lane, expected, "key {key}, pair {i}");
            }
        }
    }

    /// f32 keys widened in place: dimension `d` of key `k` in lane `k % 16` of vector
    /// `(k / 16) * D + d`.
    #[test]
    fn f32_keys_are_laid_out_by_dimension() {
        if !Isa::detect().has(IsaLevel::Avx512) {
            return;
        }
        const C: usize = 8;
        let head_dim = 16 * C;
        let keys: Vec<f32> = (0..20 * head_dim).map(|i| i as f32).collect();
        let offsets: Vec<usize> = (0..17).map(|k| (19 - k) * head_dim).collect();
        let tile = tile_of(&keys, &offsets);
        let mut columns = vec![f32::NAN; 2 * TILE_F32S];
        // SAFETY: the CPU has AVX-512 (checked above).
        let paired = unsafe { lay_out_keys::<f32, C>(&tile, &mut columns, |_, _| {}) };
        assert!(!paired);
        for key in 0..64 {
            for d in 0..head_dim {
                let expected = offsets.get(key).map_or(0.0, |&offset| keys[offset + d]);
                let got = columns[((key / 16) * head_dim + d) * 16 + key % 16];
                assert_eq!(
                    got.to_bits(),
                    expected.to_bits(),
                    "key {key}, dimension {d}"
                );
            }
        }
    }

    /// A tile of `keys` (its values too) at `offsets`, from position 0.
    fn tile_of<'a, E>(keys: &'a [E], offsets: &'a [usize]) -> KvTile<'a, E> {
        KvTile {
            keys,
            values: keys,
            offsets,
            ahead: &[],
            start: 0,
            range_start: 0,
        }
    }

    /// The f32s of a tile's keys at heads of 64.
    const TILE_F32S: usize = crate::attention::online::TILE * 64;
}
