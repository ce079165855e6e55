//! The device-maintained step inputs (`advance_seq_lens`, `derive_positions`, `derive_slot_mapping`) and the per-sequence token spans they and paged attention read the step layout through.
//!
//! A step packs the tokens of `S` sequences into one batch of `T` rows: sequence `i` computes
//! rows `query_start[i]..query_start[i+1]`. Every function but [`advance_seq_lens`] takes
//! `seq_lens` that already count this step's tokens (the program runs `advance_seq_lens`
//! first), so sequence `i` computes positions `seq_lens[i] - query_len .. seq_lens[i]`,
//! `query_len = query_start[i+1] - query_start[i]`. Rows that no sequence covers are padding:
//! position 0, slot -1.
//!
//! These are the semantics of the callables in [`crate::callables`], so every device computes
//! the same inputs. Each function checks all of its input before writing anything, so a failed
//! launch leaves its outputs as they were. The export layer has checked the shapes; a layout
//! that still does not fit (a short `query_start`, say) is a [`StepInputError`], never a panic.

use std::fmt;
use std::ops::Range;

use crate::export::DeviceFailure;

/// Why a step's inputs cannot be used. Devices report it as LAUNCH_FAILED.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepInputError(String);

impl StepInputError {
    fn new(message: impl Into<String>) -> StepInputError {
        StepInputError(message.into())
    }

    fn in_sequence(seq: usize, problem: impl fmt::Display) -> StepInputError {
        StepInputError(format!("sequence {seq}: {problem}"))
    }

    pub fn message(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StepInputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StepInputError {}

impl From<StepInputError> for DeviceFailure {
    fn from(error: StepInputError) -> DeviceFailure {
        DeviceFailure::launch_failed(error.0)
    }
}

/// Kernels that gather their data-dependent problems as messages (to report them as
/// LAUNCH_FAILED once) take a step-input problem as one more message.
impl From<StepInputError> for String {
    fn from(error: StepInputError) -> String {
        error.0
    }
}

/// The rows one sequence computes in the step batch.
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

/// `query_start[seq]..query_start[seq + 1]` as a pair, if `query_start` has both entries.
fn query_bounds(query_start: &[i32], seq: usize) -> Result<(i32, i32), StepInputError> {
    match (query_start.get(seq), query_start.get(seq + 1)) {
        (Some(&start), Some(&end)) => Ok((start, end)),
        _ => Err(StepInputError::in_sequence(
            seq,
            format_args!("query_start has only {} entries", query_start.len()),
        )),
    }
}

/// The span of sequence `seq`, checked against the step's `num_tokens` rows.
pub fn sequence_span(
    seq_lens: &[i32],
    query_start: &[i32],
    num_tokens: usize,
    seq: usize,
) -> Result<SequenceSpan, StepInputError> {
    let (start, end) = query_bounds(query_start, seq)?;
    // Chaining start <= end per sequence also makes query_start non-decreasing.
    if start < 0 || end < start || end as usize > num_tokens {
        return Err(StepInputError::in_sequence(
            seq,
            format_args!(
                "query_start gives tokens {start}..{end}, \
                 which is not a range inside the {num_tokens} tokens of the step"
            ),
        ));
    }
    let &seq_len = seq_lens.get(seq).ok_or_else(|| {
        StepInputError::in_sequence(
            seq,
            format_args!("seq_lens has only {} entries", seq_lens.len()),
        )
    })?;
    let query_len = end - start;
    if seq_len < query_len {
        return Err(StepInputError::in_sequence(
            seq,
            format_args!(
                "seq_len {seq_len} is less than the {query_len} tokens it computes this step"
            ),
        ));
    }
    Ok(SequenceSpan {
        tokens: start as usize..end as usize,
        first_position: (seq_len - query_len) as usize,
    })
}

/// The span of every sequence of the step, in order; the first bad one is the error.
pub fn sequence_spans(
    seq_lens: &[i32],
    query_start: &[i32],
    num_tokens: usize,
) -> Result<Vec<SequenceSpan>, StepInputError> {
    (0..seq_lens.len())
        .map(|seq| sequence_span(seq_lens, query_start, num_tokens, seq))
        .collect()
}

/// The cache slot of `position` given one sequence's row of the block table.
///
/// Checks that the row has the block and that it is not negative; whether the block exists in
/// the cache is the caller's to check, since only it knows the number of blocks.
pub fn slot_of(
    block_row: &[i32],
    block_size: usize,
    position: usize,
) -> Result<usize, StepInputError> {
    if block_size == 0 {
        return Err(StepInputError::new("the block size is 0"));
    }
    let block_index = position / block_size;
    let &block = block_row.get(block_index).ok_or_else(|| {
        StepInputError::new(format!(
            "position {position} needs block {block_index}, but the block table has {} columns",
            block_row.len()
        ))
    })?;
    if block < 0 {
        return Err(StepInputError::new(format!(
            "position {position} needs block table entry {block_index}, which is {block}"
        )));
    }
    (block as usize)
        .checked_mul(block_size)
        .map(|start| start + position % block_size)
        .ok_or_else(|| {
            StepInputError::new(format!(
                "block {block} times block size {block_size} overflows"
            ))
        })
}

/// `seq_lens[i] += query_start[i+1] - query_start[i]`, for seq lens that do not yet count this
/// step's tokens.
pub fn advance_seq_lens(seq_lens: &mut [i32], query_start: &[i32]) -> Result<(), StepInputError> {
    let advanced = |seq: usize, seq_len: i32| {
        let (start, end) = query_bounds(query_start, seq)?;
        let query_len = end
            .checked_sub(start)
            .filter(|len| *len >= 0)
            .ok_or_else(|| {
                StepInputError::in_sequence(
                    seq,
                    format_args!("query_start {start}..{end} is not an increasing range"),
                )
            })?;
        if seq_len < 0 {
            return Err(StepInputError::in_sequence(
                seq,
                format_args!("seq_len is negative ({seq_len})"),
            ));
        }
        seq_len.checked_add(query_len).ok_or_else(|| {
            StepInputError::in_sequence(
                seq,
                format_args!("seq_len {seq_len} + {query_len} overflows i32"),
            )
        })
    };
    for (seq, &seq_len) in seq_lens.iter().enumerate() {
        advanced(seq, seq_len)?;
    }
    for (seq, seq_len) in seq_lens.iter_mut().enumerate() {
        *seq_len = advanced(seq, *seq_len)?;
    }
    Ok(())
}

/// Writes the position of every row of the step (`positions.len()` rows), 0 for padding.
pub fn derive_positions(
    seq_lens: &[i32],
    query_start: &[i32],
    positions: &mut [i32],
) -> Result<(), StepInputError> {
    let spans = sequence_spans(seq_lens, query_start, positions.len())?;
    positions.fill(0);
    for span in &spans {
        for (row, position) in span.rows_and_positions() {
            // position < seq_len, which is an i32.
            positions[row] = position as i32;
        }
    }
    Ok(())
}

/// Writes the cache slot of every row of the step (`slots.len()` rows), -1 for padding.
///
/// `block_table` is the `[S, blocks_per_seq]` row-major table and its number of columns.
pub fn derive_slot_mapping(
    (block_table, blocks_per_seq): (&[i32], usize),
    seq_lens: &[i32],
    query_start: &[i32],
    block_size: usize,
    slots: &mut [i32],
) -> Result<(), StepInputError> {
    let spans = sequence_spans(seq_lens, query_start, slots.len())?;
    let slot_at = |seq: usize, position: usize| {
        let columns = seq * blocks_per_seq..(seq + 1) * blocks_per_seq;
        let row = block_table.get(columns).ok_or_else(|| {
            StepInputError::in_sequence(
                seq,
                format_args!(
                    "the block table has {} entries, too few for a row of {blocks_per_seq}",
                    block_table.len()
                ),
            )
        })?;
        let slot = slot_of(row, block_size, position)
            .map_err(|problem| StepInputError::in_sequence(seq, problem))?;
        i32::try_from(slot).map_err(|_| {
            StepInputError::in_sequence(seq, format_args!("slot {slot} does not fit in i32"))
        })
    };
    for (seq, span) in spans.iter().enumerate() {
        for (_, position) in span.rows_and_positions() {
            slot_at(seq, position)?;
        }
    }
    slots.fill(-1);
    for (seq, span) in spans.iter().enumerate() {
        for (row, position) in span.rows_and_positions() {
            slots[row] = slot_at(seq, position)?;
        }
    }
    Ok(())
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
    fn spans_give_rows_positions_and_lengths() {
        let spans = sequence_spans(&[5, 6], &QUERY_START, NUM_TOKENS).unwrap();
        let rows_and_positions: Vec<Vec<(usize, usize)>> = spans
            .iter()
            .map(|span| span.rows_and_positions().collect())
            .collect();
        assert_eq!(rows_and_positions, [vec![(0, 3), (1, 4)], vec![(2, 5)]]);
        let seq_lens: Vec<usize> = spans.iter().map(SequenceSpan::seq_len).collect();
        assert_eq!(seq_lens, [5, 6]);
    }

    #[test]
    fn inconsistent_layouts_are_refused_without_writing() {
        let cases: [(&[i32], &[i32], &str); 5] = [
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
            (
                &[5, 6],
                &[0, 2],
                "sequence 1: query_start has only 2 entries",
            ),
        ];
        for (seq_lens, query_start, expected) in cases {
            let mut positions = [9; NUM_TOKENS];
            let error = derive_positions(seq_lens, query_start, &mut positions).unwrap_err();
            assert!(error.message().contains(expected), "{error}");
            assert_eq!(positions, [9; NUM_TOKENS]);
            let mut slots = [9; NUM_TOKENS];
            let error =
                derive_slot_mapping((&BLOCK_TABLE, 2), seq_lens, query_start, 4, &mut slots)
                    .unwrap_err();
            assert!(error.message().contains(expected), "{error}");
            assert_eq!(slots, [9; NUM_TOKENS]);
        }
    }

    #[test]
    fn unmappable_slots_are_refused_without_writing() {
        // Block tables of 2 columns; position 8 of sequence 0 needs a third block.
        let cases: [(&[i32], &[i32], usize, &str); 4] = [
            (
                &BLOCK_TABLE,
                &[9, 6],
                4,
                "sequence 0: position 8 needs block 2, but the block table has 2 columns",
            ),
            (
                &[7, -1, 1, 9],
                &[5, 6],
                4,
                "sequence 0: position 4 needs block table entry 1, which is -1",
            ),
            (
                &BLOCK_TABLE[..3],
                &[5, 6],
                4,
                "sequence 1: the block table has 3 entries, too few for a row of 2",
            ),
            (&BLOCK_TABLE, &[5, 6], 0, "sequence 0: the block size is 0"),
        ];
        for (block_table, seq_lens, block_size, expected) in cases {
            let mut slots = [9; NUM_TOKENS];
            let error = derive_slot_mapping(
                (block_table, 2),
                seq_lens,
                &QUERY_START,
                block_size,
                &mut slots,
            )
            .unwrap_err();
            assert!(error.message().contains(expected), "{error}");
            assert_eq!(slots, [9; NUM_TOKENS]);
        }
    }

    #[test]
    fn bad_seq_lens_are_not_advanced() {
        let cases: [(&[i32], &[i32], &str); 3] = [
            (
                &[1, i32::MAX],
                &[0, 1, 2],
                "sequence 1: seq_len 2147483647 + 1 overflows",
            ),
            (
                &[1, 2],
                &[0, 2, 1],
                "sequence 1: query_start 2..1 is not an increasing range",
            ),
            (&[1, -2], &[0, 1, 2], "sequence 1: seq_len is negative (-2)"),
        ];
        for (seq_lens_before, query_start, expected) in cases {
            let mut seq_lens = seq_lens_before.to_vec();
            let error = advance_seq_lens(&mut seq_lens, query_start).unwrap_err();
            assert!(error.message().contains(expected), "{error}");
            assert_eq!(seq_lens, seq_lens_before);
        }
    }

    #[test]
    fn errors_become_launch_failures() {
        let error = StepInputError::new("the block size is 0");
        let failure = DeviceFailure::from(error.clone());
        assert_eq!(failure.status(), crate::status::LAUNCH_FAILED);
        assert_eq!(failure.message(), "the block size is 0");
        assert_eq!(String::from(error), "the block size is 0");
    }
}
