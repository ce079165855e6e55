//! Prompt logprobs: each prompt token's log-probability given the tokens before it, reduced row by row from the prefill's own logits as its chunks are computed.
//!
//! The logits row of prompt position `p` is the model's distribution for the token at `p + 1`,
//! so a prompt of `L` tokens reports rows `0..L - 1`; row `L - 1` is the row the first output
//! token is sampled from. Each row is reduced at once to the chosen token's logprob and rank and
//! the top alternatives; no full row outlives its step. These are raw model distributions: the
//! prompt was given, so no bias, grammar or sampler applies to it.

use plughost_sdk::sampler::Candidate;

use crate::plugins::logits::{log_sum_exp, top_k};

use super::request::PromptLogprob;

/// A request's prompt logprobs while its prompt is computed.
#[derive(Debug)]
pub(super) struct PromptScores {
    num_top: u32,
    /// Per prompt position from the second on; a preempted prompt computed again overwrites
    /// its rows with the same values.
    rows: Vec<Option<PromptLogprob>>,
    /// Handed to the request's first event: nothing more is scored, whatever is recomputed.
    delivered: bool,
}

impl PromptScores {
    pub(super) fn new(num_top: u32, prompt_len: usize) -> PromptScores {
        PromptScores {
            num_top,
            rows: vec![None; prompt_len.saturating_sub(1)],
            delivered: false,
        }
    }

    /// How many of a chunk's rows, from its first, report a prompt logprob: the chunk covers
    /// positions `start..end`, and a position reports while a prompt token follows it.
    pub(super) fn rows_in(&self, start: u32, end: u32) -> u32 {
        if self.delivered {
            return 0;
        }
        let last = self.rows.len() as u32;
        end.min(last).saturating_sub(start)
    }

    /// Reduces the logits `row` of prompt position `position`, whose next token is `next`.
    pub(super) fn record(&mut self, position: usize, row: &[f32], next: u32) {
        if let Some(slot) = self.rows.get_mut(position) {
            *slot = Some(score_row(row, next, self.num_top));
        }
    }

    /// Every row's score, once the whole prompt is computed; after that, nothing more.
    pub(super) fn deliver(&mut self) -> Vec<PromptLogprob> {
        if self.delivered {
            return Vec::new();
        }
        self.delivered = true;
        std::mem::take(&mut self.rows)
            .into_iter()
            .map(|row| {
                row.unwrap_or(PromptLogprob {
                    token: 0,
                    logprob: f32::NAN,
                    rank: 0,
                    top: Vec::new(),
                })
            })
            .collect()
    }
}

/// `next`'s logprob and rank in `row`, and the `num_top` most likely tokens.
pub(super) fn score_row(row: &[f32], next: u32, num_top: u32) -> PromptLogprob {
    let lse = log_sum_exp(row, 1.0);
    let value = row.get(next as usize).copied().unwrap_or(f32::NEG_INFINITY);
    let rank = 1 + row.iter().filter(|&&v| v > value).count() as u32;
    let top = top_k(row, num_top)
        .into_iter()
        .map(|c| Candidate {
            id: c.id,
            value: c.value - lse,
        })
        .collect();
    PromptLogprob {
        token: next,
        logprob: value - lse,
        rank,
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_scores_its_next_token_against_the_whole_distribution() {
        let row = [0.0f32, 2.0, 1.0, 2.0];
        let lse = row.iter().map(|v| v.exp()).sum::<f32>().ln();
        let scored = score_row(&row, 2, 2);
        assert!((scored.logprob - (1.0 - lse)).abs() < 1e-5);
        assert_eq!(scored.rank, 3);
        assert_eq!(
            scored.top.iter().map(|c| c.id).collect::<Vec<_>>(),
            vec![1, 3]
        );
        assert!((scored.top[0].value - (2.0 - lse)).abs() < 1e-5);
        assert_eq!(score_row(&row, 1, 0).rank, 1);
    }

    #[test]
    fn chunks_report_the_rows_a_prompt_token_follows() {
        let mut scores = PromptScores::new(1, 5);
        assert_eq!(scores.rows_in(0, 3), 3);
        assert_eq!(scores.rows_in(3, 5), 1);
        assert_eq!(scores.rows_in(4, 5), 0);
        for p in 0..4 {
            scores.record(p, &[0.0, 1.0], 1);
        }
        assert_eq!(scores.deliver().len(), 4);
        assert_eq!(scores.rows_in(0, 5), 0);
        assert!(scores.deliver().is_empty());
    }
}
