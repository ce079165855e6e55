//! The sampler world on the host side: one call per step for the whole batch, logits kept in host memory.

use std::path::Path;
use std::time::Duration;

use plughost_sdk::sampler::{Sampled, SamplingParams};
use wasmtime::component::Resource;

use super::generation::Slot;
use super::instance::{ContainedInstance, PluginState};
use super::logits::{LogitsBatch, LogitsBatchHandle};
use super::policy::{FaultPolicy, Unavailable};
use super::versioned::Versioned;
use super::{InstanceLimits, PluginError, PluginRuntime, PluginStats};

mod bindings;

type Bindings = Versioned<bindings::v0_1::Sampler, bindings::v0_2::Sampler>;

/// One sequence of a sampling call, in batch order.
#[derive(Debug, Clone, Copy)]
pub struct SequenceToSample {
    pub request: u64,
    /// Tokens the sequence generated before this one.
    pub position: u32,
    pub params: SamplingParams,
}

/// A loaded sampler plugin.
pub struct SamplerPlugin {
    instance: ContainedInstance<Bindings>,
    /// The values the last call's penalties overwrote, `(row, token, value)` in write order;
    /// its capacity is reused from call to call.
    undo: Vec<(u32, u32, f32)>,
}

impl super::generation::PluginWorld for SamplerPlugin {
    const WORLD: &'static str = "sampler";
    type Bindings = Bindings;
    fn from_instance(instance: ContainedInstance<Bindings>) -> Self {
        SamplerPlugin {
            instance,
            undo: Vec::new(),
        }
    }
}

/// Why the sampler gave a row no token. Either way the row's logits are as they came.
#[derive(Debug, Clone, PartialEq)]
pub enum RowFailure {
    /// No call reached the plugin: it is backed off or disabled.
    Unavailable(Unavailable),
    /// The plugin failed on this row; the text names the plugin and the cause.
    Faulted(String),
}

impl From<PluginError> for RowFailure {
    fn from(error: PluginError) -> Self {
        match error {
            PluginError::BackingOff { remaining_ms, .. } => {
                RowFailure::Unavailable(Unavailable::BackingOff {
                    remaining: Duration::from_millis(remaining_ms),
                })
            }
            PluginError::Disabled { backoffs, .. } => {
                RowFailure::Unavailable(Unavailable::Disabled { backoffs })
            }
            other => RowFailure::Faulted(other.to_string()),
        }
    }
}

/// How a batch call went wrong as a whole.
enum BatchFailure {
    /// The call never reached the plugin: it is backed off or disabled.
    Unavailable(PluginError),
    /// The plugin trapped, timed out, returned an error or the wrong number of tokens.
    Faulted(PluginError),
}

impl SamplerPlugin {
    pub fn load(
        runtime: &PluginRuntime,
        path: &Path,
        config: &str,
        limits: InstanceLimits,
    ) -> Result<Self, PluginError> {
        let mut instance = runtime.instantiate(path, config, limits)?;
        instance.set_fault_policy(Slot::Sampler, FaultPolicy::default_for(Slot::Sampler));
        Ok(SamplerPlugin {
            instance,
            undo: Vec::new(),
        })
    }

    pub fn stats(&self) -> PluginStats {
        self.instance.stats()
    }

    /// Samples one token per row of `logits`; `sequences[i]` describes row i. Any failure
    /// fails the whole batch (and counts one fault); [`SamplerPlugin::sample_rows`] finds the
    /// rows at fault instead.
    ///
    /// The logits move into the plugin's store for the call and back out,
    /// without copying; penalties rewrite them in place.
    pub fn sample(
        &mut self,
        logits: &mut LogitsBatch,
        sequences: &[SequenceToSample],
    ) -> Result<Vec<Sampled>, PluginError> {
        if logits.rows() != sequences.len() {
            return Err(PluginError::Runtime(format!(
                "sampling {} sequences over {} logits rows",
                sequences.len(),
                logits.rows()
            )));
        }
        let sampled = self
            .sample_batch(logits, sequences, true)
            .map_err(|(BatchFailure::Unavailable(e) | BatchFailure::Faulted(e))| e)?;
        let vocab = logits.vocab();
        if let Some(bad) = sampled.iter().find(|s| s.token >= vocab as u32) {
            let error = self.out_of_vocabulary(bad.token, vocab);
            self.instance.record_fault(&error);
            return Err(error);
        }
        Ok(sampled)
    }

    /// Samples one token per row, keeping a fault to the rows that cause it: after a batch
    /// fails (a trap, a timeout, an error, a wrong count), its rows are re-run one by one on a
    /// fresh instance, from their values as they came; only the rows that fail again get an
    /// error, the others keep the plugin's token. A batch failure counts one fault whatever
    /// the number of rows at fault; a row whose token falls outside the vocabulary counts one.
    /// On an error, the row's logits are as they came, so a fallback can sample them.
    pub fn sample_rows(
        &mut self,
        logits: &mut LogitsBatch,
        sequences: &[SequenceToSample],
    ) -> Vec<Result<Sampled, RowFailure>> {
        if logits.rows() != sequences.len() {
            let failure = RowFailure::Faulted(format!(
                "sampling {} sequences over {} logits rows",
                sequences.len(),
                logits.rows()
            ));
            return sequences.iter().map(|_| Err(failure.clone())).collect();
        }
        match self.sample_batch(logits, sequences, true) {
            Ok(sampled) => self.check_tokens(sampled, logits),
            Err(BatchFailure::Unavailable(error)) => {
                let failure = RowFailure::from(error);
                sequences.iter().map(|_| Err(failure.clone())).collect()
            }
            Err(BatchFailure::Faulted(error)) => {
                self.restore(logits);
                if sequences.len() == 1 {
                    return vec![Err(error.into())];
                }
                tracing::warn!(
                    plugin = %self.instance.name(),
                    rows = sequences.len(),
                    "the sampler failed a batch ({error}); re-running its rows one by one"
                );
                self.instance.reset();
                (0..sequences.len())
                    .map(|row| self.sample_alone(logits, sequences, row))
                    .collect()
            }
        }
    }

    /// Re-runs `row` by itself on the values it came with; the batch's row is left untouched.
    fn sample_alone(
        &mut self,
        logits: &mut LogitsBatch,
        sequences: &[SequenceToSample],
        row: usize,
    ) -> Result<Sampled, RowFailure> {
        let vocab = logits.vocab();
        let values = match logits.row(row) {
            Some(values) => values.to_vec(),
            None => vec![f32::NEG_INFINITY; vocab],
        };
        let mut single = LogitsBatch::new(values, vocab);
        if let Some(history) = logits.history(row) {
            single.set_history(0, history.clone());
        }
        let sampled = match self.sample_batch(&mut single, &sequences[row..=row], false) {
            Ok(sampled) => sampled,
            Err(BatchFailure::Unavailable(e) | BatchFailure::Faulted(e)) => {
                // A fresh instance for the next row, whatever this one left behind.
                self.instance.reset();
                return Err(e.into());
            }
        };
        match sampled.into_iter().next() {
            Some(s) if s.token < vocab as u32 => Ok(s),
            Some(s) => Err(self.out_of_vocabulary(s.token, vocab).into()),
            None => Err(RowFailure::Faulted(format!(
                "plugin {} returned no token for a single sequence",
                self.instance.name()
            ))),
        }
    }

    fn out_of_vocabulary(&self, token: u32, vocab: usize) -> PluginError {
        PluginError::Refused {
            plugin: self.instance.name().to_string(),
            message: format!("token {token} is outside the vocabulary of {vocab}"),
        }
    }

    /// Rows whose token is outside the vocabulary are at fault (one fault for the call) and
    /// get their logits back as they came; the others keep their token.
    fn check_tokens(
        &mut self,
        sampled: Vec<Sampled>,
        logits: &mut LogitsBatch,
    ) -> Vec<Result<Sampled, RowFailure>> {
        let vocab = logits.vocab();
        let Some(bad) = sampled.iter().find(|s| s.token >= vocab as u32) else {
            return sampled.into_iter().map(Ok).collect();
        };
        let error = self.out_of_vocabulary(bad.token, vocab);
        self.instance.record_fault(&error);
        let bad_rows: Vec<bool> = sampled.iter().map(|s| s.token >= vocab as u32).collect();
        self.restore_rows(logits, |row| bad_rows.get(row).copied().unwrap_or(false));
        sampled
            .into_iter()
            .map(|s| {
                if s.token < vocab as u32 {
                    Ok(s)
                } else {
                    Err(self.out_of_vocabulary(s.token, vocab).into())
                }
            })
            .collect()
    }

    /// Puts back what the last call's penalties overwrote, newest first, so each value ends
    /// as it came.
    fn restore(&mut self, logits: &mut LogitsBatch) {
        self.restore_rows(logits, |_| true);
    }

    /// [`SamplerPlugin::restore`] for the rows `which` picks.
    fn restore_rows(&mut self, logits: &mut LogitsBatch, which: impl Fn(usize) -> bool) {
        for &(row, token, value) in self.undo.iter().rev() {
            if !which(row as usize) {
                continue;
            }
            if let Some((values, _)) = logits.row_mut(row as usize)
                && let Some(v) = values.get_mut(token as usize)
            {
                *v = value;
            }
        }
        self.undo.clear();
    }

    /// One call over the whole of `logits`. `count` says whether a failure counts as a fault
    /// of the component (a re-run of a batch that already counted one does not).
    fn sample_batch(
        &mut self,
        logits: &mut LogitsBatch,
        sequences: &[SequenceToSample],
        count: bool,
    ) -> Result<Vec<Sampled>, BatchFailure> {
        let plugin = self.instance.name().to_string();
        let undo = &mut self.undo;
        undo.clear();
        let call = |world: &Bindings, store: &mut wasmtime::Store<PluginState>| {
            std::mem::swap(&mut store.data_mut().logits, logits);
            std::mem::swap(&mut store.data_mut().undo, undo);
            let outcome = (|| {
                let handle = store.data_mut().table().push(LogitsBatchHandle)?;
                let borrowed = Resource::<LogitsBatchHandle>::new_borrow(handle.rep());
                let result = match world {
                    Versioned::V0_1(world) => {
                        bindings::v0_1::sample(world, &mut *store, borrowed, sequences)
                    }
                    Versioned::V0_2(world) => {
                        bindings::v0_2::sample(world, &mut *store, borrowed, sequences)
                    }
                };
                store.data_mut().table().delete(handle)?;
                result
            })();
            std::mem::swap(&mut store.data_mut().logits, logits);
            std::mem::swap(&mut store.data_mut().undo, undo);
            outcome
        };
        let result = if count {
            self.instance.call(call)
        } else {
            self.instance.call_uncounted(call)
        };
        let failed = |error: PluginError| {
            if error.is_unavailable() {
                BatchFailure::Unavailable(error)
            } else {
                BatchFailure::Faulted(error)
            }
        };
        let returned = result.map_err(failed)?;
        let fault = match returned {
            Ok(sampled) if sampled.len() == sequences.len() => return Ok(sampled),
            Ok(sampled) => PluginError::Refused {
                plugin,
                message: format!("{} tokens for {} sequences", sampled.len(), sequences.len()),
            },
            Err(message) => PluginError::Plugin { plugin, message },
        };
        if count {
            self.instance.record_fault(&fault);
        }
        Err(BatchFailure::Faulted(fault))
    }
}
