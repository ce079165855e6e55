//! The Responses API's store through `plughost serve`: `--response-store-size` bounds it (the oldest go first), a stored response is retrievable, and a TTL of zero is refused at start.

use crate::serve_support::Server;
use crate::serve_support::kit::{plughost, run, text};
use serde_json::{Value, json};

/// Enough responses of a kilobyte or more to overflow an 8 KiB store.
const RESPONSES: usize = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_size_flag_bounds_the_store_and_the_oldest_go_first() {
    let server = Server::start(&["--response-store-size", "8KiB", "--num-kv-blocks", "256"]);
    let client = reqwest::Client::new();
    let url = format!("{}/v1/responses", server.base());
    let body = json!({"input": "Tell me about the weather today.", "instructions": "Be brief.", "max_output_tokens": 8,
        "metadata": {"note": "x".repeat(400)}});
    let mut ids = Vec::with_capacity(RESPONSES);
    for _ in 0..RESPONSES {
        let response = client.post(&url).json(&body).send().await.expect("sent");
        let response: Value = response.json().await.expect("JSON");
        ids.push(response["id"].as_str().expect("an id").to_string());
    }
    let status = async |id: &String| {
        let response = client.get(format!("{url}/{id}")).send().await;
        response.expect("sent").status().as_u16()
    };
    assert_eq!(status(&ids[RESPONSES - 1]).await, 200, "the newest is kept");
    assert_eq!(status(&ids[0]).await, 404, "the oldest went to make room");
}

#[test]
fn a_response_store_ttl_of_zero_is_refused_at_start() {
    let output = run(plughost(&["serve", "--response-store-ttl", "0"]));
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("--response-store-ttl"), "{stderr}");
}
