//! The device in a worker process, end to end: a worker that crashes or hangs mid-stream is replaced and every stream, greedy or seeded, goes on unchanged; past the restart budget the server answers 503 and exits non-zero.

use serde_json::{Value, json};

use super::reliability_engine::{
    DEADLINE, Server, completion, failed_start, health_after_fault, stream_events,
};

/// A launch some steps into the first batch of streams (loading launches none).
const FAULTY_LAUNCH: u32 = 300;
const STREAMS: u32 = 8;

/// Streams one completion; its text and finish reason, or the error event it ended with.
async fn stream(server: &Server, body: &Value) -> Result<(String, String), Value> {
    let (mut output, mut finish) = (String::new(), String::new());
    for event in stream_events(server, body).await {
        if event.get("error").is_some() {
            return Err(event);
        }
        if let Some(choice) = event["choices"].get(0) {
            output.push_str(choice["text"].as_str().unwrap_or_default());
            if let Some(reason) = choice["finish_reason"].as_str() {
                finish = reason.to_string();
            }
        }
    }
    Ok((output, finish))
}

async fn metric(server: &Server, name: &str) -> Option<f64> {
    let text = reqwest::Client::new()
        .get(server.url("/metrics"))
        .timeout(DEADLINE)
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
}

/// Runs `STREAMS` concurrent streams on a server whose first worker meets the fault, then each
/// prompt again alone on the replaced worker, and checks that every stream completed with the
/// same text as its solo run.
async fn streams_survive(server: &Server) {
    // Half greedy, half sampled with a seed: both promise the same tokens across a restart.
    let bodies: Vec<Value> = (0..STREAMS)
        .map(|i| {
            let mut body = completion(5 + i, 40);
            if i % 2 == 1 {
                body["temperature"] = json!(0.8);
                body["top_p"] = json!(0.95);
                body["seed"] = json!(7 + i);
            }
            body
        })
        .collect();
    let together = futures::future::join_all(bodies.iter().map(|body| stream(server, body))).await;
    // The replacement worker allocated everything while it prepared; serving allocates nothing.
    let allocations = metric(server, "plughost_device{counter=\"allocations\"}").await;
    assert!(allocations.is_some_and(|n| n > 0.0), "{allocations:?}");
    for (i, (body, outcome)) in bodies.iter().zip(together).enumerate() {
        let (text, finish) = outcome
            .unwrap_or_else(|error| panic!("stream {i} failed: {error}\n{}", server.stderr()));
        assert_eq!(finish, "length", "stream {i}");
        let (alone, _) = stream(server, body).await.expect("the solo run");
        assert!(!alone.is_empty());
        assert_eq!(text, alone, "stream {i} differs from its solo run");
    }
    assert_eq!(
        metric(server, "plughost_device{counter=\"allocations\"}").await,
        allocations,
        "the solo runs allocated device buffers"
    );
    assert_eq!(
        metric(server, "plughost_device_restarts_total").await,
        Some(1.0),
        "{}",
        server.stderr()
    );
    assert_eq!(server.health().await, Some(200));
    // The workers' time in attention crosses the process boundary, the replaced worker's added
    // to the first's.
    let attention = metric(
        server,
        "plughost_device_callable_seconds_total{callable=\"paged_attention\",step=\"decode\"}",
    )
    .await;
    assert!(attention.is_some_and(|s| s > 0.0), "{attention:?}");
}

#[tokio::test]
async fn a_worker_crash_mid_stream_costs_no_stream_and_changes_no_token() {
    let server = Server::ready(
        &format!("crash_launch={FAULTY_LAUNCH}"),
        &["--device-isolation", "process"],
    )
    .await;
    streams_survive(&server).await;
    let stderr = server.stderr();
    assert!(
        stderr.contains("the device worker was killed by signal 6 (SIGABRT)"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_worker_hang_mid_stream_costs_no_stream_and_changes_no_token() {
    let server = Server::ready(
        &format!("hang_launch={FAULTY_LAUNCH}"),
        &["--device-isolation", "process", "--device-timeout", "2"],
    )
    .await;
    streams_survive(&server).await;
    let stderr = server.stderr();
    assert!(
        stderr.contains("the device worker missed the 2 s device timeout"),
        "{stderr}"
    );
}

#[tokio::test]
async fn crashes_past_the_restart_budget_answer_503_and_exit_non_zero() {
    let mut server = Server::ready(
        &format!("crash_launch={FAULTY_LAUNCH},faults_every_worker=1"),
        &[
            "--device-isolation",
            "process",
            "--device-restart-limit",
            "1",
        ],
    )
    .await;
    // Long enough for the first worker and its replacement to crash.
    let (status, body) = server.complete(&completion(8, 400)).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "engine_failed", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("the device is broken"), "{message}");
    assert_eq!(health_after_fault(&server).await, Some(503));
    let status = server.exit_within(DEADLINE);
    assert!(!status.success(), "{}", server.stderr());
    assert!(
        server.stderr().contains("--device-restart-limit"),
        "{}",
        server.stderr()
    );
}

#[test]
fn a_device_that_will_not_open_in_its_worker_fails_the_start_with_its_message() {
    let (status, stderr) = failed_start("bogus=1", &["--device-isolation", "process"]);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("error: ") && stderr.contains("unknown mock device option `bogus`"),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("device open failed").count(),
        2,
        "once in the log line, once in the exit message: {stderr}"
    );
}

#[tokio::test]
async fn ctrl_c_drains_the_server_and_never_reaches_its_worker() {
    // A slow launch a few steps in keeps the stream going when the signal comes.
    let mut server = Server::ready("hang_launch=100,hang_ms=1500", &[]).await;
    let body = completion(8, 300);
    let drained = {
        let streaming = stream(&server, &body);
        tokio::pin!(streaming);
        // Ctrl-C once the stream is under way; the server drains it, then closes the worker.
        tokio::select! {
            outcome = &mut streaming => outcome,
            () = tokio::time::sleep(std::time::Duration::from_millis(300)) => {
                server.signal_group("INT");
                streaming.await
            }
        }
    };
    let (text, finish) = drained.unwrap_or_else(|e| panic!("{e}\n{}", server.stderr()));
    assert_eq!(finish, "length", "{}", server.stderr());
    assert!(!text.is_empty());
    server.exit_within(DEADLINE);
    let stderr = server.stderr();
    assert!(stderr.contains("SIGINT"), "{stderr}");
    assert!(!stderr.contains("the device worker was killed"), "{stderr}");
    assert!(!stderr.contains("starting a new device worker"), "{stderr}");
}

#[test]
fn restart_flags_without_a_worker_are_refused_naming_them() {
    let (status, stderr) = failed_start(
        "",
        &[
            "--device-isolation",
            "in-process",
            "--device-restart-limit",
            "3",
        ],
    );
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("--device-restart-limit applies to a device worker"),
        "{stderr}"
    );
}

/// A slow device: every launch takes 100 ms, so a step of the tiny model's few dozen launches
/// outlasts a 1 s device timeout while no launch comes near it. The timeout bounds a launch,
/// not a step, in a worker process (progress replies) and in process (the watchdog restamped
/// per launch): a long prefill on a slow machine is no hang.
#[tokio::test]
async fn steps_longer_than_the_device_timeout_are_no_hang_while_launches_complete() {
    for isolation in ["process", "in-process"] {
        let server = Server::ready(
            "launch_ms=100",
            &["--device-isolation", isolation, "--device-timeout", "1"],
        )
        .await;
        let started = std::time::Instant::now();
        let (status, body) = server.complete(&completion(6, 2)).await;
        let took = started.elapsed();
        assert_eq!(status, 200, "{isolation}: {body}\n{}", server.stderr());
        assert_eq!(body["usage"]["completion_tokens"], 2, "{isolation}: {body}");
        // Two steps (prefill and one decode), each longer than the timeout.
        assert!(
            took > std::time::Duration::from_secs(2),
            "{isolation}: {took:?}: the steps were not slower than the timeout"
        );
        assert_eq!(server.health().await, Some(200), "{isolation}");
        assert!(
            !server.stderr().contains("device timeout"),
            "{isolation}: {}",
            server.stderr()
        );
    }
}

/// With the device in a worker process, the engine sends a step's tokens once the next step's
/// launches are with the worker. Streams of different lengths, run together, still get every
/// token in order, each once, and their finish, the last stream's with no step after it.
#[tokio::test]
async fn streams_from_a_worker_process_get_every_token_in_order_and_their_finish() {
    let server = Server::ready("", &["--device-isolation", "process"]).await;
    let bodies: Vec<Value> = [(5, 3), (9, 17), (6, 40)]
        .into_iter()
        .map(|(prompt_len, max_tokens)| {
            let mut body = completion(prompt_len, max_tokens);
            body["stream_options"] = json!({"include_usage": true});
            body
        })
        .collect();
    let streams =
        futures::future::join_all(bodies.iter().map(|body| stream_events(&server, body))).await;
    for (body, events) in bodies.iter().zip(streams) {
        let mut text = String::new();
        let mut finish = None;
        for event in &events {
            assert!(event.get("error").is_none(), "{event}");
            if let Some(choice) = event["choices"].get(0) {
                text.push_str(choice["text"].as_str().unwrap_or_default());
                if let Some(reason) = choice["finish_reason"].as_str() {
                    assert!(finish.is_none(), "a second finish: {event}");
                    finish = Some(reason.to_string());
                }
            }
        }
        assert_eq!(finish.as_deref(), Some("length"), "{events:?}");
        let usage = events.last().map(|event| &event["usage"]);
        assert_eq!(
            usage.and_then(|usage| usage["completion_tokens"].as_u64()),
            body["max_tokens"].as_u64(),
            "{events:?}"
        );
        let mut whole_body = body.clone();
        if let Some(fields) = whole_body.as_object_mut() {
            fields.remove("stream_options");
        }
        let (status, whole) = server.complete(&whole_body).await;
        assert_eq!(status, 200, "{whole}");
        assert_eq!(
            text, whole["choices"][0]["text"],
            "streamed and whole differ"
        );
    }
}
