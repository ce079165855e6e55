//! Failure policies on the real `plughost serve` over real sockets, on the mock device: a
//! request that makes the sampler fail is found alone and gets the policy while the rest of
//! its batch keeps the plugin's tokens; repeated faults back a component off, then it comes
//! back, or is disabled; the state shows in `/admin/deployment`, `/metrics` and `/health`,
//! which stays 200.
//!
//! The faulty test sampler samples greedily and reports every log-probability as exactly 0,
//! so a token's log-probability tells who chose it: 0 the plugin, anything else the host's
//! native sampler.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::serve_support::deployment::{component, deployment_status, metric, metrics};
use crate::serve_support::{Server, plugins_dir};

const MODEL: &str = "tiny-qwen3";
const ADMIN_KEY: &str = "admin-secret";
/// Far beyond anything here takes on the mock device, however busy the machine.
const DEADLINE: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(50);
/// The faulty sampler's seeds (plugins/sampler-faulty).
const SEED_TRAP: u64 = 66_601;
const SEED_ERROR: u64 = 66_603;
const FAULTY: &str = "plughost_sampler_faulty";
/// Long enough that the innocent streams still run when the poisoned request is sampled.
const STREAM_TOKENS: u32 = 400;
const INNOCENTS: usize = 4;

/// A fresh scratch folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("plughost-failure-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch folder");
    dir
}

/// Starts `serve` with a deployment of the faulty sampler under `policy` (TOML lines of its
/// `[sampler]` section) and, when given, `scheduler` (a whole `[scheduler]` section).
fn serve(name: &str, policy: &str, scheduler: &str) -> Server {
    let dir = scratch(name);
    let file = dir.join("deploy.toml");
    let sampler = plugins_dir().join(format!("{FAULTY}.wasm"));
    let text = format!(
        "{scheduler}\n[sampler]\ncomponent = {:?}\n{policy}\n",
        sampler.display().to_string()
    );
    std::fs::write(&file, text).expect("write the deployment");
    Server::start(&[
        "--config",
        path_str(&file),
        "--admin-key",
        ADMIN_KEY,
        "--num-kv-blocks",
        "1024",
    ])
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

fn prompt(i: usize) -> String {
    format!("The story number {i} begins with a quiet morning and")
}

fn body(i: usize, seed: Option<u64>, max_tokens: u32, stream: bool) -> Value {
    let mut body = json!({
        "model": MODEL, "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "stream": stream, "logprobs": 1,
        // Penalties rewrite rows in place: a re-run must start from the values as they came.
        "repetition_penalty": 1.3, "frequency_penalty": 0.5,
    });
    if let Some(seed) = seed {
        body["seed"] = json!(seed);
    }
    body
}

async fn post(client: &reqwest::Client, base: &str, body: &Value) -> (StatusCode, Value) {
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(body)
        .send()
        .await
        .expect("request sent");
    let status = response.status();
    (status, response.json().await.expect("a JSON body"))
}

/// A whole streamed completion: its tokens and their log-probabilities.
#[derive(Debug, Default, Clone, PartialEq)]
struct Tokens {
    tokens: Vec<String>,
    logprobs: Vec<f64>,
}

/// Streams `body`, adding a permit to `started` at the first token and checking, at the end,
/// that `answered` is already set (the poisoned request was answered while this one ran).
async fn stream(
    client: reqwest::Client,
    base: String,
    body: Value,
    started: Arc<tokio::sync::Semaphore>,
    answered: Arc<AtomicBool>,
) -> (Tokens, bool) {
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("stream sent");
    assert_eq!(response.status(), StatusCode::OK);
    let mut chunks = response.bytes_stream();
    let mut pending = String::new();
    let mut out = Tokens::default();
    let mut finished = false;
    while let Some(chunk) = chunks.next().await {
        pending.push_str(&String::from_utf8_lossy(&chunk.expect("stream chunk")));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let value: Value = serde_json::from_str(data).expect("an SSE JSON chunk");
            assert!(
                value.get("error").is_none(),
                "innocent stream failed: {value}"
            );
            let choice = &value["choices"][0];
            if choice["finish_reason"].as_str().is_some() && !finished {
                finished = true;
            }
            let first = out.tokens.is_empty();
            let logprobs = &choice["logprobs"];
            for (token, logprob) in logprobs["tokens"]
                .as_array()
                .into_iter()
                .flatten()
                .zip(logprobs["token_logprobs"].as_array().into_iter().flatten())
            {
                out.tokens
                    .push(token.as_str().expect("a token").to_string());
                out.logprobs.push(logprob.as_f64().expect("a logprob"));
            }
            if first && !out.tokens.is_empty() {
                started.add_permits(1);
            }
        }
    }
    (out, answered.load(Ordering::SeqCst))
}

/// Runs the innocent streams; once each has its first token, sends `poisoned` (not streamed)
/// and returns its answer with the innocent streams' tokens.
async fn batch_with_poison(base: &str, poisoned: Value) -> ((StatusCode, Value), Vec<Tokens>) {
    let client = reqwest::Client::new();
    let started = Arc::new(tokio::sync::Semaphore::new(0));
    let answered = Arc::new(AtomicBool::new(false));
    let streams: Vec<_> = (0..INNOCENTS)
        .map(|i| {
            tokio::spawn(stream(
                client.clone(),
                base.to_string(),
                body(i, None, STREAM_TOKENS, true),
                started.clone(),
                answered.clone(),
            ))
        })
        .collect();
    let all_started = started.acquire_many(INNOCENTS as u32);
    tokio::time::timeout(DEADLINE, all_started)
        .await
        .expect("every innocent stream starts")
        .expect("semaphore")
        .forget();
    let answer = post(&client, base, &poisoned).await;
    answered.store(true, Ordering::SeqCst);
    let mut innocents = Vec::new();
    for s in streams {
        let (tokens, ran_past_the_poison) = tokio::time::timeout(DEADLINE, s)
            .await
            .expect("every innocent stream ends")
            .expect("stream task");
        assert!(
            ran_past_the_poison,
            "an innocent stream ended before the poisoned request was answered"
        );
        innocents.push(tokens);
    }
    (answer, innocents)
}

/// The innocent streams run alone, for their reference tokens.
async fn reference(base: &str) -> Vec<Tokens> {
    let client = reqwest::Client::new();
    let started = Arc::new(tokio::sync::Semaphore::new(0));
    let answered = Arc::new(AtomicBool::new(true));
    let mut out = Vec::new();
    for i in 0..INNOCENTS {
        let body = body(i, None, STREAM_TOKENS, true);
        let (tokens, _) = stream(
            client.clone(),
            base.to_string(),
            body,
            started.clone(),
            answered.clone(),
        )
        .await;
        out.push(tokens);
    }
    out
}

fn assert_plugin_chose_every_token(streams: &[Tokens]) {
    for (i, s) in streams.iter().enumerate() {
        assert_eq!(s.tokens.len(), STREAM_TOKENS as usize, "stream {i}");
        assert!(
            s.logprobs.iter().all(|&l| l == 0.0),
            "stream {i}: a token was not the plugin's: {:?}",
            s.logprobs
        );
    }
}

async fn health(base: &str) -> Value {
    let response = reqwest::get(format!("{base}/health"))
        .await
        .expect("health");
    assert_eq!(response.status(), StatusCode::OK);
    response.json().await.expect("a JSON health body")
}

fn sampler_health(health: &Value) -> &Value {
    health["plugins"]
        .as_array()
        .and_then(|p| p.iter().find(|c| c["slot"] == "sampler"))
        .unwrap_or_else(|| panic!("no sampler in {health}"))
}

/// Polls `/health` until the sampler is in `state`.
async fn wait_for_state(base: &str, state: &str) -> Value {
    let started = Instant::now();
    loop {
        let health = health(base).await;
        if sampler_health(&health)["state"] == state {
            return health;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the sampler never became {state}: {health}"
        );
        tokio::time::sleep(POLL).await;
    }
}

fn error_code(answer: &Value) -> &str {
    answer["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poisoned_request_is_rejected_alone_and_its_batch_keeps_the_plugins_tokens() {
    let server = serve("reject", "", "");
    let base = server.base();
    let before = reference(&base).await;
    assert_plugin_chose_every_token(&before);

    let ((status, answer), innocents) =
        batch_with_poison(&base, body(9, Some(SEED_TRAP), 8, false)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{answer}");
    assert_eq!(error_code(&answer), "plugin_failed", "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains(FAULTY) && message.contains("trapped") && message.contains("unreachable"),
        "the error names the plugin and the cause: {message}"
    );
    assert_eq!(innocents, before, "the other rows keep the plugin's tokens");
    assert!(
        server.stderr().contains("re-running its rows one by one"),
        "the poisoned row was sampled in a batch and found alone: {}",
        server.stderr()
    );

    let client = reqwest::Client::new();
    let listing = deployment_status(&client, &base, ADMIN_KEY).await;
    let sampler = component(&listing, "sampler");
    assert_eq!(
        sampler["faults"], 1,
        "one isolation is one fault: {sampler}"
    );
    assert_eq!(sampler["state"], "active", "{sampler}");
    assert_eq!(sampler["failure_policy"]["on_failure"], "reject");
    let text = metrics(&client, &base).await;
    assert_eq!(
        metric(
            &text,
            &format!("plughost_plugin_faults{{component=\"{FAULTY}\",slot=\"sampler\"}}")
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(metric(&text, "plughost_sampler_fallbacks_total"), Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_fallback_a_poisoned_request_is_sampled_natively_and_says_so() {
    let server = serve("fallback", "on_failure = \"fallback\"", "");
    let base = server.base();
    let before = reference(&base).await;

    let ((status, answer), innocents) =
        batch_with_poison(&base, body(9, Some(SEED_ERROR), 8, false)).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let usage = &answer["usage"];
    assert_eq!(
        usage["plugin_fallback_tokens"], usage["completion_tokens"],
        "every token of the poisoned request came from the native sampler: {answer}"
    );
    let logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .expect("logprobs");
    assert!(
        logprobs.iter().any(|l| l.as_f64() != Some(0.0)),
        "the native sampler's log-probabilities: {answer}"
    );
    assert_eq!(innocents, before, "the other rows keep the plugin's tokens");
    assert_plugin_chose_every_token(&innocents);

    let client = reqwest::Client::new();
    let text = metrics(&client, &base).await;
    assert!(
        metric(&text, "plughost_sampler_fallbacks_total").is_some_and(|n| n >= 1.0),
        "{text}"
    );
    // The request stayed native after its row failed, so it faulted the plugin only once.
    let listing = deployment_status(&client, &base, ADMIN_KEY).await;
    assert_eq!(component(&listing, "sampler")["faults"], 1, "{listing}");
    // An innocent request after it has every token from the plugin, and no fallback count.
    let (status, answer) = post(&client, &base, &body(1, None, 8, false)).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert!(
        answer["usage"].get("plugin_fallback_tokens").is_none(),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn repeated_faults_back_the_sampler_off_visibly_while_health_stays_200() {
    let server = serve(
        "backoff",
        "max_faults = 2\nfault_window_s = 600\nbackoff_s = 600",
        "",
    );
    let base = server.base();
    let client = reqwest::Client::new();
    for _ in 0..2 {
        let (status, answer) = post(&client, &base, &body(9, Some(SEED_TRAP), 4, false)).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{answer}");
        assert_eq!(error_code(&answer), "plugin_failed", "{answer}");
    }

    let listing = deployment_status(&client, &base, ADMIN_KEY).await;
    let sampler = component(&listing, "sampler");
    assert_eq!(sampler["state"], "backing_off", "{sampler}");
    assert_eq!(sampler["backoffs"], 1, "{sampler}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    let until = sampler["backing_off_until"].as_f64().expect("an end time");
    assert!(until > now && until <= now + 600.0, "{sampler}");
    assert_eq!(component(&listing, "scheduler")["state"], "active");

    let health = health(&base).await;
    assert_eq!(health["status"], "degraded", "{health}");
    assert_eq!(sampler_health(&health)["state"], "backing_off", "{health}");

    let text = metrics(&client, &base).await;
    let state = |s: &str| {
        metric(
            &text,
            &format!(
                "plughost_plugin_state{{component=\"{FAULTY}\",slot=\"sampler\",state=\"{s}\"}}"
            ),
        )
    };
    assert_eq!(state("backing_off"), Some(1.0), "{text}");
    assert_eq!(state("active"), Some(0.0), "{text}");

    // Backed off under `reject`: any request fails at once, saying when to come back.
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&body(1, None, 4, false))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry_after: u64 = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("a Retry-After header");
    assert!((1..=600).contains(&retry_after), "{retry_after}");
    let answer: Value = response.json().await.expect("JSON");
    assert_eq!(error_code(&answer), "plugin_backing_off", "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backed_off_sampler_comes_back_and_is_disabled_after_disable_after_back_offs() {
    let server = serve(
        "recover",
        "max_faults = 1\nfault_window_s = 600\nbackoff_s = 0.5\ndisable_after = 2",
        "",
    );
    let base = server.base();
    let client = reqwest::Client::new();
    let (status, answer) = post(&client, &base, &body(9, Some(SEED_TRAP), 4, false)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{answer}");

    wait_for_state(&base, "active").await;
    let (status, answer) = post(&client, &base, &body(1, None, 4, false)).await;
    assert_eq!(status, StatusCode::OK, "back after its back-off: {answer}");
    let logprobs = answer["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .expect("logprobs");
    assert!(logprobs.iter().all(|l| l.as_f64() == Some(0.0)), "{answer}");

    let (status, answer) = post(&client, &base, &body(9, Some(SEED_TRAP), 4, false)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{answer}");
    let health = health(&base).await;
    assert_eq!(sampler_health(&health)["state"], "disabled", "{health}");
    assert_eq!(health["status"], "degraded");
    let (status, answer) = post(&client, &base, &body(1, None, 4, false)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{answer}");
    assert_eq!(error_code(&answer), "plugin_disabled", "{answer}");
    let listing = deployment_status(&client, &base, ADMIN_KEY).await;
    let sampler = component(&listing, "sampler");
    assert_eq!(sampler["state"], "disabled", "{sampler}");
    assert_eq!(sampler["backoffs"], 2, "{sampler}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_empty_plan_while_requests_wait_runs_fcfs_and_counts_a_fault() {
    let scheduler = format!(
        "[scheduler]\ncomponent = {:?}\n",
        plugins_dir()
            .join("plughost_scheduler_faulty.wasm")
            .display()
            .to_string()
    );
    let server = serve("idle-plan", "on_failure = \"fallback\"", &scheduler);
    let base = server.base();
    let client = reqwest::Client::new();
    let mut idle = body(1, None, 4, false);
    idle["priority"] = json!(-1004);
    let (status, answer) = post(&client, &base, &idle).await;
    assert_eq!(status, StatusCode::OK, "FCFS ran the request: {answer}");
    let listing = deployment_status(&client, &base, ADMIN_KEY).await;
    let scheduler = component(&listing, "scheduler");
    assert!(
        scheduler["faults"].as_u64().is_some_and(|f| f >= 1),
        "{scheduler}"
    );
    assert_eq!(scheduler["failure_policy"]["on_failure"], "fallback");
    let text = metrics(&client, &base).await;
    assert!(
        metric(&text, "plughost_scheduler_fallbacks_total").is_some_and(|n| n >= 1.0),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rejecting_scheduler_fails_the_waiting_request_it_trapped_on() {
    let scheduler = format!(
        "[scheduler]\ncomponent = {:?}\non_failure = \"reject\"\n",
        plugins_dir()
            .join("plughost_scheduler_faulty.wasm")
            .display()
            .to_string()
    );
    let server = serve("reject-scheduler", "on_failure = \"fallback\"", &scheduler);
    let base = server.base();
    let client = reqwest::Client::new();
    let mut trap = body(1, None, 4, false);
    trap["priority"] = json!(-1001);
    let (status, answer) = post(&client, &base, &trap).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{answer}");
    assert_eq!(error_code(&answer), "plugin_failed", "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("scheduler plugin plughost_scheduler_faulty"),
        "{message}"
    );
    // The next request plans normally.
    let (status, answer) = post(&client, &base, &body(2, None, 4, false)).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
}
