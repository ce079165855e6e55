//! The engine's liveness and device faults, end to end: `plughost serve` on the mock device over real sockets, and a property test of the engine over random pools and request mixes.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use plughost::engine::{
    EngineHandle, EngineOptions, EngineSetup, FinishReason, GenerationEvent, GenerationRequest,
    StopConditions,
};
use plughost::metrics::Metrics;
use plughost::plugins::PluginSpec;
use plughost_sdk::sampler::SamplingParams;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::serve_support::free_port;

/// Far beyond the second or so the tiny fixture takes to load and serve in a debug build.
pub(super) const DEADLINE: Duration = Duration::from_secs(120);
pub(super) const MODEL: &str = "tiny-qwen3";
const MOCK: &str = "libplughost_device_mock.so";
/// A launch a few steps into the first generation (loading launches far fewer).
const FAULTY_LAUNCH: u32 = 200;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn model_dir() -> PathBuf {
    workspace().join("tests/fixtures").join(MODEL)
}

fn plugins_dir() -> PathBuf {
    let dir = std::env::var_os("PLUGHOST_PLUGINS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/plugins"));
    assert!(
        dir.join(MOCK).is_file(),
        "{} lacks the plugins: run `cargo xtask build-plugins`",
        dir.display()
    );
    dir
}

fn component_cache() -> PathBuf {
    std::env::temp_dir().join("plughost-test-component-cache")
}

/// A `plughost serve` process on the mock device; killed on drop if still running.
pub(super) struct Server {
    child: Child,
    port: u16,
    stderr: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `plughost serve` with the tiny model on the mock device and `args`.
    pub(super) fn spawn(device_config: &str, args: &[&str]) -> Server {
        Server::spawn_on(MOCK, device_config, args)
    }

    /// Starts `plughost serve` with the tiny model on the `device` library and `args`, in a
    /// process group of its own (as a shell starts a job), which signals can address.
    fn spawn_on(device: &str, device_config: &str, args: &[&str]) -> Server {
        let port = free_port();
        let mut child = Command::new(env!("CARGO_BIN_EXE_plughost"))
            .process_group(0)
            .arg("serve")
            .arg("--model")
            .arg(model_dir())
            .args(["--port", &port.to_string()])
            .arg("--plugins-dir")
            .arg(plugins_dir())
            .arg("--device")
            .arg(plugins_dir().join(device))
            .args(["--device-config", device_config])
            .arg("--component-cache")
            .arg(component_cache())
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("plughost starts");
        // Read stderr as it comes, so a chatty server never blocks on a full pipe.
        let stderr = Arc::new(Mutex::new(String::new()));
        if let Some(mut pipe) = child.stderr.take() {
            let stderr = stderr.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if let Ok(mut text) = stderr.lock() {
                        text.push_str(&String::from_utf8_lossy(&buf[..n]));
                    }
                }
            });
        }
        Server {
            child,
            port,
            stderr,
        }
    }

    /// Starts a server and waits until `/health` answers 200.
    pub(super) async fn ready(device_config: &str, args: &[&str]) -> Server {
        let mut server = Server::spawn(device_config, args);
        let started = Instant::now();
        loop {
            if let Some(status) = server.child.try_wait().expect("poll plughost") {
                panic!("plughost serve exited ({status}): {}", server.stderr());
            }
            if server.health().await == Some(200) {
                return server;
            }
            assert!(
                started.elapsed() < DEADLINE,
                "/health never answered 200: {}",
                server.stderr()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends `signal` to the server's process group, as a terminal sends Ctrl-C to its job.
    pub(super) fn signal_group(&self, signal: &str) {
        let status = Command::new("kill")
            .args([
                &format!("-{signal}"),
                "--",
                &format!("-{}", self.child.id()),
            ])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{signal} failed");
    }

    pub(super) fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub(super) fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// The status of `GET /health`, or `None` while nothing answers.
    pub(super) async fn health(&self) -> Option<u16> {
        let response = reqwest::Client::new()
            .get(self.url("/health"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .ok()?;
        Some(response.status().as_u16())
    }

    pub(super) async fn complete(&self, body: &Value) -> (u16, Value) {
        let response = reqwest::Client::new()
            .post(self.url("/v1/completions"))
            .json(body)
            .timeout(DEADLINE)
            .send()
            .await
            .expect("the request is answered");
        let status = response.status().as_u16();
        (status, response.json().await.expect("a JSON body"))
    }

    /// Waits, within `deadline`, for the process to exit on its own.
    pub(super) fn exit_within(&mut self, deadline: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("poll plughost") {
                return status;
            }
            assert!(
                started.elapsed() < deadline,
                "plughost serve kept running: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A prompt of `len` tokens (the tokenizer's ids 1, 2, ...), so lengths are exact.
pub(super) fn prompt(len: u32) -> Vec<u32> {
    (1..=len).collect()
}

pub(super) fn completion(prompt_len: u32, max_tokens: u32) -> Value {
    json!({
        "model": MODEL,
        "prompt": prompt(prompt_len),
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "temperature": 0,
    })
}

fn completion_tokens(body: &Value) -> u64 {
    body["usage"]["completion_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no usage: {body}"))
}

#[tokio::test]
async fn a_small_kv_pool_lowers_max_model_len_refuses_longer_requests_and_serves_the_rest() {
    // 16 blocks of 16 tokens: one sequence of 256 tokens at most.
    let server = Server::ready("", &["--num-kv-blocks", "16", "--block-size", "16"]).await;
    assert!(
        server
            .stderr()
            .contains("lowering max_model_len so one sequence fits the KV cache"),
        "{}",
        server.stderr()
    );
    let models: Value = reqwest::get(server.url("/v1/models"))
        .await
        .expect("models")
        .json()
        .await
        .expect("JSON");
    assert_eq!(models["data"][0]["max_model_len"], 256, "{models}");

    // More than the pool holds: refused up front, never queued.
    let (status, body) = server.complete(&completion(8, 400)).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("256") && message.contains("408"),
        "{message}"
    );

    // Requests that each fit but together need three times the pool: preempted and
    // recomputed, every one finishes, and the server stays healthy.
    let requests = (0..6).map(|i| {
        let body = completion(8 + i, 120);
        let server = &server;
        async move { server.complete(&body).await }
    });
    for (status, body) in futures::future::join_all(requests).await {
        assert_eq!(status, 200, "{body}");
        assert_eq!(completion_tokens(&body), 120, "{body}");
    }
    // The longest request the context allows runs alone through the whole pool.
    let (status, body) = server.complete(&completion(6, 250)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(completion_tokens(&body), 250, "{body}");
    assert_eq!(server.health().await, Some(200));
}

/// Starts a server on the mock device expected to fail; its exit status and stderr.
pub(super) fn failed_start(device_config: &str, args: &[&str]) -> (ExitStatus, String) {
    failed_start_on(MOCK, device_config, args)
}

fn failed_start_on(device: &str, device_config: &str, args: &[&str]) -> (ExitStatus, String) {
    let mut server = Server::spawn_on(device, device_config, args);
    let status = server.exit_within(DEADLINE);
    // The reader thread has the last of stderr once the pipe closes.
    let started = Instant::now();
    while !server.stderr().contains("error") && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    (status, server.stderr())
}

#[test]
fn a_max_model_len_the_kv_pool_cannot_hold_fails_the_start_naming_both() {
    let (status, stderr) = failed_start(
        "",
        &[
            "--num-kv-blocks",
            "16",
            "--block-size",
            "16",
            "--max-model-len",
            "400",
        ],
    );
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("--max-model-len 400 does not fit the KV cache, which holds 256 tokens"),
        "{stderr}"
    );
}

#[test]
fn a_device_that_will_not_open_fails_the_start_with_its_message() {
    let (status, stderr) = failed_start("bogus=1", &[]);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("error: ") && stderr.contains("unknown mock device option `bogus`"),
        "{stderr}"
    );
}

#[test]
fn a_cpu_device_that_will_not_open_fails_the_start_with_its_message() {
    let (status, stderr) = failed_start_on("libplughost_device_cpu.so", "bogus=1", &[]);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("error: ") && stderr.contains("unknown cpu device option `bogus`"),
        "{stderr}"
    );
}

#[test]
fn a_bad_timeout_flag_fails_the_start_naming_it() {
    let (status, stderr) = failed_start("", &["--device-timeout", "0"]);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("--device-timeout") && stderr.contains("positive number of seconds"),
        "{stderr}"
    );
}

/// The `data:` payloads of an SSE body, in order.
pub(super) fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .flat_map(|event| event.lines())
        .filter_map(|line| line.strip_prefix("data:"))
        .map(|data| data.trim_start().to_string())
        .collect()
}

/// Streams the completion `body` asks for; its events, parsed, without the final `[DONE]`.
pub(super) async fn stream_events(server: &Server, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let response = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .json(&body)
        .timeout(DEADLINE)
        .send()
        .await
        .expect("the stream starts");
    assert_eq!(response.status().as_u16(), 200);
    let text = response.text().await.expect("the stream ends");
    sse_data(&text)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON event"))
        .collect()
}

/// Streams a long completion; the parsed last event and how many token chunks came before it.
async fn stream_until_end(server: &Server) -> (Value, usize) {
    let mut events = stream_events(server, &completion(8, 200)).await;
    let last = events.pop().expect("events");
    (last, events.len())
}

/// Polls `/health` until it answers something other than 200; that status, or `None` if the
/// server went away first.
pub(super) async fn health_after_fault(server: &Server) -> Option<u16> {
    let started = Instant::now();
    while started.elapsed() < DEADLINE {
        match server.health().await {
            Some(200) => tokio::time::sleep(Duration::from_millis(20)).await,
            other => return other,
        }
    }
    panic!("/health stayed 200: {}", server.stderr());
}

#[tokio::test]
async fn a_hung_launch_fails_the_stream_turns_health_503_and_exits_non_zero_in_time() {
    let device_timeout = 2;
    let mut server = Server::ready(
        &format!("hang_launch={FAULTY_LAUNCH}"),
        &[
            "--device-isolation",
            "in-process",
            "--device-timeout",
            &device_timeout.to_string(),
        ],
    )
    .await;
    let submitted = Instant::now();
    let (last, tokens) = stream_until_end(&server).await;
    assert!(tokens > 0, "the hang came a few steps into the stream");
    assert_eq!(last["error"]["code"], "generation_failed", "{last}");
    let message = last["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("the device hung"), "{message}");
    assert_eq!(health_after_fault(&server).await, Some(503));
    // Within the timeout plus 5 s of the hang, which came after the request was sent.
    let bound = Duration::from_secs(device_timeout + 5);
    let status = server.exit_within(DEADLINE);
    let elapsed = submitted.elapsed();
    eprintln!(
        "exited {elapsed:?} after the request that met the hang (--device-timeout {device_timeout})"
    );
    assert!(!status.success(), "{}", server.stderr());
    assert!(
        elapsed < bound,
        "exited {elapsed:?} after the request, bound {bound:?}"
    );
    assert!(
        server.stderr().contains("error: the device hung"),
        "{}",
        server.stderr()
    );
}

#[tokio::test]
async fn a_stalled_engine_fails_the_stream_turns_health_503_and_exits_non_zero() {
    // The device takes its time, under the device timeout: no step finishes, which is a stall.
    let mut server = Server::ready(
        &format!("hang_launch={FAULTY_LAUNCH}"),
        &[
            "--device-isolation",
            "in-process",
            "--engine-stall-timeout",
            "2",
            "--device-timeout",
            "600",
        ],
    )
    .await;
    let (last, _) = stream_until_end(&server).await;
    let message = last["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("the engine stalled"), "{message}");
    assert_eq!(health_after_fault(&server).await, Some(503));
    let status = server.exit_within(DEADLINE);
    assert!(!status.success(), "{}", server.stderr());
}

#[tokio::test]
async fn a_transient_launch_failure_costs_requests_nothing() {
    let server = Server::ready(&format!("fail_launch={FAULTY_LAUNCH}"), &[]).await;
    let bodies: Vec<Value> = (0..4).map(|i| completion(5 + i, 40)).collect();
    let run = || futures::future::join_all(bodies.iter().map(|body| server.complete(body)));
    // The first round meets the failed launch; the second runs on a healthy device.
    let first = run().await;
    let second = run().await;
    for ((status, body), (_, again)) in first.iter().zip(&second) {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(completion_tokens(body), 40, "{body}");
        assert_eq!(body["choices"][0]["text"], again["choices"][0]["text"]);
    }
    assert!(
        server
            .stderr()
            .contains("device step failed, recomputing it once"),
        "the fault never fired: {}",
        server.stderr()
    );
    assert_eq!(server.health().await, Some(200));
    let metrics = reqwest::get(server.url("/metrics"))
        .await
        .expect("metrics answer")
        .text()
        .await
        .expect("the metrics text");
    let retries = metric(&metrics, "plughost_device_step_retries_total");
    assert_eq!(retries, Some(1.0), "{metrics}");
}

#[tokio::test]
async fn a_persistent_launch_failure_fails_only_the_requests_in_that_step() {
    // One sequence at a time: the second request waits while the first meets the fault.
    let server = Server::ready(
        &format!("fail_launch={FAULTY_LAUNCH},fail_launch_count=2"),
        &["--max-num-seqs", "1"],
    )
    .await;
    let mut first = completion(8, 200);
    first["stream"] = json!(true);
    let mut stream = reqwest::Client::new()
        .post(server.url("/v1/completions"))
        .json(&first)
        .timeout(DEADLINE)
        .send()
        .await
        .expect("the stream starts");
    // Its first token is out, so it is running: the second request waits behind it.
    let mut text = String::from_utf8_lossy(&stream.chunk().await.expect("a chunk").expect("data"))
        .into_owned();
    let second = completion(9, 20);
    let (rest, (status, body)) = tokio::join!(stream.text(), server.complete(&second));
    text.push_str(&rest.expect("the stream ends"));
    let data = sse_data(&text);
    let last: Value = data
        .iter()
        .rev()
        .find(|d| *d != "[DONE]")
        .and_then(|d| serde_json::from_str(d).ok())
        .expect("a last JSON event");
    assert_eq!(last["error"]["code"], "generation_failed", "{last}");
    assert_eq!(status, 200, "{body}");
    assert_eq!(completion_tokens(&body), 20);
    // And the server goes on serving.
    let (status, body) = server.complete(&completion(4, 10)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(server.health().await, Some(200));
}

fn plugin(file: &str) -> PluginSpec {
    PluginSpec {
        component: plugins_dir().join(file),
        config: Default::default(),
        memory_mib: None,
        call_timeout_ms: None,
        failure: Default::default(),
    }
}

/// An engine on the mock device with the given pool and limits.
fn engine(options: EngineOptions) -> Arc<EngineHandle> {
    engine_with_scheduler("plughost_scheduler_fcfs.wasm", options)
}

fn engine_with_scheduler(scheduler: &str, options: EngineOptions) -> Arc<EngineHandle> {
    let setup = EngineSetup {
        model_dir: model_dir(),
        model_name: MODEL.into(),
        device_library: plugins_dir().join(MOCK),
        device_config: String::new(),
        glue: plugin("plughost_model_qwen3.wasm"),
        scheduler: Some(plugin(scheduler)),
        sampler: Some(plugin("plughost_sampler_standard.wasm")),
        named_samplers: Default::default(),
        component_cache: Some(component_cache()),
        options,
        profile_output: None,
    };
    let engine =
        Arc::new(EngineHandle::start(setup, Arc::new(Metrics::new())).expect("start the engine"));
    engine.wait_ready().expect("the model loads");
    engine
}

/// How one request ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    Finished { reason: FinishReason, tokens: u32 },
    Failed(String),
}

/// Runs every request at once and collects how each ended, within `deadline`.
async fn run_all(
    engine: &EngineHandle,
    requests: Vec<GenerationRequest>,
    deadline: Duration,
) -> Vec<Outcome> {
    let mut receivers = Vec::new();
    for request in requests {
        let (_, events) = engine.submit(request).expect("submit");
        receivers.push(events);
    }
    let outcomes = receivers.into_iter().map(|mut events| async move {
        let mut tokens = 0;
        while let Some(event) = events.recv().await {
            match event {
                GenerationEvent::Delta { token_ids, .. } => tokens += token_ids.len() as u32,
                GenerationEvent::Finished { reason, .. } => {
                    return Outcome::Finished { reason, tokens };
                }
                GenerationEvent::Failed { message } | GenerationEvent::Unavailable { message } => {
                    return Outcome::Failed(message);
                }
                GenerationEvent::Rejected(r) => return Outcome::Failed(r.to_string()),
            }
        }
        Outcome::Failed("the event stream ended without a last event".into())
    });
    tokio::time::timeout(deadline, futures::future::join_all(outcomes))
        .await
        .expect("every request ends within the deadline")
}

#[tokio::test]
async fn every_request_finishes_whatever_the_pool_and_the_mix() {
    let mut rng = StdRng::seed_from_u64(18);
    for case in 0..10 {
        let block_size = [1u32, 2, 4, 8, 16][rng.random_range(0..5)];
        let num_kv_blocks = rng.random_range(1..=48u32);
        // Mostly the model's length, lowered to the pool; sometimes one set within the pool.
        let max_model_len = rng
            .random_bool(0.3)
            .then(|| rng.random_range(1..=(num_kv_blocks * block_size).min(512)));
        let options = EngineOptions {
            max_num_seqs: rng.random_range(1..=8),
            max_num_batched_tokens: rng.random_range(16..=128),
            block_size,
            num_kv_blocks: Some(num_kv_blocks),
            enable_prefix_caching: rng.random_bool(0.5),
            max_model_len,
            ..Default::default()
        };
        let described = format!("case {case}: {options:?}");
        let engine = engine(options);
        let summary = engine.summary().expect("ready");
        let (max_model_len, vocab) = (summary.max_model_len, summary.vocab_size);
        assert!(
            max_model_len <= num_kv_blocks * block_size,
            "{described}: max_model_len {max_model_len}"
        );
        let num_requests = rng.random_range(1..=12);
        let mut requests = Vec::new();
        let mut expected = Vec::new();
        for _ in 0..num_requests {
            // Mostly requests that fit the context, some that cannot.
            let fits = max_model_len >= 2 && rng.random_bool(0.8);
            let (prompt_len, max_tokens) = if fits {
                let prompt_len = rng.random_range(1..max_model_len.min(24));
                let max_tokens = rng.random_range(1..=(max_model_len - prompt_len).min(24));
                (prompt_len, max_tokens)
            } else {
                (rng.random_range(1..=24), max_model_len + 1)
            };
            // A shared start, so prefix caching has something to find.
            let prompt_tokens: Vec<u32> = (0..prompt_len)
                .map(|i| {
                    if i < prompt_len / 2 {
                        (7 + i) % vocab
                    } else {
                        rng.random_range(0..vocab)
                    }
                })
                .collect();
            requests.push(GenerationRequest {
                stop: StopConditions {
                    ignore_eos: true,
                    ..Default::default()
                },
                ..GenerationRequest::new(prompt_tokens, SamplingParams::GREEDY, max_tokens)
            });
            expected.push(fits.then_some(max_tokens));
        }
        let outcomes = run_all(&engine, requests, DEADLINE).await;
        for (outcome, expected) in outcomes.iter().zip(&expected) {
            match (outcome, expected) {
                (Outcome::Finished { reason, tokens }, Some(max_tokens)) => {
                    assert_eq!(
                        (*reason, *tokens),
                        (FinishReason::Length, *max_tokens),
                        "{described}"
                    );
                }
                (Outcome::Failed(message), None) => {
                    assert!(
                        message.contains("exceeds the context"),
                        "{described}: {message}"
                    );
                }
                other => panic!("{described}: {other:?}"),
            }
        }
        engine.shutdown();
    }
}

/// A greedy request of `prompt_len` tokens for exactly `max_tokens`.
fn request(prompt_len: u32, max_tokens: u32, priority: i32) -> GenerationRequest {
    GenerationRequest {
        stop: StopConditions {
            ignore_eos: true,
            ..Default::default()
        },
        priority,
        ..GenerationRequest::new(prompt(prompt_len), SamplingParams::GREEDY, max_tokens)
    }
}

/// A metric's value from Prometheus text, for a name with no labels.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

#[tokio::test]
async fn a_scheduler_plan_that_runs_nothing_is_a_fault_and_fcfs_runs_the_step() {
    // The faulty scheduler plans nothing while a request of this priority is queued.
    let idle = -1004;
    let engine = engine_with_scheduler(
        "plughost_scheduler_faulty.wasm",
        EngineOptions {
            num_kv_blocks: Some(64),
            block_size: 4,
            ..Default::default()
        },
    );
    let outcomes = run_all(
        &engine,
        vec![request(6, 8, idle), request(5, 8, 0)],
        DEADLINE,
    )
    .await;
    let done = Outcome::Finished {
        reason: FinishReason::Length,
        tokens: 8,
    };
    assert_eq!(
        outcomes,
        [
            done,
            Outcome::Finished {
                reason: FinishReason::Length,
                tokens: 8
            }
        ]
    );
    let fallbacks = metric(
        &engine.metrics().render(),
        "plughost_scheduler_fallbacks_total",
    );
    assert!(fallbacks.is_some_and(|n| n >= 1.0), "{fallbacks:?}");
    engine.shutdown();
}
