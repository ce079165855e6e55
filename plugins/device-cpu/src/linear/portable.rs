//! Portable tiles for CPUs without the vector kernels: per output, [`LANES`] multiply-add
//! chains over the residue classes of `k`, added in a fixed tree. Slow but batch-invariant
//! like them.

use super::NR;

/// Tokens per tile.
pub const MR: usize = 4;

/// Partial sums per output: eight chains keep the rounding error of long rows near that of
/// the vector kernels.
const LANES: usize = 8;

/// One tile: `tokens` rows of `x` (`inner` apart) against the weight rows `w[0..NR]`, into
/// `columns` outputs per token of `out` (`out_stride` apart).
pub struct Tile<'a> {
    pub x: &'a [f32],
    pub tokens: usize,
    pub w: [&'a [f32]; NR],
    pub out: *mut f32,
    pub out_stride: usize,
    pub columns: usize,
}

/// # Safety
/// The output block is valid and touched by no other thread.
pub unsafe fn run(tile: &Tile<'_>) {
    let inner = tile.w[0].len();
    for m in 0..tile.tokens {
        let x = &tile.x[m * inner..(m + 1) * inner];
        for (j, w) in tile.w.iter().enumerate().take(tile.columns) {
            let mut lanes = [0.0f32; LANES];
            for (k, (x, w)) in x.iter().zip(*w).enumerate() {
                lanes[k % LANES] += x * w;
            }
            let [a, b, c, d, e, f, g, h] = lanes;
            let sum = ((a + e) + (c + g)) + ((b + f) + (d + h));
            // SAFETY: the contract.
            unsafe { *tile.out.add(m * tile.out_stride + j) = sum };
        }
    }
}
