//! End-to-end tests of `plughost bench`: the load generator against a real server on the tiny
//! fixture, a stand-in server that records what it receives, and a server that never answers.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use plughost::api::ApiConfig;
use plughost_bench::{BenchOptions, report, run};
use serde_json::Value;

use crate::common::api;

fn options(base: &str, dir: &std::path::Path, extra: &[&str]) -> BenchOptions {
    let json = dir.join("result.json");
    let svg = dir.join("sweep.svg");
    let mut argv = vec![
        "--base-url".to_string(),
        base.into(),
        "--num-prompts".into(),
        "8".into(),
        "--input-len".into(),
        "16".into(),
        "--output-len".into(),
        "8".into(),
        "--ignore-eos".into(),
        // The fixture's vocabulary has 448 ids.
        "--max-token-id".into(),
        "448".into(),
        "--result-json".into(),
        json.display().to_string(),
        // libtest does not capture a bar drawn straight to a terminal's stderr.
        "--no-progress".into(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    if extra.contains(&"--sweep") {
        argv.extend(["--plot".to_string(), svg.display().to_string()]);
    }
    BenchOptions::from_args(argv).expect("the options parse")
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("plughost-bench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    dir
}

async fn metrics(base: &str) -> String {
    reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("the metrics text")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_measures_a_real_server_and_writes_json_and_svg() {
    let engine = api::start_engine();
    let addr = api::spawn_server(engine, ApiConfig::default());
    let base = format!("http://{addr}");
    let dir = scratch("run");

    let report = run(options(
        &base,
        &dir,
        &["--max-concurrency", "4", "--warmup", "2"],
    ))
    .await
    .expect("the bench runs");
    assert_eq!(report.model.as_deref(), Some(api::MODEL));
    let summary = &report.runs[0].summary;
    assert_eq!(summary.first_error, None);
    assert_eq!((summary.num_successful, summary.num_failed), (8, 0));
    assert_eq!(summary.total_output_tokens, 64);
    assert_eq!(summary.total_input_tokens, 8 * 16);
    assert!(summary.ttft.mean_ms > 0.0 && summary.ttft.p50_ms > 0.0);
    assert!(summary.tpot.mean_ms > 0.0 && summary.tpot.p99_ms > 0.0);
    assert!(summary.output_throughput > 0.0);

    // End-to-end latency covers the first token and everything after it.
    let (ttft, e2el) = (&summary.ttft, &summary.e2el);
    assert_eq!(e2el.num_samples, 8);
    assert!(e2el.mean_ms >= ttft.mean_ms, "{e2el:?} vs {ttft:?}");
    assert!(e2el.p50_ms >= ttft.p50_ms, "{e2el:?} vs {ttft:?}");
    assert!(e2el.p99_ms >= ttft.p99_ms, "{e2el:?} vs {ttft:?}");
    assert!(e2el.p99_ms >= e2el.p50_ms && e2el.p50_ms > 0.0);
    for record in &report.runs[0].records {
        assert!(record.e2e_s >= record.ttft_s, "{record:?}");
    }
    let text = report::text(&report);
    for label in ["Mean E2EL (ms):", "Median E2EL (ms):", "P99 E2EL (ms):"] {
        assert!(text.contains(label), "missing {label} in\n{text}");
    }

    // The server finished the two warm-up requests as well, but the summary counts only the
    // measured eight; and no measured prompt hit the prefix cache, so none had been seen.
    assert_eq!(
        (report.warmup.num_requests, report.warmup.num_failed),
        (2, 0)
    );
    assert_eq!(summary.num_requests, 8);
    let served = metrics(&base).await;
    let finished = api::metric(&served, "plughost_e2e_request_latency_seconds_count");
    assert_eq!(finished, Some(10.0), "{served}");
    let queried = api::metric(&served, "plughost_prefix_cache_queries_total");
    assert!(queried.is_some_and(|q| q > 0.0), "{served}");
    let hits = api::metric(&served, "plughost_prefix_cache_hits_total");
    assert_eq!(hits, Some(0.0), "{served}");

    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("result.json")).expect("the JSON"))
            .expect("the result is JSON");
    assert_eq!(json["runs"][0]["records"].as_array().map(Vec::len), Some(8));
    assert_eq!(json["runs"][0]["summary"]["num_successful"], 8);
    assert_eq!(json["warmup"]["num_requests"], 2);
    let e2el = &json["runs"][0]["summary"]["e2el"];
    for key in ["mean_ms", "p50_ms", "p99_ms"] {
        assert!(e2el[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {e2el}");
    }

    let report = run(options(&base, &dir, &["--sweep", "1,4"]))
        .await
        .expect("the sweep runs");
    let levels: Vec<_> = report
        .runs
        .iter()
        .map(|r| r.summary.max_concurrency)
        .collect();
    assert_eq!(levels, [Some(1), Some(4)]);
    assert!(report.runs.iter().all(|r| r.summary.num_successful == 8));
    assert!(report::text(&report).contains("E2EL p99"));
    let svg = std::fs::read_to_string(dir.join("sweep.svg")).expect("the chart");
    assert!(svg.starts_with("<svg"), "{svg}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A server that needs a key: `--api-key` sends it with every request (the model discovery
/// included), and a wrong one makes every request fail with the server's 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_reaches_a_server_that_needs_one() {
    let engine = api::start_engine();
    let config = ApiConfig {
        api_keys: plughost::api::auth::ApiKeys::new(["sk-bench"]).expect("a valid key"),
        ..ApiConfig::default()
    };
    let addr = api::spawn_server(engine, config);
    let base = format!("http://{addr}");
    let dir = scratch("api-key");

    let report = run(options(
        &base,
        &dir,
        &["--api-key", "sk-bench", "--warmup", "0"],
    ))
    .await
    .expect("the bench runs");
    assert_eq!(report.model.as_deref(), Some(api::MODEL));
    let summary = &report.runs[0].summary;
    assert_eq!((summary.num_successful, summary.num_failed), (8, 0));
    let written = std::fs::read_to_string(dir.join("result.json")).expect("the JSON");
    assert!(!written.contains("sk-bench"), "the key is not written out");

    let report = run(options(
        &base,
        &dir,
        &[
            "--api-key",
            "sk-wrong",
            "--warmup",
            "0",
            "--model",
            api::MODEL,
        ],
    ))
    .await
    .expect("the bench runs");
    let summary = &report.runs[0].summary;
    assert_eq!((summary.num_successful, summary.num_failed), (0, 8));
    let error = summary.first_error.as_deref().unwrap_or_default();
    assert!(error.contains("401"), "{error}");
}

#[tokio::test]
async fn an_unreachable_server_counts_failed_requests() {
    // Bind then drop a listener so the port is (almost certainly) closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let dir = scratch("down");
    let report = run(options(&format!("http://127.0.0.1:{port}"), &dir, &[]))
        .await
        .expect("failures are counted, not returned");
    let summary = &report.runs[0].summary;
    assert_eq!((summary.num_successful, summary.num_failed), (0, 8));
    let error = summary.first_error.as_deref().unwrap_or_default();
    assert!(error.contains("cannot reach"), "{error}");
    // The failed warm-up is reported on its own and does not stop the run.
    assert_eq!(
        (report.warmup.num_requests, report.warmup.num_failed),
        (1, 1)
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// How the stand-in server answers a completion request.
#[derive(Clone, Copy)]
struct Answer {
    /// Before the first chunk.
    first_delay: Duration,
    /// After the first chunk, stop sending (without closing) until the client hangs up.
    stall: bool,
}

/// A stand-in OpenAI server on its own threads: `/v1/models` lists one model, and every POST gets
/// `max_tokens` one-letter chunks, usage and `[DONE]`. It keeps each POST body, in arrival order.
struct StandIn {
    base: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

impl StandIn {
    fn start(answer: Answer) -> StandIn {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("address"));
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let kept = bodies.clone();
        std::thread::spawn(move || {
            for socket in listener.incoming().flatten() {
                let kept = kept.clone();
                std::thread::spawn(move || serve_one(socket, &kept, answer));
            }
        });
        StandIn { base, bodies }
    }

    fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().expect("the bodies").clone()
    }
}

/// Reads one HTTP/1.1 request: its head and its `content-length` body.
fn read_request(socket: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = socket.read(&mut chunk).ok().filter(|&n| n > 0)?;
        buffer.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
    let length = head
        .lines()
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, value)| value.trim().parse::<usize>().ok())
        .unwrap_or(0);
    while buffer.len() < head_end + length {
        let n = socket.read(&mut chunk).ok().filter(|&n| n > 0)?;
        buffer.extend_from_slice(&chunk[..n]);
    }
    Some((head, buffer[head_end..head_end + length].to_vec()))
}

fn serve_one(mut socket: TcpStream, bodies: &Mutex<Vec<Value>>, answer: Answer) {
    let Some((head, body)) = read_request(&mut socket) else {
        return;
    };
    if head.starts_with("GET /v1/models") {
        let json = r#"{"object":"list","data":[{"id":"stand-in","object":"model"}]}"#;
        let _ = write!(
            socket,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{json}",
            json.len()
        );
        return;
    }
    let body: Value = serde_json::from_slice(&body).expect("a JSON request body");
    let tokens = body["max_tokens"].as_u64().unwrap_or(1);
    let prompt_tokens = body["prompt"].as_array().map_or(0, Vec::len);
    bodies.lock().expect("the bodies").push(body);
    std::thread::sleep(answer.first_delay);
    let mut out = String::from(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
    );
    for i in 0..tokens {
        out.push_str("data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n");
        if i == 0 && answer.stall {
            let _ = socket.write_all(out.as_bytes());
            // Hold the connection open without a byte more until the client gives up.
            let _ = socket.read(&mut [0u8; 1]);
            return;
        }
    }
    out.push_str(&format!(
        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt_tokens},\"completion_tokens\":{tokens}}}}}\n\n"
    ));
    out.push_str("data: [DONE]\n\n");
    let _ = socket.write_all(out.as_bytes());
}

fn stand_in_options(base: &str, extra: &[&str]) -> BenchOptions {
    let mut argv = vec![
        "--base-url",
        base,
        "--num-prompts",
        "6",
        "--input-len",
        "12",
        "--output-len",
        "3",
        "--no-progress",
    ];
    argv.extend(extra);
    BenchOptions::from_args(argv).expect("the options parse")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_up_requests_go_first_with_unseen_prompts_and_are_not_counted() {
    let delay = Duration::from_millis(400);
    let server = StandIn::start(Answer {
        first_delay: delay,
        stall: false,
    });

    let plain = run(stand_in_options(&server.base, &["--warmup", "0"]))
        .await
        .expect("the bench runs");
    assert_eq!(plain.runs[0].summary.num_successful, 6);
    assert_eq!(plain.warmup.num_requests, 0);
    let measured: Vec<Value> = server
        .bodies()
        .iter()
        .map(|b| b["prompt"].clone())
        .collect();
    assert_eq!(measured.len(), 6);

    let warmed = run(stand_in_options(&server.base, &["--warmup", "2"]))
        .await
        .expect("the bench runs");
    let bodies = server.bodies();
    // The server saw 2 warm-up and 6 measured requests; the summary counts the 6.
    assert_eq!(bodies.len(), 6 + 2 + 6);
    let summary = &warmed.runs[0].summary;
    assert_eq!(summary.num_requests, 6);
    assert_eq!((summary.num_successful, summary.num_failed), (6, 0));
    assert_eq!(summary.total_output_tokens, 6 * 3);
    assert_eq!(warmed.runs[0].records.len(), 6);
    assert_eq!(
        (warmed.warmup.num_requests, warmed.warmup.num_failed),
        (2, 0)
    );

    // The warm-up was awaited before anything measured was sent, with prompts of its own...
    let prompts: Vec<Value> = bodies[6..].iter().map(|b| b["prompt"].clone()).collect();
    let (warmup, again) = prompts.split_at(2);
    assert_ne!(warmup[0], warmup[1]);
    for prompt in warmup {
        assert_eq!(prompt.as_array().map(Vec::len), Some(12));
        assert!(!measured.contains(prompt), "a warm-up prompt is measured");
    }
    // ...and it leaves the measured prompts as they are without it.
    let sorted = |v: &[Value]| {
        let mut v: Vec<String> = v.iter().map(Value::to_string).collect();
        v.sort();
        v
    };
    assert_eq!(sorted(again), sorted(&measured));

    // The clock started after the warm-up: every measured request went out at once, long
    // before a warm-up answer (delayed by `delay`) could have come back.
    for record in &warmed.runs[0].records {
        assert!(record.start_s < delay.as_secs_f64(), "{record:?}");
    }
    assert!(warmed.warmup.duration_s >= delay.as_secs_f64());
}

#[tokio::test]
async fn sampling_options_reach_the_request_body() {
    let server = StandIn::start(Answer {
        first_delay: Duration::ZERO,
        stall: false,
    });
    let extra = [
        "--model",
        "m",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
    ];
    let report = run(stand_in_options(&server.base, &extra))
        .await
        .expect("the bench runs");
    assert_eq!(report.runs[0].summary.num_successful, 6);
    let bodies = server.bodies();
    // The warm-up request carries the same sampling options as the measured ones.
    assert_eq!(bodies.len(), 1 + 6);
    for body in &bodies {
        assert_eq!(body["model"], "m");
        assert_eq!(body["temperature"].as_f64(), Some(0.7), "{body}");
        assert_eq!(body["top_p"].as_f64(), Some(0.9), "{body}");
        assert_eq!(body["top_k"].as_i64(), Some(20), "{body}");
    }

    let report = run(stand_in_options(&server.base, &["--warmup", "0"]))
        .await
        .expect("the bench runs");
    // Without --model the bench asks /v1/models.
    assert_eq!(report.model.as_deref(), Some("stand-in"));
    let bodies = server.bodies();
    for body in &bodies[7..] {
        assert_eq!(body["temperature"].as_f64(), Some(0.0), "{body}");
        assert_eq!(body["top_p"].as_f64(), Some(1.0), "{body}");
        // OpenAI's API has no top_k: it is only sent when asked for.
        assert!(body.get("top_k").is_none(), "{body}");
    }
}

#[test]
fn max_concurrency_and_sweep_cannot_be_combined() {
    let parse = |extra: &[&str]| {
        let mut argv = vec!["--base-url", "http://127.0.0.1:1"];
        argv.extend(extra);
        BenchOptions::from_args(argv)
    };
    let error = parse(&["--max-concurrency", "4", "--sweep", "1,2"])
        .expect_err("the combination is rejected");
    assert!(
        error.contains("--max-concurrency") && error.contains("--sweep"),
        "{error}"
    );
    assert!(error.contains("cannot be used with"), "{error}");
    assert!(parse(&["--max-concurrency", "4"]).is_ok());
    assert!(parse(&["--sweep", "1,2"]).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_gives_failed_requests_in_bounded_time() {
    // Accepts connections, reads nothing and answers nothing, holding each one open until the
    // client drops it.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    std::thread::spawn(move || {
        for mut socket in listener.incoming().flatten() {
            counter.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                let mut sink = [0u8; 4096];
                while socket.read(&mut sink).is_ok_and(|n| n > 0) {}
            });
        }
    });

    let started = Instant::now();
    // No --model: the model lookup is bounded by the same timeout.
    let bench = run(stand_in_options(&base, &["--request-timeout", "0.5"]));
    let report = tokio::time::timeout(Duration::from_secs(60), bench)
        .await
        .expect("the bench ends instead of hanging")
        .expect("failures are counted, not returned");
    let elapsed = started.elapsed();

    assert_eq!(report.model, None);
    let summary = &report.runs[0].summary;
    assert_eq!((summary.num_successful, summary.num_failed), (0, 6));
    let error = summary.first_error.as_deref().unwrap_or_default();
    assert!(error.contains("timed out"), "{error}");
    assert_eq!(
        (report.warmup.num_requests, report.warmup.num_failed),
        (1, 1)
    );
    // The warm-up request and the six measured ones all reached the listener.
    assert!(accepted.load(Ordering::SeqCst) >= 7);
    // Model lookup, warm-up and the run each wait one timeout; the rest is slack for a busy machine.
    assert!(
        elapsed >= Duration::from_millis(1500) && elapsed < Duration::from_secs(20),
        "{elapsed:?}"
    );
    // Every measured request waited about the timeout, not more.
    for record in &report.runs[0].records {
        assert!(!record.success && record.start_s < 1.0, "{record:?}");
    }
    assert!(
        summary.duration_s >= 0.5 && summary.duration_s < 10.0,
        "{summary:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_stalls_midway_times_out() {
    let server = StandIn::start(Answer {
        first_delay: Duration::ZERO,
        stall: true,
    });
    let bench = run(stand_in_options(
        &server.base,
        &["--model", "m", "--request-timeout", "0.5", "--warmup", "0"],
    ));
    let report = tokio::time::timeout(Duration::from_secs(60), bench)
        .await
        .expect("the bench ends instead of hanging")
        .expect("failures are counted, not returned");
    let summary = &report.runs[0].summary;
    assert_eq!((summary.num_successful, summary.num_failed), (0, 6));
    let error = summary.first_error.as_deref().unwrap_or_default();
    assert!(error.contains("timed out"), "{error}");
    assert_eq!(server.bodies().len(), 6);
}
