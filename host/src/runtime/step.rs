//! One step's batch as the runtime takes it, the host-side staging of its step inputs, and its timing.

use std::time::Duration;

use super::RuntimeError;
use super::extents::Extents;

/// One sequence's part of a step.
#[derive(Debug, Clone, Copy)]
pub struct StepSequence<'a> {
    /// Identifies the sequence across steps, so unchanged inputs are not written again.
    pub id: u64,
    /// Tokens computed this step: a prefill chunk or the one token of a decode.
    pub tokens: &'a [u32],
    /// Tokens whose KV entries are already in the cache.
    pub computed_len: u32,
    /// The sequence's KV blocks, covering at least `computed_len + tokens.len()` tokens.
    pub block_table: &'a [u32],
    /// Whether the step returns a logits row for the sequence's last token.
    pub emit: bool,
}

/// Where one step's time went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTiming {
    /// Building the step inputs on the host.
    pub prepare_inputs: Duration,
    /// Writing inputs, binding arguments, launching and waiting for the step's end, minus
    /// device time and the logits copy: in a worker process, the round trip is here, and the
    /// caller's work while the device runs (the engine sends the previous step's events).
    pub dispatch: Duration,
    /// Time the device reports for the step's launches.
    pub device: Duration,
    /// Copying the logits rows into host memory (from a worker process, out of the shared
    /// region, which the step's last reply filled).
    pub read_logits: Duration,
}

/// Host-side copies of the step inputs the host fills, reused every step.
#[derive(Debug, Default)]
pub struct StepStaging {
    pub token_ids: Vec<i32>,
    pub query_start: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub block_table: Vec<i32>,
    pub logits_indices: Vec<i32>,
    /// The sequence in each batch slot.
    pub slot_ids: Vec<u64>,
    /// Block-table entries each slot uses.
    pub row_lens: Vec<usize>,
}

/// The limits a step is checked against.
#[derive(Debug, Clone, Copy)]
pub struct StepLimits {
    pub max: Extents,
    pub vocab: u32,
}

fn invalid(message: String) -> RuntimeError {
    RuntimeError::Step(message)
}

impl StepStaging {
    /// Checks the batch and lays its inputs out; returns the step's extents. After the emitting
    /// rows, the logits also hold, for each sequence `i`, its first `scored[i]` rows (rows of
    /// prompt positions whose logprobs a request asked for), in batch order; a missing entry
    /// is 0. Every logits row counts against the rows the logits buffer was prepared for.
    pub fn fill_scored(
        &mut self,
        batch: &[StepSequence<'_>],
        scored: &[u32],
        limits: &StepLimits,
    ) -> Result<Extents, RuntimeError> {
        let extents = self.fill(batch, limits)?;
        for (i, (seq, &rows)) in batch.iter().zip(scored).enumerate() {
            if rows as usize > seq.tokens.len() {
                return Err(invalid(format!(
                    "sequence {i} reports {rows} rows of a {}-token chunk",
                    seq.tokens.len()
                )));
            }
            let first = self.query_start[i];
            self.logits_indices
                .extend((0..rows as i32).map(|row| first + row));
        }
        if self.logits_indices.len() as u64 > limits.max.emitting {
            return Err(invalid(format!(
                "{} logits rows, prepared for {}",
                self.logits_indices.len(),
                limits.max.emitting
            )));
        }
        Ok(Extents {
            emitting: self.logits_indices.len() as u64,
            ..extents
        })
    }

    /// Checks the batch and lays its inputs out; returns the step's extents.
    pub fn fill(
        &mut self,
        batch: &[StepSequence<'_>],
        limits: &StepLimits,
    ) -> Result<Extents, RuntimeError> {
        let max = limits.max;
        if batch.is_empty() {
            return Err(invalid("the batch is empty".into()));
        }
        if batch.len() as u64 > max.sequences {
            return Err(invalid(format!(
                "{} sequences, prepared for {}",
                batch.len(),
                max.sequences
            )));
        }
        let width = max.blocks_per_sequence as usize;
        self.token_ids.clear();
        self.query_start.clear();
        self.seq_lens.clear();
        self.logits_indices.clear();
        self.block_table.clear();
        self.slot_ids.clear();
        self.row_lens.clear();
        self.block_table.resize(batch.len() * width, 0);
        self.query_start.push(0);
        for (i, seq) in batch.iter().enumerate() {
            if seq.tokens.is_empty() {
                return Err(invalid(format!("sequence {i} computes no tokens")));
            }
            let end = seq.computed_len as u64 + seq.tokens.len() as u64;
            let needed = end.div_ceil(max.block_size);
            if needed > seq.block_table.len() as u64 || seq.block_table.len() > width {
                return Err(invalid(format!(
                    "sequence {i} needs {needed} KV blocks for {end} tokens, has {} (at most {width})",
                    seq.block_table.len()
                )));
            }
            if let Some(&bad) = seq.block_table.iter().find(|&&b| b as u64 >= max.kv_blocks) {
                return Err(invalid(format!(
                    "sequence {i} names KV block {bad} of {}",
                    max.kv_blocks
                )));
            }
            if let Some(&bad) = seq.tokens.iter().find(|&&t| t >= limits.vocab) {
                return Err(invalid(format!(
                    "sequence {i} has token {bad} outside the vocabulary of {}",
                    limits.vocab
                )));
            }
            let row = &mut self.block_table[i * width..i * width + seq.block_table.len()];
            for (slot, &block) in row.iter_mut().zip(seq.block_table) {
                *slot = block as i32;
            }
            self.slot_ids.push(seq.id);
            self.row_lens.push(seq.block_table.len());
            self.token_ids.extend(seq.tokens.iter().map(|&t| t as i32));
            self.seq_lens.push(seq.computed_len as i32);
            if seq.emit {
                self.logits_indices.push(self.token_ids.len() as i32 - 1);
            }
            self.query_start.push(self.token_ids.len() as i32);
        }
        if self.token_ids.len() as u64 > max.tokens {
            return Err(invalid(format!(
                "{} tokens, prepared for {}",
                self.token_ids.len(),
                max.tokens
            )));
        }
        Ok(Extents {
            tokens: self.token_ids.len() as u64,
            sequences: batch.len() as u64,
            emitting: self.logits_indices.len() as u64,
            ..max
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(emitting: u64) -> StepLimits {
        StepLimits {
            max: Extents {
                tokens: 64,
                sequences: 4,
                emitting,
                kv_blocks: 16,
                block_size: 4,
                blocks_per_sequence: 8,
            },
            vocab: 100,
        }
    }

    #[test]
    fn scored_rows_follow_the_emitting_rows_within_the_logits_buffer() {
        let prefill = [1u32, 2, 3, 4, 5];
        let decode = [6u32];
        let batch = [
            StepSequence {
                id: 1,
                tokens: &prefill,
                computed_len: 0,
                block_table: &[0, 1],
                emit: false,
            },
            StepSequence {
                id: 2,
                tokens: &decode,
                computed_len: 3,
                block_table: &[2],
                emit: true,
            },
        ];
        let mut staging = StepStaging::default();
        let extents = staging
            .fill_scored(&batch, &[3, 0], &limits(4))
            .expect("fits");
        // The decode's row first, then the prefill's first three positions.
        assert_eq!(staging.logits_indices, vec![5, 0, 1, 2]);
        assert_eq!(extents.emitting, 4);
        assert!(staging.fill_scored(&batch, &[4, 0], &limits(4)).is_err());
        assert!(staging.fill_scored(&batch, &[6, 0], &limits(8)).is_err());
    }
}
