//! The server around requests: a client that disconnects frees the engine, shutdown drains, a failed load answers 503.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use plughost::api::{ApiConfig, serve};
use plughost::engine::{EngineHandle, EngineOptions, EngineSetup};
use plughost::metrics::Metrics;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common;
use crate::common::api::{MODEL, metric, spawn_server, sse_data, start_engine, start_engine_on};

fn long_stream() -> Value {
    json!({"model": MODEL, "prompt": [39, 68, 299, 78, 11, 260], "max_tokens": 400, "ignore_eos": true, "stream": true})
}

async fn metrics_text(client: &reqwest::Client, base: &str) -> String {
    client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text")
}

#[tokio::test]
async fn a_client_that_disconnects_aborts_its_requests_and_frees_the_kv_cache() {
    let engine = start_engine();
    let base = format!(
        "http://{}",
        spawn_server(engine.clone(), ApiConfig::default())
    );
    let client = reqwest::Client::new();
    let mut choices_sent = 0;
    for n in [1, 3] {
        choices_sent += n;
        let mut body = long_stream();
        body["n"] = json!(n);
        let response = client
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), StatusCode::OK);
        let mut chunks = response.bytes_stream();
        let first = chunks.next().await.expect("a first chunk").expect("bytes");
        assert!(String::from_utf8_lossy(&first).starts_with("data: "));
        drop(chunks);

        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let text = metrics_text(&client, &base).await;
            let running = metric(
                &text,
                &format!("plughost_num_requests_running{{model_name=\"{MODEL}\"}}"),
            );
            let usage = metric(
                &text,
                &format!("plughost_kv_cache_usage_perc{{model_name=\"{MODEL}\"}}"),
            );
            let aborted =
                metric(&text, "plughost_requests_finished_total{reason=\"abort\"}").unwrap_or(0.0);
            // Each choice sent so far is aborted: the earlier round's abort alone does not
            // show that this round's choices have left the engine.
            if running == Some(0.0) && usage == Some(0.0) && aborted >= f64::from(choices_sent) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "n = {n}: still running {running:?}, KV usage {usage:?}, aborted {aborted} 5 s after the client left"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let text = metrics_text(&client, &base).await;
    let finished = |reason: &str| {
        metric(
            &text,
            &format!("plughost_requests_finished_total{{reason=\"{reason}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(
        finished("length"),
        0.0,
        "the streams were cut long before 400 tokens"
    );
    assert_eq!(finished("abort"), 4.0, "one abort per choice");
    engine.shutdown();
}

#[tokio::test]
async fn shutdown_drains_streams_in_flight_then_serve_returns() {
    let engine = start_engine();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(
        listener,
        engine.clone(),
        ApiConfig::default(),
        async {
            let _ = stopped.await;
        },
    ));
    let client = reqwest::Client::new();
    let mut body = long_stream();
    body["max_tokens"] = json!(48);
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("send");
    let mut chunks = response.bytes_stream();
    let mut text =
        String::from_utf8_lossy(&chunks.next().await.expect("first").expect("bytes")).to_string();
    stop.send(()).expect("the server waits for shutdown");
    while let Some(chunk) = chunks.next().await {
        text.push_str(&String::from_utf8_lossy(
            &chunk.expect("the stream runs to its end"),
        ));
    }
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "the stream in flight finished: {text}"
    );
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("serve returns")
        .expect("join")
        .expect("serve");
    assert!(
        reqwest::Client::new()
            .get(format!("{base}/health"))
            .send()
            .await
            .is_err(),
        "no longer accepting"
    );
    engine.shutdown();
}

#[tokio::test]
async fn a_model_that_failed_to_load_answers_503() {
    let setup = EngineSetup {
        model_dir: std::env::temp_dir().join("plughost-no-such-model"),
        model_name: MODEL.into(),
        device_library: common::plugin_path("libplughost_device_mock.so"),
        device_config: String::new(),
        glue: plughost::plugins::PluginSpec {
            component: common::plugin_path("plughost_model_qwen3.wasm"),
            config: Default::default(),
            memory_mib: None,
            call_timeout_ms: None,
            failure: Default::default(),
        },
        scheduler: None,
        sampler: None,
        named_samplers: Default::default(),
        component_cache: None,
        options: EngineOptions::default(),
        profile_output: None,
    };
    let engine = Arc::new(EngineHandle::start(setup, Arc::new(Metrics::new())).expect("start"));
    assert!(engine.wait_ready().is_err());
    let base = format!("http://{}", spawn_server(engine, ApiConfig::default()));
    let client = reqwest::Client::new();
    let requests = [
        client.get(format!("{base}/health")),
        client.get(format!("{base}/v1/models")),
        client
            .post(format!("{base}/v1/completions"))
            .json(&json!({"prompt": "Hi"})),
        client
            .post(format!("{base}/v1/chat/completions"))
            .json(&json!({"messages": [{"role": "user", "content": "Hi"}]})),
    ];
    for request in requests {
        let response = request.send().await.expect("send");
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body: Value = response.json().await.expect("an OpenAI error body");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("failed to load")),
            "{body}"
        );
    }
}

/// The mock device fails this launch and the next: a few steps into a generation, a step the
/// engine's one retry does not get past.
const FAILING_DEVICE: (&str, &str) = (
    "libplughost_device_mock.so",
    "fail_launch=200,fail_launch_count=2",
);

#[tokio::test]
async fn an_engine_failure_after_the_stream_started_is_sent_as_an_error_event() {
    let engine = start_engine_on(FAILING_DEVICE.0, FAILING_DEVICE.1);
    let base = format!(
        "http://{}",
        spawn_server(engine.clone(), ApiConfig::default())
    );
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&long_stream())
        .send()
        .await
        .expect("send");
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "the stream started before the failure"
    );
    let data = sse_data(&response.text().await.expect("body"));
    let (last, chunks) = data.split_last().expect("events");
    let error: Value = serde_json::from_str(last).expect("a JSON event");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{last}"
    );
    assert_eq!(
        (
            error["error"]["type"].as_str(),
            error["error"]["code"].as_str()
        ),
        (Some("server_error"), Some("generation_failed"))
    );
    assert!(
        !chunks.is_empty() && chunks.iter().all(|c| c.contains("\"text_completion\"")),
        "tokens came before the failure: {data:?}"
    );

    // The engine failed that request only and goes on serving.
    let body = json!({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": true});
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::OK);
    engine.shutdown();
}

#[tokio::test]
async fn an_engine_failure_without_streaming_is_a_500() {
    let engine = start_engine_on(FAILING_DEVICE.0, FAILING_DEVICE.1);
    let base = format!(
        "http://{}",
        spawn_server(engine.clone(), ApiConfig::default())
    );
    let mut body = long_stream();
    body["stream"] = json!(false);
    let response = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body: Value = response.json().await.expect("an OpenAI error body");
    assert_eq!(body["error"]["code"], "generation_failed", "{body}");
    engine.shutdown();
}

/// `/ready` is readiness: 200 while the server takes new work, 503 `draining` from the first
/// shutdown signal on, while `/health` (liveness) stays 200; both are open without the API key.
#[tokio::test]
async fn ready_turns_503_when_draining_while_health_stays_200() {
    let engine = start_engine();
    let config = ApiConfig {
        api_keys: plughost::api::ApiKeys::new(["sk-ready"]).expect("a valid key"),
        ..ApiConfig::default()
    };
    let drain = config.drain.clone();
    let base = format!("http://{}", spawn_server(engine, config));
    let client = reqwest::Client::new();
    let get = |path: &'static str| {
        let (client, base) = (client.clone(), base.clone());
        async move {
            let response = client
                .get(format!("{base}{path}"))
                .send()
                .await
                .expect("an answer");
            let status = response.status();
            (status, response.text().await.expect("a body"))
        }
    };
    assert_eq!(get("/ready").await.0, StatusCode::OK);
    assert_eq!(get("/health").await.0, StatusCode::OK);

    drain.start();
    let (status, body) = get("/ready").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let error: Value = serde_json::from_str(&body).expect("a JSON error");
    assert_eq!(error["error"]["code"], "draining", "{body}");
    assert_eq!(get("/health").await.0, StatusCode::OK);
}
