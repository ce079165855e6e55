//! The device-maintained step inputs: advancing seq lens and deriving positions and slot mappings from them, with the real values.
//!
//! Every function takes `seq_lens` that already count this step's tokens (the program runs
//! `advance_seq_lens` first), so sequence `i` computes positions
//! `seq_lens[i] - query_len .. seq_lens[i]` where `query_len = query_start[i+1] - query_start[i]`.
//! Tokens of the step that no sequence covers are padding: position 0, slot -1.

use std::ops::Range;

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
}

/// Checks the step layout and returns each sequence's span.
pub fn sequence_spans(
    seq_lens: &[i32],
    query_start: &[i32],
    num_tokens: usize,
) -> Result<Vec<SequenceSpan>, String> {
    let mut spans = Vec::with_capacity(seq_lens.len());
    for (seq, &seq_len) in seq_lens.iter().enumerate() {
        let (start, end) = (query_start[seq], query_start[seq + 1]);
        // Chaining start <= end per sequence also makes query_start non-decreasing.
        if start < 0 || end < start || end as usize > num_tokens {
            return Err(format!(
                "sequence {seq}: query_start gives tokens {start}..{end}, \
                 which is not a range inside the {num_tokens} tokens of the step"
            ));
        }
        let query_len = end - start;
        if seq_len < query_len {
            return Err(format!(
                "sequence {seq}: seq_len {seq_len} is less than the {query_len} tokens it computes this step"
            ));
        }
        spans.push(SequenceSpan {
            tokens: start as usize..end as usize,
            first_position: (seq_len - query_len) as usize,
        });
    }
    Ok(spans)
}

/// `seq_lens[i] += query_start[i+1] - query_start[i]`.
pub fn advance_seq_lens(seq_lens: &mut [i32], query_start: &[i32]) -> Result<(), String> {
    for (seq, seq_len) in seq_lens.iter_mut().enumerate() {
        let (start, end) = (query_start[seq], query_start[seq + 1]);
        let query_len = end
            .checked_sub(start)
            .filter(|len| *len >= 0)
            .ok_or_else(|| {
                format!("sequence {seq}: query_start {start}..{end} is not an increasing range")
            })?;
        if *seq_len < 0 {
            return Err(format!("sequence {seq}: seq_len is negative ({seq_len})"));
        }
        *seq_len = seq_len.checked_add(query_len).ok_or_else(|| {
            format!("sequence {seq}: seq_len {seq_len} + {query_len} overflows i32")
        })?;
    }
    Ok(())
}

pub fn derive_positions(
    seq_lens: &[i32],
    query_start: &[i32],
    num_tokens: usize,
) -> Result<Vec<i32>, String> {
    let mut positions = vec![0; num_tokens];
    for span in sequence_spans(seq_lens, query_start, num_tokens)? {
        for (row, position) in span.rows_and_positions() {
            // position < seq_len, which is an i32.
            positions[row] = position as i32;
        }
    }
    Ok(positions)
}

/// `block_table` is `[S, blocks_per_seq]` row-major.
pub fn derive_slot_mapping(
    block_table: &[i32],
    blocks_per_seq: usize,
    seq_lens: &[i32],
    query_start: &[i32],
    block_size: usize,
    num_tokens: usize,
) -> Result<Vec<i32>, String> {
    let mut slots = vec![-1; num_tokens];
    for (seq, span) in sequence_spans(seq_lens, query_start, num_tokens)?
        .into_iter()
        .enumerate()
    {
        let row = &block_table[seq * blocks_per_seq..(seq + 1) * blocks_per_seq];
        for (token, position) in span.rows_and_positions() {
            let slot = slot_of(row, block_size, position)
                .map_err(|problem| format!("sequence {seq}: {problem}"))?;
            slots[token] = i32::try_from(slot)
                .map_err(|_| format!("sequence {seq}: slot {slot} does not fit in i32"))?;
        }
    }
    Ok(slots)
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
        assert_eq!(
            derive_positions(&seq_lens, &QUERY_START, NUM_TOKENS).unwrap(),
            vec![3, 4, 5, 0]
        );
        assert_eq!(
            derive_slot_mapping(&BLOCK_TABLE, 2, &seq_lens, &QUERY_START, 4, NUM_TOKENS).unwrap(),
            vec![7 * 4 + 3, 2 * 4, 9 * 4 + 1, -1]
        );
    }

    #[test]
    fn inconsistent_layouts_are_refused() {
        let cases: [(&[i32], &[i32], usize, &str); 4] = [
            (
                &[5, 6],
                &[0, 3, 2],
                4,
                "sequence 1: query_start gives tokens 3..2",
            ),
            (&[5, 6], &[0, 2, 5], 4, "inside the 4 tokens"),
            (
                &[1, 6],
                &[0, 2, 3],
                4,
                "sequence 0: seq_len 1 is less than the 2 tokens",
            ),
            (
                &[5, 6],
                &[-1, 2, 3],
                4,
                "sequence 0: query_start gives tokens -1..2",
            ),
        ];
        for (seq_lens, query_start, num_tokens, expected) in cases {
            let message = derive_positions(seq_lens, query_start, num_tokens).unwrap_err();
            assert!(message.contains(expected), "{message}");
        }
        let message = derive_slot_mapping(&[7, 2, 1, 9], 2, &[9, 6], &[0, 2, 3], 4, 4).unwrap_err();
        assert!(
            message.contains(
                "sequence 0: position 8 needs block 2, but the block table has 2 columns"
            ),
            "{message}"
        );
        let message = advance_seq_lens(&mut [i32::MAX], &[0, 1]).unwrap_err();
        assert!(message.contains("overflows"), "{message}");
    }
}
