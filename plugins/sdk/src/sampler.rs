//! Sampler plugins: host-owned logits rows, per-sequence parameters, and the export glue.

use crate::scheduler::RequestId;

mod rng;
pub mod testing;

pub use rng::{RowRng, Uniform};

/// A candidate token with a score (a raw logit or a log-probability).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: u32,
    pub value: f32,
}

/// Penalties from the host's record of the sequence's tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
    pub repetition: f32,
}

impl Penalties {
    /// Penalties that change nothing.
    pub const NONE: Penalties = Penalties {
        presence: 0.0,
        frequency: 0.0,
        repetition: 1.0,
    };

    pub fn is_none(&self) -> bool {
        self.presence == 0.0 && self.frequency == 0.0 && self.repetition == 1.0
    }
}

/// How one sequence wants to be sampled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// 1.0 disables top-p.
    pub top_p: f32,
    /// 0 disables min-p.
    pub min_p: f32,
    pub penalties: Penalties,
    pub seed: u64,
    /// Compute log-probabilities; when false `Sampled::logprob` is NaN.
    pub logprobs: bool,
    pub num_top_logprobs: u32,
}

impl SamplingParams {
    /// Greedy decoding with nothing else enabled.
    pub const GREEDY: SamplingParams = SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        penalties: Penalties::NONE,
        seed: 0,
        logprobs: false,
        num_top_logprobs: 0,
    };
}

/// The token chosen for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Log-probability of `token` under softmax of the raw logits.
    pub logprob: f32,
    pub top_logprobs: Vec<Candidate>,
}

/// One row of logits owned by the host; every method runs natively in the host.
///
/// Inside a component this is the WIT `logits` resource; in native tests and
/// benchmarks any in-memory row can implement it.
pub trait LogitsRow {
    fn len(&self) -> u32;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Index of the largest logit, lowest index on ties.
    fn argmax(&self) -> u32;
    /// The `k` largest logits, largest first.
    fn top_k(&self, k: u32) -> Vec<Candidate>;
    /// A copy of up to `len` logits from `start`.
    fn read(&self, start: u32, len: u32) -> Vec<f32>;
    /// Log-probabilities of `ids` under softmax(logits / temperature).
    fn log_softmax(&self, ids: &[u32], temperature: f32) -> Vec<f32>;
    /// ln Σ exp(logit / temperature) over the row.
    fn log_sum_exp(&self, temperature: f32) -> f32;
    /// Inverse-CDF draw from softmax(logits / temperature) with uniform `u`.
    fn sample_full(&self, temperature: f32, u: f32) -> u32;
    /// Inverse-CDF draw with uniform `u` from the nucleus (the fewest most likely tokens whose
    /// probability under softmax(logits / temperature) reaches `top_p`), in index order.
    fn sample_top_p(&self, temperature: f32, top_p: f32, u: f32) -> u32;
    /// Rewrites the row in place with the sequence's penalties.
    fn apply_penalties(&self, penalties: &Penalties);
}

/// One row of the batch to sample.
pub struct Sequence<'a> {
    pub request: RequestId,
    /// Tokens generated before this one.
    pub position: u32,
    pub params: SamplingParams,
    pub logits: &'a dyn LogitsRow,
}

impl Sequence<'_> {
    /// This sequence's random stream at this position, keyed by the request's seed: the same
    /// numbers whatever batch or step the sequence lands in.
    pub fn rng(&self) -> RowRng {
        RowRng::new(self.params.seed, self.position)
    }
}

/// Implemented by a sampler plugin. One value lives per plugin instance.
pub trait Sampler: Sized + 'static {
    /// Builds the sampler from its JSON config (may be empty).
    fn init(config: &str) -> Result<Self, String>;
    /// Samples one token per sequence, in order.
    fn sample(&mut self, batch: &[Sequence<'_>]) -> Result<Vec<Sampled>, String>;
}

#[cfg(feature = "sampler")]
#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "wit",
        world: "sampler",
        pub_export_macro: true,
        export_macro_name: "export_sampler_world",
        default_bindings_module: "plughost_sdk::sampler::bindings",
    });
}

/// The conversions between one contract version's generated sampling records (`wit` where it
/// is expanded) and the SDK's types: `Row`, a row of the host's logits batch, `params` and
/// `sampled`. The SDK expands it over its own bindings; a component bound to another version
/// can expand it over its own.
#[doc(hidden)]
#[macro_export]
macro_rules! __sampling_adapter {
    () => {
        use $crate::sampler::{Candidate, LogitsRow, Penalties, Sampled, SamplingParams};

        fn penalties_to_wit(p: &Penalties) -> wit::Penalties {
            wit::Penalties {
                presence: p.presence,
                frequency: p.frequency,
                repetition: p.repetition,
            }
        }

        fn penalties(p: wit::Penalties) -> Penalties {
            Penalties {
                presence: p.presence,
                frequency: p.frequency,
                repetition: p.repetition,
            }
        }

        fn candidates(list: Vec<wit::Candidate>) -> Vec<Candidate> {
            list.into_iter()
                .map(|c| Candidate {
                    id: c.id,
                    value: c.value,
                })
                .collect()
        }

        /// One row of the host's logits batch.
        pub struct Row<'a> {
            pub batch: &'a wit::LogitsBatch,
            pub row: u32,
        }

        impl LogitsRow for Row<'_> {
            fn len(&self) -> u32 {
                self.batch.vocab_size()
            }
            fn argmax(&self) -> u32 {
                self.batch.argmax(self.row)
            }
            fn top_k(&self, k: u32) -> Vec<Candidate> {
                candidates(self.batch.top_k(self.row, k))
            }
            fn read(&self, start: u32, len: u32) -> Vec<f32> {
                self.batch.read(self.row, start, len)
            }
            fn log_softmax(&self, ids: &[u32], temperature: f32) -> Vec<f32> {
                self.batch.log_softmax(self.row, ids, temperature)
            }
            fn log_sum_exp(&self, temperature: f32) -> f32 {
                self.batch.log_sum_exp(self.row, temperature)
            }
            fn sample_full(&self, temperature: f32, u: f32) -> u32 {
                self.batch.sample_full(self.row, temperature, u)
            }
            fn sample_top_p(&self, temperature: f32, top_p: f32, u: f32) -> u32 {
                self.batch.sample_top_p(self.row, temperature, top_p, u)
            }
            fn apply_penalties(&self, p: &Penalties) {
                self.batch.apply_penalties(self.row, penalties_to_wit(p))
            }
        }

        pub fn params(p: wit::SamplingParams) -> SamplingParams {
            SamplingParams {
                temperature: p.temperature,
                top_k: p.top_k,
                top_p: p.top_p,
                min_p: p.min_p,
                penalties: penalties(p.penalties),
                seed: p.seed,
                logprobs: p.logprobs,
                num_top_logprobs: p.num_top_logprobs,
            }
        }

        pub fn sampled(s: Sampled) -> wit::Sampled {
            wit::Sampled {
                token: s.token,
                logprob: s.logprob,
                top_logprobs: s
                    .top_logprobs
                    .into_iter()
                    .map(|c| wit::Candidate {
                        id: c.id,
                        value: c.value,
                    })
                    .collect(),
            }
        }
    };
}

#[cfg(feature = "sampler")]
#[doc(hidden)]
pub mod adapter {
    use super::bindings::plughost::plugin::sampling as wit;

    crate::__sampling_adapter!();
}

/// Exports a [`Sampler`] implementation as the component's `sampler` world.
#[cfg(feature = "sampler")]
#[macro_export]
macro_rules! export_sampler {
    ($ty:ty) => {
        thread_local! {
            static __PLUGHOST_SAMPLER: $crate::__private::RefCell<Option<$ty>> =
                const { $crate::__private::RefCell::new(None) };
        }

        struct __PlughostSamplerExport;

        impl $crate::sampler::bindings::Guest for __PlughostSamplerExport {
            fn init(config: String) -> Result<(), String> {
                let value = <$ty as $crate::sampler::Sampler>::init(&config)?;
                __PLUGHOST_SAMPLER.with(|cell| *cell.borrow_mut() = Some(value));
                Ok(())
            }

            fn sample(
                logits: &$crate::sampler::bindings::plughost::plugin::sampling::LogitsBatch,
                batch: Vec<$crate::sampler::bindings::plughost::plugin::sampling::Sequence>,
            ) -> Result<Vec<$crate::sampler::bindings::plughost::plugin::sampling::Sampled>, String>
            {
                // Asking the host for a row it does not have would trap;
                // a mismatched batch is an error the host can report.
                let num_rows = logits.rows();
                if usize::try_from(num_rows).ok() != Some(batch.len()) {
                    return Err(format!(
                        "batch of {} sequences but {} logits rows",
                        batch.len(),
                        num_rows
                    ));
                }
                let rows: Vec<$crate::sampler::adapter::Row<'_>> = (0..batch.len() as u32)
                    .map(|row| $crate::sampler::adapter::Row { batch: logits, row })
                    .collect();
                let sequences: Vec<$crate::sampler::Sequence<'_>> = batch
                    .iter()
                    .zip(&rows)
                    .map(|(s, row)| $crate::sampler::Sequence {
                        request: s.request,
                        position: s.position,
                        params: $crate::sampler::adapter::params(s.params),
                        logits: row,
                    })
                    .collect();
                let sampled = __PLUGHOST_SAMPLER.with(|cell| match cell.borrow_mut().as_mut() {
                    Some(s) => $crate::sampler::Sampler::sample(s, &sequences),
                    None => Err("sampler called before init".to_string()),
                })?;
                Ok(sampled
                    .into_iter()
                    .map($crate::sampler::adapter::sampled)
                    .collect())
            }
        }

        $crate::sampler::bindings::export_sampler_world!(__PlughostSamplerExport);
    };
}
