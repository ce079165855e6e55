//! Q8_0 weights interleaved in groups of [`GROUP`] rows: the CPU device's own arrangement of a Q8_0 matrix, made in place on the first launch that reads it, the group tiles' operand order.
//!
//! A group is 16 consecutive weight rows. For each block `b` of 32 values it holds the 16
//! rows' f16 scales side by side (32 bytes), then the values in eight 64-byte quads: quad `q`
//! holds values `4q..4q + 4` of row 0, then of row 1, ... of row 15. One 64-byte load is then
//! exactly a `vpdpbusd` operand with one i32 lane per row, and the 16 scales convert in one
//! instruction; the AVX2 tiles read each quad as two 32-byte halves of eight rows. The values
//! are stored offset by 128 (`w + 128`, the sign bit flipped), which is what `vpdpbusd` takes
//! as its unsigned operand; the tiles subtract `128 ·` the activations' block sum.
//!
//! Blocks go in pairs, the two blocks' scales first (64 bytes), then their two runs of quads
//! (512 bytes each): with an even block count every load lies on a 64-byte line of its own. A
//! last, odd block is its 32 bytes of scales and its quads. A group takes as many bytes as its
//! 16 rows did, so the arrangement is made in place; the rows past the last whole group stay
//! in the host's order.
//!
//! The arrangement changes no value: the group tiles and the row path compute the same
//! integers and float operations (see `dots`), so a weight gives the same bits in either order.

use plughost_device_abi::DType;
use plughost_device_abi::export::{AS_WRITTEN, DeviceFailure, Launch};

#[cfg(target_arch = "x86_64")]
use super::activations::Q8Tile;
use super::dots::Q8_0_BYTES;
use crate::Context;
#[cfg(target_arch = "x86_64")]
use crate::isa::IsaLevel;

/// Weight rows per group: one i32 lane each in a 64-byte register.
pub const GROUP: usize = 16;

/// Values per block.
const BLOCK: usize = 32;

/// Bytes of one block's values across a group: eight quads of 64.
const QUADS_BYTES: usize = GROUP * BLOCK;

/// Bytes of one block's scales across a group.
const SCALES_BYTES: usize = 2 * GROUP;

/// Marks an arrangement code as this module's; the low 32 bits hold `K`.
const KIND: u64 = 0x7138 << 48;

/// The arrangement code of a Q8_0 matrix of rows of `inner` values, when it has whole blocks
/// and `K` can be encoded.
pub fn arrangement(inner: usize) -> Option<u64> {
    let inner = u32::try_from(inner).ok()?;
    (inner > 0 && inner.is_multiple_of(BLOCK as u32)).then_some(KIND | u64::from(inner))
}

/// The `K` of an arrangement code made by [`arrangement`].
pub fn inner_of(arrangement: u64) -> Option<usize> {
    (arrangement & !u64::from(u32::MAX) == KIND)
        .then_some((arrangement & u64::from(u32::MAX)) as usize)
}

/// Where block `b` of `blocks` keeps its 16 scales and its quads, from the group's start.
#[inline(always)]
pub fn block_at(b: usize, blocks: usize) -> (usize, usize) {
    let pair = (b / 2) * 2 * (SCALES_BYTES + QUADS_BYTES);
    if b / 2 * 2 + 1 < blocks {
        let second = b % 2;
        (
            pair + SCALES_BYTES * second,
            pair + 2 * SCALES_BYTES + QUADS_BYTES * second,
        )
    } else {
        (pair, pair + SCALES_BYTES)
    }
}

/// The blocks of `group`, after checking that it holds whole blocks and that `tile` holds
/// `tokens` tokens' activations of them: what the group tiles' loads rely on.
#[cfg(target_arch = "x86_64")]
pub fn check_group(group: &[u8], tile: &Q8Tile<'_>, tokens: usize) -> usize {
    let block_bytes = GROUP * Q8_0_BYTES;
    assert!(
        group.len().is_multiple_of(block_bytes),
        "a group holds whole blocks"
    );
    let blocks = group.len() / block_bytes;
    assert!(
        tile.tokens == tokens
            && tile.digits.len() >= 2 * BLOCK * blocks * tokens
            && tile.scales.len() >= blocks * tokens
            && tile.offsets.len() >= blocks * tokens,
        "a tile of {tokens} tokens covers the group's blocks"
    );
    blocks
}

/// Writes `rows` (whole Q8_0 rows of `blocks` blocks, at most [`GROUP`] of them) into
/// `group` as one group; the places of missing rows get zero scales and values.
pub fn pack(rows: &[u8], blocks: usize, group: &mut [u8]) {
    let row_bytes = blocks * Q8_0_BYTES;
    group.fill(0);
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        for (b, block) in row.chunks_exact(Q8_0_BYTES).enumerate() {
            let (scales, quads) = block_at(b, blocks);
            group[scales + 2 * r..scales + 2 * r + 2].copy_from_slice(&block[..2]);
            for (q, values) in block[2..].chunks_exact(4).enumerate() {
                let at = quads + 64 * q + 4 * r;
                for (to, &value) in group[at..at + 4].iter_mut().zip(values) {
                    *to = value ^ 0x80;
                }
            }
        }
    }
}

/// Row `r` of a group back in the host's order, into `row` (`blocks` blocks).
pub fn unpack_row(group: &[u8], r: usize, blocks: usize, row: &mut [u8]) {
    for (b, block) in row.chunks_exact_mut(Q8_0_BYTES).enumerate() {
        let (scales, quads) = block_at(b, blocks);
        block[..2].copy_from_slice(&group[scales + 2 * r..scales + 2 * r + 2]);
        for (q, values) in block[2..].chunks_exact_mut(4).enumerate() {
            let at = quads + 64 * q + 4 * r;
            for (to, &value) in values.iter_mut().zip(&group[at..at + 4]) {
                *to = value ^ 0x80;
            }
        }
    }
}

/// Interleaves the whole groups of a row-major Q8_0 matrix of rows of `inner` values, in
/// place; a partial group at the end stays as it is. `scratch` is reused.
pub fn arrange(bytes: &mut [u8], inner: usize, scratch: &mut Vec<u8>) {
    let blocks = inner / BLOCK;
    for group in bytes.chunks_exact_mut(GROUP * blocks * Q8_0_BYTES) {
        scratch.clear();
        scratch.extend_from_slice(group);
        pack(scratch, blocks, group);
    }
}

/// Undoes [`arrange`].
pub fn restore(bytes: &mut [u8], inner: usize, scratch: &mut Vec<u8>) {
    let blocks = inner / BLOCK;
    let row_bytes = blocks * Q8_0_BYTES;
    for group in bytes.chunks_exact_mut(GROUP * row_bytes) {
        scratch.clear();
        scratch.extend_from_slice(group);
        for (r, row) in group.chunks_exact_mut(row_bytes).enumerate() {
            unpack_row(scratch, r, blocks, row);
        }
    }
}

/// Row `index` of a Q8_0 matrix of rows of `inner` values that [`arrange`] interleaved, in
/// the host's order, into `row`.
pub fn row_of(bytes: &[u8], inner: usize, index: usize, row: &mut [u8]) {
    let blocks = inner / BLOCK;
    let row_bytes = blocks * Q8_0_BYTES;
    let group_bytes = GROUP * row_bytes;
    let group = index / GROUP;
    if (group + 1) * group_bytes <= bytes.len() {
        let group = &bytes[group * group_bytes..(group + 1) * group_bytes];
        unpack_row(group, index % GROUP, blocks, row);
    } else {
        row.copy_from_slice(&bytes[index * row_bytes..(index + 1) * row_bytes]);
    }
}

/// Puts the Q8_0 weight arguments `names` of a launch in groups when its tiles read groups (a
/// level from `avx2` up) and the weight spans its own buffer, in the host's order otherwise.
/// Returns, per weight, whether it is in groups. A buffer stays arranged across launches, so
/// only the first launch that reads it pays for the arrangement.
pub fn arrange_weights<const N: usize>(
    launch: &mut Launch<'_>,
    names: [&str; N],
    inner: usize,
    context: &Context,
) -> Result<[bool; N], DeviceFailure> {
    let mut grouped = [false; N];
    for (name, grouped) in names.into_iter().zip(&mut grouped) {
        #[cfg(target_arch = "x86_64")]
        let target = arrangement(inner).filter(|_| {
            context.isa.has(IsaLevel::Avx2)
                && launch.dtype(name) == DType::Q8_0
                && launch.spans_buffer(name)
        });
        #[cfg(not(target_arch = "x86_64"))]
        let target = None;
        let target = target.unwrap_or(AS_WRITTEN);
        let current = launch.arrangement(name);
        if current != target {
            if current != AS_WRITTEN {
                super::super::restore_arrangement(launch, name)?;
            }
            if target != AS_WRITTEN {
                launch.rearrange(name, target, |bytes| {
                    arrange_in_tasks(bytes, inner, context);
                    Ok(())
                })?;
            }
        }
        *grouped = target != AS_WRITTEN;
    }
    Ok(grouped)
}

/// [`arrange`] spread over the workers, some sixteen tasks of whole groups.
pub fn arrange_in_tasks(bytes: &mut [u8], inner: usize, context: &Context) {
    let group_bytes = GROUP * (inner / BLOCK) * Q8_0_BYTES;
    let groups_per_task = (bytes.len() / group_bytes).div_ceil(16).max(1);
    context
        .workers
        .for_each_chunk(bytes, groups_per_task * group_bytes, |_task, chunk| {
            arrange(chunk, inner, &mut Vec::new())
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arranging_then_restoring_gives_the_bytes_back() {
        // 37 rows: two whole groups and five rows left in the host's order; 3 blocks, so the
        // last block of each group is alone.
        for blocks in [1, 2, 3, 4] {
            let inner = blocks * BLOCK;
            let rows = 37;
            let bytes: Vec<u8> = (0..rows * blocks * Q8_0_BYTES)
                .map(|i| (i * 7 + i / 251) as u8)
                .collect();
            let mut arranged = bytes.clone();
            let mut scratch = Vec::new();
            arrange(&mut arranged, inner, &mut scratch);
            assert_ne!(arranged, bytes);
            let row_bytes = blocks * Q8_0_BYTES;
            assert_eq!(
                arranged[2 * GROUP * row_bytes..],
                bytes[2 * GROUP * row_bytes..]
            );
            let mut row = vec![0; row_bytes];
            for index in 0..rows {
                row_of(&arranged, inner, index, &mut row);
                assert_eq!(row, bytes[index * row_bytes..(index + 1) * row_bytes]);
            }
            // Value 4q + i of row r of block b lies at quad q, lane r, byte i.
            let (scales, quads) = block_at(blocks - 1, blocks);
            let r = 5;
            let block = &bytes[r * row_bytes + (blocks - 1) * Q8_0_BYTES..];
            assert_eq!(arranged[scales + 2 * r..scales + 2 * r + 2], block[..2]);
            assert_eq!(arranged[quads + 64 * 3 + 4 * r + 2], block[2 + 14] ^ 0x80);
            let mut restored = arranged.clone();
            restore(&mut restored, inner, &mut scratch);
            assert_eq!(restored, bytes);
            // As the host's read gets it back: through the device's restore.
            let code = arrangement(inner).expect("whole blocks");
            crate::linear::restore(code, &mut arranged).expect("restored");
            assert_eq!(arranged, bytes);
        }
    }

    #[test]
    fn pairs_of_blocks_fill_whole_lines() {
        let blocks = 4;
        assert_eq!(block_at(0, blocks), (0, 64));
        assert_eq!(block_at(1, blocks), (32, 576));
        assert_eq!(block_at(2, blocks), (1088, 1152));
        let (scales, quads) = block_at(2, 3);
        assert_eq!((scales, quads), (1088, 1120));
        assert_eq!(quads + QUADS_BYTES, 3 * GROUP * Q8_0_BYTES);
    }

    #[test]
    fn arrangement_codes_carry_k() {
        assert_eq!(arrangement(40), None);
        let code = arrangement(1024).unwrap();
        assert_eq!(inner_of(code), Some(1024));
        assert_eq!(inner_of(1), None);
    }
}
