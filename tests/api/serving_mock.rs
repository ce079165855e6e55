//! Serving on the mock device: a hundred sequential HTTP requests allocate nothing after the first, and shutdown frees everything.

use plughost::api::ApiConfig;
use serde_json::json;

use crate::common::api::{MODEL, metric, spawn_server, start_engine_on};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_sequential_requests_allocate_nothing_after_the_first_and_shutdown_frees_all() {
    let engine = start_engine_on("libplughost_device_mock.so", "");
    let base = format!(
        "http://{}",
        spawn_server(engine.clone(), ApiConfig::default())
    );
    let client = reqwest::Client::new();
    let device = |name: &str| {
        let text = engine.metrics().render();
        metric(&text, &format!("plughost_device{{counter=\"{name}\"}}"))
            .unwrap_or_else(|| panic!("device counter {name} in:\n{text}"))
    };
    let mut after_first = None;
    for i in 0..100u32 {
        let prompt: Vec<u32> = (0..(3 + i % 17)).map(|t| (t * 13 + i) % 400).collect();
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4 + i % 9, "ignore_eos": true, "temperature": 0});
        let response = client
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await
            .expect("request sent");
        assert!(
            response.status().is_success(),
            "request {i}: {}",
            response.status()
        );
        let allocations = device("allocations");
        match after_first {
            None => after_first = Some(allocations),
            Some(first) => assert_eq!(allocations, first, "request {i} allocated device memory"),
        }
    }
    assert!(device("frees") == 0.0, "no buffer was freed while serving");
    let engine_for_shutdown = engine.clone();
    tokio::task::spawn_blocking(move || engine_for_shutdown.shutdown())
        .await
        .expect("shutdown joins");
    assert_eq!(
        device("live_allocations"),
        0.0,
        "after shutdown no device buffer is live"
    );
    assert_eq!(device("live_bytes"), 0.0);
    assert_eq!(device("frees"), device("allocations"));
}
