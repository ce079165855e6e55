//! The banned-tokens sampler plugin: samples as the request asks (greedy, temperature, top-k, top-p, seed) but never emits a token id its config bans.
//!
//! The draw runs over the row's top candidates (the host ranks them
//! natively, so the logits never cross into the component): the request's
//! `top_k`, or `candidates` when it sets none, plus one per banned id so a ban
//! never shrinks the pool. Banned ids are dropped, the rest renormalised at
//! the request's temperature, cut to `top_p`, and drawn from with a uniform
//! number fixed by the seed and the position. `min_p` is not applied.

use std::collections::HashSet;

use plughost_sdk::sampler::{Candidate, LogitsRow, Sampled, Sampler, Sequence};
use serde::Deserialize;

/// The sampler's options, from the deployment file's `config` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BannedConfig {
    /// Token ids never emitted (for example a word's tokens, or an unwanted special token).
    pub banned_token_ids: Vec<u32>,
    /// Candidates a draw ranks when the request sets no `top_k`.
    pub candidates: u32,
}

impl Default for BannedConfig {
    fn default() -> Self {
        BannedConfig {
            banned_token_ids: Vec::new(),
            candidates: 256,
        }
    }
}

impl BannedConfig {
    /// Parses the JSON config; an empty string gives the defaults.
    pub fn from_json(config: &str) -> Result<BannedConfig, String> {
        let config: BannedConfig = if config.trim().is_empty() {
            BannedConfig::default()
        } else {
            serde_json::from_str(config)
                .map_err(|e| format!("invalid banned-tokens sampler config: {e}"))?
        };
        if config.candidates == 0 {
            return Err("candidates must be at least 1".into());
        }
        Ok(config)
    }
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct BannedTokens {
    banned: HashSet<u32>,
    candidates: u32,
}

impl BannedTokens {
    pub fn new(config: BannedConfig) -> BannedTokens {
        BannedTokens {
            banned: config.banned_token_ids.into_iter().collect(),
            candidates: config.candidates,
        }
    }

    fn sample_one(&self, sequence: &Sequence<'_>) -> Result<Sampled, String> {
        let row = sequence.logits;
        let params = &sequence.params;
        if !params.penalties.is_none() {
            row.apply_penalties(&params.penalties);
        }
        let wanted = if params.top_k > 0 {
            params.top_k
        } else {
            self.candidates
        };
        let banned = u32::try_from(self.banned.len()).unwrap_or(u32::MAX);
        let ranked: Vec<u32> = row
            .top_k(wanted.saturating_add(banned))
            .into_iter()
            .map(|c| c.id)
            .filter(|id| !self.banned.contains(id))
            .take(wanted as usize)
            .collect();
        let Some(&best) = ranked.first() else {
            return Err(format!(
                "request {}: every candidate token is banned",
                sequence.request
            ));
        };
        let token = if params.temperature <= 0.0 {
            best
        } else {
            let logprobs = row.log_softmax(&ranked, params.temperature);
            draw(
                &ranked,
                &logprobs,
                params.top_p,
                sequence.rng().next().as_f32(),
            )
        };
        Ok(Sampled {
            token,
            logprob: if params.logprobs {
                row.log_softmax(&[token], 1.0)[0]
            } else {
                f32::NAN
            },
            top_logprobs: self.top_logprobs(row, params.num_top_logprobs),
        })
    }

    /// The most likely tokens that may be emitted, with their log-probabilities.
    fn top_logprobs(&self, row: &dyn LogitsRow, n: u32) -> Vec<Candidate> {
        if n == 0 {
            return Vec::new();
        }
        let banned = u32::try_from(self.banned.len()).unwrap_or(u32::MAX);
        let ids: Vec<u32> = row
            .top_k(n.saturating_add(banned))
            .into_iter()
            .map(|c| c.id)
            .filter(|id| !self.banned.contains(id))
            .take(n as usize)
            .collect();
        let logprobs = row.log_softmax(&ids, 1.0);
        ids.into_iter()
            .zip(logprobs)
            .map(|(id, value)| Candidate { id, value })
            .collect()
    }
}

/// Draws from `ids` (most likely first) renormalised, within the nucleus of mass `top_p`.
fn draw(ids: &[u32], logprobs: &[f32], top_p: f32, u: f32) -> u32 {
    let weights: Vec<f64> = logprobs.iter().map(|lp| f64::from(*lp).exp()).collect();
    let total: f64 = weights.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return ids[0];
    }
    let cut = f64::from(top_p.clamp(0.0, 1.0));
    let mut kept = 0.0;
    let mut nucleus = 0;
    for w in &weights {
        kept += w / total;
        nucleus += 1;
        if kept >= cut {
            break;
        }
    }
    let target = f64::from(u) * kept;
    let mut mass = 0.0;
    for (id, w) in ids.iter().zip(&weights).take(nucleus) {
        mass += w / total;
        if target < mass {
            return *id;
        }
    }
    ids[nucleus - 1]
}

impl Sampler for BannedTokens {
    fn init(config: &str) -> Result<BannedTokens, String> {
        BannedConfig::from_json(config).map(BannedTokens::new)
    }

    fn sample(&mut self, batch: &[Sequence<'_>]) -> Result<Vec<Sampled>, String> {
        batch.iter().map(|s| self.sample_one(s)).collect()
    }
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_sampler!(BannedTokens);

#[cfg(test)]
mod tests {
    use super::*;
    use plughost_sdk::sampler::SamplingParams;
    use plughost_sdk::sampler::testing::VecRow;

    fn sample(sampler: &mut BannedTokens, logits: &[f32], params: SamplingParams) -> Sampled {
        let row = VecRow::new(logits.to_vec());
        let batch = [Sequence {
            request: 1,
            position: 3,
            params,
            logits: &row,
        }];
        sampler.sample(&batch).expect("sampled").remove(0)
    }

    #[test]
    fn greedy_skips_banned_tokens() {
        let mut sampler = BannedTokens::init(r#"{"banned_token_ids": [1, 2]}"#).unwrap();
        let logits = [0.0, 5.0, 4.0, 3.0, -1.0];
        let sampled = sample(&mut sampler, &logits, SamplingParams::GREEDY);
        assert_eq!(sampled.token, 3);
        let with_top = SamplingParams {
            logprobs: true,
            num_top_logprobs: 2,
            ..SamplingParams::GREEDY
        };
        let sampled = sample(&mut sampler, &logits, with_top);
        let top: Vec<u32> = sampled.top_logprobs.iter().map(|c| c.id).collect();
        assert_eq!(top, [3, 0], "banned tokens are not offered either");
        assert!(sampled.logprob.is_finite());
    }

    #[test]
    fn no_draw_ever_picks_a_banned_token() {
        let mut sampler = BannedTokens::init(r#"{"banned_token_ids": [0, 7]}"#).unwrap();
        let logits: Vec<f32> = (0..16)
            .map(|i| if i % 7 == 0 { 9.0 } else { 1.0 })
            .collect();
        let mut seen = HashSet::new();
        for seed in 0..500 {
            let params = SamplingParams {
                temperature: 1.5,
                seed,
                ..SamplingParams::GREEDY
            };
            let token = sample(&mut sampler, &logits, params).token;
            assert!(token != 0 && token != 7, "seed {seed} drew banned {token}");
            seen.insert(token);
        }
        assert!(seen.contains(&14), "the best allowed token is drawn");
        assert!(
            seen.len() > 5,
            "the draw spreads over the allowed tokens: {seen:?}"
        );
    }

    #[test]
    fn a_row_of_only_banned_tokens_fails_with_the_request_named() {
        let mut sampler = BannedTokens::init(r#"{"banned_token_ids": [0, 1]}"#).unwrap();
        let row = VecRow::new(vec![1.0, 2.0]);
        let batch = [Sequence {
            request: 42,
            position: 0,
            params: SamplingParams::GREEDY,
            logits: &row,
        }];
        let error = sampler.sample(&batch).unwrap_err();
        assert!(error.contains("request 42"), "{error}");
    }

    #[test]
    fn the_config_is_checked() {
        assert!(BannedTokens::init("").is_ok());
        assert!(BannedTokens::init(r#"{"candidates": 0}"#).is_err());
        assert!(BannedTokens::init(r#"{"banned": [1]}"#).is_err());
        assert!(BannedTokens::init(r#"{"banned_token_ids": [-1]}"#).is_err());
    }
}
