//! The operational endpoints vLLM users know, on `plughost serve --log-format json`: `/version`, `/v1/models` with `root` and `max_model_len`, `/tokenize` and `/detokenize` agreeing with what generation sees, and one JSON access-log line per request.

use std::time::{Duration, Instant};

use crate::serve_support::{Server, workspace};
use reqwest::StatusCode;
use serde_json::{Value, json};

const MODEL: &str = "tiny-qwen3";

async fn post(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    body: Value,
) -> (StatusCode, Value) {
    let response = client
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .expect("sent");
    let status = response.status();
    (status, response.json().await.expect("a JSON body"))
}

/// The access-log lines (JSON) the server wrote so far.
fn access_lines(server: &Server) -> Vec<Value> {
    server
        .stderr()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["target"] == "plughost::access")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_models_tokenize_detokenize_and_the_access_log() {
    let server = Server::start(&["--log-format", "json", "--num-kv-blocks", "256"]);
    let base = server.base();
    let client = reqwest::Client::new();

    let version: Value = client
        .get(format!("{base}/version"))
        .send()
        .await
        .expect("version")
        .json()
        .await
        .expect("JSON");
    assert_eq!(version, json!({"version": env!("CARGO_PKG_VERSION")}));
    let models: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("JSON");
    let card = &models["data"][0];
    assert_eq!(card["id"], MODEL);
    assert!(
        card["max_model_len"].as_u64().is_some_and(|n| n > 0),
        "{card}"
    );
    let root = card["root"].as_str().expect("root");
    assert_eq!(
        std::fs::canonicalize(root).expect("root exists"),
        std::fs::canonicalize(workspace().join("tests/fixtures").join(MODEL)).expect("fixture")
    );
    assert!(card["parent"].is_null());

    // A chat's tokens are exactly the prompt the chat completion counts, and they decode back.
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]);
    let (status, tokenized) = post(
        &client,
        &base,
        "/tokenize",
        json!({"model": MODEL, "messages": messages, "return_token_strs": true}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{tokenized}");
    let ids: Vec<u64> = serde_json::from_value(tokenized["tokens"].clone()).expect("ids");
    assert_eq!(tokenized["count"], ids.len());
    assert_eq!(
        tokenized["token_strs"].as_array().map(Vec::len),
        Some(ids.len())
    );
    let (status, chat) = post(
        &client,
        &base,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": messages, "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{chat}");
    assert_eq!(chat["usage"]["prompt_tokens"], ids.len());
    let (status, text) = post(&client, &base, "/detokenize", json!({"tokens": ids})).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let prompt = text["prompt"].as_str().expect("prompt");
    assert!(
        prompt.contains("Be brief.") && prompt.contains("Hello there"),
        "{prompt}"
    );
    let (_, plain) = post(
        &client,
        &base,
        "/tokenize",
        json!({"prompt": "Hello there"}),
    )
    .await;
    let (_, back) = post(
        &client,
        &base,
        "/detokenize",
        json!({"tokens": plain["tokens"]}),
    )
    .await;
    assert_eq!(back["prompt"], "Hello there");

    for (path, body, param) in [
        (
            "/tokenize",
            json!({"prompt": "a", "messages": messages}),
            "messages",
        ),
        ("/tokenize", json!({}), "prompt"),
        (
            "/tokenize",
            json!({"prompt": "a", "model": "other"}),
            "model",
        ),
        ("/detokenize", json!({"tokens": [100000]}), "tokens"),
        ("/detokenize", json!({}), "tokens"),
        (
            "/tokenize",
            json!({"messages": messages, "continue_final_message": true}),
            "continue_final_message",
        ),
        (
            "/tokenize",
            json!({"messages": messages, "chat_template": "{{ x }}"}),
            "chat_template",
        ),
    ] {
        let (status, error) = post(&client, &base, path, body.clone()).await;
        assert!(status.is_client_error(), "{path} {body}: {status} {error}");
        assert_eq!(error["error"]["param"], param, "{path} {body}: {error}");
    }

    // One access line per request, written when its response ended, with the usage's counts.
    let response = client
        .post(format!("{base}/v1/completions"))
        .header("x-request-id", "access-log-check")
        .json(&json!({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .expect("stream");
    assert_eq!(response.status(), StatusCode::OK);
    response.text().await.expect("the whole stream");
    let deadline = Instant::now() + Duration::from_secs(30);
    let line = loop {
        if let Some(line) = access_lines(&server)
            .into_iter()
            .find(|l| l["span"]["id"] == "access-log-check")
        {
            break line;
        }
        assert!(
            Instant::now() < deadline,
            "no access line:\n{}",
            server.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let fields = &line["fields"];
    assert_eq!(fields["message"], "POST /v1/completions");
    assert_eq!(fields["status"], 200);
    assert_eq!(
        (
            fields["prompt_tokens"].as_u64(),
            fields["completion_tokens"].as_u64()
        ),
        (Some(3), Some(4))
    );
    let (ttft, total) = (
        fields["ttft_ms"].as_f64().expect("ttft"),
        fields["total_ms"].as_f64().expect("total"),
    );
    assert!(0.0 < ttft && ttft <= total, "{fields}");
    let lines = access_lines(&server);
    let tokenize_lines = lines
        .iter()
        .filter(|l| l["fields"]["message"] == "POST /tokenize")
        .count();
    assert_eq!(
        tokenize_lines,
        2 + 5,
        "one per /tokenize request:\n{lines:?}"
    );
}
