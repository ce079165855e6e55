//! The standard sampler plugin: the `Sampler` implementation and, in the component, its export.
//!
//! The algorithm lives in [`sample`] as plain Rust, generic over
//! [`LogitsRow`], so tests and the host's benchmarks run the same code
//! natively over their own rows; only the wasm32 build exports the `sampler`
//! world. The SDK's `plughost_sdk::sampler::testing::VecRow` is an in-memory row.

pub mod sample;

pub use sample::{MIN_TEMPERATURE, sample_sequence};

use plughost_sdk::sampler::{Sampled, Sampler, Sequence};
use serde::Deserialize;

/// The sampler's options, read from the deployment's JSON config. There are
/// none yet; an unknown key is still an error, so a typo cannot pass silently.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StandardConfig {}

impl StandardConfig {
    /// Parses the JSON config; an empty string gives the defaults.
    pub fn from_json(config: &str) -> Result<StandardConfig, String> {
        if config.trim().is_empty() {
            return Ok(StandardConfig::default());
        }
        serde_json::from_str(config).map_err(|e| format!("invalid standard sampler config: {e}"))
    }
}

/// Greedy, temperature, top-k, top-p, min-p, penalties, seeds and logprobs.
#[derive(Debug, Clone, Default)]
pub struct Standard {
    config: StandardConfig,
}

impl Standard {
    pub fn new(config: StandardConfig) -> Standard {
        Standard { config }
    }

    pub fn config(&self) -> &StandardConfig {
        &self.config
    }
}

impl Sampler for Standard {
    fn init(config: &str) -> Result<Standard, String> {
        StandardConfig::from_json(config).map(Standard::new)
    }

    fn sample(&mut self, batch: &[Sequence<'_>]) -> Result<Vec<Sampled>, String> {
        batch
            .iter()
            .map(|s| {
                // A row without tokens has nothing to sample: the host sent
                // a broken batch, and failing it says so.
                if s.logits.is_empty() {
                    return Err(format!("request {}: the logits row is empty", s.request));
                }
                Ok(sample_sequence(s.logits, &s.params, s.request, s.position))
            })
            .collect()
    }
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_sampler!(Standard);

#[cfg(test)]
mod tests {
    use super::*;
    use plughost_sdk::sampler::SamplingParams;
    use plughost_sdk::sampler::testing::VecRow;

    #[test]
    fn config_parses_and_rejects_unknown_keys() {
        let cases: &[(&str, Result<(), &str>)] = &[
            ("", Ok(())),
            ("{}", Ok(())),
            (r#"{"top_k": 5}"#, Err("unknown field `top_k`")),
            ("[", Err("invalid standard sampler config")),
        ];
        for (json, expected) in cases {
            match (Standard::init(json), expected) {
                (Ok(_), Ok(())) => {}
                (Err(message), Err(needle)) => {
                    assert!(message.contains(needle), "{json}: {message}")
                }
                (got, _) => panic!("{json}: unexpected {:?}", got.map(|s| s.config)),
            }
        }
    }

    #[test]
    fn a_batch_samples_each_sequence_as_alone() {
        let logits: Vec<Vec<f32>> = (0..4u32)
            .map(|r| {
                (0..64u32)
                    .map(|i| ((i * 7 + r * 13) % 17) as f32 / 4.0)
                    .collect()
            })
            .collect();
        let params = |seed| SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed,
            logprobs: true,
            num_top_logprobs: 2,
            ..SamplingParams::GREEDY
        };
        let rows: Vec<VecRow> = logits.iter().cloned().map(VecRow::new).collect();
        let batch: Vec<Sequence<'_>> = rows
            .iter()
            .enumerate()
            .map(|(i, row)| Sequence {
                request: i as u64,
                position: 3 * i as u32,
                params: params(100 + i as u64),
                logits: row,
            })
            .collect();
        let mut sampler = Standard::default();
        let sampled = sampler.sample(&batch).map_err(|e| e.to_string());
        let alone: Vec<Sampled> = logits
            .iter()
            .enumerate()
            .map(|(i, l)| {
                sample_sequence(
                    &VecRow::new(l.clone()),
                    &params(100 + i as u64),
                    i as u64,
                    3 * i as u32,
                )
            })
            .collect();
        assert_eq!(sampled, Ok(alone));
        assert_eq!(sampler.sample(&[]), Ok(Vec::new()));
        let empty = VecRow::new(Vec::new());
        let bad = [Sequence {
            request: 9,
            position: 0,
            params: params(1),
            logits: &empty,
        }];
        assert!(sampler.sample(&bad).is_err_and(|e| e.contains("request 9")));
    }
}
