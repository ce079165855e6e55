//! Host-owned logits of one sampling call and the native fast paths plugins reach through the `logits-batch` resource.
//!
//! Logits never cross the WebAssembly boundary on the normal paths: copying a
//! 151,936-entry row into a guest costs more than the sampling itself. The
//! functions here are the only implementation of these operations; the
//! plugin resource and native callers (benchmarks, the built-in fallback)
//! both use them.

use std::sync::Arc;

use multiversion::multiversion;
use plughost_sdk::sampler::{Candidate, LogitsRow, Penalties};

use super::history::NO_TOKENS;
pub use super::history::{SeenTokens, TokenHistory};

/// A step's logits: `rows` rows of `vocab` values, with each row's tokens seen, for penalties.
/// A row's history is shared with its sequence, never copied.
#[derive(Debug, Clone, Default)]
pub struct LogitsBatch {
    values: Vec<f32>,
    vocab: usize,
    /// `None`: the row has no history (its penalties, if any, change nothing).
    histories: Vec<Option<Arc<SeenTokens>>>,
}

/// The handle a guest holds for the batch; the data stays in the store's `LogitsBatch`.
pub struct LogitsBatchHandle;

impl LogitsBatch {
    /// Wraps `values` (row-major, `vocab` per row). Histories default to empty.
    pub fn new(values: Vec<f32>, vocab: usize) -> Self {
        let rows = values.len().checked_div(vocab).unwrap_or(0);
        LogitsBatch {
            values,
            vocab,
            histories: vec![None; rows],
        }
    }

    /// Gives `row` the tokens its sequence has seen: an `Arc` the sequence keeps counting into
    /// between steps, or lists to count once.
    pub fn set_history(&mut self, row: usize, history: impl Into<Arc<SeenTokens>>) {
        if let Some(slot) = self.histories.get_mut(row) {
            *slot = Some(history.into());
        }
    }

    /// The history `row` was given, shared.
    pub fn history(&self, row: usize) -> Option<&Arc<SeenTokens>> {
        self.histories.get(row)?.as_ref()
    }

    pub fn rows(&self) -> usize {
        self.values.len().checked_div(self.vocab).unwrap_or(0)
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    pub fn row(&self, row: usize) -> Option<&[f32]> {
        let start = row.checked_mul(self.vocab)?;
        self.values.get(start..start + self.vocab)
    }

    pub fn row_mut(&mut self, row: usize) -> Option<(&mut [f32], &SeenTokens)> {
        let start = row.checked_mul(self.vocab)?;
        let values = self.values.get_mut(start..start + self.vocab)?;
        let history = self.histories.get(row)?.as_deref().unwrap_or(&NO_TOKENS);
        Some((values, history))
    }

    /// Gives the values back, e.g. to reuse the allocation next step.
    pub fn into_values(self) -> Vec<f32> {
        self.values
    }
}

/// NaN sorts below everything, so a broken logit is never chosen.
fn key(v: f32) -> f32 {
    if v.is_nan() { f32::NEG_INFINITY } else { v }
}

pub fn argmax(row: &[f32]) -> u32 {
    // Two passes that vectorize: the maximum, then the first index holding it.
    let best = max_key(row);
    first_index_of(row, best) as u32
}

/// The first index of `row` holding `value`, 0 when none does. Whole chunks are tested with
/// no early exit, which vectorizes, and only the chunk that holds it is searched element by
/// element: a plain search stops at each element and took a vocabulary of 151,936 logits
/// longer than the maximum did.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma",
    "x86_64+avx2+fma"
))]
fn first_index_of(row: &[f32], value: f32) -> usize {
    const CHUNK: usize = 64;
    let (chunks, rest) = row.as_chunks::<CHUNK>();
    let first_in = |values: &[f32]| values.iter().position(|&v| v == value);
    for (c, chunk) in chunks.iter().enumerate() {
        if chunk.iter().fold(false, |found, &v| found | (v == value)) {
            return c * CHUNK + first_in(chunk).unwrap_or(0);
        }
    }
    first_in(rest).map_or(0, |i| chunks.len() * CHUNK + i)
}

/// The largest of `row` ignoring NaN (`f32::max` returns the other operand), -inf when there
/// is none: 32 independent lanes, so the loop vectorizes into several registers' worth of
/// maxima at once (eight lanes took three times as long over a vocabulary).
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma",
    "x86_64+avx2+fma"
))]
fn max_key(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 32];
    let (chunks, rest) = row.as_chunks::<32>();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(v);
        }
    }
    lanes
        .iter()
        .chain(rest)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// The `k` largest values, largest first; ties keep the lower index first.
pub fn top_k(row: &[f32], k: u32) -> Vec<Candidate> {
    let k = (k as usize).min(row.len());
    if k == 0 {
        return Vec::new();
    }
    let better =
        |a: &Candidate, b: &Candidate| key(b.value).total_cmp(&key(a.value)).then(a.id.cmp(&b.id));
    // A sorted buffer of the best k with a cheap reject test wins for the
    // small k samplers ask for.
    if k <= 256 {
        let mut best: Vec<Candidate> = Vec::with_capacity(k + 1);
        let mut floor = f32::NEG_INFINITY;
        for (i, &v) in row.iter().enumerate() {
            let v = key(v);
            if best.len() == k && v <= floor {
                continue;
            }
            let c = Candidate {
                id: i as u32,
                value: v,
            };
            let at = best.partition_point(|b| better(b, &c).is_lt());
            best.insert(at, c);
            best.truncate(k);
            if best.len() == k {
                floor = best[k - 1].value;
            }
        }
        return best;
    }
    // Large k (a nucleus over a flat distribution): find a threshold at or below the k-th
    // largest value with two histogram passes, then sort only the values at or above it.
    let threshold = kth_largest_floor(row, k);
    let mut candidates: Vec<Candidate> = row
        .iter()
        .enumerate()
        .filter(|&(_, &v)| ordered_bits(v) >= threshold)
        .map(|(i, &v)| Candidate {
            id: i as u32,
            value: key(v),
        })
        .collect();
    candidates.sort_unstable_by(better);
    candidates.truncate(k);
    candidates
}

/// `key(v)` as a `u32` in the same order as `f32::total_cmp` (-0 below +0).
fn ordered_bits(v: f32) -> u32 {
    let bits = key(v).to_bits();
    // Negative: flip every bit; positive: set the sign bit. Branch-free, so loops vectorize.
    bits ^ ((((bits as i32) >> 31) as u32) | 0x8000_0000)
}

/// A value of [`ordered_bits`] at or below the `k`-th largest of `row` (`1 <= k <= len`), with
/// few values between the two: the top 11 bits of the k-th largest, then the next 11.
fn kth_largest_floor(row: &[f32], k: usize) -> u32 {
    let mut high = [0u32; 2048];
    for &v in row {
        high[(ordered_bits(v) >> 21) as usize] += 1;
    }
    let (high_bucket, above) = bucket_holding(&high, k);
    let mut low = [0u32; 2048];
    for &v in row {
        let bits = ordered_bits(v);
        if (bits >> 21) as usize == high_bucket {
            low[((bits >> 10) & 0x7ff) as usize] += 1;
        }
    }
    let (low_bucket, _) = bucket_holding(&low, k - above);
    ((high_bucket as u32) << 21) | ((low_bucket as u32) << 10)
}

/// Walking `counts` from the top: the bucket in which the running count reaches `k`, and the
/// count above that bucket.
fn bucket_holding(counts: &[u32], k: usize) -> (usize, usize) {
    let mut above = 0;
    for (bucket, &count) in counts.iter().enumerate().rev() {
        if above + count as usize >= k {
            return (bucket, above);
        }
        above += count as usize;
    }
    (0, above)
}

fn effective_temperature(temperature: f32) -> f32 {
    if temperature > 0.0 && temperature.is_finite() {
        temperature
    } else {
        1.0
    }
}

pub fn log_sum_exp(row: &[f32], temperature: f32) -> f32 {
    let t = effective_temperature(temperature);
    let max = max_key(row);
    if max == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    max / t + sum_exp(row, max, t).ln()
}

/// `Σ exp((v - max) / t)` over the row: eight running sums, so the loop vectorizes, of
/// [`exp_below_zero`], which vectorizes where `f32::exp` is a call per element.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma",
    "x86_64+avx2+fma"
))]
fn sum_exp(row: &[f32], max: f32, t: f32) -> f32 {
    eight_lane_sum(row, |v| exp_below_zero((key(v) - max) / t))
}

/// `Σ term(v)` over `values` in eight running sums (lane `l` takes the elements at `i ≡ l`
/// mod 8), added up at the end: the loop vectorizes. Inlined, so it is compiled for each
/// instruction set its callers are.
#[inline(always)]
fn eight_lane_sum<A>(values: &[f32], term: impl Fn(f32) -> A) -> A
where
    A: Copy + Default + std::ops::AddAssign + std::iter::Sum,
{
    let mut lanes = [A::default(); 8];
    let (chunks, rest) = values.as_chunks::<8>();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += term(v);
        }
    }
    for (lane, &v) in lanes.iter_mut().zip(rest) {
        *lane += term(v);
    }
    lanes.into_iter().sum()
}

/// `exp(x)` for `x <= 0` (a logit minus the row's maximum), within a few ulp; 0 below -87 and for NaN.
/// Branch-free and call-free: `2^n · p(r)` with `x = n·ln 2 + r`, `|r| <= ln 2 / 2`.
#[inline(always)]
fn exp_below_zero(x: f32) -> f32 {
    // Below -87 the result is under f32's normal range: flush to 0, as for NaN. Masked tokens
    // (-inf) must weigh exactly 0, so that no draw can land on them.
    let in_range = x >= -87.0;
    let x = if in_range { x } else { -87.0 };
    // Round `x / ln 2` to an integer by adding 1.5 · 2^23 (round to nearest, no SSE4.1).
    const ROUNDER: f32 = 12_582_912.0;
    let shifted = x * std::f32::consts::LOG2_E + ROUNDER;
    let n = shifted - ROUNDER;
    let n_bits = shifted.to_bits().wrapping_sub(ROUNDER.to_bits()) as i32;
    // ln 2 in two parts, so `n · ln2_hi` is exact.
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let mut p = 1.0 / 720.0;
    for coefficient in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p * r + coefficient;
    }
    // `n` lies in [-126, 0], so `2^n` is a normal f32 built from its exponent bits.
    let value = p * f32::from_bits(((n_bits + 127) as u32) << 23);
    if in_range { value } else { 0.0 }
}

pub fn log_softmax(row: &[f32], ids: &[u32], temperature: f32) -> Vec<f32> {
    let t = effective_temperature(temperature);
    let lse = log_sum_exp(row, t);
    ids.iter()
        .map(|&id| match row.get(id as usize) {
            Some(&v) => key(v) / t - lse,
            None => f32::NEG_INFINITY,
        })
        .collect()
}

/// Inverse-CDF draw from softmax(row / temperature) with `u` in [0, 1).
pub fn sample_full(row: &[f32], temperature: f32, u: f32) -> u32 {
    let t = effective_temperature(temperature);
    let max = max_key(row);
    if max == f32::NEG_INFINITY {
        return 0;
    }
    let total = sum_exp(row, max, t);
    let target = u.clamp(0.0, 1.0) * total;
    let mut acc = 0.0f32;
    let mut last_positive = 0usize;
    for (i, &v) in row.iter().enumerate() {
        let p = exp_below_zero((key(v) - max) / t);
        if p > 0.0 {
            last_positive = i;
        }
        acc += p;
        if acc > target {
            return i as u32;
        }
    }
    // Rounding can leave `acc` a hair under `target`; the last token with mass is the answer then.
    last_positive as u32
}

/// Inverse-CDF draw with `u` in [0, 1) from the nucleus of softmax(row / temperature): the
/// fewest most likely tokens (lower index first among equals) whose probability reaches
/// `top_p`, walked in index order. Linear in the row, with no sort: tokens too light to be in
/// any nucleus are dropped in one pass, and the cut among the rest is found on histograms of
/// the logits' bits that carry probability mass, refined until they name the exact cut value,
/// so a flat distribution costs what a peaked one does.
pub fn sample_top_p(row: &[f32], temperature: f32, top_p: f32, u: f32) -> u32 {
    let t = effective_temperature(temperature);
    let max = max_key(row);
    if max == f32::NEG_INFINITY {
        return 0;
    }
    let top_p = if top_p.is_nan() {
        1.0
    } else {
        f64::from(top_p.clamp(0.0, 1.0))
    };
    SCRATCH.with(|cell| {
        let (weights, heavy, subset) = &mut *cell.borrow_mut();
        weights.resize(row.len(), 0.0);
        fill_weights(row, max, t, weights);
        let total = total_weight(weights);
        // Every token lighter than `floor` together weighs under half of the `1 - top_p`
        // share the nucleus leaves out, so none of them can be in it (the cut's own weight is
        // at least `floor`).
        let floor = ((1.0 - top_p) * total / (2.0 * row.len() as f64)) as f32;
        heavy.resize(row.len(), 0);
        let kept = keep_heavy(weights, floor, heavy);
        let heavy = &heavy[..kept];
        let Some(cut) = nucleus_cut((row, weights), heavy, top_p * total, subset) else {
            return argmax(row);
        };
        let target = f64::from(u.clamp(0.0, 1.0)) * cut.mass;
        let (mut cumulative, mut ties_seen, mut last) = (0.0f64, 0usize, None);
        for &i in heavy {
            let bits = ordered_bits(row[i as usize]);
            let member = bits > cut.value
                || (bits == cut.value && ties_seen < cut.ties && {
                    ties_seen += 1;
                    true
                });
            if !member {
                continue;
            }
            let w = weights[i as usize];
            cumulative += f64::from(w);
            if w > 0.0 {
                last = Some(i);
            }
            if cumulative > target && w > 0.0 {
                return i;
            }
        }
        // Rounding can leave the walk a hair short of `target`: the last member with mass.
        last.unwrap_or(0)
    })
}

/// `weights[i] = exp((row[i] - max) · (1 / t))`, NaN as -inf; a multiplication, as a
/// division per token would take as long as the exponential.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma",
    "x86_64+avx2+fma"
))]
fn fill_weights(row: &[f32], max: f32, t: f32, weights: &mut [f32]) {
    let inverse = 1.0 / t;
    for (w, &v) in weights.iter_mut().zip(row) {
        *w = exp_below_zero((key(v) - max) * inverse);
    }
}

/// Writes the indices of the tokens of weight at least `floor` to the front of `out` (as long
/// as `weights`), in order, and returns how many. Every index is written and the count
/// advanced only for the kept ones, so there is no branch to mispredict when about half are.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma",
    "x86_64+avx2+fma"
))]
fn keep_heavy(weights: &[f32], floor: f32, out: &mut [u32]) -> usize {
    let mut kept = 0;
    for (i, &w) in weights.iter().enumerate() {
        out[kept] = i as u32;
        kept += usize::from(w >= floor);
    }
    kept
}

/// `Σ weights` in f64, eight running sums so the loop vectorizes.
#[multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512dq+avx512vl+avx2+fma",
    "x86_64+avx2+fma"
))]
fn total_weight(weights: &[f32]) -> f64 {
    eight_lane_sum(weights, f64::from)
}

thread_local! {
    /// One row's unnormalised probabilities, the tokens that may be in its nucleus and the
    /// finer levels' subset, for `sample_top_p`; grown to the vocabulary once.
    #[allow(clippy::type_complexity)]
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<u32>, Vec<(u32, f32)>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Where the nucleus ends: every value above `value` (as [`ordered_bits`]) is in, and the
/// first `ties` tokens holding exactly `value`; `mass` is the nucleus's total weight.
struct NucleusCut {
    value: u32,
    ties: usize,
    mass: f64,
}

/// The cut of the fewest most likely tokens among `heavy` (indices into `row` and `weights`)
/// whose weight reaches `wanted`: three histogram passes over 11, 11 and 10 bits of the
/// ordered logits, each summing weight per bucket from the top, narrow the bucket holding the
/// cut to a single value. `None` when `heavy` is empty.
fn nucleus_cut(
    (row, weights): (&[f32], &[f32]),
    heavy: &[u32],
    wanted: f64,
    subset: &mut Vec<(u32, f32)>,
) -> Option<NucleusCut> {
    // (shift, width) of the bits each level resolves.
    const LEVELS: [(u32, u32); 3] = [(21, 11), (10, 11), (0, 10)];
    if heavy.is_empty() {
        return None;
    }
    let (mut prefix, mut prefix_bits, mut above) = (0u32, 0u32, 0.0f64);
    // The first level passes over every heavy token into two histograms, even and odd
    // tokens, so a run of tokens in one bucket waits less on its own additions.
    let mut mass = [[0.0f64; 2048]; 2];
    let mut count = [[0u32; 2048]; 2];
    for (level, (shift, width)) in LEVELS.into_iter().enumerate() {
        let mask = (1u32 << width) - 1;
        let bucket_of = |bits: u32| ((bits >> shift) & mask) as usize;
        if level == 0 {
            let mut add = |way: usize, i: u32| {
                let bucket = bucket_of(ordered_bits(row[i as usize]));
                mass[way][bucket] += f64::from(weights[i as usize]);
                count[way][bucket] += 1;
            };
            let (pairs, rest) = heavy.as_chunks::<2>();
            for &[even, odd] in pairs {
                add(0, even);
                add(1, odd);
            }
            for &i in rest {
                add(0, i);
            }
            for bucket in 0..2048 {
                mass[0][bucket] += mass[1][bucket];
                count[0][bucket] += count[1][bucket];
            }
        } else {
            mass[0].fill(0.0);
            count[0].fill(0);
            for &(bits, w) in subset.iter() {
                let bucket = bucket_of(bits);
                mass[0][bucket] += f64::from(w);
                count[0][bucket] += 1;
            }
        }
        let (mass, count) = (&mass[0], &count[0]);
        let (mut chosen, mut lowest) = (None, 0);
        for bucket in (0..=mask as usize).rev() {
            if count[bucket] == 0 {
                continue;
            }
            if above + mass[bucket] >= wanted {
                chosen = Some(bucket);
                break;
            }
            above += mass[bucket];
            lowest = bucket;
        }
        // No bucket reached `wanted` (rounding): the lowest non-empty one ends the nucleus.
        let bucket = chosen.unwrap_or_else(|| {
            above -= mass[lowest];
            lowest
        });
        prefix = (prefix << width) | bucket as u32;
        prefix_bits += width;
        let under_prefix = |bits: u32| bits >> (32 - prefix_bits) == prefix;
        if level == 0 {
            // Every token is written and the count advanced only for those under the prefix:
            // no branch to mispredict on a flat distribution, where many are.
            subset.resize(heavy.len(), (0, 0.0));
            let mut kept = 0;
            for &i in heavy {
                let bits = ordered_bits(row[i as usize]);
                subset[kept] = (bits, weights[i as usize]);
                kept += usize::from(under_prefix(bits));
            }
            subset.truncate(kept);
        } else {
            subset.retain(|&(bits, _)| under_prefix(bits));
        }
    }
    // `prefix` is now one exact value, the cut, and `subset` its ties, which share one weight.
    let value = prefix;
    let tie_count = subset.len();
    let tie_weight = subset.first().map_or(0.0, |&(_, w)| f64::from(w));
    let needed = if tie_weight > 0.0 {
        ((wanted - above) / tie_weight).ceil().max(1.0) as usize
    } else {
        tie_count
    };
    let ties = needed.clamp(1, tie_count.max(1));
    Some(NucleusCut {
        value,
        ties,
        mass: above + ties as f64 * tie_weight,
    })
}

/// The repetition penalty over prompt and generated tokens, then the OpenAI
/// presence/frequency penalties over generated tokens (vLLM's order). Each distinct token is
/// touched once, from counts kept as the tokens came: the cost does not grow with the length.
pub fn apply_penalties(row: &mut [f32], history: &SeenTokens, penalties: &Penalties) {
    if penalties.repetition != 1.0 && penalties.repetition > 0.0 {
        for &t in history.distinct() {
            if let Some(v) = row.get_mut(t as usize) {
                *v = if *v > 0.0 {
                    *v / penalties.repetition
                } else {
                    *v * penalties.repetition
                };
            }
        }
    }
    if penalties.presence != 0.0 || penalties.frequency != 0.0 {
        for &(t, n) in history.output_counts() {
            if let Some(v) = row.get_mut(t as usize) {
                *v -= penalties.presence + penalties.frequency * n as f32;
            }
        }
    }
}

/// A native row implementing the SDK trait over the same functions the plugin resource uses.
pub struct NativeRow<'a> {
    values: std::cell::RefCell<&'a mut [f32]>,
    history: &'a SeenTokens,
}

impl<'a> NativeRow<'a> {
    pub fn new(values: &'a mut [f32], history: &'a SeenTokens) -> Self {
        NativeRow {
            values: std::cell::RefCell::new(values),
            history,
        }
    }
}

impl LogitsRow for NativeRow<'_> {
    fn len(&self) -> u32 {
        self.values.borrow().len() as u32
    }
    fn argmax(&self) -> u32 {
        argmax(&self.values.borrow())
    }
    fn top_k(&self, k: u32) -> Vec<Candidate> {
        top_k(&self.values.borrow(), k)
    }
    fn read(&self, start: u32, len: u32) -> Vec<f32> {
        read(&self.values.borrow(), start, len)
    }
    fn log_softmax(&self, ids: &[u32], temperature: f32) -> Vec<f32> {
        log_softmax(&self.values.borrow(), ids, temperature)
    }
    fn log_sum_exp(&self, temperature: f32) -> f32 {
        log_sum_exp(&self.values.borrow(), temperature)
    }
    fn sample_full(&self, temperature: f32, u: f32) -> u32 {
        sample_full(&self.values.borrow(), temperature, u)
    }
    fn sample_top_p(&self, temperature: f32, top_p: f32, u: f32) -> u32 {
        sample_top_p(&self.values.borrow(), temperature, top_p, u)
    }
    fn apply_penalties(&self, penalties: &Penalties) {
        apply_penalties(&mut self.values.borrow_mut(), self.history, penalties)
    }
}

/// Up to `len` values from `start`, clipped to the row.
pub fn read(row: &[f32], start: u32, len: u32) -> Vec<f32> {
    let start = (start as usize).min(row.len());
    let end = start.saturating_add(len as usize).min(row.len());
    row[start..end].to_vec()
}

#[cfg(test)]
mod tests;
