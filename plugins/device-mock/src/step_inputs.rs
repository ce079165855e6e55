//! The mock device's view of the device-maintained step inputs: the shared `plughost_device_abi::step_inputs`, with the derived inputs returned as new vectors since the mock copies its buffers in and out.

pub use plughost_device_abi::step_inputs::{
    StepInputError, advance_seq_lens, sequence_spans, slot_of,
};

use plughost_device_abi::step_inputs;

/// The position of each of the step's `num_tokens` rows, 0 for padding.
pub fn derive_positions(
    seq_lens: &[i32],
    query_start: &[i32],
    num_tokens: usize,
) -> Result<Vec<i32>, StepInputError> {
    let mut positions = vec![0; num_tokens];
    step_inputs::derive_positions(seq_lens, query_start, &mut positions)?;
    Ok(positions)
}

/// The cache slot of each of the step's `num_tokens` rows, -1 for padding; `block_table` is
/// `[S, blocks_per_seq]` row-major.
pub fn derive_slot_mapping(
    block_table: &[i32],
    blocks_per_seq: usize,
    seq_lens: &[i32],
    query_start: &[i32],
    block_size: usize,
    num_tokens: usize,
) -> Result<Vec<i32>, StepInputError> {
    let mut slots = vec![-1; num_tokens];
    step_inputs::derive_slot_mapping(
        (block_table, blocks_per_seq),
        seq_lens,
        query_start,
        block_size,
        &mut slots,
    )?;
    Ok(slots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_inputs_cover_every_row_of_the_step() {
        // Sequence 0 computes positions 3 and 4, sequence 1 position 5; row 3 is padding.
        let (seq_lens, query_start) = ([5, 6], [0, 2, 3]);
        assert_eq!(
            derive_positions(&seq_lens, &query_start, 4),
            Ok(vec![3, 4, 5, 0])
        );
        assert_eq!(
            derive_slot_mapping(&[7, 2, 1, 9], 2, &seq_lens, &query_start, 4, 4),
            Ok(vec![7 * 4 + 3, 2 * 4, 9 * 4 + 1, -1])
        );
        let error = derive_positions(&[1, 6], &query_start, 4).unwrap_err();
        assert!(
            error.message().contains("seq_len 1 is less than"),
            "{error}"
        );
    }
}
