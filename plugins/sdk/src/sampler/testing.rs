//! An in-memory `LogitsRow` for native tests and benchmarks: straightforward reference implementations of the host's fast paths.
//!
//! A sampler's unit tests build a [`VecRow`] per sequence and call the
//! plugin's `Sampler::sample` natively, with no host and no component.
//!
//! It favours being obviously right over being fast; the host has its own
//! native row over its own kernels. It counts the logits it hands to the
//! caller so tests can check that a path never copies the whole row.

use std::cell::{Cell, RefCell};
use std::cmp::Ordering;

use super::{Candidate, LogitsRow, Penalties};

/// One row of logits with the sequence's token history (for penalties).
#[derive(Debug, Default)]
pub struct VecRow {
    logits: RefCell<Vec<f32>>,
    prompt: Vec<u32>,
    output: Vec<u32>,
    num_copied: Cell<u64>,
}

impl VecRow {
    /// A row whose sequence has no token history.
    pub fn new(logits: Vec<f32>) -> VecRow {
        VecRow::with_history(logits, Vec::new(), Vec::new())
    }

    /// A row whose sequence has the given prompt and generated tokens.
    pub fn with_history(logits: Vec<f32>, prompt: Vec<u32>, output: Vec<u32>) -> VecRow {
        VecRow {
            logits: RefCell::new(logits),
            prompt,
            output,
            num_copied: Cell::new(0),
        }
    }

    /// The current logits (after any penalties).
    pub fn logits(&self) -> Vec<f32> {
        self.logits.borrow().clone()
    }

    /// Logits handed out by `read` and `top_k` so far.
    pub fn num_copied(&self) -> u64 {
        self.num_copied.get()
    }

    fn count_copied(&self, n: usize) {
        self.num_copied
            .set(self.num_copied.get().saturating_add(n as u64));
    }
}

/// NaN ranks below every number, so one bad logit is never chosen.
fn rank(value: f32) -> f32 {
    if value.is_nan() {
        f32::NEG_INFINITY
    } else {
        value
    }
}

/// The WIT contract treats a temperature of 0 as 1.
fn effective(temperature: f32) -> f64 {
    if temperature == 0.0 {
        1.0
    } else {
        f64::from(temperature)
    }
}

/// Largest first, lowest index on ties.
fn by_rank_desc(logits: &[f32], a: usize, b: usize) -> Ordering {
    rank(logits[b]).total_cmp(&rank(logits[a])).then(a.cmp(&b))
}

/// ln Σ exp(x) in f64, stable for large and infinite values.
fn log_sum_exp(scaled: impl Iterator<Item = f64> + Clone) -> f64 {
    let max = scaled.clone().fold(f64::NEG_INFINITY, f64::max);
    if max.is_infinite() {
        return max;
    }
    max + scaled.map(|x| (x - max).exp()).sum::<f64>().ln()
}

impl VecRow {
    fn scaled(&self, temperature: f32) -> Vec<f64> {
        let t = effective(temperature);
        self.logits
            .borrow()
            .iter()
            .map(|&v| f64::from(rank(v)) / t)
            .collect()
    }
}

impl LogitsRow for VecRow {
    fn len(&self) -> u32 {
        u32::try_from(self.logits.borrow().len()).unwrap_or(u32::MAX)
    }

    fn argmax(&self) -> u32 {
        let logits = self.logits.borrow();
        let best = (0..logits.len()).min_by(|&a, &b| by_rank_desc(&logits, a, b));
        best.map_or(0, |i| i as u32)
    }

    fn top_k(&self, k: u32) -> Vec<Candidate> {
        let logits = self.logits.borrow();
        let k = (k as usize).min(logits.len());
        let mut order: Vec<usize> = (0..logits.len()).collect();
        if k < order.len() && k > 0 {
            order.select_nth_unstable_by(k - 1, |&a, &b| by_rank_desc(&logits, a, b));
        }
        order.truncate(k);
        order.sort_by(|&a, &b| by_rank_desc(&logits, a, b));
        self.count_copied(k);
        order
            .into_iter()
            .map(|i| Candidate {
                id: i as u32,
                value: logits[i],
            })
            .collect()
    }

    fn read(&self, start: u32, len: u32) -> Vec<f32> {
        let logits = self.logits.borrow();
        let start = (start as usize).min(logits.len());
        let end = start.saturating_add(len as usize).min(logits.len());
        self.count_copied(end - start);
        logits[start..end].to_vec()
    }

    fn log_softmax(&self, ids: &[u32], temperature: f32) -> Vec<f32> {
        let scaled = self.scaled(temperature);
        let lse = log_sum_exp(scaled.iter().copied());
        ids.iter()
            .map(|&id| match scaled.get(id as usize) {
                Some(&x) => (x - lse) as f32,
                None => f32::NEG_INFINITY,
            })
            .collect()
    }

    fn log_sum_exp(&self, temperature: f32) -> f32 {
        log_sum_exp(self.scaled(temperature).into_iter()) as f32
    }

    fn sample_full(&self, temperature: f32, u: f32) -> u32 {
        let scaled = self.scaled(temperature);
        let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if !max.is_finite() {
            return self.argmax();
        }
        let weights: Vec<f64> = scaled.iter().map(|&x| (x - max).exp()).collect();
        let target = f64::from(u) * weights.iter().sum::<f64>();
        let mut cumulative = 0.0;
        for (i, &w) in weights.iter().enumerate() {
            cumulative += w;
            if w > 0.0 && cumulative > target {
                return i as u32;
            }
        }
        // Rounding left the target past the last weight: the last token
        // with any mass is the inverse CDF's answer.
        weights
            .iter()
            .rposition(|&w| w > 0.0)
            .map_or_else(|| self.argmax(), |i| i as u32)
    }

    /// The definition, by sorting: the most likely tokens until their mass reaches `top_p`,
    /// then the inverse CDF over them in index order.
    fn sample_top_p(&self, temperature: f32, top_p: f32, u: f32) -> u32 {
        let scaled = self.scaled(temperature);
        let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if !max.is_finite() {
            return self.argmax();
        }
        let weights: Vec<f64> = scaled.iter().map(|&x| (x - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let logits = self.logits.borrow();
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| by_rank_desc(&logits, a, b));
        let mut member = vec![false; logits.len()];
        let mut mass = 0.0;
        for &i in &order {
            member[i] = true;
            mass += weights[i];
            if mass >= f64::from(top_p) * total {
                break;
            }
        }
        let target = f64::from(u) * mass;
        let mut cumulative = 0.0;
        let mut last = None;
        for (i, &w) in weights.iter().enumerate().filter(|&(i, _)| member[i]) {
            cumulative += w;
            if w > 0.0 {
                last = Some(i as u32);
                if cumulative > target {
                    return i as u32;
                }
            }
        }
        last.unwrap_or(0)
    }

    fn apply_penalties(&self, penalties: &Penalties) {
        let mut logits = self.logits.borrow_mut();
        let mut output_counts = vec![0u32; logits.len()];
        for &id in &self.output {
            if let Some(count) = output_counts.get_mut(id as usize) {
                *count += 1;
            }
        }
        let mut seen = vec![false; logits.len()];
        for &id in self.prompt.iter().chain(&self.output) {
            if let Some(s) = seen.get_mut(id as usize) {
                *s = true;
            }
        }
        for (i, logit) in logits.iter_mut().enumerate() {
            // Order and the guard against a non-positive repetition follow vLLM.
            if seen[i] && penalties.repetition != 1.0 && penalties.repetition > 0.0 {
                if *logit > 0.0 {
                    *logit /= penalties.repetition;
                } else {
                    *logit *= penalties.repetition;
                }
            }
            let count = output_counts[i];
            if count > 0 {
                *logit -= penalties.frequency * count as f32 + penalties.presence;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_paths_follow_the_contract() {
        let row = VecRow::new(vec![1.0, 3.0, f32::NAN, 3.0, -2.0]);
        assert_eq!(row.len(), 5);
        assert_eq!(row.argmax(), 1, "lowest index on ties, NaN never wins");
        let top: Vec<u32> = row.top_k(3).iter().map(|c| c.id).collect();
        assert_eq!(top, [1, 3, 0]);
        assert_eq!(row.top_k(99).len(), 5);
        assert_eq!(row.read(3, 10), [3.0, -2.0]);
        assert!(row.read(9, 1).is_empty());
        assert_eq!(row.num_copied(), 3 + 5 + 2);
        let lps = row.log_softmax(&[0, 1, 2, 3, 4, 99], 1.0);
        let total: f32 = lps.iter().map(|lp| lp.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{lps:?}");
        assert_eq!(lps[5], f32::NEG_INFINITY);
        assert_eq!(row.log_softmax(&[1], 0.0), row.log_softmax(&[1], 1.0));
        assert_eq!(row.sample_full(1.0, 0.0), 0);
        assert_eq!(row.sample_full(1.0, 0.999_999_9), 4);
    }

    #[test]
    fn penalties_follow_the_contract() {
        let row = VecRow::with_history(vec![2.0, -2.0, 1.0, 1.0], vec![0, 1], vec![2, 2]);
        row.apply_penalties(&Penalties {
            presence: 0.5,
            frequency: 0.25,
            repetition: 2.0,
        });
        assert_eq!(row.logits(), [1.0, -4.0, 0.5 - 0.5 - 0.5, 1.0]);
    }
}
