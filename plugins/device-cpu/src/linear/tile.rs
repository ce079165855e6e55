//! Packing one block of `w` — up to [`NR`] rows by up to [`KC`] columns — into a k-major f32 tile, widening f16/bf16 on the way.
//!
//! The tile holds `tile[k * NR + r] = w[first_row + r][k0 + k]`, rows past the end of `w`
//! as zeros, so the microkernel reads the [`NR`] weights of one `k` as two contiguous 8-lane
//! vectors. Packing only moves and widens values, both exact, so which path packs a tile never
//! changes a result.

use plughost_device_abi::export::FloatSlice;

use super::microkernel::Isa;
use crate::widen::bf16_to_f32;

/// Outputs (rows of `w`) per tile: two 8-lane AVX2 vectors.
pub const NR: usize = 16;

/// Columns of `w` per tile: 16 KiB of f32, so a tile stays in L1 while every token group of
/// the launch streams over it, and a panel's 16 rows are read in 256-element runs.
///
/// It is also the K block of the summation order (see `linear`): another value gives other
/// (equally batch-invariant) results, so it must not depend on the launch.
pub const KC: usize = 256;

/// f32 elements one tile needs.
pub const TILE_LEN: usize = NR * KC;

/// Which block of `w` to pack: rows `first_row..first_row + rows`, columns `k0..k0 + kc`.
#[derive(Clone, Copy, Debug)]
pub struct Block {
    pub first_row: usize,
    pub rows: usize,
    pub k0: usize,
    pub kc: usize,
    /// Row length of `w` (`K`).
    pub inner: usize,
}

/// Fills `tile[..block.kc * NR]` with `block` of `w` (see the module docs).
pub fn pack(isa: Isa, w: FloatSlice<'_>, block: Block, tile: &mut [f32]) {
    let Block {
        first_row,
        rows,
        k0,
        kc,
        inner,
    } = block;
    // The vector paths below rely on these bounds.
    assert!(
        (1..=NR).contains(&rows)
            && kc <= KC
            && tile.len() >= kc * NR
            && k0 + kc <= inner
            && (first_row + rows) * inner <= w.len(),
        "pack: {block:?} out of bounds for {} weights and a tile of {}",
        w.len(),
        tile.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2Fma && rows == NR {
        use super::columns::{Bf16, F16, Panel};
        let start = first_row * inner;
        let tile = tile.as_mut_ptr();
        // SAFETY: `isa` vouches for the CPU features; the assert above keeps every read inside
        // rows `first_row..first_row + NR`, columns `k0..k0 + kc` of `w`, and every write
        // inside `tile[..kc * NR]`.
        unsafe {
            match w {
                FloatSlice::F32(values) => {
                    let panel = Panel {
                        w: values.as_ptr().add(start),
                        inner,
                    };
                    pack_columns(panel, k0..k0 + kc, tile);
                }
                FloatSlice::BF16(bits) => {
                    let panel = Panel {
                        w: bits.as_ptr().add(start),
                        inner,
                    };
                    pack_columns(Bf16(panel), k0..k0 + kc, tile);
                }
                FloatSlice::F16(bits) => {
                    let panel = Panel {
                        w: bits.as_ptr().add(start),
                        inner,
                    };
                    pack_columns(F16(panel), k0..k0 + kc, tile);
                }
            }
        }
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    match w {
        FloatSlice::F32(values) => pack_portable(values, block, tile, |v| v),
        FloatSlice::BF16(bits) => pack_portable(bits, block, tile, bf16_to_f32),
        FloatSlice::F16(bits) => {
            pack_portable(bits, block, tile, |b| half::f16::from_bits(b).to_f32())
        }
    }
}

/// Element by element; also the path for a last, partial panel of rows.
fn pack_portable<T: Copy>(w: &[T], block: Block, tile: &mut [f32], widen: impl Fn(T) -> f32) {
    let Block {
        first_row,
        rows,
        k0,
        kc,
        inner,
    } = block;
    for (k, lanes) in tile[..kc * NR].chunks_exact_mut(NR).enumerate() {
        for (r, lane) in lanes.iter_mut().enumerate() {
            *lane = if r < rows {
                widen(w[(first_row + r) * inner + k0 + k])
            } else {
                0.0
            };
        }
    }
}

/// # Safety
/// As [`super::columns::Columns::eight`] for `columns`; `tile` has room for `columns.len() *
/// NR` f32s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_columns<C: super::columns::Columns>(
    panel: C,
    columns: std::ops::Range<usize>,
    tile: *mut f32,
) {
    use std::arch::x86_64::_mm256_storeu_ps;
    let whole = columns.start + columns.len() / 8 * 8;
    // SAFETY (all blocks): `columns` are readable, their tile rows writable.
    let store = |k: usize, i: usize| unsafe { tile.add((k - columns.start) * NR + 8 * i) };
    for k in (columns.start..whole).step_by(8) {
        for (i, column) in unsafe { panel.eight(k) }.into_iter().enumerate() {
            unsafe { _mm256_storeu_ps(store(k, i), column) };
        }
    }
    for k in whole..columns.end {
        for (i, column) in unsafe { panel.one(k) }.into_iter().enumerate() {
            unsafe { _mm256_storeu_ps(store(k, i), column) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::noise;
    use half::{bf16, f16};

    #[test]
    fn every_path_packs_the_same_tile() {
        let inner = 300;
        let values: Vec<f32> = (0..40 * inner).map(|i| noise(5, i)).collect();
        let f16_bits: Vec<u16> = values.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let bf16_bits: Vec<u16> = values
            .iter()
            .map(|&v| bf16::from_f32(v).to_bits())
            .collect();
        let sources = [
            FloatSlice::F32(&values),
            FloatSlice::F16(&f16_bits),
            FloatSlice::BF16(&bf16_bits),
        ];
        // Full panels (vector path on AVX2) with a column tail, partial panels, short blocks.
        let blocks = [
            (0, 16, 0, 256),
            (16, 16, 7, 203),
            (24, 16, 256, 44),
            (32, 8, 3, 5),
        ];
        for w in sources {
            let mut exact = vec![0.0; w.len()];
            crate::widen::widen_into(w, 0, &mut exact);
            for (first_row, rows, k0, kc) in blocks {
                let block = Block {
                    first_row,
                    rows,
                    k0,
                    kc,
                    inner,
                };
                for isa in [Isa::Portable, Isa::detect()] {
                    let mut tile = vec![f32::NAN; TILE_LEN];
                    pack(isa, w, block, &mut tile);
                    for k in 0..kc {
                        for r in 0..NR {
                            let want = if r < rows {
                                exact[(first_row + r) * inner + k0 + k]
                            } else {
                                0.0
                            };
                            assert_eq!(tile[k * NR + r], want, "{isa:?} {w:?} {block:?} {k} {r}");
                        }
                    }
                }
            }
        }
    }
}
