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
    vec![
        "bench".into(),
        "--base-url".into(),
        base_url.into(),
        "--num-prompts".into(),
        load.num_prompts.to_string(),
        "--max-concurrency".into(),
        load.concurrency.to_string(),
        "--input-len".into(),
        shape.input_len.to_string(),
        "--output-len".into(),
        shape.output_len.to_string(),
        "--ignore-eos".into(),
        "--temperature".into(),
        temperature.to_string(),
        "--top-p".into(),
        top_p.to_string(),
        "--seed".into(),
        load.seed.to_string(),
        "--max-token-id".into(),
        shape.max_token_id.to_string(),
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

/// Runs `plughost bench` for one load, keeping its JSON at `json`; its table goes to stderr.
pub fn run(
    plughost: &Path,
    load: &Load,
    shape: &Shape,
    base_url: &str,
    json: &Path,
) -> Result<Summary> {
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
    read_summary(json)
}

/// The first run's summary in a `--result-json` file.
pub fn read_summary(json: &Path) -> Result<Summary> {
    let text =
        std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    let report: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", json.display()))?;
    let summary = report["runs"][0]["summary"].clone();
    ensure!(
        !summary.is_null(),
        "{} has no runs[0].summary",
        json.display()
    );
    serde_json::from_value(summary)
        .with_context(|| format!("reading the summary in {}", json.display()))
}

/// Where a load's raw result goes.
pub fn json_path(dir: &Path, server: &str, load: &Load) -> PathBuf {
    dir.join(format!("{server}-{}.json", load.key))
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
        let s = read_summary(&path).unwrap();
        assert_eq!((s.num_successful, s.itl.p99_ms), (2, 6.0));
        std::fs::write(&path, r#"{"runs":[]}"#).unwrap();
        assert!(read_summary(&path).is_err());
        std::fs::remove_file(&path).ok();
    }
}
