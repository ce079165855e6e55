//! plughost's `/metrics`: the load gauges a router's endpoint picker reads, scraped from `plughost serve --metrics-names vllm` by Prometheus's own Python parser (families, types, labels and ranges, idle, under load and idle again, under plughost's names and vLLM's), and the decode steps' counters kept apart from prefill's.

use std::process::Command;

use crate::serve_support::Server;

#[test]
fn the_router_gauges_parse_and_move_under_both_names() {
    let python = std::env::var("PLUGHOST_TEST_PYTHON").unwrap_or_else(|_| {
        panic!(
            "PLUGHOST_TEST_PYTHON is not set: `cargo xtask test` installs the clients and sets it"
        )
    });
    let server = Server::start(&[
        "--metrics-names",
        "vllm",
        "--block-size",
        "8",
        "--num-kv-blocks",
        "300",
        "--max-num-seqs",
        "4",
    ]);
    let script = crate::serve_support::workspace().join("tests/clients/metrics_contract_check.py");
    let output = Command::new(python)
        .arg(script)
        .args([server.base().as_str(), "tiny-qwen3", "8", "300"])
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.trim() == "ok",
        "metrics contract check failed:\n{stdout}\n{stderr}\nserver log:\n{}",
        server.stderr()
    );
}

#[test]
fn without_the_flag_only_plughost_names_are_exported() {
    let server = Server::start(&["--block-size", "8", "--num-kv-blocks", "300"]);
    let metrics = server.try_get("/metrics").expect("metrics answer");
    assert_eq!(metrics.status, 200);
    let body = metrics.body;
    assert!(
        body.contains("plughost_kv_cache_usage_perc{model_name=\"tiny-qwen3\"} 0"),
        "{body}"
    );
    assert!(
        body.contains(
            "plughost_cache_config_info{block_size=\"8\",cache_dtype=\"f32\",model_name=\"tiny-qwen3\",num_blocks=\"300\"} 1"
        ),
        "{body}"
    );
    assert!(!body.contains("vllm:"), "{body}");
    // Before any step: the whole pool is free, not an empty one.
    assert!(
        body.lines()
            .any(|l| l == "plughost_kv_cache_free_blocks 300"),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_steps_and_their_launch_time_are_counted_apart_from_prefill() {
    let server = Server::start(&["--block-size", "8", "--num-kv-blocks", "300"]);
    let base = server.base();
    let client = reqwest::Client::new();
    // One request alone: its prompt is one step, each token after the first one more.
    let body: serde_json::Value = client
        .post(format!("{base}/v1/completions"))
        .json(&serde_json::json!({
            "model": "tiny-qwen3", "prompt": "hello there", "max_tokens": 6,
            "temperature": 0, "ignore_eos": true
        }))
        .send()
        .await
        .expect("sent")
        .json()
        .await
        .expect("a JSON body");
    assert_eq!(body["usage"]["completion_tokens"], 6, "{body}");
    let metrics = server.try_get("/metrics").expect("metrics answer").body;
    let value = |series: &str| crate::serve_support::deployment::metric(&metrics, series);
    assert_eq!(value("plughost_decode_steps_total"), Some(5.0), "{metrics}");
    for step in ["decode", "prefill"] {
        let series = format!(
            "plughost_device_callable_seconds_total{{callable=\"linear\",step=\"{step}\"}}"
        );
        assert!(
            value(&series).is_some_and(|s| s > 0.0),
            "{series} in {metrics}"
        );
    }
}
