//! The loads of the comparison and running them through `plughost bench`: its command line in,
//! its `--result-json` summary out.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, ensure};
use serde::Deserialize;

/// Temperature and top-p of the sampling load.
pub const SAMPLING: (f32, f32) = (0.8, 0.95);

/// One load: a fixed number of requests at a fixed concurrency.
#[derive(Debug, Clone)]
pub struct Load {
    /// File-name-safe key, e.g. `single`.
    pub key: String,
    pub title: String,
    pub concurrency: usize,
    pub num_prompts: usize,
    /// Temperature and top-p; `None` is greedy.
    pub sampling: Option<(f32, f32)>,
    /// Every load has its own seed, so no prompt repeats within a server's lifetime (both
    /// servers cache prompt prefixes); both servers see the same prompts.
    pub seed: u64,
    /// Prompt and output tokens when this load has its own (the depth sweep's); otherwise the
    /// shape's.
    pub lengths: Option<(u32, u32)>,
    /// Whether `plughost bench` sends one request of the load's shape before measuring.
    pub warm_up: bool,
}

impl Load {
    /// The load as round `round` sends it: its own seed, past every earlier round's, so no
    /// prompt repeats on a server across rounds either. A load with its own lengths (a long
    /// prompt of the depth sweep) warms up in the first round only: the servers run through
    /// every round, so later rounds find them warm, and a warm-up there would double the
    /// longest prompts' time for nothing.
    pub fn in_round(&self, round: usize, loads_per_round: usize) -> Load {
        Load {
            seed: self.seed.wrapping_add((round * loads_per_round) as u64),
            warm_up: self.warm_up && (round == 0 || self.lengths.is_none()),
            ..self.clone()
        }
    }
}

/// What every load shares.
pub struct Shape {
    pub input_len: u32,
    pub output_len: u32,
    /// Random prompt token ids are drawn below this.
    pub max_token_id: u64,
}

/// The `plughost bench` flags of `load` against `base_url`.
pub fn bench_args(load: &Load, shape: &Shape, base_url: &str) -> Vec<String> {
    let (temperature, top_p) = load.sampling.unwrap_or((0.0, 1.0));
    let (input_len, output_len) = load.lengths.unwrap_or((shape.input_len, shape.output_len));
    vec![
        "bench".into(),
        "--base-url".into(),
        base_url.into(),
        "--num-prompts".into(),
        load.num_prompts.to_string(),
        "--max-concurrency".into(),
        load.concurrency.to_string(),
        "--input-len".into(),
        input_len.to_string(),
        "--output-len".into(),
        output_len.to_string(),
        "--ignore-eos".into(),
        "--temperature".into(),
        temperature.to_string(),
        "--top-p".into(),
        top_p.to_string(),
        "--seed".into(),
        load.seed.to_string(),
        "--max-token-id".into(),
        shape.max_token_id.to_string(),
        "--warmup".into(),
        usize::from(load.warm_up).to_string(),
    ]
}

/// Latency percentiles in milliseconds, as `plughost bench` writes them.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct Distribution {
    #[serde(default)]
    pub p50_ms: f64,
    #[serde(default)]
    pub p99_ms: f64,
}

/// The part of a `plughost bench` run summary the comparison reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Summary {
    pub num_successful: usize,
    pub num_failed: usize,
    #[serde(default)]
    pub first_error: Option<String>,
    pub duration_s: f64,
    pub output_throughput: f64,
    pub ttft: Distribution,
    pub tpot: Distribution,
    pub itl: Distribution,
}

/// One request of a run, as `plughost bench` records it; times in seconds.
#[derive(Debug, Clone, Deserialize)]
pub struct Record {
    pub success: bool,
    pub output_tokens: u64,
    pub ttft_s: f64,
    pub e2e_s: f64,
    #[serde(default)]
    pub itl_s: Vec<f64>,
}

impl Record {
    /// Time per output token after the first, as `plughost bench` defines it.
    fn tpot_s(&self) -> Option<f64> {
        (self.output_tokens > 1)
            .then(|| (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) as f64)
    }
}

/// One round of a load against one server: its summary and its requests.
#[derive(Debug, Clone)]
pub struct Run {
    pub summary: Summary,
    pub records: Vec<Record>,
}

/// The rounds of one load against one server as if they were one run: requests pooled for the
/// percentiles, output tokens over the summed durations for the throughput. `None` without
/// rounds.
pub fn pool(runs: &[Run]) -> Option<Summary> {
    let first = runs.first()?;
    if runs.len() == 1 {
        return Some(first.summary.clone());
    }
    let ok: Vec<&Record> = runs
        .iter()
        .flat_map(|r| &r.records)
        .filter(|r| r.success)
        .collect();
    let duration_s: f64 = runs.iter().map(|r| r.summary.duration_s).sum();
    let output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    Some(Summary {
        num_successful: runs.iter().map(|r| r.summary.num_successful).sum(),
        num_failed: runs.iter().map(|r| r.summary.num_failed).sum(),
        first_error: runs.iter().find_map(|r| r.summary.first_error.clone()),
        duration_s,
        output_throughput: if duration_s > 0.0 {
            output_tokens as f64 / duration_s
        } else {
            0.0
        },
        ttft: Distribution::from_seconds(ok.iter().map(|r| r.ttft_s).collect()),
        tpot: Distribution::from_seconds(ok.iter().filter_map(|r| r.tpot_s()).collect()),
        itl: Distribution::from_seconds(ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect()),
    })
}

/// The `p`-th percentile (0–100) of sorted values, interpolated between ranks the way
/// `plughost bench` (and numpy) do, so pooled figures read like a single run's.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let Some(last) = sorted.len().checked_sub(1) else {
        return 0.0;
    };
    let rank = p / 100.0 * last as f64;
    let (low, high) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[low] + (sorted[high] - sorted[low]) * (rank - low as f64)
}

impl Distribution {
    /// From samples in seconds; zeros without samples.
    fn from_seconds(mut samples: Vec<f64>) -> Self {
        samples.retain(|s| s.is_finite());
        samples.sort_by(f64::total_cmp);
        Distribution {
            p50_ms: percentile(&samples, 50.0) * 1000.0,
            p99_ms: percentile(&samples, 99.0) * 1000.0,
        }
    }
}

/// Runs `plughost bench` for one load, keeping its JSON at `json`; its table goes to stderr.
pub fn run(
    plughost: &Path,
    load: &Load,
    shape: &Shape,
    base_url: &str,
    json: &Path,
) -> Result<Run> {
    let mut args: Vec<OsString> = bench_args(load, shape, base_url)
        .into_iter()
        .map(OsString::from)
        .collect();
    args.push("--result-json".into());
    args.push(json.as_os_str().to_owned());
    eprintln!(
        "{}: {} request{} at concurrency {}",
        load.title,
        load.num_prompts,
        if load.num_prompts == 1 { "" } else { "s" },
        load.concurrency
    );
    let output = Command::new(plughost)
        .args(&args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {} bench", plughost.display()))?;
    eprint!("{}", String::from_utf8_lossy(&output.stdout));
    ensure!(
        output.status.success(),
        "`plughost bench` failed ({}) for {}",
        output.status,
        load.title
    );
    read_run(json)
}

/// The first run's summary and records in a `--result-json` file.
pub fn read_run(json: &Path) -> Result<Run> {
    let text =
        std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    let mut report: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", json.display()))?;
    let run = report
        .get_mut("runs")
        .and_then(|runs| runs.get_mut(0))
        .map(serde_json::Value::take)
        .unwrap_or_default();
    ensure!(
        !run["summary"].is_null(),
        "{} has no runs[0].summary",
        json.display()
    );
    let summary = serde_json::from_value(run["summary"].clone())
        .with_context(|| format!("reading the summary in {}", json.display()))?;
    let records = serde_json::from_value(run["records"].clone())
        .with_context(|| format!("reading the records in {}", json.display()))?;
    Ok(Run { summary, records })
}

/// Where a load's raw result goes.
pub fn json_path(dir: &Path, server: &str, load: &Load) -> PathBuf {
    dir.join(format!("{server}-{}.json", load.key))
}

/// Where one round of a load's raw results goes.
pub fn round_json_path(dir: &Path, server: &str, load: &Load, round: usize) -> PathBuf {
    dir.join(format!("{server}-{}-round{}.json", load.key, round + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_sampling_loads_differ_only_in_their_flags() {
        let shape = Shape {
            input_len: 256,
            output_len: 128,
            max_token_id: 49152,
        };
        let mut load = Load {
            key: "k".into(),
            title: "t".into(),
            concurrency: 16,
            num_prompts: 32,
            sampling: None,
            seed: 7,
            lengths: None,
            warm_up: true,
        };
        let greedy = bench_args(&load, &shape, "http://h:1").join(" ");
        assert!(
            greedy.contains("--temperature 0 --top-p 1 --seed 7"),
            "{greedy}"
        );
        assert!(greedy.contains("--ignore-eos"));
        load.sampling = Some(SAMPLING);
        let sampling = bench_args(&load, &shape, "http://h:1").join(" ");
        assert!(
            sampling.contains("--temperature 0.8 --top-p 0.95"),
            "{sampling}"
        );
    }

    #[test]
    fn summaries_are_read_from_the_result_json() {
        let path =
            std::env::temp_dir().join(format!("xtask-compare-loads-{}.json", std::process::id()));
        std::fs::write(
            &path,
            r#"{"runs":[{"summary":{"num_successful":2,"num_failed":0,"first_error":null,
            "duration_s":1.5,"total_output_tokens":10,"output_throughput":6.6,"extra":1,
            "ttft":{"p50_ms":1,"p99_ms":2,"mean_ms":1},"tpot":{"p50_ms":3,"p99_ms":4},
            "itl":{"p50_ms":5,"p99_ms":6}},"records":[]}]}"#,
        )
        .unwrap();
        let run = read_run(&path).unwrap();
        let s = &run.summary;
        assert_eq!((s.num_successful, s.itl.p99_ms), (2, 6.0));
        assert!(run.records.is_empty());
        std::fs::write(&path, r#"{"runs":[]}"#).unwrap();
        assert!(read_run(&path).is_err());
        std::fs::remove_file(&path).ok();
    }

    fn round(duration_s: f64, tpots_s: &[f64], failed: usize) -> Run {
        let records: Vec<Record> = tpots_s
            .iter()
            .map(|tpot| Record {
                success: true,
                output_tokens: 11,
                ttft_s: 0.5,
                e2e_s: 0.5 + 10.0 * tpot,
                itl_s: vec![*tpot; 10],
            })
            .collect();
        Run {
            summary: Summary {
                num_successful: records.len(),
                num_failed: failed,
                first_error: (failed > 0).then(|| "boom".to_string()),
                duration_s,
                output_throughput: 11.0 * records.len() as f64 / duration_s,
                ttft: Distribution::default(),
                tpot: Distribution::default(),
                itl: Distribution::default(),
            },
            records,
        }
    }

    #[test]
    fn pooled_rounds_read_as_one_run() {
        let pooled = pool(&[round(2.0, &[0.010, 0.030], 0), round(1.0, &[0.020], 1)]).unwrap();
        assert_eq!((pooled.num_successful, pooled.num_failed), (3, 1));
        assert_eq!(pooled.first_error.as_deref(), Some("boom"));
        // 33 output tokens over 3 seconds, not the mean of 11 and 11 tok/s per round.
        assert!((pooled.output_throughput - 11.0).abs() < 1e-9);
        assert!((pooled.tpot.p50_ms - 20.0).abs() < 1e-9, "{pooled:?}");
        // numpy: rank 0.99 × 2 = 1.98 between 20 and 30 ms.
        assert!((pooled.tpot.p99_ms - 29.8).abs() < 1e-9, "{pooled:?}");
        assert!((pooled.ttft.p50_ms - 500.0).abs() < 1e-9);
        assert_eq!(pooled.itl.p50_ms, 20.0);
        // One round is that round's own summary.
        let one = pool(&[round(2.0, &[0.010], 0)]).unwrap();
        assert_eq!(one.tpot.p50_ms, 0.0);
        assert!(pool(&[]).is_none());
    }
}
