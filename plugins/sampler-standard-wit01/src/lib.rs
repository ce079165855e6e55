//! The standard sampler as a `plughost:plugin@0.1.0` component: the algorithm of `sampler-standard`, exported through the 0.1 contract.
//!
//! It is a fixture: the host speaks 0.2 and runs this component through its 0.1 adapter, and
//! the tests check that it samples the tokens the 0.2 build of the same algorithm does.

#![cfg(target_arch = "wasm32")]

#[path = "../../sampler-standard/src/sample.rs"]
mod sample;

use plughost::plugin::sampling as wit;
use plughost_sdk::sampler::{Candidate, LogitsRow, Penalties, SamplingParams};

wit_bindgen::generate!({
    path: "../../wit/0.1",
    world: "sampler",
});

/// One row of the host's logits batch, through the 0.1 resource.
struct Row<'a> {
    batch: &'a wit::LogitsBatch,
    row: u32,
}

fn candidates(list: Vec<wit::Candidate>) -> Vec<Candidate> {
    list.into_iter()
        .map(|c| Candidate {
            id: c.id,
            value: c.value,
        })
        .collect()
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
        let p = wit::Penalties {
            presence: p.presence,
            frequency: p.frequency,
            repetition: p.repetition,
        };
        self.batch.apply_penalties(self.row, p)
    }
}

struct Standard;

impl Guest for Standard {
    fn init(config: String) -> Result<(), String> {
        match config.trim() {
            "" | "{}" => Ok(()),
            other => Err(format!(
                "the standard sampler takes no options, got {other}"
            )),
        }
    }

    fn sample(
        logits: &wit::LogitsBatch,
        batch: Vec<wit::Sequence>,
    ) -> Result<Vec<wit::Sampled>, String> {
        if usize::try_from(logits.rows()).ok() != Some(batch.len()) {
            return Err(format!(
                "batch of {} sequences but {} logits rows",
                batch.len(),
                logits.rows()
            ));
        }
        let mut sampled = Vec::with_capacity(batch.len());
        for (row, s) in (0u32..).zip(&batch) {
            let row = Row { batch: logits, row };
            if row.is_empty() {
                return Err(format!("request {}: the logits row is empty", s.request));
            }
            let p = s.params;
            let params = SamplingParams {
                temperature: p.temperature,
                top_k: p.top_k,
                top_p: p.top_p,
                min_p: p.min_p,
                penalties: Penalties {
                    presence: p.penalties.presence,
                    frequency: p.penalties.frequency,
                    repetition: p.penalties.repetition,
                },
                seed: p.seed,
                logprobs: p.logprobs,
                num_top_logprobs: p.num_top_logprobs,
            };
            let token = sample::sample_sequence(&row, &params, s.request, s.position);
            sampled.push(wit::Sampled {
                token: token.token,
                logprob: token.logprob,
                top_logprobs: token
                    .top_logprobs
                    .into_iter()
                    .map(|c| wit::Candidate {
                        id: c.id,
                        value: c.value,
                    })
                    .collect(),
            });
        }
        Ok(sampled)
    }
}

export!(Standard);
