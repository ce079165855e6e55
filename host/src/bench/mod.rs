//! `plughost bench`: a load generator for OpenAI-compatible servers in the manner of `vllm bench serve`.
//!
//! `client` times one streaming request, `stats` turns records into a summary, `report` prints
//! and writes it. Requests arrive on a Poisson schedule independent of the concurrency limit,
//! so a saturated server shows up as queueing in TTFT rather than as a slower arrival rate.

pub mod client;
pub mod report;
pub mod stats;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use client::{RequestRecord, RequestSpec};
use stats::{RunShape, Summary};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `/v1/completions`
    Completions,
    /// `/v1/chat/completions`
    Chat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptKind {
    /// Fresh seeded token ids per request (random words on the chat endpoint).
    Random,
    /// The same text for every request.
    Fixed,
}

/// The options of `plughost bench`.
#[derive(Debug, Clone, Parser, Serialize)]
#[command(name = "bench")]
pub struct BenchOptions {
    /// The server, e.g. http://127.0.0.1:8000.
    #[arg(long)]
    pub base_url: String,
    /// The model name (default: the first of /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,
    #[arg(long, default_value_t = 32)]
    pub num_prompts: usize,
    /// Requests in flight at once (default: unbounded).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Requests per second with Poisson arrivals; `inf` sends everything at once.
    #[arg(long, default_value_t = f64::INFINITY)]
    pub request_rate: f64,
    #[arg(long, default_value_t = 256)]
    pub input_len: u32,
    #[arg(long, default_value_t = 128)]
    pub output_len: u32,
    #[arg(long, value_enum, default_value_t = PromptKind::Random)]
    pub prompt_kind: PromptKind,
    /// Keep generating past end-of-sequence so every request yields `output-len` tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Random prompts draw token ids from [100, this); lower it for models with small vocabularies.
    #[arg(long, default_value_t = 30000)]
    pub max_token_id: u32,
    /// Write the summary and the per-request records here.
    #[arg(long)]
    pub result_json: Option<PathBuf>,
    /// Run once per concurrency in this list, e.g. 1,2,4,8.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub sweep: Option<Vec<usize>>,
    /// Draw output tokens/s and TTFT p50 against concurrency as SVG (needs --sweep).
    #[arg(long, requires = "sweep")]
    pub plot: Option<PathBuf>,
}

const MIN_TOKEN_ID: u32 = 100;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid option: {0}")]
    InvalidOption(String),
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One concurrency level: its summary and every request's record, in request order.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub summary: Summary,
    pub records: Vec<RequestRecord>,
}

/// Everything a bench invocation measured; `--result-json` writes this.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub model: Option<String>,
    pub options: BenchOptions,
    pub runs: Vec<RunResult>,
}

impl BenchOptions {
    /// Parses the flags after `bench`, as the command line would; for library callers and tests.
    pub fn from_args<I, T>(args: I) -> Result<Self, String>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let argv = std::iter::once("bench".into()).chain(args.into_iter().map(Into::into));
        Self::try_parse_from(argv).map_err(|e| e.to_string())
    }

    fn validate(&self) -> Result<(), BenchError> {
        let invalid = |m: &str| Err(BenchError::InvalidOption(m.into()));
        if self.num_prompts == 0 {
            return invalid("--num-prompts must be at least 1");
        }
        if self.input_len == 0 || self.output_len == 0 {
            return invalid("--input-len and --output-len must be at least 1");
        }
        if self.request_rate.is_nan() || self.request_rate <= 0.0 {
            return invalid("--request-rate must be positive (or inf)");
        }
        if self.max_token_id <= MIN_TOKEN_ID {
            return invalid("--max-token-id must be above 100");
        }
        if self.max_concurrency == Some(0) || self.sweep.iter().flatten().any(|&c| c == 0) {
            return invalid("concurrency must be at least 1");
        }
        if self.sweep.as_ref().is_some_and(Vec::is_empty) {
            return invalid("--sweep needs at least one concurrency");
        }
        Ok(())
    }

    fn url(&self) -> String {
        let base = self.base_url.trim_end_matches('/');
        let base = base.strip_suffix("/v1").unwrap_or(base);
        match self.endpoint {
            Endpoint::Completions => format!("{base}/v1/completions"),
            Endpoint::Chat => format!("{base}/v1/chat/completions"),
        }
    }

    /// One concurrency per run: the sweep's, else `--max-concurrency` once.
    fn concurrencies(&self) -> Vec<Option<usize>> {
        match &self.sweep {
            Some(levels) => levels.iter().map(|&c| Some(c)).collect(),
            None => vec![self.max_concurrency],
        }
    }
}

/// The first model `/v1/models` lists; `None` (and a warning) when the server does not say,
/// so that an unreachable server still shows up as failed requests.
async fn discover_model(client: &reqwest::Client, base_url: &str) -> Option<String> {
    let base = base_url.trim_end_matches('/');
    let base = base.strip_suffix("/v1").unwrap_or(base);
    let url = format!("{base}/v1/models");
    let listed = async {
        let response = client.get(&url).send().await?.error_for_status()?;
        response.json::<Value>().await
    };
    match listed.await {
        Ok(list) => {
            let id = list["data"][0]["id"].as_str().map(str::to_string);
            if id.is_none() {
                tracing::warn!("{url} lists no model; sending requests without one");
            }
            id
        }
        Err(e) => {
            tracing::warn!("cannot list models at {url}: {e}; sending requests without a model");
            None
        }
    }
}

/// SplitMix64's finalizer: nearby inputs (seed, run, index) give unrelated streams.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const WORDS: &[&str] = &[
    "the", "model", "serves", "tokens", "quickly", "while", "plugins", "schedule", "each", "batch",
    "and", "sample", "from", "a", "cache", "of", "blocks",
];

/// The prompt of request `index` in run `run`: the JSON fields to merge into the body.
fn prompt_fields(options: &BenchOptions, run: usize, index: usize) -> (&'static str, Value) {
    let seed = mix(options.seed ^ mix(run as u64) ^ mix(mix(index as u64)));
    let mut rng = StdRng::seed_from_u64(seed);
    let len = options.input_len as usize;
    let text = match options.prompt_kind {
        PromptKind::Fixed => "hello ".repeat(len).trim_end().to_string(),
        PromptKind::Random if options.endpoint == Endpoint::Completions => {
            let ids: Vec<u32> = (0..len)
                .map(|_| rng.random_range(MIN_TOKEN_ID..options.max_token_id))
                .collect();
            return ("prompt", json!(ids));
        }
        PromptKind::Random => (0..len)
            .map(|_| WORDS[rng.random_range(0..WORDS.len())])
            .collect::<Vec<_>>()
            .join(" "),
    };
    match options.endpoint {
        Endpoint::Completions => ("prompt", json!(text)),
        Endpoint::Chat => ("messages", json!([{"role": "user", "content": text}])),
    }
}

fn request_body(options: &BenchOptions, model: Option<&str>, run: usize, index: usize) -> Value {
    let (key, prompt) = prompt_fields(options, run, index);
    let mut body = json!({
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": options.output_len,
        "temperature": options.temperature,
        "top_p": options.top_p,
    });
    body[key] = prompt;
    if let Some(model) = model {
        body["model"] = json!(model);
    }
    if options.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    body
}

/// Seconds after the start at which each request arrives.
fn arrival_offsets(options: &BenchOptions, run: usize) -> Vec<f64> {
    if options.request_rate.is_infinite() {
        return vec![0.0; options.num_prompts];
    }
    let mut rng = StdRng::seed_from_u64(mix(options.seed ^ mix(run as u64) ^ 0xa771_7a15));
    let mut at = 0.0;
    (0..options.num_prompts)
        .map(|_| {
            let offset = at;
            let u: f64 = rng.random();
            at += -(1.0 - u).ln() / options.request_rate;
            offset
        })
        .collect()
}

struct RunPlan<'a> {
    options: &'a BenchOptions,
    client: &'a reqwest::Client,
    model: Option<&'a str>,
    run: usize,
    max_concurrency: Option<usize>,
}

async fn run_once(plan: RunPlan<'_>) -> RunResult {
    let url: Arc<str> = plan.options.url().into();
    let permits = plan.max_concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for (index, offset) in arrival_offsets(plan.options, plan.run)
        .into_iter()
        .enumerate()
    {
        tokio::time::sleep_until((start + Duration::from_secs_f64(offset)).into()).await;
        let body = request_body(plan.options, plan.model, plan.run, index);
        let (client, url, permits) = (plan.client.clone(), url.clone(), permits.clone());
        tasks.spawn(async move {
            let _permit = match &permits {
                Some(p) => p.clone().acquire_owned().await.ok(),
                None => None,
            };
            let spec = RequestSpec {
                index,
                url: &url,
                body: &body,
                run_start: start,
            };
            client::send(&client, spec).await
        });
    }
    let mut records = Vec::with_capacity(plan.options.num_prompts);
    while let Some(joined) = tasks.join_next().await {
        records.push(joined.unwrap_or_else(|e| RequestRecord {
            error: Some(format!("the request task failed: {e}")),
            ..Default::default()
        }));
    }
    let duration_s = start.elapsed().as_secs_f64();
    records.sort_by_key(|r| r.index);
    let shape = RunShape {
        max_concurrency: plan.max_concurrency,
        request_rate: plan.options.request_rate,
        duration_s,
    };
    RunResult {
        summary: stats::summarize(&records, shape),
        records,
    }
}

/// Runs the benchmark (once, or once per `--sweep` concurrency) and writes the files asked for.
/// Request failures are counted in the summaries, never returned as errors.
pub async fn run(options: BenchOptions) -> Result<BenchReport, BenchError> {
    options.validate()?;
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()?;
    let model = match &options.model {
        Some(model) => Some(model.clone()),
        None => discover_model(&client, &options.base_url).await,
    };
    let mut runs = Vec::new();
    for (run, max_concurrency) in options.concurrencies().into_iter().enumerate() {
        let plan = RunPlan {
            options: &options,
            client: &client,
            model: model.as_deref(),
            run,
            max_concurrency,
        };
        runs.push(run_once(plan).await);
    }
    let report = BenchReport {
        model,
        options,
        runs,
    };
    report::write_files(&report)?;
    Ok(report)
}

/// The `plughost bench` command: run on a fresh runtime and print the report.
pub fn main(options: BenchOptions) -> Result<(), String> {
    let runtime = tokio::runtime::Runtime::new()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let report = runtime.block_on(run(options)).map_err(|e| e.to_string())?;
    print!("{}", report::text(&report));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(args: &[&str]) -> BenchOptions {
        let argv = ["bench", "--base-url", "http://h:1"].iter().chain(args);
        BenchOptions::try_parse_from(argv).expect("the options parse")
    }

    #[test]
    fn random_prompts_are_exact_fresh_and_reproducible() {
        let o = options(&["--input-len", "16", "--max-token-id", "448"]);
        let ids = |run, index| prompt_fields(&o, run, index).1;
        let first = ids(0, 0);
        let list = first.as_array().unwrap();
        assert_eq!(list.len(), 16);
        assert!(
            list.iter()
                .all(|v| (100..448).contains(&v.as_u64().unwrap()))
        );
        assert_eq!(first, ids(0, 0));
        assert_ne!(first, ids(0, 1));
        assert_ne!(first, ids(1, 0));
    }

    #[test]
    fn bodies_follow_the_endpoint_and_flags() {
        let chat = request_body(
            &options(&["--endpoint", "chat", "--ignore-eos"]),
            Some("m"),
            0,
            0,
        );
        assert!(chat["messages"][0]["content"].is_string());
        assert_eq!(chat["ignore_eos"], json!(true));
        assert_eq!(chat["model"], json!("m"));
        let fixed = request_body(
            &options(&["--prompt-kind", "fixed", "--input-len", "3"]),
            None,
            0,
            0,
        );
        assert_eq!(fixed["prompt"], json!("hello hello hello"));
        assert!(fixed.get("ignore_eos").is_none() && fixed.get("model").is_none());
        assert_eq!(fixed["stream_options"]["include_usage"], json!(true));
    }

    #[test]
    fn options_are_checked() {
        let cases: &[(&[&str], bool)] = &[
            (&[], true),
            (&["--num-prompts", "0"], false),
            (&["--request-rate", "0"], false),
            (&["--request-rate", "inf"], true),
            (&["--sweep", "1,0"], false),
            (&["--sweep", "1,2,4", "--plot", "x.svg"], true),
            (&["--max-token-id", "50"], false),
        ];
        for (args, ok) in cases {
            assert_eq!(options(args).validate().is_ok(), *ok, "{args:?}");
        }
        assert!(
            BenchOptions::try_parse_from(["bench", "--base-url", "u", "--plot", "x.svg"]).is_err()
        );
    }

    #[test]
    fn poisson_arrivals_average_the_rate() {
        let o = options(&["--request-rate", "10", "--num-prompts", "2000"]);
        let offsets = arrival_offsets(&o, 0);
        assert_eq!(offsets[0], 0.0);
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
        let rate = (offsets.len() - 1) as f64 / offsets.last().unwrap();
        assert!((rate - 10.0).abs() < 1.0, "rate {rate}");
    }
}
