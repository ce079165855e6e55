//! The sampler world's bindings in each contract version: the host's `logits-batch` resource and the records of one call.
//!
//! The sampling interface has the same shape in 0.1 and 0.2, so one definition serves both:
//! each version's module expands [`sampling_world!`] with the folder of its WIT.

use plughost_sdk::sampler::{Candidate, Penalties, Sampled};
use wasmtime::component::Resource;

use super::super::instance::PluginState;
use super::super::logits::{self, LogitsBatchHandle};
use super::super::versioned::impl_world_bindings;
use super::SequenceToSample;

fn out_of_range(row: u32) -> wasmtime::Error {
    wasmtime::Error::msg(format!("logits row {row} is out of range"))
}

impl PluginState {
    fn logits_row(&self, row: u32) -> wasmtime::Result<&[f32]> {
        self.logits
            .row(row as usize)
            .ok_or_else(|| out_of_range(row))
    }

    fn penalise(&mut self, row: u32, penalties: &Penalties) -> wasmtime::Result<()> {
        let (values, history) = self
            .logits
            .row_mut(row as usize)
            .ok_or_else(|| out_of_range(row))?;
        // Penalties rewrite the row in place; keep what they overwrite, so a failed call can
        // hand the rows back as they came (culprit isolation and the fallback need them).
        // They touch each distinct token once, so those are all there is to keep.
        let undo = &mut self.undo;
        for &t in history.distinct() {
            if let Some(&v) = values.get(t as usize) {
                undo.push((row, t, v));
            }
        }
        logits::apply_penalties(values, history, penalties);
        Ok(())
    }
}

/// One version's sampler bindings, generated from the WIT in folder `$wit`, with everything
/// they need from the host.
macro_rules! sampling_world {
    ($wit:tt) => {
        mod bindings {
            wasmtime::component::bindgen!({
                path: $wit,
                world: "sampler",
                with: { "plughost:plugin/sampling.logits-batch": crate::plugins::logits::LogitsBatchHandle },
                imports: { default: trappable },
            });
        }
        pub(crate) use bindings::Sampler;
        use bindings::plughost::plugin::sampling as wit;

        use super::*;

        impl_world_bindings!(bindings::Sampler, SamplerPre, "sampler");

        impl wit::Host for PluginState {}
        impl bindings::plughost::plugin::types::Host for PluginState {}

        fn penalties(p: wit::Penalties) -> Penalties {
            Penalties {
                presence: p.presence,
                frequency: p.frequency,
                repetition: p.repetition,
            }
        }

        impl wit::HostLogitsBatch for PluginState {
            fn rows(&mut self, _: Resource<LogitsBatchHandle>) -> wasmtime::Result<u32> {
                Ok(self.logits.rows() as u32)
            }
            fn vocab_size(&mut self, _: Resource<LogitsBatchHandle>) -> wasmtime::Result<u32> {
                Ok(self.logits.vocab() as u32)
            }
            fn argmax(
                &mut self,
                _: Resource<LogitsBatchHandle>,
                row: u32,
            ) -> wasmtime::Result<u32> {
                self.host_work(|s| Ok(logits::argmax(s.logits_row(row)?)))
            }
            fn top_k(
                &mut self,
                _: Resource<LogitsBatchHandle>,
                row: u32,
                k: u32,
            ) -> wasmtime::Result<Vec<wit::Candidate>> {
                let best = self.host_work(|s| {
                    Ok::<_, wasmtime::Error>(logits::top_k(s.logits_row(row)?, k))
                })?;
                Ok(best
                    .into_iter()
                    .map(|c| wit::Candidate {
                        id: c.id,
                        value: c.value,
                    })
                    .collect())
            }
            fn read(
                &mut self,
                _: Resource<LogitsBatchHandle>,
                row: u32,
                start: u32,
                len: u32,
            ) -> wasmtime::Result<Vec<f32>> {
                self.host_work(|s| Ok(logits::read(s.logits_row(row)?, start, len)))
            }
            fn log_softmax(
                &mut self,
                _: Resource<LogitsBatchHandle>,
                row: u32,
                ids: Vec<u32>,
                temperature: f32,
            ) -> wasmtime::Result<Vec<f32>> {
                self.host_work(|s| Ok(logits::log_softmax(s.logits_row(row)?, &ids, temperature)))
            }
            fn log_sum_exp(
                &mut self,
                _: Resource<LogitsBatchHandle>,
                row: u32,
                temperature: f32,
            ) -> wasmtime::Result<f32> {
                self.host_work(|s| Ok(logits::log_sum_exp(s.logits_row(row)?, temperature)))
            }
            fn sample_full(
                &mut self,
                _: Resource<LogitsBatchHandle>,
                row: u32,
                temperature: f32,
                u: f32,
            ) -> wasmtime::Result<u32> {
                self.host_work(|s| Ok(logits::sample_full(s.logits_row(row)?, temperature, u)))
            }
            fn sample_top_p(
                &mut self,
                _: Resource<LogitsBatchHandle>,
                row: u32,
                temperature: f32,
                top_p: f32,
                u: f32,
            ) -> wasmtime::Result<u32> {
                self.host_work(|s| {
                    Ok(logits::sample_top_p(
                        s.logits_row(row)?,
                        temperature,
                        top_p,
                        u,
                    ))
                })
            }
            fn apply_penalties(
                &mut self,
                _: Resource<LogitsBatchHandle>,
                row: u32,
                p: wit::Penalties,
            ) -> wasmtime::Result<()> {
                self.host_work(|s| s.penalise(row, &penalties(p)))
            }
            fn drop(&mut self, handle: Resource<LogitsBatchHandle>) -> wasmtime::Result<()> {
                self.table().delete(handle)?;
                Ok(())
            }
        }

        fn sequence(s: &SequenceToSample) -> wit::Sequence {
            let p = &s.params;
            wit::Sequence {
                request: s.request,
                position: s.position,
                params: wit::SamplingParams {
                    temperature: p.temperature,
                    top_k: p.top_k,
                    top_p: p.top_p,
                    min_p: p.min_p,
                    penalties: wit::Penalties {
                        presence: p.penalties.presence,
                        frequency: p.penalties.frequency,
                        repetition: p.penalties.repetition,
                    },
                    seed: p.seed,
                    logprobs: p.logprobs,
                    num_top_logprobs: p.num_top_logprobs,
                },
            }
        }

        fn sampled(s: wit::Sampled) -> Sampled {
            Sampled {
                token: s.token,
                logprob: s.logprob,
                top_logprobs: s
                    .top_logprobs
                    .into_iter()
                    .map(|c| Candidate {
                        id: c.id,
                        value: c.value,
                    })
                    .collect(),
            }
        }

        /// Samples `sequences` over the logits batch the store holds, which the guest sees
        /// through the borrowed handle `batch`.
        pub(crate) fn sample(
            world: &Sampler,
            store: &mut wasmtime::Store<PluginState>,
            batch: Resource<LogitsBatchHandle>,
            sequences: &[SequenceToSample],
        ) -> wasmtime::Result<Result<Vec<Sampled>, String>> {
            let sequences: Vec<wit::Sequence> = sequences.iter().map(sequence).collect();
            let returned = world.call_sample(store, batch, &sequences)?;
            Ok(returned.map(|list| list.into_iter().map(sampled).collect()))
        }
    };
}

/// `plughost:plugin@0.1`: the same records as 0.2.
pub(crate) mod v0_1 {
    sampling_world!("../wit/0.1");
}

/// `plughost:plugin@0.2`, the host's own.
pub(crate) mod v0_2 {
    sampling_world!("../wit/0.2");
}
