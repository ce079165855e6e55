//! The device-maintained step inputs (`advance_seq_lens`, `derive_positions`, `derive_slot_mapping`) and the per-sequence token spans that attention shares.
//!
//! Same semantics as the mock device: every function but `advance_seq_lens` takes `seq_lens`
//! that already count this step's tokens, so sequence `i` computes positions
//! `seq_lens[i] - query_len .. seq_lens[i]`, `query_len = query_start[i+1] - query_start[i]`.
//! Tokens of the step that no sequence covers are padding: position 0, slot -1. Each function
//! checks all of its input before writing anything, so a failed launch leaves its outputs as
//! they were.

use std::ops::Range;

use plughost_device_abi::export::{DeviceFailure, Launch};

/// The tokens one sequence computes in the flattened step batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SequenceSpan {
    /// Rows of the step batch.
    pub tokens: Range<usize>,
    /// The position of the first of those tokens in the sequence.
    pub first_position: usize,
}

impl SequenceSpan {
    /// `(row, position)` for every token of the span.
    pub fn rows_and_positions(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.tokens
            .clone()
            .enumerate()
            .map(|(index, row)| (row, self.first_position + index))
    }

    /// The sequence's length including this step's tokens.
    pub fn seq_len(&self) -> usize {
        self.first_position + self.tokens.len()
    }
}

/// The span of sequence `seq`, checked against the step's `num_tokens`.
pub fn sequence_span(
    seq_lens: &[i32],
    query_start: &[i32],
    num_tokens: usize,
    seq: usize,
) -> Result<SequenceSpan, String> {
    let (start, end) = (query_start[seq], query_start[seq + 1]);
    // Chaining start <= end per sequence also makes query_start non-decreasing.
    if start < 0 || end < start || end as usize > num_tokens {
        return Err(format!(
            "sequence {seq}: query_start gives tokens {start}..{end}, \
             which is not a range inside the {num_tokens} tokens of the step"
        ));
    }
    let (seq_len, query_len) = (seq_lens[seq], end - start);
    if seq_len < query_len {
        return Err(format!(
            "sequence {seq}: seq_len {seq_len} is less than the {query_len} tokens it computes this step"
        ));
    }
    Ok(SequenceSpan {
        tokens: start as usize..end as usize,
        first_position: (seq_len - query_len) as usize,
    })
}

/// The cache slot of `position` given one sequence's row of the block table.
pub fn slot_of(block_row: &[i32], block_size: usize, position: usize) -> Result<usize, String> {
    let block_index = position / block_size;
    let &block = block_row.get(block_index).ok_or_else(|| {
        format!(
            "position {position} needs block {block_index}, but the block table has {} columns",
            block_row.len()
        )
    })?;
    if block < 0 {
        return Err(format!(
            "position {position} needs block table entry {block_index}, which is {block}"
        ));
    }
    (block as usize)
        .checked_mul(block_size)
        .map(|start| start + position % block_size)
        .ok_or_else(|| format!("block {block} times block size {block_size} overflows"))
}

/// `seq_lens[i] += query_start[i+1] - query_start[i]`.
pub fn advance_seq_lens(seq_lens: &mut [i32], query_start: &[i32]) -> Result<(), String> {
    let advanced = |seq: usize, seq_len: i32| {
        let (start, end) = (query_start[seq], query_start[seq + 1]);
        let query_len = end
            .checked_sub(start)
            .filter(|len| *len >= 0)
            .ok_or_else(|| {
                format!("sequence {seq}: query_start {start}..{end} is not an increasing range")
            })?;
        if seq_len < 0 {
            return Err(format!("sequence {seq}: seq_len is negative ({seq_len})"));
        }
        seq_len
            .checked_add(query_len)
            .ok_or_else(|| format!("sequence {seq}: seq_len {seq_len} + {query_len} overflows i32"))
    };
    for (seq, &seq_len) in seq_lens.iter().enumerate() {
        advanced(seq, seq_len)?;
    }
    for (seq, seq_len) in seq_lens.iter_mut().enumerate() {
        *seq_len = advanced(seq, *seq_len)?;
    }
    Ok(())
}

pub fn derive_positions(
    seq_lens: &[i32],
    query_start: &[i32],
    positions: &mut [i32],
) -> Result<(), String> {
    let num_tokens = positions.len();
    for seq in 0..seq_lens.len() {
        sequence_span(seq_lens, query_start, num_tokens, seq)?;
    }
    positions.fill(0);
    for seq in 0..seq_lens.len() {
        let span = sequence_span(seq_lens, query_start, num_tokens, seq)?;
        for (row, position) in span.rows_and_positions() {
            // position < seq_len, which is an i32.
            positions[row] = position as i32;
        }
    }
    Ok(())
}

/// `block_table` is `[S, blocks_per_seq]` row-major.
pub fn derive_slot_mapping(
    (block_table, blocks_per_seq): (&[i32], usize),
    seq_lens: &[i32],
    query_start: &[i32],
    block_size: usize,
    slots: &mut [i32],
) -> Result<(), String> {
    let num_tokens = slots.len();
    let slot_at = |seq: usize, position: usize| {
        let row = &block_table[seq * blocks_per_seq..(seq + 1) * blocks_per_seq];
        let slot = slot_of(row, block_size, position)
            .map_err(|problem| format!("sequence {seq}: {problem}"))?;
        i32::try_from(slot).map_err(|_| format!("sequence {seq}: slot {slot} does not fit in i32"))
    };
    for seq in 0..seq_lens.len() {
        let span = sequence_span(seq_lens, query_start, num_tokens, seq)?;
        for (_, position) in span.rows_and_positions() {
            slot_at(seq, position)?;
        }
    }
    slots.fill(-1);
    for seq in 0..seq_lens.len() {
        let span = sequence_span(seq_lens, query_start, num_tokens, seq)?;
        for (row, position) in span.rows_and_positions() {
            slots[row] = slot_at(seq, position)?;
        }
    }
    Ok(())
}

pub(crate) fn run_advance_seq_lens(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let mut views = launch.views()?;
    let query_start = views.i32("query_start");
    advance_seq_lens(views.i32_mut("seq_lens"), query_start).map_err(DeviceFailure::launch_failed)
}

pub(crate) fn run_derive_positions(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let mut views = launch.views()?;
    let (seq_lens, query_start) = (views.i32("seq_lens"), views.i32("query_start"));
    derive_positions(seq_lens, query_start, views.i32_mut("positions"))
        .map_err(DeviceFailure::launch_failed)
}

pub(crate) fn run_derive_slot_mapping(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let (blocks_per_seq, block_size) = (launch.dim("M"), launch.dim("bs"));
    let mut views = launch.views()?;
    let block_table = (views.i32("block_table"), blocks_per_seq);
    let (seq_lens, query_start) = (views.i32("seq_lens"), views.i32("query_start"));
    let slots = views.i32_mut("slot_mapping");
    derive_slot_mapping(block_table, seq_lens, query_start, block_size, slots)
        .map_err(DeviceFailure::launch_failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Sequence 0 computes a 2-token prefill chunk after 3 cached tokens, sequence 1 decodes
    // its 6th token, and the last row of the step is padding.
    const SEQ_LENS_BEFORE: [i32; 2] = [3, 5];
    const QUERY_START: [i32; 3] = [0, 2, 3];
    const NUM_TOKENS: usize = 4;
    const BLOCK_TABLE: [i32; 4] = [7, 2, 1, 9];

    #[test]
    fn device_maintained_inputs_for_a_mixed_step() {
        let mut seq_lens = SEQ_LENS_BEFORE;
        advance_seq_lens(&mut seq_lens, &QUERY_START).unwrap();
        assert_eq!(seq_lens, [5, 6]);
        let mut positions = [9; NUM_TOKENS];
        derive_positions(&seq_lens, &QUERY_START, &mut positions).unwrap();
        assert_eq!(positions, [3, 4, 5, 0]);
        let mut slots = [9; NUM_TOKENS];
        derive_slot_mapping((&BLOCK_TABLE, 2), &seq_lens, &QUERY_START, 4, &mut slots).unwrap();
        assert_eq!(slots, [7 * 4 + 3, 2 * 4, 9 * 4 + 1, -1]);
    }

    #[test]
    fn inconsistent_layouts_are_refused_without_writing() {
        let cases: [(&[i32], &[i32], &str); 4] = [
            (
                &[5, 6],
                &[0, 3, 2],
                "sequence 1: query_start gives tokens 3..2",
            ),
            (&[5, 6], &[0, 2, 5], "inside the 4 tokens"),
            (
                &[1, 6],
                &[0, 2, 3],
                "sequence 0: seq_len 1 is less than the 2 tokens",
            ),
            (
                &[5, 6],
                &[-1, 2, 3],
                "sequence 0: query_start gives tokens -1..2",
            ),
        ];
        for (seq_lens, query_start, expected) in cases {
            let mut positions = [9; NUM_TOKENS];
            let message = derive_positions(seq_lens, query_start, &mut positions).unwrap_err();
            assert!(message.contains(expected), "{message}");
            assert_eq!(positions, [9; NUM_TOKENS]);
        }
        let mut slots = [9; NUM_TOKENS];
        let message = derive_slot_mapping((&BLOCK_TABLE, 2), &[9, 6], &QUERY_START, 4, &mut slots)
            .unwrap_err();
        assert!(
            message.contains(
                "sequence 0: position 8 needs block 2, but the block table has 2 columns"
            ),
            "{message}"
        );
        assert_eq!(slots, [9; NUM_TOKENS]);
        let mut seq_lens = [1, i32::MAX];
        let message = advance_seq_lens(&mut seq_lens, &[0, 1, 2]).unwrap_err();
        assert!(message.contains("overflows"), "{message}");
        assert_eq!(seq_lens, [1, i32::MAX]);
    }
}
