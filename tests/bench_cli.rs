//! End-to-end test of `plughost bench`: the load generator against a real server on the tiny fixture.

#[path = "api_support.rs"]
mod api_support;
mod common;

use plughost::api::ApiConfig;
use plughost::bench::{BenchOptions, run};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_measures_a_real_server_and_writes_json_and_svg() {
    let engine = api_support::start_engine();
    let addr = api_support::spawn_server(engine, ApiConfig::default());
    let base = format!("http://{addr}");
    let dir = scratch("run");

    let report = run(options(&base, &dir, &["--max-concurrency", "4"]))
        .await
        .expect("the bench runs");
    assert_eq!(report.model.as_deref(), Some(api_support::MODEL));
    let summary = &report.runs[0].summary;
    assert_eq!(summary.first_error, None);
    assert_eq!((summary.num_successful, summary.num_failed), (8, 0));
    assert_eq!(summary.total_output_tokens, 64);
    assert_eq!(summary.total_input_tokens, 8 * 16);
    assert!(summary.ttft.mean_ms > 0.0 && summary.ttft.p50_ms > 0.0);
    assert!(summary.tpot.mean_ms > 0.0 && summary.tpot.p99_ms > 0.0);
    assert!(summary.output_throughput > 0.0);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("result.json")).expect("the JSON"))
            .expect("the result is JSON");
    assert_eq!(json["runs"][0]["records"].as_array().map(Vec::len), Some(8));
    assert_eq!(json["runs"][0]["summary"]["num_successful"], 8);

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
    let svg = std::fs::read_to_string(dir.join("sweep.svg")).expect("the chart");
    assert!(svg.starts_with("<svg"), "{svg}");
    let _ = std::fs::remove_dir_all(dir);
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
    let _ = std::fs::remove_dir_all(dir);
}
