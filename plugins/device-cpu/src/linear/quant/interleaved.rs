//! Block-quantized weights interleaved in groups of [`GROUP`] rows: the CPU device's own arrangement of such a matrix, made in place on the first launch that reads it, the group tiles' operand order.
//!
//! A group is 16 consecutive weight rows. For each block `b` of 32 values it holds the 16
//! rows' f16 scales side by side (32 bytes; Q4_1 then its 16 minima), then the values in
//! 64-byte quads, each four bytes of each of the 16 rows (row 0's, then row 1's, ...): one
//! 64-byte load is exactly a `vpdpbusd` operand with one i32 lane per row, and the 16 scales
//! convert in one instruction; the AVX2 tiles read each quad as two 32-byte halves of eight
//! rows. Q8_0 has eight quads, values `4q..4q + 4`, stored offset by 128 (`w + 128`, the sign
//! bit flipped), which is what `vpdpbusd` takes as its unsigned operand; the Q4 types four, the
//! block's stored bytes `4q..4q + 4` (the nibbles of values `4q..4q + 4` low, `16 + 4q..` high).
//! The tiles subtract what the offsets add (`128 ·`, Q4_0's `8 ·` the activations' block sum).
//!
//! Blocks go in pairs, the two blocks' scales first (64 bytes; Q4_1's minima next), then their
//! two runs of quads: with an even block count every load lies on a 64-byte line of its own.
//! A last, odd block is its scales and its quads. A group takes as many bytes as its 16 rows
//! did, so the arrangement is made in place; the rows past the last whole group stay in the
//! host's order.
//!
//! The K-quants keep each 256-value block of the 16 rows in as many bytes as the rows' blocks
//! ([`k_place`]). Q4_K: the rows' `d` side by side (32 bytes), their `dmin` (32), then the three
//! words of packed scales and minima (bytes `4..8`, `8..12`, `12..16` of each row), each word
//! of the 16 rows in 64 bytes, which the tiles unpack for all rows at once as `dots` does for
//! one; then the 128 bytes of nibbles in 32 quads (bytes `4q..4q + 4` of each row: values
//! `64c + 4i..` low and `64c + 32 + 4i..` high for `q = 8c + i`). Q6_K: its sixteen scales
//! in pairs of sub-blocks, the two scales of each row side by side (`vpmaddwd`'s operand), 32
//! bytes a pair; then its sixteen sub-blocks of 16 values in turn, each in three quads whose
//! bytes hold each value's six bits whole ([`q6_k_sub_blocks`]): the first three quads of four
//! values in the low six bits of a byte, the fourth quad's in the top two bits of all three,
//! so that four operands unpack in eleven operations where GGUF's split nibbles and bit pairs
//! take seventeen; and the rows' `d`: last in an even block and first in an odd one, so that
//! the quads of every block start on a 64-byte line. A block is then read from its start to
//! its end, one stream; the tiles also ask for its lines
//! ahead ([`prefetch_ahead`]), which the hardware prefetchers alone do not keep far enough.
//!
//! The arrangement changes no value: every 6-bit value of Q6_K is kept, only its bits are
//! moved, and the group tiles and the row path compute the same integers and float operations
//! (see `dots`), so a weight gives the same bits in either order.

use plughost_device_abi::DType;
use plughost_device_abi::export::{AS_WRITTEN, DeviceFailure, Launch};

#[cfg(target_arch = "x86_64")]
use super::activations::Q8Tile;
use super::dots::{activation_block, block_bytes};
use crate::Context;
#[cfg(target_arch = "x86_64")]
use crate::isa::IsaLevel;

/// Weight rows per group: one i32 lane each in a 64-byte register.
pub const GROUP: usize = 16;

/// Bytes of one f16 field (scale or minimum) across a group.
const FIELD_BYTES: usize = 2 * GROUP;

/// Marks an arrangement code as this module's; bits 32..48 name the type, the low 32 hold `K`.
const KIND: u64 = 0x7138 << 48;

/// The types kept in groups, in the order of their codes.
const TYPES: [DType; 5] = [
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q4_K,
    DType::Q6_K,
];

/// The type of the group tiles' `FORMAT` (0 Q8_0, 1 Q4_0, 2 Q4_1).
#[cfg(target_arch = "x86_64")]
pub const fn format_type(format: u8) -> DType {
    TYPES[format as usize]
}

/// Whether `dtype` is kept in groups.
pub fn groups(dtype: DType) -> bool {
    TYPES.contains(&dtype)
}

/// Whether `dtype` is a K-quant, whose blocks [`k_place`] lays out.
fn k_quant(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_K | DType::Q6_K)
}

/// Where byte `i` of row `r`'s block `b` of a K-quant group lies, from the block's start in
/// the group (`b · GROUP · block_bytes`).
#[inline(always)]
pub fn k_place(dtype: DType, b: usize, r: usize, i: usize) -> usize {
    // A quad's byte: bytes `4q..4q + 4` of each of the 16 rows, row by row.
    let quad = |at: usize, i: usize| at + 64 * (i / 4) + 4 * r + i % 4;
    if dtype == DType::Q4_K {
        match i {
            0..4 => 32 * (i / 2) + 2 * r + i % 2,
            4..16 => quad(64, i - 4),
            _ => quad(256, i - 16),
        }
    } else {
        let (fields, d) = if b.is_multiple_of(2) {
            (0, 3328)
        } else {
            (32, 0)
        };
        match i {
            // The sub-blocks' quads ([`q6_k_sub_blocks`]), in order.
            0..192 => fields + 256 + 16 * (i - i % 4) + 4 * r + i % 4,
            192..208 => fields + 32 * ((i - 192) / 2) + 2 * r + (i - 192) % 2,
            _ => d + 2 * r + i - 208,
        }
    }
}

/// Where Q6_K block `b` of a group keeps its scale pairs, its sub-blocks' quads
/// ([`Q6_K_SUB_BLOCK`] bytes each) and `d`, from the block's start: see [`k_place`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn q6_k_at(b: usize) -> [usize; 3] {
    [192, 0, 208].map(|i| k_place(DType::Q6_K, b, 0, i))
}

/// Bytes of one Q6_K sub-block's three quads in a group.
#[cfg(target_arch = "x86_64")]
pub const Q6_K_SUB_BLOCK: usize = 3 * 64;

/// The 192 value bytes of a Q6_K block (GGUF's `ql` nibbles and `qh` bit pairs) as its
/// sixteen sub-blocks of 16 values, 12 bytes each: bytes `4k..4k + 4` of sub-block `j` hold
/// values `16j + 4k..16j + 4k + 4` for `k` 0, 1 and 2 in their low six bits, and the same
/// bytes of `16j + 12..16j + 16` in their top two bits (bits 0–1 in `k` 0's, 2–3 in 1's,
/// 4–5 in 2's). A tile gets the first three values with one mask each, the fourth with three
/// shifts, three masks and two ors.
fn q6_k_sub_blocks(block: &[u8]) -> [u8; 192] {
    let mut out = [0; 192];
    for (i, byte) in out.iter_mut().enumerate() {
        let (j, k, e) = (i / 12, (i % 12) / 4, i % 4);
        let value = |q: usize| super::dots::q6_k_value(block, 16 * j + 4 * q + e) as u8;
        *byte = value(k) | ((value(3) >> (2 * k)) & 3) << 6;
    }
    out
}

/// Undoes [`q6_k_sub_blocks`]: the value bytes of the block into `block`'s first 192.
fn q6_k_from_sub_blocks(sub_blocks: &[u8], block: &mut [u8]) {
    block[..192].fill(0);
    for v in 0..256 {
        let (j, q, e) = (v / 16, (v % 16) / 4, v % 4);
        let byte = |k: usize| sub_blocks[12 * j + 4 * k + e];
        let value = if q < 3 {
            byte(q) & 0x3F
        } else {
            (0..3).fold(0, |value, k| value | (byte(k) >> 6) << (2 * k))
        };
        // GGUF's places of value `v` (`dots::q6_k_value`).
        let (half, k, i) = (v / 128, (v % 128) / 32, v % 32);
        block[64 * half + 32 * (k % 2) + i] |= (value & 0x0F) << (4 * (k / 2));
        block[128 + 32 * half + i] |= (value >> 4) << (2 * k);
    }
}

/// A K-quant row's block as a group keeps its bytes: Q6_K's values in sub-blocks.
fn k_block(dtype: DType, block: &[u8]) -> [u8; super::dots::Q6_K_BYTES] {
    let mut out = [0; super::dots::Q6_K_BYTES];
    out[..block.len()].copy_from_slice(block);
    if dtype == DType::Q6_K {
        out[..192].copy_from_slice(&q6_k_sub_blocks(block));
    }
    out
}

/// The f16 fields of a block of `dtype`: its scale, and Q4_1's minimum.
fn fields(dtype: DType) -> usize {
    if dtype == DType::Q4_1 { 2 } else { 1 }
}

/// Bytes past the line a group tile is reading that it asks the caches for: two Q6_K blocks
/// of a group, some 7 KB, about what a core reads from memory in the time one such request
/// takes to come back.
#[cfg(target_arch = "x86_64")]
const STREAM_AHEAD: usize = 2 * GROUP * super::dots::Q6_K_BYTES;

/// Asks for the lines [`STREAM_AHEAD`] past `bytes` bytes from `at`, one request per line.
///
/// A lone token reads a group at memory speed and does little work per line, so the hardware
/// prefetchers alone keep too few lines in flight (on Zen 5 the K-quant tiles streamed at a
/// third of the bandwidth). The K-quant tiles ask once per line as they first read it, spread
/// over the block: asked for all at once, a block's 36 to 53 lines take the miss buffers the
/// tile's own loads need. A 32-value block is a few lines, which AVX2's tile asks for together.
/// The requests run past the group into the next one, which lies right after it. Which
/// tiles ask on which CPU: [`super::super::RowPrefetch`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn prefetch_ahead(at: *const u8, bytes: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let ahead = at.wrapping_add(STREAM_AHEAD);
    for line in 0..bytes.div_ceil(64) {
        // SAFETY: every x86-64 CPU has SSE, and a prefetch reads nothing a program sees and
        // never faults, wherever it points.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast()) };
    }
}

/// Bytes of one row's values in a block of `dtype`.
fn value_bytes(dtype: DType) -> usize {
    block_bytes(dtype) - 2 * fields(dtype)
}

/// What a stored value byte of `dtype` becomes in a group: Q8_0's sign bit flips.
fn flip(dtype: DType) -> u8 {
    if dtype == DType::Q8_0 { 0x80 } else { 0 }
}

// Groups are made only where the x86-64 group tiles read them.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
/// The arrangement code of a `dtype` matrix of rows of `inner` values, when `dtype` is kept
/// in groups, the rows are whole blocks and `K` can be encoded.
pub fn arrangement(dtype: DType, inner: usize) -> Option<u64> {
    let tag = TYPES.iter().position(|&t| t == dtype)? as u64;
    let inner = u32::try_from(inner).ok()?;
    let values = activation_block(dtype) as u32;
    (inner > 0 && inner.is_multiple_of(values)).then_some(KIND | tag << 32 | u64::from(inner))
}

/// The type and `K` of an arrangement code made by [`arrangement`].
pub fn inner_of(arrangement: u64) -> Option<(DType, usize)> {
    if arrangement >> 48 != KIND >> 48 {
        return None;
    }
    let dtype = *TYPES.get(((arrangement >> 32) & 0xFFFF) as usize)?;
    Some((dtype, (arrangement & u64::from(u32::MAX)) as usize))
}

/// Where block `b` of `blocks` of a `dtype` group keeps its fields (16 scales; Q4_1's 16
/// minima) and its quads, from the group's start.
#[inline(always)]
pub fn block_at(dtype: DType, b: usize, blocks: usize) -> ([usize; 2], usize) {
    let (fields, values) = (fields(dtype), GROUP * value_bytes(dtype));
    let pair = (b / 2) * 2 * (fields * FIELD_BYTES + values);
    if b / 2 * 2 + 1 < blocks {
        let second = b % 2;
        let field = |f: usize| pair + 2 * FIELD_BYTES * f + FIELD_BYTES * second;
        (
            [field(0), field(1)],
            pair + 2 * FIELD_BYTES * fields + values * second,
        )
    } else {
        let field = |f: usize| pair + FIELD_BYTES * f;
        ([field(0), field(1)], pair + FIELD_BYTES * fields)
    }
}

/// The blocks of a `dtype` group, after checking that it holds whole blocks and that `tile`
/// holds `tokens` tokens' activations of them: what the group tiles' loads rely on.
#[cfg(target_arch = "x86_64")]
pub fn check_group(dtype: DType, group: &[u8], tile: &Q8Tile<'_>, tokens: usize) -> usize {
    let group_block = GROUP * block_bytes(dtype);
    assert!(
        group.len().is_multiple_of(group_block),
        "a group holds whole blocks"
    );
    let blocks = group.len() / group_block;
    // The 32-value blocks' tiles keep a block sum per token, the K-quants' their pairs.
    let (sums, pairs) = if k_quant(dtype) {
        (0, super::activations::K_PAIRS)
    } else {
        (1, 0)
    };
    assert!(
        tile.tokens == tokens
            && tile.digits.len() >= 2 * activation_block(dtype) * blocks * tokens
            && tile.scales.len() >= blocks * tokens
            && tile.sums.len() >= sums * blocks * tokens
            && tile.pairs.len() >= pairs * blocks * tokens,
        "a tile of {tokens} tokens covers the group's blocks"
    );
    blocks
}

/// Writes `rows` (whole `dtype` rows of `blocks` blocks, at most [`GROUP`] of them) into
/// `group` as one group; the places of missing rows get zero scales and values.
pub fn pack(dtype: DType, rows: &[u8], blocks: usize, group: &mut [u8]) {
    let (bytes, header) = (block_bytes(dtype), 2 * fields(dtype));
    group.fill(0);
    if k_quant(dtype) {
        for (r, row) in rows.chunks_exact(blocks * bytes).enumerate() {
            for (b, block) in row.chunks_exact(bytes).enumerate() {
                let to = &mut group[b * GROUP * bytes..(b + 1) * GROUP * bytes];
                for (i, &byte) in k_block(dtype, block)[..bytes].iter().enumerate() {
                    to[k_place(dtype, b, r, i)] = byte;
                }
            }
        }
        return;
    }
    for (r, row) in rows.chunks_exact(blocks * bytes).enumerate() {
        for (b, block) in row.chunks_exact(bytes).enumerate() {
            let (fields, quads) = block_at(dtype, b, blocks);
            for (f, field) in block[..header].chunks_exact(2).enumerate() {
                group[fields[f] + 2 * r..fields[f] + 2 * r + 2].copy_from_slice(field);
            }
            for (q, values) in block[header..].chunks_exact(4).enumerate() {
                let at = quads + 64 * q + 4 * r;
                for (to, &value) in group[at..at + 4].iter_mut().zip(values) {
                    *to = value ^ flip(dtype);
                }
            }
        }
    }
}

/// Row `r` of a `dtype` group back in the host's order, into `row` (`blocks` blocks).
pub fn unpack_row(dtype: DType, group: &[u8], r: usize, blocks: usize, row: &mut [u8]) {
    if k_quant(dtype) {
        let bytes = block_bytes(dtype);
        for (b, block) in row.chunks_exact_mut(bytes).enumerate() {
            let from = &group[b * GROUP * bytes..(b + 1) * GROUP * bytes];
            for (i, byte) in block.iter_mut().enumerate() {
                *byte = from[k_place(dtype, b, r, i)];
            }
            if dtype == DType::Q6_K {
                let sub_blocks: [u8; 192] = std::array::from_fn(|i| block[i]);
                q6_k_from_sub_blocks(&sub_blocks, block);
            }
        }
        return;
    }
    let header = 2 * fields(dtype);
    for (b, block) in row.chunks_exact_mut(block_bytes(dtype)).enumerate() {
        let (fields, quads) = block_at(dtype, b, blocks);
        for (f, field) in block[..header].chunks_exact_mut(2).enumerate() {
            field.copy_from_slice(&group[fields[f] + 2 * r..fields[f] + 2 * r + 2]);
        }
        for (q, values) in block[header..].chunks_exact_mut(4).enumerate() {
            let at = quads + 64 * q + 4 * r;
            for (to, &value) in values.iter_mut().zip(&group[at..at + 4]) {
                *to = value ^ flip(dtype);
            }
        }
    }
}

/// Interleaves the whole groups of a row-major `dtype` matrix of rows of `inner` values, in
/// place; a partial group at the end stays as it is. `scratch` is reused.
pub fn arrange(dtype: DType, bytes: &mut [u8], inner: usize, scratch: &mut Vec<u8>) {
    let blocks = inner / activation_block(dtype);
    for group in bytes.chunks_exact_mut(GROUP * blocks * block_bytes(dtype)) {
        scratch.clear();
        scratch.extend_from_slice(group);
        pack(dtype, scratch, blocks, group);
    }
}

/// Undoes [`arrange`].
pub fn restore(dtype: DType, bytes: &mut [u8], inner: usize, scratch: &mut Vec<u8>) {
    let blocks = inner / activation_block(dtype);
    let row_bytes = blocks * block_bytes(dtype);
    for group in bytes.chunks_exact_mut(GROUP * row_bytes) {
        scratch.clear();
        scratch.extend_from_slice(group);
        for (r, row) in group.chunks_exact_mut(row_bytes).enumerate() {
            unpack_row(dtype, scratch, r, blocks, row);
        }
    }
}

/// Row `index` of a `dtype` matrix of rows of `inner` values that [`arrange`] interleaved,
/// in the host's order, into `row`.
pub fn row_of(dtype: DType, bytes: &[u8], inner: usize, index: usize, row: &mut [u8]) {
    let blocks = inner / activation_block(dtype);
    let row_bytes = blocks * block_bytes(dtype);
    let group_bytes = GROUP * row_bytes;
    let group = index / GROUP;
    if (group + 1) * group_bytes <= bytes.len() {
        let group = &bytes[group * group_bytes..(group + 1) * group_bytes];
        unpack_row(dtype, group, index % GROUP, blocks, row);
    } else {
        row.copy_from_slice(&bytes[index * row_bytes..(index + 1) * row_bytes]);
    }
}

/// Puts the weight arguments `names` of a launch in groups when its tiles read groups (a type
/// kept in groups, at a level from `avx2` up) and the weight spans its own buffer, in the
/// host's order otherwise. Returns, per weight, whether it is in groups. A buffer stays
/// arranged across launches, so only the first launch that reads it pays for the arrangement.
pub fn arrange_weights<const N: usize>(
    launch: &mut Launch<'_>,
    names: [&str; N],
    inner: usize,
    context: &Context,
) -> Result<[bool; N], DeviceFailure> {
    let mut grouped = [false; N];
    for (name, grouped) in names.into_iter().zip(&mut grouped) {
        let dtype = launch.dtype(name);
        #[cfg(target_arch = "x86_64")]
        let target = arrangement(dtype, inner)
            .filter(|_| context.isa.has(IsaLevel::Avx2) && launch.spans_buffer(name));
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
                    arrange_in_tasks(dtype, bytes, inner, context);
                    Ok(())
                })?;
            }
        }
        *grouped = target != AS_WRITTEN;
    }
    Ok(grouped)
}

/// [`arrange`] spread over the workers, some sixteen tasks of whole groups.
pub fn arrange_in_tasks(dtype: DType, bytes: &mut [u8], inner: usize, context: &Context) {
    let group_bytes = GROUP * (inner / activation_block(dtype)) * block_bytes(dtype);
    let groups_per_task = (bytes.len() / group_bytes).div_ceil(16).max(1);
    context
        .workers
        .for_each_chunk(bytes, groups_per_task * group_bytes, |_task, chunk| {
            arrange(dtype, chunk, inner, &mut Vec::new())
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arranging_then_restoring_gives_the_bytes_back() {
        // 37 rows: two whole groups and five rows left in the host's order; with 3 blocks,
        // the last block of each group is alone.
        for dtype in TYPES {
            let bytes_per_block = block_bytes(dtype);
            for blocks in [1, 2, 3, 4] {
                let inner = blocks * activation_block(dtype);
                let rows = 37;
                let bytes: Vec<u8> = (0..rows * blocks * bytes_per_block)
                    .map(|i| (i * 7 + i / 251) as u8)
                    .collect();
                let mut arranged = bytes.clone();
                let mut scratch = Vec::new();
                arrange(dtype, &mut arranged, inner, &mut scratch);
                assert_ne!(arranged, bytes);
                let row_bytes = blocks * bytes_per_block;
                let tail = 2 * GROUP * row_bytes;
                assert_eq!(arranged[tail..], bytes[tail..]);
                let mut row = vec![0; row_bytes];
                for index in 0..rows {
                    row_of(dtype, &arranged, inner, index, &mut row);
                    assert_eq!(row, bytes[index * row_bytes..(index + 1) * row_bytes]);
                }
                let r = 5;
                let block = &bytes[r * row_bytes + (blocks - 1) * bytes_per_block..];
                let last = (blocks - 1) * GROUP * bytes_per_block;
                if dtype == DType::Q4_K {
                    // Byte 16 + 4q + i of a Q4_K row's block (values) lies at quad q, lane r,
                    // byte i of the block's quads.
                    let byte = arranged[last + 256 + 64 * 3 + 4 * r + 2];
                    assert_eq!(byte, block[16 + 4 * 3 + 2]);
                } else if dtype == DType::Q6_K {
                    // Value 18 of a Q6_K row's block (sub-block 1's first quad, byte 2) lies
                    // in the low six bits of the fourth quad, lane r, byte 2; value 30 (its
                    // fourth quad) in the top two bits of quads three to five.
                    let quads = last + if blocks % 2 == 1 { 256 } else { 288 };
                    let lane = |q: usize| arranged[quads + 64 * q + 4 * r + 2];
                    let value = |v| super::super::dots::q6_k_value(block, v) as u8;
                    assert_eq!(lane(3) & 0x3F, value(18));
                    let top = (0..3).fold(0, |top, k| top | (lane(3 + k) >> 6) << (2 * k));
                    assert_eq!(top, value(30));
                } else {
                    // Byte 4q + i of row r's values in block b lies at quad q, lane r, byte i.
                    let (fields, quads) = block_at(dtype, blocks - 1, blocks);
                    assert_eq!(
                        arranged[fields[0] + 2 * r..fields[0] + 2 * r + 2],
                        block[..2]
                    );
                    let header = 2 * super::fields(dtype);
                    let value = block[header + 4 * 3 + 2] ^ flip(dtype);
                    assert_eq!(arranged[quads + 64 * 3 + 4 * r + 2], value);
                }
                let mut restored = arranged.clone();
                restore(dtype, &mut restored, inner, &mut scratch);
                assert_eq!(restored, bytes);
                // As the host's read gets it back: through the device's restore.
                let code = arrangement(dtype, inner).expect("whole blocks");
                crate::linear::restore(code, &mut arranged).expect("restored");
                assert_eq!(arranged, bytes, "{dtype}, {blocks} blocks");
            }
        }
    }

    #[test]
    fn k_quant_blocks_take_each_byte_once_and_start_their_quads_on_lines() {
        for dtype in [DType::Q4_K, DType::Q6_K] {
            let bytes = block_bytes(dtype);
            for b in 0..3 {
                let mut seen = vec![false; GROUP * bytes];
                for r in 0..GROUP {
                    for i in 0..bytes {
                        let at = k_place(dtype, b, r, i);
                        assert!(!seen[at], "{dtype} block {b}: byte {i} of row {r} twice");
                        seen[at] = true;
                    }
                }
                assert!(seen.iter().all(|&s| s), "{dtype} block {b} fills its bytes");
                let values = k_place(dtype, b, 0, if dtype == DType::Q4_K { 16 } else { 0 });
                assert_eq!((b * GROUP * bytes + values) % 64, 0, "{dtype} block {b}");
            }
        }
    }

    #[test]
    fn pairs_of_blocks_fill_whole_lines() {
        let blocks = 4;
        assert_eq!(block_at(DType::Q8_0, 0, blocks), ([0, 64], 64));
        assert_eq!(block_at(DType::Q8_0, 1, blocks).1, 576);
        assert_eq!(block_at(DType::Q8_0, 2, blocks).0[0], 1088);
        assert_eq!(block_at(DType::Q4_1, 1, blocks), ([32, 96], 128 + 256));
        assert_eq!(block_at(DType::Q4_0, 2, blocks).1, 576 + 64);
        for dtype in &TYPES[..3] {
            let dtype = *dtype;
            let (_, quads) = block_at(dtype, 2, 3);
            let values = GROUP * value_bytes(dtype);
            assert_eq!(quads + values, 3 * GROUP * block_bytes(dtype), "{dtype}");
            assert_eq!((2 * GROUP * block_bytes(dtype)) % 64, 0, "{dtype}");
        }
    }

    #[test]
    fn arrangement_codes_carry_the_type_and_k() {
        assert_eq!(arrangement(DType::Q8_0, 40), None);
        assert_eq!(arrangement(DType::Q4_K, 1024 + 32), None);
        assert_eq!(arrangement(DType::BF16, 1024), None);
        for dtype in TYPES {
            let code = arrangement(dtype, 1024).unwrap();
            assert_eq!(inner_of(code), Some((dtype, 1024)));
        }
        assert_eq!(inner_of(1), None);
    }
}
