//! Percentiles and the summary of one benchmark run, computed from per-request records.

use serde::Serialize;

use crate::client::RequestRecord;

/// The `p`-th percentile (0–100) of sorted values, interpolating linearly between ranks as
/// numpy's default does, so the numbers compare with `vllm bench serve`.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let (first, last) = (sorted.first()?, sorted.last()?);
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let (low, high) = (rank.floor() as usize, rank.ceil() as usize);
    let value = sorted[low] + (sorted[high] - sorted[low]) * (rank - low as f64);
    Some(value.clamp(*first, *last))
}

/// Mean, median and 99th percentile of one latency, in milliseconds; zeros when no sample exists.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Distribution {
    pub num_samples: usize,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl Distribution {
    /// From samples in seconds.
    pub fn from_seconds(mut samples: Vec<f64>) -> Self {
        samples.retain(|s| s.is_finite());
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_by(f64::total_cmp);
        let ms = |s: Option<f64>| s.unwrap_or(0.0) * 1000.0;
        Self {
            num_samples: samples.len(),
            mean_ms: samples.iter().sum::<f64>() / samples.len() as f64 * 1000.0,
            p50_ms: ms(percentile(&samples, 50.0)),
            p99_ms: ms(percentile(&samples, 99.0)),
        }
    }
}

/// What one run (one concurrency level) measured.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// `None` is unbounded.
    pub max_concurrency: Option<usize>,
    /// Requests per second; infinite (serialized as `null`) sends everything at once.
    pub request_rate: Option<f64>,
    pub num_requests: usize,
    pub num_successful: usize,
    pub num_failed: usize,
    pub first_error: Option<String>,
    pub duration_s: f64,
    pub total_input_tokens: u64,
    pub total_output_tokens: u64,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft: Distribution,
    pub tpot: Distribution,
    pub itl: Distribution,
    /// End-to-end request latency: from sending to the end of the stream, successes only.
    pub e2el: Distribution,
    /// Latencies per `priority` sent, highest first; empty when requests sent none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub by_priority: Vec<PriorityLatency>,
}

/// The latencies of the successful requests that sent one `priority`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PriorityLatency {
    pub priority: i64,
    pub num_successful: usize,
    pub ttft: Distribution,
    pub e2el: Distribution,
}

fn by_priority(ok: &[&RequestRecord]) -> Vec<PriorityLatency> {
    let mut priorities: Vec<i64> = ok.iter().filter_map(|r| r.priority).collect();
    priorities.sort_unstable_by(|a, b| b.cmp(a));
    priorities.dedup();
    priorities
        .into_iter()
        .map(|priority| {
            let group: Vec<&&RequestRecord> =
                ok.iter().filter(|r| r.priority == Some(priority)).collect();
            PriorityLatency {
                priority,
                num_successful: group.len(),
                ttft: Distribution::from_seconds(group.iter().map(|r| r.ttft_s).collect()),
                e2el: Distribution::from_seconds(group.iter().map(|r| r.e2e_s).collect()),
            }
        })
        .collect()
}

/// How the run was shaped, carried into its summary.
#[derive(Debug, Clone, Copy)]
pub struct RunShape {
    pub max_concurrency: Option<usize>,
    pub request_rate: f64,
    pub duration_s: f64,
}

pub fn summarize(records: &[RequestRecord], shape: RunShape) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
    let total_input_tokens = ok.iter().map(|r| r.prompt_tokens).sum();
    let total_output_tokens = ok.iter().map(|r| r.output_tokens).sum();
    let duration = shape.duration_s.max(1e-9);
    let per_second = |n: f64| n / duration;
    Summary {
        max_concurrency: shape.max_concurrency,
        request_rate: shape.request_rate.is_finite().then_some(shape.request_rate),
        num_requests: records.len(),
        num_successful: ok.len(),
        num_failed: records.len() - ok.len(),
        first_error: records.iter().find_map(|r| r.error.clone()),
        duration_s: shape.duration_s,
        total_input_tokens,
        total_output_tokens,
        request_throughput: per_second(ok.len() as f64),
        output_throughput: per_second(total_output_tokens as f64),
        total_token_throughput: per_second((total_input_tokens + total_output_tokens) as f64),
        ttft: Distribution::from_seconds(ok.iter().map(|r| r.ttft_s).collect()),
        tpot: Distribution::from_seconds(ok.iter().filter_map(|r| r.tpot_s()).collect()),
        itl: Distribution::from_seconds(ok.iter().flat_map(|r| r.itl_s.clone()).collect()),
        e2el: Distribution::from_seconds(ok.iter().map(|r| r.e2e_s).collect()),
        by_priority: by_priority(&ok),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let values = [1.0, 2.0, 3.0, 4.0];
        let cases = [
            (0.0, 1.0),
            (50.0, 2.5),
            (99.0, 3.97),
            (100.0, 4.0),
            (150.0, 4.0),
        ];
        for (p, expected) in cases {
            let got = percentile(&values, p).unwrap();
            assert!((got - expected).abs() < 1e-9, "p{p}: {got} != {expected}");
        }
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
    }

    #[test]
    fn distributions_are_in_milliseconds_and_skip_non_finite_samples() {
        let d = Distribution::from_seconds(vec![0.003, 0.001, f64::NAN, 0.002]);
        assert_eq!(d.num_samples, 3);
        assert!((d.mean_ms - 2.0).abs() < 1e-9);
        assert!((d.p50_ms - 2.0).abs() < 1e-9);
        assert_eq!(Distribution::from_seconds(vec![]), Distribution::default());
    }

    fn record(success: bool, output_tokens: u64, ttft_s: f64, e2e_s: f64) -> RequestRecord {
        RequestRecord {
            index: 0,
            priority: None,
            success,
            error: (!success).then(|| "HTTP 500: boom".to_string()),
            prompt_tokens: if success { 10 } else { 0 },
            output_tokens,
            start_s: 0.0,
            ttft_s,
            e2e_s,
            itl_s: vec![0.01; output_tokens.saturating_sub(1) as usize],
        }
    }

    #[test]
    fn the_summary_counts_only_successes_and_keeps_the_first_error() {
        let records = [
            record(true, 5, 0.1, 0.5),
            record(false, 0, 0.0, 0.0),
            record(true, 1, 0.2, 0.2),
        ];
        let shape = RunShape {
            max_concurrency: Some(2),
            request_rate: f64::INFINITY,
            duration_s: 2.0,
        };
        let s = summarize(&records, shape);
        assert_eq!((s.num_successful, s.num_failed), (2, 1));
        assert_eq!(s.first_error.as_deref(), Some("HTTP 500: boom"));
        assert_eq!((s.total_input_tokens, s.total_output_tokens), (20, 6));
        assert!((s.output_throughput - 3.0).abs() < 1e-9);
        assert!((s.total_token_throughput - 13.0).abs() < 1e-9);
        // One output token has no time per output token.
        assert_eq!(s.tpot.num_samples, 1);
        assert!((s.tpot.mean_ms - 100.0).abs() < 1e-6);
        assert_eq!(s.itl.num_samples, 4);
        assert_eq!(s.e2el.num_samples, 2);
        assert!((s.e2el.mean_ms - 350.0).abs() < 1e-6);
        assert!((s.e2el.p99_ms - 497.0).abs() < 1e-6);
        assert_eq!(s.request_rate, None);
        assert!(s.by_priority.is_empty());
    }

    #[test]
    fn latencies_are_broken_down_by_priority_highest_first() {
        let with = |priority, ttft_s| RequestRecord {
            priority: Some(priority),
            ..record(true, 2, ttft_s, ttft_s + 1.0)
        };
        let records = [with(0, 0.5), with(5, 0.1), with(0, 0.7), with(5, 0.3)];
        let shape = RunShape {
            max_concurrency: None,
            request_rate: f64::INFINITY,
            duration_s: 1.0,
        };
        let s = summarize(&records, shape);
        let groups: Vec<(i64, usize, f64)> = s
            .by_priority
            .iter()
            .map(|p| (p.priority, p.num_successful, p.ttft.p50_ms))
            .collect();
        assert_eq!(groups.len(), 2);
        assert_eq!((groups[0].0, groups[0].1), (5, 2));
        assert!((groups[0].2 - 200.0).abs() < 1e-6);
        assert_eq!((groups[1].0, groups[1].1), (0, 2));
        assert!((groups[1].2 - 600.0).abs() < 1e-6);
    }
}
