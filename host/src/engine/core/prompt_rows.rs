//! Prompt rows in a step: how many of a chunk's logits rows report prompt logprobs, the cap that keeps every step's rows within the logits buffer, and what happens once a prompt is scored.

use crate::sched::Plan;

use super::super::request::{FinishReason, GenerationEvent};
use super::super::state::RequestState;
use super::EngineCore;

/// One sequence's reporting rows in a step's logits: rows `first_row..first_row + rows`
/// hold prompt positions `start..start + rows`.
#[derive(Debug, Clone, Copy)]
pub(super) struct ScoredChunk {
    pub id: u64,
    pub start: u32,
    pub rows: u32,
}

/// Whether the chunk `start..end` of `state` ends at its last token and a token is sampled
/// from it. A request with no output budget (`max_tokens: 0`, to score its prompt) samples none.
pub(super) fn emits(state: &RequestState, end: usize) -> bool {
    end == state.tokens().len() && state.request.max_tokens > 0
}

/// How many of the chunk's rows, from its first, report prompt logprobs.
pub(super) fn scored_rows(state: &RequestState, start: u32, end: u32) -> u32 {
    state
        .prompt_scores
        .as_ref()
        .map_or(0, |scores| scores.rows_in(start, end))
}

/// Every logits row the chunk of `num_tokens` tokens from `state`'s computed length needs.
fn logits_rows(state: &RequestState, num_tokens: u32) -> u32 {
    let start = state.num_computed;
    let end = start + num_tokens;
    scored_rows(state, start, end) + u32::from(emits(state, end as usize))
}

impl EngineCore {
    /// Shortens the prefill chunks of requests that score their prompt so the step's logits
    /// rows fit the logits buffer: every other sequence keeps its row, each scoring one keeps
    /// at least one token, and the spare rows go to scoring chunks in plan order. A shortened
    /// prompt goes on in the next steps.
    pub(super) fn fit_scored_rows(&self, plan: &mut Plan) {
        let cap = self.runtime.max_logits_rows();
        let scoring = |id: u64| self.requests.get(id).filter(|s| s.prompt_scores.is_some());
        let mut least = 0u32;
        for run in &plan.run {
            if let Some(state) = self.requests.get(run.id) {
                let tokens = match scoring(run.id) {
                    Some(_) => run.num_tokens.min(1),
                    None => run.num_tokens,
                };
                least += logits_rows(state, tokens);
            }
        }
        let mut spare = cap.saturating_sub(least);
        for run in &mut plan.run {
            let Some(state) = scoring(run.id) else {
                continue;
            };
            let floor = logits_rows(state, run.num_tokens.min(1));
            // A chunk's rows grow by at most one per token.
            run.num_tokens = run.num_tokens.min(1 + spare);
            spare = spare.saturating_sub(logits_rows(state, run.num_tokens).saturating_sub(floor));
        }
    }

    /// Reduces the step's reporting rows, which follow its `first_row` emitting rows, into
    /// their requests' prompt scores.
    pub(super) fn record_prompt_rows(&mut self, chunks: &[ScoredChunk], first_row: usize) {
        let vocab = self.runtime.model_info().vocab_size as usize;
        let mut row = first_row;
        for chunk in chunks {
            let Some(state) = self.requests.get_mut(chunk.id) else {
                row += chunk.rows as usize;
                continue;
            };
            for position in chunk.start as usize..(chunk.start + chunk.rows) as usize {
                if let Some(values) = self.logits.get(row * vocab..(row + 1) * vocab) {
                    state.score_prompt_row(position, values);
                }
                row += 1;
            }
        }
        // The sampler reads the emitting rows only.
        self.logits.truncate(first_row * vocab);
    }

    /// Requests of `scheduled` with no output budget whose prompt is now computed: their
    /// prompt logprobs go out, and they finish with `length` without sampling.
    pub(super) fn finish_scored_prompts(&mut self, scheduled: &[(u64, u32)]) {
        for &(id, _) in scheduled {
            let Some(state) = self.requests.get_mut(id) else {
                continue;
            };
            if state.request.max_tokens > 0 || (state.num_computed as usize) < state.prompt().len()
            {
                continue;
            }
            let prompt_logprobs = state.deliver_prompt_logprobs();
            self.output.send(
                &state.events,
                GenerationEvent::Delta {
                    text: String::new(),
                    token_ids: Vec::new(),
                    logprobs: Vec::new(),
                    prompt_logprobs,
                },
            );
            self.finish(id, FinishReason::Length);
        }
    }
}
