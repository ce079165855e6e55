//! The stubborn sampler plugin: at every `every`-th position it returns `token_id` (when the row has it) whatever the row says; elsewhere it samples as the request asks (greedy, or a full draw at the request's temperature).
//!
//! It exists to show that the host, not the plugin, enforces structured outputs: where the
//! request's grammar forbids `token_id` the host rejects the proposal and draws that row
//! again natively from the masked row.

use plughost_sdk::sampler::{LogitsRow, Sampled, Sampler, Sequence};
use serde::Deserialize;

/// The sampler's options, from the deployment file's `config` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StubbornConfig {
    /// The token proposed regardless of the logits.
    pub token_id: u32,
    /// Proposed at positions 0, `every`, 2·`every`, ...
    pub every: u32,
}

impl Default for StubbornConfig {
    fn default() -> Self {
        StubbornConfig {
            token_id: 0,
            every: 3,
        }
    }
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct Stubborn {
    config: StubbornConfig,
}

impl Stubborn {
    fn sample_one(&self, sequence: &Sequence<'_>) -> Sampled {
        let row: &dyn LogitsRow = sequence.logits;
        let params = &sequence.params;
        // A row narrower than the token (a reload's dry run uses a small synthetic one) gets
        // no proposal: a token outside the vocabulary is a plugin fault, not a forbidden token.
        let propose =
            sequence.position.is_multiple_of(self.config.every) && self.config.token_id < row.len();
        let token = if propose {
            self.config.token_id
        } else if params.temperature <= 0.0 {
            row.argmax()
        } else {
            row.sample_full(params.temperature, sequence.rng().next().as_f32())
        };
        Sampled {
            token,
            logprob: if params.logprobs {
                row.log_softmax(&[token], 1.0)[0]
            } else {
                f32::NAN
            },
            top_logprobs: Vec::new(),
        }
    }
}

impl Sampler for Stubborn {
    fn init(config: &str) -> Result<Stubborn, String> {
        let config: StubbornConfig = if config.trim().is_empty() {
            StubbornConfig::default()
        } else {
            serde_json::from_str(config)
                .map_err(|e| format!("invalid stubborn sampler config: {e}"))?
        };
        if config.every == 0 {
            return Err("every must be at least 1".into());
        }
        Ok(Stubborn { config })
    }

    fn sample(&mut self, batch: &[Sequence<'_>]) -> Result<Vec<Sampled>, String> {
        Ok(batch.iter().map(|s| self.sample_one(s)).collect())
    }
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_sampler!(Stubborn);

#[cfg(test)]
mod tests {
    use super::*;
    use plughost_sdk::sampler::SamplingParams;
    use plughost_sdk::sampler::testing::VecRow;

    #[test]
    fn proposes_its_token_every_few_positions_and_argmax_elsewhere() {
        let mut sampler = Stubborn::init(r#"{"token_id": 4, "every": 2}"#).unwrap();
        let row = VecRow::new(vec![0.0, 9.0, 1.0, 2.0, -5.0]);
        let tokens: Vec<u32> = (0..4)
            .map(|position| {
                let batch = [Sequence {
                    request: 1,
                    position,
                    params: SamplingParams::GREEDY,
                    logits: &row,
                }];
                sampler.sample(&batch).unwrap()[0].token
            })
            .collect();
        assert_eq!(tokens, [4, 1, 4, 1]);
        assert!(Stubborn::init(r#"{"every": 0}"#).is_err());
        assert!(Stubborn::init(r#"{"bogus": 1}"#).is_err());
    }
}
