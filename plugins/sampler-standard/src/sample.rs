//! The standard sampling algorithm for one sequence over a host-owned logits row.
//!
//! The steps, in order:
//!
//! 1. **Penalties** (presence, frequency, repetition) rewrite the row in the
//!    host, when any is set.
//! 2. **Greedy** when the temperature is 0 (below [`MIN_TEMPERATURE`], or not
//!    a finite number) or top-k is 1: the host's `argmax`.
//! 3. Otherwise the logits are divided by the temperature and filtered:
//!    **top-k** keeps the `top_k` largest (0, or at least the vocabulary,
//!    keeps all); **top-p** keeps the smallest set of the most likely tokens
//!    whose probability reaches `top_p` (1.0 keeps all); **min-p** keeps the
//!    tokens at least `min_p` times as likely as the most likely one (0 keeps
//!    all). Top-p and min-p see the distribution left by top-k, renormalised.
//!    At least the most likely token always survives.
//! 4. The token is drawn by inverse CDF with a uniform number that is a pure
//!    function of `(seed, position)` ([`Uniform`]), so a seed gives the same
//!    tokens however batches form.
//! 5. `logprob` is the chosen token's log-probability under the softmax of
//!    the (penalised) logits at temperature 1, and `top_logprobs` the
//!    `num_top_logprobs` most likely tokens with theirs: one `top_k` and one
//!    `log_softmax` call in the host.
//!
//! The row stays in the host. Only temperature: the host's `sample_full`
//! draws over the whole row. Top-p alone: the host's `sample_top_p` draws
//! from the nucleus. Top-k: the host's `top_k(k)` hands over `k`
//! candidates. Min-p (with or without top-p), no top-k: candidates come in growing
//! chunks (64, then doubling) until the chunk holds the nucleus (its mass,
//! normalised exactly with the host's `log_sum_exp`, reaches `top_p`) or the
//! min-p cut; only a nearly flat distribution ever fetches the whole row.

use plughost_sdk::sampler::{Candidate, LogitsRow, Sampled, SamplingParams};
use plughost_sdk::scheduler::RequestId;

use plughost_sdk::sampler::Uniform;

/// Temperatures below this sample greedily: dividing by them overflows the
/// logits, and the distribution is one-hot long before.
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// Candidates fetched first when top-p or min-p runs without top-k; enough
/// for the nucleus of a typical language-model step.
const FIRST_CHUNK: u32 = 64;

/// Samples one token from `row` by `params` (see the module documentation).
///
/// `position` counts the tokens the sequence generated before this one;
/// with `params.seed` it fixes the draw. `request` does not take part in the
/// draw, so two requests given the same seed draw the same tokens, as the
/// OpenAI `seed` promises; it mirrors the WIT `sequence` record.
///
/// Never fails and never panics: odd parameters (NaN, negative, out of
/// range) fall back to the nearest sensible behaviour, and an empty row,
/// which has no token to give, yields token 0 with a log-probability of
/// -inf. Callers that can meet an empty row reject it first, as
/// [`Standard`](crate::Standard) does.
pub fn sample_sequence<R: LogitsRow + ?Sized>(
    row: &R,
    params: &SamplingParams,
    request: RequestId,
    position: u32,
) -> Sampled {
    let _ = request;
    let vocab_size = row.len();
    if vocab_size == 0 {
        return Sampled {
            token: 0,
            logprob: f32::NEG_INFINITY,
            top_logprobs: Vec::new(),
        };
    }
    if !params.penalties.is_none() {
        row.apply_penalties(&params.penalties);
    }
    let token = choose(row, params, vocab_size, position);
    if !params.logprobs {
        return Sampled {
            token,
            logprob: f32::NAN,
            top_logprobs: Vec::new(),
        };
    }
    with_logprobs(row, token, params.num_top_logprobs, vocab_size)
}

/// The filters of one draw, with disabled and out-of-range values resolved.
struct Filters {
    temperature: f32,
    /// 0: off.
    top_k: u32,
    /// `None`: off.
    top_p: Option<f64>,
    /// `None`: off.
    min_p: Option<f64>,
}

impl Filters {
    /// `None` means greedy.
    fn new(params: &SamplingParams, vocab_size: u32) -> Option<Filters> {
        let temperature = params.temperature;
        // Written so that NaN lands on greedy / off.
        if !(temperature >= MIN_TEMPERATURE && temperature.is_finite()) || params.top_k == 1 {
            return None;
        }
        Some(Filters {
            temperature,
            top_k: if params.top_k >= vocab_size {
                0
            } else {
                params.top_k
            },
            top_p: (params.top_p < 1.0).then_some(f64::from(params.top_p)),
            min_p: (params.min_p > 0.0).then_some(f64::from(params.min_p)),
        })
    }
}

fn choose<R: LogitsRow + ?Sized>(
    row: &R,
    params: &SamplingParams,
    vocab_size: u32,
    position: u32,
) -> u32 {
    let Some(filters) = Filters::new(params, vocab_size) else {
        return row.argmax();
    };
    let u = Uniform::new(params.seed, position);
    let kept = if filters.top_k > 0 {
        top_k_candidates(row, &filters)
    } else if let (Some(top_p), None) = (filters.top_p, filters.min_p) {
        // Top-p alone: the host's linear-time nucleus draw, which never sorts the row.
        return row.sample_top_p(filters.temperature, top_p as f32, u.as_f32());
    } else if filters.top_p.is_some() || filters.min_p.is_some() {
        nucleus_candidates(row, &filters, vocab_size)
    } else {
        return row.sample_full(filters.temperature, u.as_f32());
    };
    draw(&kept, u.as_f64()).unwrap_or_else(|| row.argmax())
}

/// A candidate with its logit divided by the temperature, NaN as -inf.
#[derive(Debug, Clone, Copy)]
struct Scaled {
    id: u32,
    logit: f64,
}

/// Scales `candidates` and sorts them most likely first (the host already
/// does; sorting again keeps a NaN or a careless host from breaking the
/// prefix logic below).
fn scaled(candidates: Vec<Candidate>, temperature: f32) -> Vec<Scaled> {
    let t = f64::from(temperature);
    let mut scaled: Vec<Scaled> = candidates
        .into_iter()
        .map(|c| Scaled {
            id: c.id,
            logit: if c.value.is_nan() {
                f64::NEG_INFINITY
            } else {
                f64::from(c.value) / t
            },
        })
        .collect();
    scaled.sort_by(|a, b| b.logit.total_cmp(&a.logit));
    scaled
}

/// exp(logit - max): the unnormalised weight relative to the best candidate.
/// Written so that an infinite best logit gives the best a weight of 1 and
/// the rest 0, not NaN.
fn relative_weight(logit: f64, max: f64) -> f64 {
    if logit == max {
        1.0
    } else {
        (logit - max).exp()
    }
}

/// Top-k, then top-p and min-p over the k candidates renormalised.
fn top_k_candidates<R: LogitsRow + ?Sized>(row: &R, filters: &Filters) -> Vec<Scaled> {
    let mut candidates = scaled(row.top_k(filters.top_k), filters.temperature);
    let Some(max) = candidates.first().map(|c| c.logit) else {
        return candidates;
    };
    let weights: Vec<f64> = candidates
        .iter()
        .map(|c| relative_weight(c.logit, max))
        .collect();
    let total: f64 = weights.iter().sum();
    let probs: Vec<f64> = weights.iter().map(|w| w / total).collect();
    let num_kept = num_top_p(&probs, filters.top_p)
        .unwrap_or(candidates.len())
        .min(num_min_p(&weights, filters.min_p).unwrap_or(candidates.len()));
    candidates.truncate(num_kept.max(1));
    candidates
}

/// Top-p and min-p over the whole row, fetching candidates in growing chunks
/// until the kept set ends inside the chunk.
fn nucleus_candidates<R: LogitsRow + ?Sized>(
    row: &R,
    filters: &Filters,
    vocab_size: u32,
) -> Vec<Scaled> {
    // Top-p needs probabilities normalised over the whole row; min-p only
    // ratios to the best, which a chunk already has.
    let log_total = filters
        .top_p
        .map(|_| f64::from(row.log_sum_exp(filters.temperature)));
    let mut chunk = FIRST_CHUNK.min(vocab_size);
    loop {
        let mut candidates = scaled(row.top_k(chunk), filters.temperature);
        let Some(max) = candidates.first().map(|c| c.logit) else {
            return candidates;
        };
        let num_top_p = log_total.and_then(|log_total| {
            let probs: Vec<f64> = candidates
                .iter()
                .map(|c| (c.logit - log_total).exp())
                .collect();
            num_top_p(&probs, filters.top_p)
        });
        let weights: Vec<f64> = candidates
            .iter()
            .map(|c| relative_weight(c.logit, max))
            .collect();
        let num_min_p = num_min_p(&weights, filters.min_p);
        // Both cuts are prefixes of the same order, so the kept set is the
        // shorter one: it is known as soon as either cut is inside the chunk.
        let whole_row = chunk >= vocab_size || (candidates.len() as u64) < u64::from(chunk);
        if num_top_p.is_some() || num_min_p.is_some() || whole_row {
            let num_kept = num_top_p
                .unwrap_or(candidates.len())
                .min(num_min_p.unwrap_or(candidates.len()));
            candidates.truncate(num_kept.max(1));
            return candidates;
        }
        chunk = chunk.saturating_mul(2).min(vocab_size);
    }
}

/// How many of `probs` (most likely first) the nucleus keeps: the shortest
/// prefix whose mass reaches `top_p`. `None` if the filter is off or the
/// prefix does not end inside `probs`.
fn num_top_p(probs: &[f64], top_p: Option<f64>) -> Option<usize> {
    let top_p = top_p?;
    let mut mass = 0.0;
    for (i, p) in probs.iter().enumerate() {
        // `mass` is what the tokens before i hold: token i is kept while
        // that is short of `top_p`; the first token always is.
        if i > 0 && mass >= top_p {
            return Some(i);
        }
        mass += p;
    }
    (mass >= top_p).then_some(probs.len())
}

/// How many of `weights` (relative to the best, most likely first) reach
/// `min_p`. `None` if the filter is off or every weight reaches it.
fn num_min_p(weights: &[f64], min_p: Option<f64>) -> Option<usize> {
    let min_p = min_p?;
    weights.iter().position(|&w| w < min_p).map(|i| i.max(1))
}

/// Inverse CDF over `kept` (most likely first) with the uniform `u`.
fn draw(kept: &[Scaled], u: f64) -> Option<u32> {
    let max = kept.first()?.logit;
    if max == f64::NEG_INFINITY {
        return None;
    }
    let weights: Vec<f64> = kept.iter().map(|c| relative_weight(c.logit, max)).collect();
    let target = u * weights.iter().sum::<f64>();
    let mut cumulative = 0.0;
    for (c, &w) in kept.iter().zip(&weights) {
        cumulative += w;
        if w > 0.0 && cumulative > target {
            return Some(c.id);
        }
    }
    // Rounding can leave the target just past the total: the last token
    // with any weight is what the inverse CDF means there.
    kept.iter()
        .zip(&weights)
        .rev()
        .find(|(_, w)| **w > 0.0)
        .map(|(c, _)| c.id)
}

/// Adds the log-probabilities at temperature 1, in one `log_softmax` call.
fn with_logprobs<R: LogitsRow + ?Sized>(
    row: &R,
    token: u32,
    num_top_logprobs: u32,
    vocab_size: u32,
) -> Sampled {
    let top = match num_top_logprobs.min(vocab_size) {
        0 => Vec::new(),
        n => row.top_k(n),
    };
    let mut ids = Vec::with_capacity(1 + top.len());
    ids.push(token);
    ids.extend(top.iter().map(|c| c.id));
    let logprobs = row.log_softmax(&ids, 1.0);
    Sampled {
        token,
        logprob: logprobs.first().copied().unwrap_or(f32::NEG_INFINITY),
        top_logprobs: top
            .iter()
            .zip(logprobs.iter().skip(1))
            .map(|(c, &value)| Candidate { id: c.id, value })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plughost_sdk::sampler::Penalties;
    use plughost_sdk::sampler::testing::VecRow;

    fn params(temperature: f32, top_k: u32, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            ..SamplingParams::GREEDY
        }
    }

    fn sample(logits: &[f32], params: &SamplingParams, position: u32) -> Sampled {
        sample_sequence(&VecRow::new(logits.to_vec()), params, 1, position)
    }

    fn tokens(
        logits: &[f32],
        params: &SamplingParams,
        positions: std::ops::Range<u32>,
    ) -> Vec<u32> {
        positions.map(|p| sample(logits, params, p).token).collect()
    }

    /// Deterministic pseudo-random logits in [-scale, scale).
    fn noise(len: usize, seed: u64, scale: f32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| (Uniform::new(seed, i).as_f32() * 2.0 - 1.0) * scale)
            .collect()
    }

    fn softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
        let max = logits
            .iter()
            .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
        let weights: Vec<f64> = logits
            .iter()
            .map(|&v| ((f64::from(v) - max) / temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        weights.iter().map(|w| w / total).collect()
    }

    #[test]
    fn greedy_is_argmax() {
        let rows: &[(&[f32], u32)] = &[
            (&[0.1, 0.5, 0.2], 1),
            (&[-3.0, -1.0, -2.0], 1),
            (&[2.0, 5.0, 5.0, 1.0], 1),
            (&[7.0], 0),
        ];
        let greedy_params = [
            SamplingParams::GREEDY,
            params(1e-7, 0, 1.0, 0.0, 1),
            params(-1.0, 0, 0.5, 0.1, 1),
            params(f32::NAN, 0, 1.0, 0.0, 1),
            params(f32::INFINITY, 0, 1.0, 0.0, 1),
        ];
        for (logits, argmax) in rows {
            for p in &greedy_params {
                assert_eq!(
                    tokens(logits, p, 0..20),
                    vec![*argmax; 20],
                    "{logits:?} {p:?}"
                );
            }
        }
    }

    #[test]
    fn top_k_one_is_argmax_at_any_temperature() {
        let logits = noise(500, 3, 4.0);
        let argmax = VecRow::new(logits.clone()).argmax();
        for temperature in [0.1, 1.0, 10.0, 1000.0] {
            for top_p in [1.0, 0.5] {
                let p = params(temperature, 1, top_p, 0.0, 9);
                assert_eq!(
                    tokens(&logits, &p, 0..50),
                    vec![argmax; 50],
                    "{temperature} {top_p}"
                );
            }
        }
    }

    /// One set of parameters per sampling path.
    fn every_path(seed: u64) -> [SamplingParams; 5] {
        [
            params(1.0, 0, 1.0, 0.0, seed),
            params(1.0, 40, 1.0, 0.0, seed),
            params(1.0, 40, 0.9, 0.05, seed),
            params(1.0, 0, 0.95, 0.0, seed),
            params(1.0, 0, 1.0, 0.02, seed),
        ]
    }

    #[test]
    fn a_seed_fixes_the_tokens_and_other_seeds_change_them() {
        let logits = noise(200, 5, 2.0);
        for (a, b) in every_path(11).iter().zip(&every_path(12)) {
            let stream = tokens(&logits, a, 0..64);
            // Positions out of order, as batches form differently.
            let again: Vec<u32> = (0..64).rev().map(|p| sample(&logits, a, p).token).collect();
            assert_eq!(stream, again.into_iter().rev().collect::<Vec<_>>(), "{a:?}");
            let other = tokens(&logits, b, 0..64);
            assert_ne!(stream, other, "{a:?}");
            let num_differing = stream.iter().zip(&other).filter(|(x, y)| x != y).count();
            assert!(
                num_differing > 32,
                "{a:?}: only {num_differing} of 64 differ"
            );
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Probabilities ≈ 0.664, 0.244, 0.090, then 997 tokens sharing 0.003:
        // top-p 0.8 keeps the first two.
        let mut logits = vec![-5.0f32; 1000];
        logits[..3].copy_from_slice(&[5.0, 4.0, 3.0]);
        let row = VecRow::new(logits.clone());
        let p = params(1.0, 0, 0.8, 0.0, 1);
        let mut seen = [0u32; 2];
        for position in 0..500 {
            let token = sample_sequence(&row, &p, 1, position).token;
            match token {
                0 => seen[0] += 1,
                1 => seen[1] += 1,
                other => panic!("outside the nucleus: {other:?}"),
            }
        }
        assert!(seen[0] > 250 && seen[1] > 80, "{seen:?}");
        assert!(
            row.num_copied() <= 500 * u64::from(FIRST_CHUNK),
            "one chunk per draw"
        );
        // With top-k the nucleus is taken from the renormalised top-k.
        let p = params(1.0, 2, 0.7, 0.0, 1);
        assert!(
            tokens(&logits, &p, 0..200).iter().all(|&t| t == 0),
            "0.664 / 0.908 ≥ 0.7"
        );
    }

    #[test]
    fn top_p_grows_the_chunk_until_the_nucleus_fits() {
        // Flat: every token holds 1/1000, so top-p 0.5 keeps 500 tokens and
        // needs chunks 64, 128, 256, 512.
        let logits = vec![0.0f32; 1000];
        let p = params(1.0, 0, 0.5, 0.0, 4);
        let stream = tokens(&logits, &p, 0..2000);
        assert!(
            stream.iter().all(|&t| t <= 500),
            "{:?}",
            stream.iter().max()
        );
        assert!(
            stream.iter().any(|&t| t > 400),
            "the whole nucleus is reachable"
        );
    }

    #[test]
    fn min_p_excludes_unlikely_tokens() {
        // Relative to the best: 1, e^-0.1 ≈ 0.90, e^-2 ≈ 0.14, smaller after.
        let mut logits = noise(300, 8, 1.0);
        logits[..3].copy_from_slice(&[3.0, 2.9, 1.0]);
        for top_k in [0, 50] {
            let p = params(1.0, top_k, 1.0, 0.5, 2);
            let stream = tokens(&logits, &p, 0..300);
            assert!(stream.iter().all(|&t| t < 2), "top_k {top_k}: {stream:?}");
            assert!(stream.contains(&0) && stream.contains(&1), "top_k {top_k}");
        }
    }

    #[test]
    fn penalties_change_the_choice() {
        let logits = vec![2.0, 1.9, 0.0];
        let cases: &[(Penalties, &[u32], &[u32], u32)] = &[
            (Penalties::NONE, &[0], &[0, 0], 0),
            (
                Penalties {
                    presence: 0.5,
                    ..Penalties::NONE
                },
                &[],
                &[0],
                1,
            ),
            (
                Penalties {
                    frequency: 0.1,
                    ..Penalties::NONE
                },
                &[],
                &[0, 0],
                1,
            ),
            (
                Penalties {
                    frequency: 0.1,
                    ..Penalties::NONE
                },
                &[],
                &[0],
                0,
            ),
            (
                Penalties {
                    repetition: 1.2,
                    ..Penalties::NONE
                },
                &[0],
                &[],
                1,
            ),
        ];
        for (penalties, prompt, output, expected) in cases {
            let row = VecRow::with_history(logits.clone(), prompt.to_vec(), output.to_vec());
            let p = SamplingParams {
                penalties: *penalties,
                ..SamplingParams::GREEDY
            };
            let token = sample_sequence(&row, &p, 1, 0).token;
            assert_eq!(token, *expected, "{penalties:?}");
        }
    }

    #[test]
    fn logprobs_match_a_direct_log_softmax() {
        let logits = noise(50, 21, 3.0);
        let direct: Vec<f64> = softmax(&logits, 1.0).iter().map(|p| p.ln()).collect();
        let mut best: Vec<u32> = (0..50).collect();
        best.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        for temperature in [0.0, 0.7, 1.5] {
            let p = SamplingParams {
                logprobs: true,
                num_top_logprobs: 5,
                ..params(temperature, 0, 1.0, 0.0, 3)
            };
            for position in 0..20 {
                let s = sample(&logits, &p, position);
                assert!((f64::from(s.logprob) - direct[s.token as usize]).abs() < 1e-5);
                let ids: Vec<u32> = s.top_logprobs.iter().map(|c| c.id).collect();
                assert_eq!(ids, best[..5]);
                for c in &s.top_logprobs {
                    assert!((f64::from(c.value) - direct[c.id as usize]).abs() < 1e-5);
                }
            }
        }
        let all = sample(
            &logits,
            &SamplingParams {
                logprobs: true,
                num_top_logprobs: 1000,
                ..SamplingParams::GREEDY
            },
            0,
        );
        assert_eq!(all.top_logprobs.len(), 50, "clipped to the vocabulary");
        let total: f64 = all
            .top_logprobs
            .iter()
            .map(|c| f64::from(c.value).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
    }

    #[test]
    fn draws_follow_the_filtered_softmax() {
        let logits = [0.0, 0.5, 1.0, -1.0, 2.0, 0.3, -0.5, 1.5];
        let num_draws = 20_000u32;
        // (params, logits the distribution is over)
        let cases: Vec<(SamplingParams, Vec<f32>)> = vec![
            (params(1.0, 0, 1.0, 0.0, 1), logits.to_vec()),
            (
                params(2.0, 0, 1.0, 0.0, 1),
                logits.iter().map(|v| v / 2.0).collect(),
            ),
            (params(1.0, 0, 1.0, 1e-6, 1), logits.to_vec()),
            (params(1.0, 0, 0.999_999, 0.0, 1), logits.to_vec()),
            (
                params(2.0, 0, 1.0, 1e-6, 1),
                logits.iter().map(|v| v / 2.0).collect(),
            ),
            // Top-k 6 drops the two smallest (-1.0 and -0.5).
            (
                params(1.0, 6, 1.0, 0.0, 1),
                logits
                    .iter()
                    .map(|&v| if v < 0.0 { f32::NEG_INFINITY } else { v })
                    .collect(),
            ),
            (
                params(0.5, 6, 1.0, 0.0, 1),
                logits
                    .iter()
                    .map(|&v| if v < 0.0 { f32::NEG_INFINITY } else { v * 2.0 })
                    .collect(),
            ),
        ];
        for (p, expected_logits) in cases {
            let expected = softmax(&expected_logits, 1.0);
            let mut counts = [0u32; 8];
            for token in tokens(&logits, &p, 0..num_draws) {
                counts[token as usize] += 1;
            }
            let mut chi_square = 0.0;
            for (count, prob) in counts.iter().zip(&expected) {
                let want = prob * f64::from(num_draws);
                if want == 0.0 {
                    assert_eq!(*count, 0, "{p:?}: a filtered token was drawn");
                } else {
                    chi_square += (f64::from(*count) - want).powi(2) / want;
                }
            }
            // At most 7 degrees of freedom: 24.3 is the 0.1% tail there.
            assert!(
                chi_square < 24.3,
                "{p:?}: chi-square {chi_square}, counts {counts:?}"
            );
        }
    }

    #[test]
    fn normal_paths_never_copy_the_whole_row() {
        let mut logits = noise(32_000, 13, 3.0);
        logits[7] = 14.0;
        logits[8] = 13.0;
        let cases = [
            (params(1.0, 0, 1.0, 0.0, 1), 0),
            (params(1.0, 50, 0.9, 0.0, 1), 50),
            // Top-p alone draws in the host: nothing crosses.
            (params(0.8, 0, 0.95, 0.0, 1), 0),
            (params(0.8, 0, 0.95, 0.1, 1), u64::from(FIRST_CHUNK)),
            (params(0.8, 0, 1.0, 0.1, 1), u64::from(FIRST_CHUNK)),
            (
                SamplingParams {
                    logprobs: true,
                    num_top_logprobs: 5,
                    ..SamplingParams::GREEDY
                },
                5,
            ),
        ];
        for (p, num_copied) in cases {
            let row = VecRow::new(logits.clone());
            sample_sequence(&row, &p, 1, 0);
            assert_eq!(row.num_copied(), num_copied, "{p:?}");
        }
    }

    #[test]
    fn odd_inputs_never_panic() {
        let empty = VecRow::new(Vec::new());
        let sampled = sample_sequence(&empty, &every_path(1)[2], 1, 0);
        assert_eq!((sampled.token, sampled.logprob), (0, f32::NEG_INFINITY));
        let rows: Vec<Vec<f32>> = vec![
            vec![1.0, f32::NAN, 2.0],
            vec![f32::NAN; 4],
            vec![f32::NEG_INFINITY; 4],
            vec![f32::INFINITY, 1.0, f32::INFINITY],
            vec![f32::MAX, -f32::MAX, 0.0],
            vec![0.5],
        ];
        let odd_params = [
            params(1.0, 1000, 1.0, 0.0, 1),
            params(1.0, 0, 0.0, 0.0, 1),
            params(1.0, 0, -1.0, 0.0, 1),
            params(1.0, 0, f32::NAN, f32::NAN, 1),
            params(1.0, 0, 1.0, 5.0, 1),
            params(1.0, 2, 0.0, 5.0, 1),
            params(1e-5, 0, 0.5, 0.0, 1),
            params(f32::MAX, 0, 0.5, 0.1, 1),
            SamplingParams {
                penalties: Penalties {
                    presence: f32::NAN,
                    frequency: 1.0,
                    repetition: 0.0,
                },
                logprobs: true,
                num_top_logprobs: u32::MAX,
                ..params(1.0, 0, 0.9, 0.0, u64::MAX)
            },
        ];
        for logits in &rows {
            for p in &odd_params {
                for position in [0, u32::MAX] {
                    let row = VecRow::with_history(logits.clone(), vec![0, 99], vec![0]);
                    let token = sample_sequence(&row, p, 1, position).token;
                    assert!((token as usize) < logits.len(), "{logits:?} {p:?}");
                }
            }
        }
    }

    #[test]
    fn top_p_zero_and_min_p_above_one_keep_the_best_token() {
        let logits = noise(100, 2, 2.0);
        let argmax = VecRow::new(logits.clone()).argmax();
        for p in [
            params(1.0, 0, 0.0, 0.0, 1),
            params(1.0, 0, 1.0, 2.0, 1),
            params(1.0, 10, 0.0, 0.0, 1),
        ] {
            assert_eq!(tokens(&logits, &p, 0..30), vec![argmax; 30], "{p:?}");
        }
    }
}
