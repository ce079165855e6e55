//! The sampler world on the host side: one call per step for the whole batch, logits kept in host memory.

use std::path::Path;

use plughost_sdk::sampler::{Candidate, Sampled, SamplingParams};
use wasmtime::component::Resource;

use super::instance::{ContainedInstance, PluginState};
use super::logits::{self, LogitsBatch, LogitsBatchHandle};
use super::{InstanceLimits, PluginError, PluginRuntime, PluginStats};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit/0.1",
        world: "sampler",
        with: { "plughost:plugin/sampling.logits-batch": crate::plugins::logits::LogitsBatchHandle },
        imports: { default: trappable },
    });
}

use bindings::plughost::plugin::sampling as wit;

/// One sequence of a sampling call, in batch order.
#[derive(Debug, Clone, Copy)]
pub struct SequenceToSample {
    pub request: u64,
    /// Tokens the sequence generated before this one.
    pub position: u32,
    pub params: SamplingParams,
}

super::instance::impl_world!(bindings::Sampler, SamplerPre, "sampler");

fn out_of_range(row: u32) -> wasmtime::Error {
    wasmtime::Error::msg(format!("logits row {row} is out of range"))
}

impl PluginState {
    fn logits_row(&self, row: u32) -> wasmtime::Result<&[f32]> {
        self.logits
            .row(row as usize)
            .ok_or_else(|| out_of_range(row))
    }
}

impl wit::Host for PluginState {}
impl bindings::plughost::plugin::types::Host for PluginState {}

impl wit::HostLogitsBatch for PluginState {
    fn rows(&mut self, _: Resource<LogitsBatchHandle>) -> wasmtime::Result<u32> {
        Ok(self.logits.rows() as u32)
    }
    fn vocab_size(&mut self, _: Resource<LogitsBatchHandle>) -> wasmtime::Result<u32> {
        Ok(self.logits.vocab() as u32)
    }
    fn argmax(&mut self, _: Resource<LogitsBatchHandle>, row: u32) -> wasmtime::Result<u32> {
        Ok(logits::argmax(self.logits_row(row)?))
    }
    fn top_k(
        &mut self,
        _: Resource<LogitsBatchHandle>,
        row: u32,
        k: u32,
    ) -> wasmtime::Result<Vec<wit::Candidate>> {
        let best = logits::top_k(self.logits_row(row)?, k);
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
        Ok(logits::read(self.logits_row(row)?, start, len))
    }
    fn log_softmax(
        &mut self,
        _: Resource<LogitsBatchHandle>,
        row: u32,
        ids: Vec<u32>,
        temperature: f32,
    ) -> wasmtime::Result<Vec<f32>> {
        Ok(logits::log_softmax(
            self.logits_row(row)?,
            &ids,
            temperature,
        ))
    }
    fn log_sum_exp(
        &mut self,
        _: Resource<LogitsBatchHandle>,
        row: u32,
        temperature: f32,
    ) -> wasmtime::Result<f32> {
        Ok(logits::log_sum_exp(self.logits_row(row)?, temperature))
    }
    fn sample_full(
        &mut self,
        _: Resource<LogitsBatchHandle>,
        row: u32,
        temperature: f32,
        u: f32,
    ) -> wasmtime::Result<u32> {
        Ok(logits::sample_full(self.logits_row(row)?, temperature, u))
    }
    fn sample_top_p(
        &mut self,
        _: Resource<LogitsBatchHandle>,
        row: u32,
        temperature: f32,
        top_p: f32,
        u: f32,
    ) -> wasmtime::Result<u32> {
        Ok(logits::sample_top_p(
            self.logits_row(row)?,
            temperature,
            top_p,
            u,
        ))
    }
    fn apply_penalties(
        &mut self,
        _: Resource<LogitsBatchHandle>,
        row: u32,
        penalties: wit::Penalties,
    ) -> wasmtime::Result<()> {
        let (values, history) = self
            .logits
            .row_mut(row as usize)
            .ok_or_else(|| out_of_range(row))?;
        let penalties = plughost_sdk::sampler::Penalties {
            presence: penalties.presence,
            frequency: penalties.frequency,
            repetition: penalties.repetition,
        };
        logits::apply_penalties(values, history, &penalties);
        Ok(())
    }
    fn drop(&mut self, handle: Resource<LogitsBatchHandle>) -> wasmtime::Result<()> {
        self.table().delete(handle)?;
        Ok(())
    }
}

fn params_to_wit(p: &SamplingParams) -> wit::SamplingParams {
    wit::SamplingParams {
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
    }
}

fn sampled_from_wit(s: wit::Sampled) -> Sampled {
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

/// A loaded sampler plugin.
pub struct SamplerPlugin {
    instance: ContainedInstance<bindings::Sampler>,
}

impl super::generation::PluginWorld for SamplerPlugin {
    const WORLD: &'static str = "sampler";
    type Bindings = bindings::Sampler;
    fn from_instance(instance: ContainedInstance<bindings::Sampler>) -> Self {
        SamplerPlugin { instance }
    }
}

impl SamplerPlugin {
    pub fn load(
        runtime: &PluginRuntime,
        path: &Path,
        config: &str,
        limits: InstanceLimits,
    ) -> Result<Self, PluginError> {
        Ok(SamplerPlugin {
            instance: runtime.instantiate(path, config, limits)?,
        })
    }

    pub fn stats(&self) -> PluginStats {
        self.instance.stats()
    }

    /// Samples one token per row of `logits`; `sequences[i]` describes row i.
    ///
    /// The logits move into the plugin's store for the call and back out,
    /// without copying; penalties rewrite them in place.
    pub fn sample(
        &mut self,
        logits: &mut LogitsBatch,
        sequences: &[SequenceToSample],
    ) -> Result<Vec<Sampled>, PluginError> {
        let plugin = self.instance.name().to_string();
        if logits.rows() != sequences.len() {
            return Err(PluginError::Runtime(format!(
                "sampling {} sequences over {} logits rows",
                sequences.len(),
                logits.rows()
            )));
        }
        let batch: Vec<wit::Sequence> = sequences
            .iter()
            .map(|s| wit::Sequence {
                request: s.request,
                position: s.position,
                params: params_to_wit(&s.params),
            })
            .collect();
        let result = self.instance.call(|world, store| {
            std::mem::swap(&mut store.data_mut().logits, logits);
            let outcome = (|| {
                let handle = store.data_mut().table().push(LogitsBatchHandle)?;
                let borrowed = Resource::<LogitsBatchHandle>::new_borrow(handle.rep());
                let result = world.call_sample(&mut *store, borrowed, &batch);
                store.data_mut().table().delete(handle)?;
                result
            })();
            std::mem::swap(&mut store.data_mut().logits, logits);
            outcome
        })?;
        let sampled = result.map_err(|message| PluginError::Plugin {
            plugin: plugin.clone(),
            message,
        })?;
        if sampled.len() != sequences.len() {
            return Err(PluginError::Plugin {
                plugin,
                message: format!(
                    "returned {} tokens for {} sequences",
                    sampled.len(),
                    sequences.len()
                ),
            });
        }
        let vocab = logits.vocab() as u32;
        if let Some(bad) = sampled.iter().find(|s| s.token >= vocab) {
            return Err(PluginError::Plugin {
                plugin,
                message: format!(
                    "returned token {} outside the vocabulary of {vocab}",
                    bad.token
                ),
            });
        }
        Ok(sampled.into_iter().map(sampled_from_wit).collect())
    }
}
