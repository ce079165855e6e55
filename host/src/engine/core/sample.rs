//! Sampling a step: one sampler call per deployment generation over the emitting rows, each row's failure handled by its sampler's policy.

use std::sync::Arc;

use plughost_sdk::sampler::{Sampled, SamplingParams};

use crate::plugins::generation::{LoadedSampler, Slot};
use crate::plugins::logits::{LogitsBatch, NativeRow};
use crate::plugins::sampler::{RowFailure, SequenceToSample};
use crate::plugins::{OnFailure, PluginRejection};

use super::EngineCore;

impl EngineCore {
    /// Samples one token per emitting request, each with the sampler of the generation it
    /// started with. One generation (the usual case) samples the whole batch in one call;
    /// while requests of several generations run, each generation samples its own rows.
    pub(super) fn sample(&mut self, emitting: &[u64]) -> Vec<SampledRow> {
        let vocab = self.runtime.model_info().vocab_size as usize;
        self.shape_rows(emitting);
        let mut batch = LogitsBatch::new(std::mem::take(&mut self.logits), vocab);
        let mut sequences = Vec::with_capacity(emitting.len());
        let mut samplers: Vec<Option<Arc<LoadedSampler>>> = Vec::with_capacity(emitting.len());
        for (row, id) in emitting.iter().enumerate() {
            let Some(state) = self.requests.get(*id) else {
                continue;
            };
            // Shared, not copied: the request counts its tokens as they come.
            if let Some(seen) = state.seen_tokens() {
                batch.set_history(row, seen.clone());
            }
            sequences.push(SequenceToSample {
                request: *id,
                position: state.output().len() as u32,
                // Log-probabilities cost a pass over the row; only requests that return them pay it.
                params: SamplingParams {
                    logprobs: state.request.logprobs,
                    ..state.request.sampling
                },
            });
            // A request whose own row failed the plugin under `fallback` stays native.
            samplers.push(match state.sampler_fallback.native_from_now_on {
                true => None,
                false => state.sampler.clone(),
            });
        }
        let same = |a: &Option<Arc<LoadedSampler>>, b: &Option<Arc<LoadedSampler>>| match (a, b) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        let mut sampled = match samplers.first() {
            Some(first) if samplers.iter().any(|s| !same(s, first)) => {
                self.sample_by_generation(&mut batch, &sequences, &samplers, same)
            }
            first => {
                let sampler = first.cloned().flatten();
                self.sample_with(sampler.as_deref(), &mut batch, &sequences)
            }
        };
        self.enforce_masks(&mut batch, emitting, &sequences, &samplers, &mut sampled);
        self.logits = batch.into_values();
        self.fail_lost_grammars();
        sampled
    }

    /// Splits the batch by sampler, samples each part, and puts the tokens back in row order.
    fn sample_by_generation(
        &mut self,
        batch: &mut LogitsBatch,
        sequences: &[SequenceToSample],
        samplers: &[Option<Arc<LoadedSampler>>],
        same: impl Fn(&Option<Arc<LoadedSampler>>, &Option<Arc<LoadedSampler>>) -> bool,
    ) -> Vec<SampledRow> {
        let vocab = batch.vocab();
        let mut out: Vec<Option<SampledRow>> = vec![None; sequences.len()];
        let mut done = vec![false; sequences.len()];
        for first in 0..sequences.len() {
            if done[first] {
                continue;
            }
            let rows: Vec<usize> = (first..sequences.len())
                .filter(|&r| !done[r] && same(&samplers[r], &samplers[first]))
                .collect();
            let mut values = Vec::with_capacity(rows.len() * vocab);
            for &r in &rows {
                values.extend_from_slice(batch.row(r).unwrap_or(&[]));
            }
            let mut part = LogitsBatch::new(values, vocab);
            for (i, &r) in rows.iter().enumerate() {
                if let Some(history) = batch.history(r) {
                    part.set_history(i, history.clone());
                }
            }
            let part_sequences: Vec<SequenceToSample> =
                rows.iter().map(|&r| sequences[r]).collect();
            let sampled = self.sample_with(samplers[first].as_deref(), &mut part, &part_sequences);
            for (&r, s) in rows.iter().zip(sampled) {
                out[r] = Some(s);
                done[r] = true;
            }
        }
        out.into_iter()
            .map(|s| {
                s.unwrap_or(SampledRow::Token(Sampled {
                    token: 0,
                    logprob: f32::NEG_INFINITY,
                    top_logprobs: Vec::new(),
                }))
            })
            .collect()
    }

    /// Samples `batch` with `sampler`, or natively when there is none. A row the plugin failed
    /// (alone: the plugin isolates its culprits) or could not take (backed off, disabled) gets
    /// the component's failure policy: the native standard sampler under `fallback`, a
    /// rejection under `reject`. The other rows keep the plugin's tokens.
    fn sample_with(
        &mut self,
        sampler: Option<&LoadedSampler>,
        batch: &mut LogitsBatch,
        sequences: &[SequenceToSample],
    ) -> Vec<SampledRow> {
        let Some(component) = sampler else {
            return (0..sequences.len())
                .map(|row| SampledRow::Token(native_sample_row(batch, sequences, row)))
                .collect();
        };
        let rows = component.plugin().sample_rows(batch, sequences);
        let on_failure = component.faults().on_failure();
        let mut out = Vec::with_capacity(rows.len());
        for (row, result) in rows.into_iter().enumerate() {
            out.push(match result {
                Ok(sampled) => SampledRow::Token(sampled),
                Err(failure) => match on_failure {
                    OnFailure::Fallback => {
                        self.metrics.sampler_fallbacks.inc();
                        SampledRow::Fallback {
                            sampled: native_sample_row(batch, sequences, row),
                            culprit: matches!(failure, RowFailure::Faulted(_)),
                        }
                    }
                    OnFailure::Reject => {
                        SampledRow::Rejected(rejection(Slot::Sampler, component.name(), failure))
                    }
                },
            });
        }
        out
    }
}

/// What sampling gave one emitting row.
#[derive(Debug, Clone)]
pub(in crate::engine) enum SampledRow {
    Token(Sampled),
    /// Sampled natively because the sampler failed the row (`culprit`: on the row's own
    /// input) or is backed off, under its `fallback` policy.
    Fallback {
        sampled: Sampled,
        culprit: bool,
    },
    /// The sampler failed the row and its policy is `reject`.
    Rejected(PluginRejection),
}

/// How a request hears that the plugin `plugin` in `slot` failed it under a `reject` policy.
pub(super) fn rejection(slot: Slot, plugin: String, failure: RowFailure) -> PluginRejection {
    match failure {
        RowFailure::Unavailable(u) => PluginRejection::unavailable(slot, &plugin, u),
        RowFailure::Faulted(cause) => PluginRejection::Faulted {
            slot,
            plugin,
            cause,
        },
    }
}

/// The standard sampler run natively on one row: what a deployment without a sampler plugin
/// runs, and the fallback of one that fails.
fn native_sample_row(
    batch: &mut LogitsBatch,
    sequences: &[SequenceToSample],
    row: usize,
) -> Sampled {
    match (batch.row_mut(row), sequences.get(row)) {
        (Some((values, history)), Some(seq)) => {
            let native = NativeRow::new(values, history);
            plughost_sampler_standard::sample_sequence(
                &native,
                &seq.params,
                seq.request,
                seq.position,
            )
        }
        _ => Sampled {
            token: 0,
            logprob: f32::NEG_INFINITY,
            top_logprobs: Vec::new(),
        },
    }
}
