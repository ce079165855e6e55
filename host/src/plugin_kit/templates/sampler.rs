//! __NAME__: a top-k sampler plugin for plughost.
//!
//! Greedy when the request's temperature is 0; otherwise a draw among the `k`
//! most likely tokens at the request's temperature, repeatable for a given
//! seed. The request's own `top_k` wins over the configured one.

use plughost_sdk::sampler::{Candidate, LogitsRow, Sampled, Sampler, Sequence};
use serde::Deserialize;

/// The plugin's options: the `config` table of the deployment file, as JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Candidates a draw chooses among when the request sets no `top_k`.
    pub top_k: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config { top_k: 40 }
    }
}

pub struct TopK {
    config: Config,
}

impl Sampler for TopK {
    fn init(config: &str) -> Result<Self, String> {
        let config: Config = if config.trim().is_empty() {
            Config::default()
        } else {
            serde_json::from_str(config).map_err(|e| format!("invalid config: {e}"))?
        };
        if config.top_k == 0 {
            return Err("top_k must be at least 1".into());
        }
        Ok(TopK { config })
    }

    fn sample(&mut self, batch: &[Sequence<'_>]) -> Result<Vec<Sampled>, String> {
        batch.iter().map(|s| self.sample_one(s)).collect()
    }
}

impl TopK {
    fn sample_one(&self, sequence: &Sequence<'_>) -> Result<Sampled, String> {
        let row = sequence.logits;
        if row.is_empty() {
            return Err(format!("request {}: empty logits row", sequence.request));
        }
        let params = &sequence.params;
        if !params.penalties.is_none() {
            row.apply_penalties(&params.penalties);
        }
        let token = if params.temperature <= 0.0 {
            row.argmax()
        } else {
            let k = if params.top_k > 0 {
                params.top_k
            } else {
                self.config.top_k
            };
            let candidates = row.top_k(k);
            let ids: Vec<u32> = candidates.iter().map(|c| c.id).collect();
            let logprobs = row.log_softmax(&ids, params.temperature);
            // Renormalise over the candidates and walk their cumulative mass.
            let u = sequence.rng().next().as_f32();
            let total: f32 = logprobs.iter().map(|lp| lp.exp()).sum();
            let mut mass = 0.0;
            let mut chosen = ids[ids.len() - 1];
            for (id, lp) in ids.iter().zip(&logprobs) {
                mass += lp.exp() / total;
                if u < mass {
                    chosen = *id;
                    break;
                }
            }
            chosen
        };
        Ok(Sampled {
            token,
            logprob: if params.logprobs {
                row.log_softmax(&[token], 1.0)[0]
            } else {
                f32::NAN
            },
            top_logprobs: top_logprobs(row, params.num_top_logprobs),
        })
    }
}

fn top_logprobs(row: &dyn LogitsRow, n: u32) -> Vec<Candidate> {
    if n == 0 {
        return Vec::new();
    }
    let ids: Vec<u32> = row.top_k(n).iter().map(|c| c.id).collect();
    let logprobs = row.log_softmax(&ids, 1.0);
    ids.into_iter()
        .zip(logprobs)
        .map(|(id, value)| Candidate { id, value })
        .collect()
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_sampler!(TopK);

#[cfg(test)]
mod tests {
    use super::*;
    use plughost_sdk::sampler::SamplingParams;
    use plughost_sdk::sampler::testing::VecRow;

    fn sequence(row: &VecRow, temperature: f32, seed: u64) -> Sequence<'_> {
        Sequence {
            request: 1,
            position: 0,
            params: SamplingParams {
                temperature,
                seed,
                ..SamplingParams::GREEDY
            },
            logits: row,
        }
    }

    #[test]
    fn greedy_takes_the_argmax_and_draws_stay_in_the_top_k() {
        let mut sampler = TopK::init(r#"{"top_k": 2}"#).unwrap();
        let row = VecRow::new(vec![0.5, 3.0, 2.9, -1.0, 0.0]);
        let greedy = sampler.sample(&[sequence(&row, 0.0, 0)]).unwrap();
        assert_eq!(greedy[0].token, 1);
        for seed in 0..200 {
            let drawn = sampler.sample(&[sequence(&row, 1.0, seed)]).unwrap();
            assert!(
                [1, 2].contains(&drawn[0].token),
                "seed {seed}: {:?}",
                drawn[0]
            );
        }
    }

    #[test]
    fn the_config_is_checked() {
        assert!(TopK::init("").is_ok());
        assert!(TopK::init(r#"{"top_k": 0}"#).is_err());
        assert!(TopK::init(r#"{"k": 3}"#).is_err());
    }
}
