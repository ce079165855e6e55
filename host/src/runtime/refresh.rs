//! Refresh policies of the pooled step inputs: a mirror of what the device holds, and the smallest writes that make it current.
//!
//! Token ids are written every step. Query offsets, logits indices and
//! block-table rows are written only where they changed (for a running
//! decode, a block-table row changes only when it crosses a page boundary).
//! Sequence lengths are advanced by the program on the device, so the host
//! writes one only when a slot's sequence changed or its length differs from
//! what the device computed (a join, a finish, a preemption).

use std::ops::Range;

use super::step::StepStaging;

/// Which step input a write goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputKind {
    TokenIds,
    QueryStart,
    LogitsIndices,
    BlockTable,
    SeqLens,
}

/// Elements `range` of `kind`'s host staging go to the same elements of its device buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputWrite {
    pub kind: InputKind,
    pub range: Range<usize>,
}

/// What the device's step-input buffers hold after the last successful step.
#[derive(Debug, Default)]
pub struct InputMirror {
    valid: bool,
    query_start: Vec<i32>,
    logits_indices: Vec<i32>,
    block_table: Vec<i32>,
    /// Sequence lengths after the device advanced them.
    seq_lens: Vec<i32>,
    slot_ids: Vec<u64>,
}

/// The element ranges where `new` differs from `old` (longer `new` differs past `old`'s end).
fn changed_runs(old: &[i32], new: &[i32], base: usize, out: &mut Vec<Range<usize>>) {
    let mut i = 0;
    while i < new.len() {
        if old.get(i) == Some(&new[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < new.len() && old.get(i) != Some(&new[i]) {
            i += 1;
        }
        out.push(base + start..base + i);
    }
}

impl InputMirror {
    /// Forgets what the device holds, so the next step writes everything (after a failed step).
    pub fn invalidate(&mut self) {
        self.valid = false;
    }

    /// The writes that bring the device up to `staging` for a step of sequences `slot_ids`,
    /// whose block-table rows use `row_lens` entries each (`width` entries per row).
    pub fn writes<'a>(
        &'a self,
        staging: &StepStaging,
        slot_ids: &[u64],
        row_lens: &[usize],
        width: usize,
    ) -> Vec<InputWrite> {
        let mut writes = vec![InputWrite {
            kind: InputKind::TokenIds,
            range: 0..staging.token_ids.len(),
        }];
        let mut runs = Vec::new();
        let empty: [i32; 0] = [];
        // What the device holds; nothing is known after a failed step.
        let old = |v: &'a [i32]| -> &'a [i32] { if self.valid { v } else { &[] } };
        for (kind, old_values, new_values) in [
            (
                InputKind::QueryStart,
                old(&self.query_start),
                &staging.query_start,
            ),
            (
                InputKind::LogitsIndices,
                old(&self.logits_indices),
                &staging.logits_indices,
            ),
        ] {
            runs.clear();
            changed_runs(old_values, new_values, 0, &mut runs);
            writes.extend(runs.drain(..).map(|range| InputWrite { kind, range }));
        }
        for (slot, &id) in slot_ids.iter().enumerate() {
            let same_sequence = self.valid && self.slot_ids.get(slot) == Some(&id);
            let row = slot * width..slot * width + row_lens[slot];
            let old_row = if same_sequence {
                self.block_table.get(row.clone()).unwrap_or(&empty)
            } else {
                &empty
            };
            changed_runs(
                old_row,
                &staging.block_table[row.clone()],
                row.start,
                &mut runs,
            );
            writes.extend(runs.drain(..).map(|range| InputWrite {
                kind: InputKind::BlockTable,
                range,
            }));
            let device_len = if same_sequence {
                self.seq_lens.get(slot)
            } else {
                None
            };
            if device_len != Some(&staging.seq_lens[slot]) {
                writes.push(InputWrite {
                    kind: InputKind::SeqLens,
                    range: slot..slot + 1,
                });
            }
        }
        writes
    }

    /// Records what the device holds once the step ran: inputs as written, lengths advanced.
    pub fn step_done(
        &mut self,
        staging: &StepStaging,
        slot_ids: &[u64],
        row_lens: &[usize],
        width: usize,
    ) {
        self.valid = true;
        self.query_start.clone_from(&staging.query_start);
        self.logits_indices.clone_from(&staging.logits_indices);
        self.block_table
            .resize(staging.block_table.len().max(self.block_table.len()), 0);
        for (slot, &len) in row_lens.iter().enumerate() {
            let row = slot * width..slot * width + len;
            self.block_table[row.clone()].copy_from_slice(&staging.block_table[row]);
        }
        self.slot_ids.clear();
        self.slot_ids.extend_from_slice(slot_ids);
        self.seq_lens.clear();
        self.seq_lens.extend(
            staging
                .seq_lens
                .iter()
                .zip(staging.query_start.windows(2))
                .map(|(len, q)| len + (q[1] - q[0])),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn staging(seqs: &[(u32, &[i32], usize)], width: usize) -> (StepStaging, Vec<usize>) {
        // (computed_len, blocks, tokens this step)
        let mut s = StepStaging::default();
        s.query_start.push(0);
        s.block_table.resize(seqs.len() * width, 0);
        let mut lens = Vec::new();
        for (i, (computed, blocks, n)) in seqs.iter().enumerate() {
            s.block_table[i * width..i * width + blocks.len()].copy_from_slice(blocks);
            lens.push(blocks.len());
            s.seq_lens.push(*computed as i32);
            s.token_ids.extend(std::iter::repeat_n(7, *n));
            s.logits_indices.push(s.token_ids.len() as i32 - 1);
            s.query_start.push(s.token_ids.len() as i32);
        }
        (s, lens)
    }

    fn kinds(writes: &[InputWrite]) -> Vec<(InputKind, Range<usize>)> {
        writes.iter().map(|w| (w.kind, w.range.clone())).collect()
    }

    #[test]
    fn a_steady_decode_writes_token_ids_and_rows_that_cross_a_page_only() {
        use InputKind::*;
        let width = 4;
        let mut mirror = InputMirror::default();
        let (first, lens) = staging(&[(5, &[3, 4], 1), (2, &[9], 1)], width);
        let all = mirror.writes(&first, &[10, 11], &lens, width);
        assert!(all.iter().any(|w| w.kind == SeqLens) && all.iter().any(|w| w.kind == BlockTable));
        mirror.step_done(&first, &[10, 11], &lens, width);
        // Both advance by one; the first crosses into a third block (block size 3 → position 6... any new entry).
        let (next, lens) = staging(&[(6, &[3, 4, 8], 1), (3, &[9], 1)], width);
        let writes = mirror.writes(&next, &[10, 11], &lens, width);
        assert_eq!(kinds(&writes), vec![(TokenIds, 0..2), (BlockTable, 2..3)]);
    }

    #[test]
    fn a_changed_batch_rewrites_only_the_affected_slots() {
        use InputKind::*;
        let width = 4;
        let mut mirror = InputMirror::default();
        let (first, lens) = staging(&[(5, &[3, 4], 1), (2, &[9], 1)], width);
        mirror.step_done(&first, &[10, 11], &lens, width);
        // Sequence 11 finished; 12 joins with a 3-token prefill in slot 1.
        let (next, lens) = staging(&[(6, &[3, 4], 1), (0, &[1], 3)], width);
        let writes = mirror.writes(&next, &[10, 12], &lens, width);
        assert_eq!(
            kinds(&writes),
            vec![
                (TokenIds, 0..4),
                (QueryStart, 2..3),
                (LogitsIndices, 1..2),
                (BlockTable, 4..5),
                (SeqLens, 1..2)
            ]
        );
        mirror.invalidate();
        assert!(mirror.writes(&next, &[10, 12], &lens, width).len() > writes.len());
    }
}
