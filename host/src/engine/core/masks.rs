//! The engine's constrained-decoding step: masks computed while the device runs, then `logit_bias` and the mask applied to each row before the sampler, and every sampled token checked against its mask.

use std::sync::Arc;

use plughost_sdk::sampler::Sampled;

use crate::grammar::{MaskJobs, MaskState, MaskWorker};
use crate::plugins::generation::{LoadedSampler, Slot};
use crate::plugins::logits::{self, LogitsBatch, NativeRow};
use crate::plugins::sampler::SequenceToSample;
use crate::plugins::{OnFailure, PluginRejection};

use super::EngineCore;
use super::sample::SampledRow;

/// The engine's share of constrained decoding across steps.
#[derive(Default)]
pub struct StepMasks {
    /// Started at the first constrained step.
    worker: Option<MaskWorker>,
    /// The job vector between steps, so handing matchers over does not allocate.
    spare: MaskJobs,
    /// Requests whose grammar state was lost this step (the worker died with it).
    lost: Vec<u64>,
}

impl EngineCore {
    /// Hands the matchers of the rows that emit a token this step to the mask worker, which
    /// computes their masks while the device runs the step. Call before `execute`, and
    /// [`EngineCore::finish_masks`] after it on every path.
    pub(super) fn begin_masks(&mut self, scheduled: &[(u64, u32)]) {
        let mut jobs = std::mem::take(&mut self.masks.spare);
        jobs.clear();
        for &(id, n) in scheduled {
            let Some(state) = self.requests.get_mut(id) else {
                continue;
            };
            let emits = (state.num_computed + n) as usize == state.tokens().len();
            if emits && let Some(grammar) = state.grammar.take() {
                jobs.push((id, grammar));
            }
        }
        if jobs.is_empty() {
            self.masks.spare = jobs;
            return;
        }
        if self.masks.worker.is_none() {
            match MaskWorker::start() {
                Ok(worker) => self.masks.worker = Some(worker),
                Err(e) => tracing::warn!("cannot start the grammar mask thread: {e}"),
            }
        }
        let handed = match self.masks.worker.as_mut() {
            Some(worker) => worker.begin(jobs),
            None => Err(jobs),
        };
        if let Err(jobs) = handed {
            // No worker: the masks are computed when the rows are shaped, after the device.
            self.masks.worker = None;
            self.return_matchers(jobs);
        }
    }

    /// Takes the matchers back from the mask worker, their masks computed.
    pub(super) fn finish_masks(&mut self) {
        let started = std::time::Instant::now();
        let Some(worker) = self.masks.worker.as_mut().filter(|w| w.is_busy()) else {
            return;
        };
        let jobs = worker.finish();
        self.record(
            "mask_wait",
            crate::profile::Track::Host,
            started,
            started.elapsed(),
        );
        self.return_matchers(jobs);
    }

    fn return_matchers(&mut self, mut jobs: MaskJobs) {
        for (id, grammar) in jobs.drain(..) {
            if let Some(state) = self.requests.get_mut(id) {
                state.grammar = Some(grammar);
            }
        }
        self.masks.spare = jobs;
    }

    /// Applies each emitting row's `logit_bias`, then its grammar mask (forbidden tokens read
    /// `-inf`), to the logits in place, so every sampler and every fast path sees the shaped
    /// row. A row at a dead end keeps only the end-of-sequence token, so any sampler stays
    /// well-defined; the request ends there without emitting it.
    pub(super) fn shape_rows(&mut self, emitting: &[u64]) {
        let vocab = self.runtime.model_info().vocab_size as usize;
        self.masks.lost.clear();
        for (row, id) in emitting.iter().enumerate() {
            let Some(state) = self.requests.get_mut(*id) else {
                continue;
            };
            let Some(values) = self.logits.get_mut(row * vocab..(row + 1) * vocab) else {
                break;
            };
            state.request.logit_bias.apply(values);
            match state.grammar.as_mut() {
                Some(grammar) => {
                    // Computed here only when the worker could not take it.
                    grammar.compute_mask();
                    match grammar.state() {
                        MaskState::Ready => grammar.apply_mask(values),
                        _ => {
                            values.fill(f32::NEG_INFINITY);
                            if let Some(eos) = self.output.first_eos()
                                && let Some(v) = values.get_mut(eos as usize)
                            {
                                *v = 0.0;
                            }
                        }
                    }
                }
                // A grammar waiting out a reasoning block applies no mask yet.
                None if state.request.constraint.is_some() && state.dormant_grammar.is_none() => {
                    self.masks.lost.push(*id)
                }
                None => {}
            }
        }
    }

    /// Checks each sampled token against its row's mask. A token the mask forbids (a sampler
    /// plugin that ignored the `-inf`) is a fault of that sampler for that row, under its own
    /// policy: `fallback` replaces it with [`reject_forbidden_token`]'s native draw from the
    /// masked row, `reject` fails the request. `samplers[row]` is the row's plugin, if any.
    pub(super) fn enforce_masks(
        &mut self,
        batch: &mut LogitsBatch,
        emitting: &[u64],
        sequences: &[SequenceToSample],
        samplers: &[Option<Arc<LoadedSampler>>],
        sampled: &mut [SampledRow],
    ) {
        for (row, id) in emitting.iter().enumerate() {
            let (Some(state), Some(seq), Some(s)) = (
                self.requests.get(*id),
                sequences.get(row),
                sampled.get_mut(row),
            ) else {
                continue;
            };
            let Some(grammar) = state.grammar.as_deref() else {
                continue;
            };
            let (token, from_plugin) = match s {
                SampledRow::Token(t) => (t.token, true),
                SampledRow::Fallback { sampled, .. } => (sampled.token, false),
                SampledRow::Rejected(_) => continue,
            };
            if grammar.state() != &MaskState::Ready || grammar.allows(token) {
                continue;
            }
            let replacement = reject_forbidden_token(batch, row, seq);
            let allowed = grammar.allows(replacement.token);
            tracing::warn!(
                request = id,
                request_id = state.request_id(),
                rejected = token,
                replacement = replacement.token,
                "the sampler returned a token the request's grammar forbids"
            );
            self.metrics.grammar_rejections.inc();
            let replacement = if allowed {
                replacement
            } else {
                // Only a row of NaN could leave the native draw outside the mask.
                let token = batch.row(row).map_or(0, logits::argmax);
                Sampled {
                    token,
                    logprob: f32::NAN,
                    top_logprobs: Vec::new(),
                }
            };
            let plugin = samplers
                .get(row)
                .and_then(Option::as_ref)
                .filter(|_| from_plugin);
            *s = match plugin {
                None => SampledRow::Fallback {
                    sampled: replacement,
                    culprit: false,
                },
                Some(component) => {
                    let cause =
                        format!("returned token {token}, which the request's grammar forbids");
                    match component.row_faulted(&cause) {
                        OnFailure::Fallback => SampledRow::Fallback {
                            sampled: replacement,
                            culprit: false,
                        },
                        OnFailure::Reject => SampledRow::Rejected(PluginRejection::Faulted {
                            slot: Slot::Sampler,
                            plugin: component.name(),
                            cause,
                        }),
                    }
                }
            };
        }
    }

    /// Ends the requests whose grammar state was lost with the mask worker.
    pub(super) fn fail_lost_grammars(&mut self) {
        if self.masks.lost.is_empty() {
            return;
        }
        let lost = std::mem::take(&mut self.masks.lost);
        self.fail_requests(&lost, "the request's grammar state was lost");
        self.masks.lost = lost;
    }
}

/// A forbidden token's replacement: `row` sampled alone by the native standard sampler from
/// the masked row, with the request's own parameters, so the draw stays inside the mask.
fn reject_forbidden_token(
    batch: &mut LogitsBatch,
    row: usize,
    sequence: &SequenceToSample,
) -> Sampled {
    match batch.row_mut(row) {
        Some((values, history)) => {
            let native = NativeRow::new(values, history);
            plughost_sampler_standard::sample_sequence(
                &native,
                &sequence.params,
                sequence.request,
                sequence.position,
            )
        }
        None => Sampled {
            token: 0,
            logprob: f32::NAN,
            top_logprobs: Vec::new(),
        },
    }
}
