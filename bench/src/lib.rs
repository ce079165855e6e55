//! `plughost bench`: a load generator for OpenAI-compatible servers in the manner of `vllm bench serve`.
//!
//! `client` times one streaming request, `stats` turns records into a summary, `report` prints
//! and writes it, `progress` draws a bar of completed requests on a terminal. Requests arrive on
//! a Poisson schedule independent of the concurrency limit, so a saturated server shows up as
//! queueing in TTFT rather than as a slower arrival rate. Warm-up requests go first, with
//! prompts of their own, and are awaited before the clock starts.

pub mod client;
pub mod progress;
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
use progress::PhaseProgress;
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
    /// A long shared prefix (`--shared-prefix-len` tokens; `--shared-prefixes` of them, taken
    /// in turn) before a short random suffix of `--input-len` tokens: system prompts, RAG
    /// documents, chat history. The warm-up sends the prefixes too, so every measured request
    /// is a prefix hit somewhere: on the device, or in a KV tier below it when the device
    /// pool is too small to keep them all between uses.
    SharedPrefix,
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
    /// Sent as `Authorization: Bearer KEY` with every request, for a server started with
    /// `--api-key`. Never written to the results.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    #[serde(skip)]
    pub api_key: Option<String>,
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,
    #[arg(long, default_value_t = 32)]
    pub num_prompts: usize,
    /// Requests sent and awaited before timing starts; not counted in the results.
    ///
    /// Their prompts come from a seed stream of their own (random even with --prompt-kind
    /// fixed), so no measured prompt is one the server has seen and cached. One, the default,
    /// pays a fresh server's one-time costs (connections, lazy allocation, first-use
    /// compilation) outside the measurement.
    #[arg(long, visible_alias = "num-warmups", default_value_t = 1)]
    pub warmup: usize,
    /// Requests in flight at once (default: unbounded). Not with --sweep, which sets it per run.
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
    /// Tokens of each shared prefix (`--prompt-kind shared-prefix`).
    #[arg(long, default_value_t = 6144)]
    pub shared_prefix_len: u32,
    /// Distinct shared prefixes, request i taking prefix i mod n (`--prompt-kind
    /// shared-prefix`): with two and a device pool that holds one, every use of a prefix
    /// follows its eviction from the device.
    #[arg(long, default_value_t = 1)]
    pub shared_prefixes: u32,
    /// Keep generating past end-of-sequence so every request yields `output-len` tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// A JSON schema file: every request then carries it as `response_format` (`json_schema`),
    /// to measure what constrained decoding costs.
    #[arg(long, value_name = "FILE", value_parser = read_json_schema)]
    pub json_schema: Option<Value>,
    /// Seconds one request may take from sending to the end of its stream; a request still
    /// unfinished then counts as failed, so a hung server cannot hang the benchmark.
    #[arg(long, value_name = "SECS", default_value_t = 600.0)]
    pub request_timeout: f64,
    // f64 rather than f32 so that the body carries exactly what was typed (0.7, not 0.69999998).
    /// Sent as `temperature` in every request; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Sent as `top_p` in every request.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Sent as `top_k` only when given: OpenAI's API has no such field, while vLLM, llama.cpp
    /// and plughost accept it (-1 or 0 disables it).
    #[arg(long, allow_negative_numbers = true)]
    pub top_k: Option<i64>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Random prompts draw token ids from [100, this); lower it for models with small vocabularies.
    #[arg(long, default_value_t = 30000)]
    pub max_token_id: u32,
    /// Write the summary and the per-request records here.
    #[arg(long)]
    pub result_json: Option<PathBuf>,
    /// Run once per concurrency in this list, e.g. 1,2,4,8. Each value is that run's
    /// --max-concurrency, so the two flags cannot be combined.
    #[arg(
        long,
        value_delimiter = ',',
        num_args = 1..,
        conflicts_with = "max_concurrency"
    )]
    pub sweep: Option<Vec<usize>>,
    /// Draw output tokens/s and TTFT p50 against concurrency as SVG (needs --sweep).
    #[arg(long, requires = "sweep")]
    pub plot: Option<PathBuf>,
    /// No progress bar on stderr (it is only drawn when stderr is a terminal anyway).
    #[arg(long)]
    pub no_progress: bool,
    /// A JSON object merged into every request body, e.g. '{"sampler": "creative"}'; its keys
    /// replace the benchmark's own.
    #[arg(long, value_name = "JSON")]
    pub extra_body: Option<String>,
    /// Request i sends `priority` = the (i mod n)-th value of this list, e.g. 10,0,-5; the
    /// report then breaks latencies down by priority.
    #[arg(long, value_delimiter = ',', num_args = 1.., allow_negative_numbers = true)]
    pub priorities: Option<Vec<i64>>,
}

const MIN_TOKEN_ID: u32 = 100;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid option: {0}")]
    InvalidOption(String),
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
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

/// What the warm-up did. Its requests are in no run's summary or records.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WarmupResult {
    pub num_requests: usize,
    pub num_failed: usize,
    pub first_error: Option<String>,
    pub duration_s: f64,
}

/// Everything a bench invocation measured; `--result-json` writes this.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub model: Option<String>,
    pub options: BenchOptions,
    pub warmup: WarmupResult,
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
        if self.prompt_kind == PromptKind::SharedPrefix
            && (self.shared_prefix_len == 0 || self.shared_prefixes == 0)
        {
            return invalid("--shared-prefix-len and --shared-prefixes must be at least 1");
        }
        if self.max_concurrency == Some(0) || self.sweep.iter().flatten().any(|&c| c == 0) {
            return invalid("concurrency must be at least 1");
        }
        if self.sweep.as_ref().is_some_and(Vec::is_empty) {
            return invalid("--sweep needs at least one concurrency");
        }
        // Checked here so that `request_timeout()` cannot meet a value Duration rejects.
        // NaN, negative and infinite values fail `try_from_secs_f64`; zero is a valid Duration.
        if self.request_timeout <= 0.0 || Duration::try_from_secs_f64(self.request_timeout).is_err()
        {
            return invalid("--request-timeout must be a positive, finite number of seconds");
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return invalid("--temperature must be at least 0");
        }
        if self.top_p.is_nan() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return invalid("--top-p must be in (0, 1]");
        }
        if self.top_k.is_some_and(|k| k < -1) {
            return invalid("--top-k must be -1 or 0 (disabled) or at least 1");
        }
        if self.priorities.as_ref().is_some_and(Vec::is_empty) {
            return invalid("--priorities needs at least one value");
        }
        self.extra_body()?;
        Ok(())
    }

    /// `--extra-body` as a JSON object.
    fn extra_body(&self) -> Result<serde_json::Map<String, Value>, BenchError> {
        match &self.extra_body {
            None => Ok(serde_json::Map::new()),
            Some(text) => match serde_json::from_str(text) {
                Ok(Value::Object(map)) => Ok(map),
                Ok(_) => Err(BenchError::InvalidOption(
                    "--extra-body must be a JSON object".into(),
                )),
                Err(e) => Err(BenchError::InvalidOption(format!(
                    "--extra-body is not JSON: {e}"
                ))),
            },
        }
    }

    /// The `priority` request `index` sends, if `--priorities` is given.
    fn priority(&self, index: usize) -> Option<i64> {
        let list = self.priorities.as_ref()?;
        list.get(index % list.len().max(1)).copied()
    }

    /// The per-request deadline; `validate` has ruled out values `Duration` cannot hold.
    fn request_timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.request_timeout).unwrap_or(Duration::MAX)
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
/// so that an unreachable or hung server still shows up as failed requests.
async fn discover_model(
    client: &reqwest::Client,
    base_url: &str,
    timeout: Duration,
) -> Option<String> {
    let base = base_url.trim_end_matches('/');
    let base = base.strip_suffix("/v1").unwrap_or(base);
    let url = format!("{base}/v1/models");
    let listed = async {
        let response = client.get(&url).send().await?.error_for_status()?;
        response.json::<Value>().await
    };
    let Ok(listed) = tokio::time::timeout(timeout, listed).await else {
        tracing::warn!(
            "{url} did not answer within the request timeout; sending requests without a model"
        );
        return None;
    };
    match listed {
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

/// Which seed stream a prompt comes from. The servers under test cache prompts (prefix
/// caching), so the warm-up has a stream of its own: no measured prompt repeats a warm-up one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PromptStream {
    Warmup,
    /// Concurrency level `n` of the invocation (0 without a sweep).
    Run(usize),
}

/// The warm-up stream's key. Runs use `mix(run)`, a bijection, so exactly one 64-bit run number
/// would share it; none that a sweep can reach in practice.
const WARMUP_STREAM: u64 = 0x7761_726d_2d75_7021;

/// The prompt of request `index` in `stream`: the JSON fields to merge into the body.
fn prompt_fields(
    options: &BenchOptions,
    stream: PromptStream,
    index: usize,
) -> (&'static str, Value) {
    let (stream_key, kind) = match stream {
        PromptStream::Run(run) => (mix(run as u64), options.prompt_kind),
        // Warm-up prompts are random whatever the kind: a fixed one would be the measured
        // prompt. Shared prefixes are the exception: warming them up is the point.
        PromptStream::Warmup if options.prompt_kind == PromptKind::SharedPrefix => {
            (WARMUP_STREAM, PromptKind::SharedPrefix)
        }
        PromptStream::Warmup => (WARMUP_STREAM, PromptKind::Random),
    };
    let seed = mix(options.seed ^ stream_key ^ mix(mix(index as u64)));
    let mut rng = StdRng::seed_from_u64(seed);
    let len = options.input_len as usize;
    let text = match kind {
        PromptKind::Fixed => "hello ".repeat(len).trim_end().to_string(),
        PromptKind::SharedPrefix => return shared_prefix_prompt(options, &mut rng, index),
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

/// Shared prefix `index mod --shared-prefixes` (seeded by `--seed` and its number alone, so
/// every stream and run sends the same ones) followed by `--input-len` random tokens or words.
fn shared_prefix_prompt(
    options: &BenchOptions,
    suffix_rng: &mut StdRng,
    index: usize,
) -> (&'static str, Value) {
    let prefix_number = index as u64 % u64::from(options.shared_prefixes.max(1));
    let mut prefix_rng =
        StdRng::seed_from_u64(mix(options.seed ^ mix(prefix_number) ^ 0x5052_4546));
    let prefix_len = options.shared_prefix_len as usize;
    let len = options.input_len as usize;
    if options.endpoint == Endpoint::Completions {
        let ids: Vec<u32> = (0..prefix_len)
            .map(|_| prefix_rng.random_range(MIN_TOKEN_ID..options.max_token_id))
            .chain((0..len).map(|_| suffix_rng.random_range(MIN_TOKEN_ID..options.max_token_id)))
            .collect();
        return ("prompt", json!(ids));
    }
    let words: Vec<&str> = (0..prefix_len)
        .map(|_| WORDS[prefix_rng.random_range(0..WORDS.len())])
        .chain((0..len).map(|_| WORDS[suffix_rng.random_range(0..WORDS.len())]))
        .collect();
    (
        "messages",
        json!([{"role": "user", "content": words.join(" ")}]),
    )
}

fn request_body(
    options: &BenchOptions,
    model: Option<&str>,
    stream: PromptStream,
    index: usize,
) -> Value {
    let (key, prompt) = prompt_fields(options, stream, index);
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
    if let Some(top_k) = options.top_k {
        body["top_k"] = json!(top_k);
    }
    if let Some(schema) = &options.json_schema {
        body["response_format"] = json!({
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": schema},
        });
    }
    if let Some(priority) = options.priority(index) {
        body["priority"] = json!(priority);
    }
    // `validate` has checked it; a run never gets here with a malformed one.
    for (key, value) in options.extra_body().unwrap_or_default() {
        body[key] = value;
    }
    body
}

/// `--json-schema FILE`: the file's JSON, read once at start.
fn read_json_schema(path: &str) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    serde_json::from_str(&text).map_err(|e| format!("{path} is not JSON: {e}"))
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

/// One batch of requests: the warm-up, or one concurrency level.
struct Phase<'a> {
    options: &'a BenchOptions,
    client: &'a reqwest::Client,
    model: Option<&'a str>,
    stream: PromptStream,
    /// When each request arrives, in seconds from the phase's start; one per request.
    offsets: Vec<f64>,
    max_concurrency: Option<usize>,
    label: String,
}

/// Sends every request of a phase and waits for all of them; records in request order and the
/// phase's duration in seconds.
async fn send_phase(phase: Phase<'_>) -> (Vec<RequestRecord>, f64) {
    let url: Arc<str> = phase.options.url().into();
    let timeout = phase.options.request_timeout();
    let permits = phase.max_concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let mut progress =
        PhaseProgress::new(phase.label, phase.offsets.len(), !phase.options.no_progress);
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for (index, offset) in phase.offsets.iter().enumerate() {
        // `sleep` saturates an unreachable arrival (a vanishing --request-rate) where
        // `Instant + Duration` would panic.
        let at = Duration::try_from_secs_f64(*offset).unwrap_or(Duration::MAX);
        tokio::time::sleep(at.saturating_sub(start.elapsed())).await;
        let body = request_body(phase.options, phase.model, phase.stream, index);
        let (client, url, permits) = (phase.client.clone(), url.clone(), permits.clone());
        tasks.spawn(async move {
            // The timeout starts after the permit: waiting for a slot is the benchmark's own
            // queueing, not the server's slowness.
            let _permit = match &permits {
                Some(p) => p.clone().acquire_owned().await.ok(),
                None => None,
            };
            let spec = RequestSpec {
                index,
                priority: body.get("priority").and_then(Value::as_i64),
                url: &url,
                body: &body,
                run_start: start,
                timeout,
            };
            client::send(&client, spec).await
        });
    }
    let mut records = Vec::with_capacity(phase.offsets.len());
    while let Some(joined) = tasks.join_next().await {
        let record = joined.unwrap_or_else(|e| RequestRecord {
            error: Some(format!("the request task failed: {e}")),
            ..Default::default()
        });
        progress.complete(record.success);
        records.push(record);
    }
    let duration_s = start.elapsed().as_secs_f64();
    progress.finish();
    records.sort_by_key(|r| r.index);
    (records, duration_s)
}

/// Sends `--warmup` requests at once (within the first run's concurrency) and waits for them.
/// Failures only warn: the measured runs still go ahead and report their own.
async fn warm_up(
    options: &BenchOptions,
    client: &reqwest::Client,
    model: Option<&str>,
    max_concurrency: Option<usize>,
) -> WarmupResult {
    if options.warmup == 0 {
        return WarmupResult::default();
    }
    let phase = Phase {
        options,
        client,
        model,
        stream: PromptStream::Warmup,
        offsets: vec![0.0; options.warmup],
        max_concurrency,
        label: "warm-up".into(),
    };
    let (records, duration_s) = send_phase(phase).await;
    let failed: Vec<&RequestRecord> = records.iter().filter(|r| !r.success).collect();
    let first_error = failed.iter().find_map(|r| r.error.clone());
    if let Some(error) = &first_error {
        tracing::warn!(
            "{} of {} warm-up requests failed ({error}); measuring anyway",
            failed.len(),
            records.len()
        );
    }
    WarmupResult {
        num_requests: records.len(),
        num_failed: failed.len(),
        first_error,
        duration_s,
    }
}

async fn run_once(phase: Phase<'_>) -> RunResult {
    let shape_concurrency = phase.max_concurrency;
    let request_rate = phase.options.request_rate;
    let (records, duration_s) = send_phase(phase).await;
    let shape = RunShape {
        max_concurrency: shape_concurrency,
        request_rate,
        duration_s,
    };
    RunResult {
        summary: stats::summarize(&records, shape),
        records,
    }
}

/// Runs the warm-up, then the benchmark (once, or once per `--sweep` concurrency), and writes the
/// files asked for. Request failures are counted in the summaries, never returned as errors.
pub async fn run(options: BenchOptions) -> Result<BenchReport, BenchError> {
    options.validate()?;
    // A fresh connection per request: some servers (llama.cpp's) close a connection after
    // each streamed response while still announcing keep-alive, and a request sent on such a
    // reused connection fails. Every server under test pays the same small connect cost.
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(key) = &options.api_key {
        let mut value =
            reqwest::header::HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                BenchError::InvalidOption("--api-key must be printable ASCII".to_string())
            })?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(0)
        .default_headers(headers)
        .build()?;
    let model = match &options.model {
        Some(model) => Some(model.clone()),
        None => discover_model(&client, &options.base_url, options.request_timeout()).await,
    };
    let levels = options.concurrencies();
    let first_level = levels.first().copied().flatten();
    let warmup = warm_up(&options, &client, model.as_deref(), first_level).await;
    let mut runs = Vec::new();
    for (run, max_concurrency) in levels.iter().copied().enumerate() {
        let label = match max_concurrency {
            Some(c) => format!("concurrency {c}"),
            None => "run".to_string(),
        };
        let phase = Phase {
            options: &options,
            client: &client,
            model: model.as_deref(),
            stream: PromptStream::Run(run),
            offsets: arrival_offsets(&options, run),
            max_concurrency,
            label,
        };
        runs.push(run_once(phase).await);
    }
    let report = BenchReport {
        model,
        options,
        warmup,
        runs,
    };
    report::write_files(&report)?;
    Ok(report)
}

/// The `plughost bench` command: run on a fresh runtime and print the report.
pub fn main(options: BenchOptions) -> Result<(), BenchError> {
    let runtime = tokio::runtime::Runtime::new().map_err(BenchError::Runtime)?;
    let report = runtime.block_on(run(options))?;
    print!("{}", report::text(&report));
    Ok(())
}

#[cfg(test)]
mod tests;
