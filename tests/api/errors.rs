//! The HTTP API refuses bad input with the right status and an OpenAI error body, and keeps serving.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::common::api::{MODEL, server};

enum Body {
    None,
    Json(Value),
    Raw(Vec<u8>),
}

struct Case {
    name: &'static str,
    method: Method,
    path: &'static str,
    body: Body,
    status: u16,
    /// The `error.param` expected, when the case names one.
    param: Option<&'static str>,
}

fn post(
    name: &'static str,
    path: &'static str,
    body: Value,
    status: u16,
    param: Option<&'static str>,
) -> Case {
    Case {
        name,
        method: Method::POST,
        path,
        body: Body::Json(body),
        status,
        param,
    }
}

fn completion(name: &'static str, extra: Value, param: &'static str) -> Case {
    let mut body = json!({"model": MODEL, "prompt": "Hello, the", "max_tokens": 4});
    merge(&mut body, extra);
    post(name, "/v1/completions", body, 400, Some(param))
}

fn chat(name: &'static str, extra: Value, param: &'static str) -> Case {
    let mut body =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    merge(&mut body, extra);
    post(name, "/v1/chat/completions", body, 400, Some(param))
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        for (key, value) in extra {
            if value.is_null() {
                body.remove(&key);
            } else {
                body.insert(key, value);
            }
        }
    }
}

fn cases() -> Vec<Case> {
    let too_long: Vec<u32> = (0..600).map(|i| 10 + i % 400).collect();
    let raw = |name, body: &[u8], status| Case {
        name,
        method: Method::POST,
        path: "/v1/completions",
        body: Body::Raw(body.to_vec()),
        status,
        param: None,
    };
    let mut big = br#"{"prompt": ""#.to_vec();
    // Past the default limit of 16 MiB.
    big.resize(17_000_000, b'a');
    big.extend_from_slice(br#""}"#);
    vec![
        completion(
            "max_tokens as a string",
            json!({"max_tokens": "ten"}),
            "max_tokens",
        ),
        chat(
            "temperature as a string",
            json!({"temperature": "hot"}),
            "temperature",
        ),
        chat("messages as an object", json!({"messages": {}}), "messages"),
        completion(
            "negative max_tokens",
            json!({"max_tokens": -5}),
            "max_tokens",
        ),
        completion("zero max_tokens", json!({"max_tokens": 0}), "max_tokens"),
        completion(
            "temperature below 0",
            json!({"temperature": -0.5}),
            "temperature",
        ),
        completion(
            "temperature above 2",
            json!({"temperature": 2.5}),
            "temperature",
        ),
        completion("top_p above 1", json!({"top_p": 1.5}), "top_p"),
        completion("top_p of 0", json!({"top_p": 0}), "top_p"),
        completion("top_k of -5", json!({"top_k": -5}), "top_k"),
        completion("min_p of 2", json!({"min_p": 2}), "min_p"),
        completion("n of 0", json!({"n": 0}), "n"),
        completion("n far too large", json!({"n": 100000}), "n"),
        completion(
            "presence_penalty of 5",
            json!({"presence_penalty": 5}),
            "presence_penalty",
        ),
        completion(
            "frequency_penalty of -3",
            json!({"frequency_penalty": -3}),
            "frequency_penalty",
        ),
        completion(
            "repetition_penalty of 0",
            json!({"repetition_penalty": 0}),
            "repetition_penalty",
        ),
        completion("logprobs of 50", json!({"logprobs": 50}), "logprobs"),
        chat(
            "top_logprobs of 21",
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        chat(
            "top_logprobs without logprobs",
            json!({"top_logprobs": 2}),
            "top_logprobs",
        ),
        completion(
            "five stop strings",
            json!({"stop": ["a", "b", "c", "d", "e"]}),
            "stop",
        ),
        completion("stop as a number", json!({"stop": 7}), "stop"),
        completion(
            "stop token outside the vocabulary",
            json!({"stop_token_ids": [448]}),
            "stop_token_ids",
        ),
        completion("seed as a string", json!({"seed": "abc"}), "seed"),
        completion(
            "stream_options without stream",
            json!({"stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        chat("empty messages", json!({"messages": []}), "messages"),
        chat("missing messages", json!({"messages": null}), "messages"),
        chat(
            "unknown role",
            json!({"messages": [{"role": "wizard", "content": "Hi"}]}),
            "messages[0].role",
        ),
        chat(
            "image content part",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
            "messages[0].content[0].type",
        ),
        chat(
            "content as a number",
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
        completion("missing prompt", json!({"prompt": null}), "prompt"),
        completion("empty prompt list", json!({"prompt": []}), "prompt"),
        completion("empty prompt string", json!({"prompt": ""}), "prompt"),
        completion(
            "empty string in a prompt list",
            json!({"prompt": ["a", ""]}),
            "prompt",
        ),
        completion("mixed prompt list", json!({"prompt": ["a", 5]}), "prompt"),
        completion(
            "token id outside the vocabulary",
            json!({"prompt": [1, 2, 448]}),
            "prompt",
        ),
        completion("negative token id", json!({"prompt": [[1, -2]]}), "prompt"),
        post(
            "prompt longer than the context",
            "/v1/completions",
            json!({"prompt": too_long}),
            400,
            None,
        ),
        post(
            "max_tokens beyond the context",
            "/v1/completions",
            json!({"prompt": "Hello, the", "max_tokens": 600}),
            400,
            None,
        ),
        raw(
            "invalid JSON",
            br#"{"prompt": "Hello", "max_tokens": "#,
            400,
        ),
        raw("a JSON array body", br#"["Hello"]"#, 400),
        raw("an empty body", b"", 400),
        raw("a non-UTF-8 body", b"{\"prompt\": \"caf\xe9\"}", 400),
        raw("a 17 MB body", &big, 413),
        post(
            "unknown model on completions",
            "/v1/completions",
            json!({"model": "gpt-17", "prompt": "Hi"}),
            404,
            Some("model"),
        ),
        post(
            "unknown model on chat",
            "/v1/chat/completions",
            json!({"model": "gpt-17", "messages": [{"role": "user", "content": "Hi"}]}),
            404,
            Some("model"),
        ),
        Case {
            name: "GET on a POST route",
            method: Method::GET,
            path: "/v1/completions",
            body: Body::None,
            status: 405,
            param: None,
        },
        Case {
            name: "POST on a GET route",
            method: Method::POST,
            path: "/v1/models",
            body: Body::None,
            status: 405,
            param: None,
        },
        Case {
            name: "an unknown path",
            method: Method::GET,
            path: "/v1/engines",
            body: Body::None,
            status: 404,
            param: None,
        },
        Case {
            name: "an unknown POST path",
            method: Method::POST,
            path: "/v2/completions",
            body: Body::None,
            status: 404,
            param: None,
        },
    ]
}

async fn send(
    client: &reqwest::Client,
    base: &str,
    case: &Case,
) -> Result<reqwest::Response, reqwest::Error> {
    let request = client.request(case.method.clone(), format!("{base}{}", case.path));
    let request = match &case.body {
        Body::None => request,
        Body::Json(value) => request.json(value),
        Body::Raw(bytes) => request
            .header("content-type", "application/json")
            .body(bytes.clone()),
    };
    request.send().await
}

#[tokio::test]
async fn invalid_requests_get_openai_errors_and_the_server_keeps_serving() {
    let server = server();
    let client = reqwest::Client::new();
    let cases = cases();
    assert!(cases.len() >= 25);
    let mut failures = Vec::new();
    for case in &cases {
        let response = match send(&client, &server.base, case).await {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{}: request failed: {e}", case.name));
                continue;
            }
        };
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let text = response.text().await.unwrap_or_default();
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let error = &body["error"];
        let message = error["message"].as_str().unwrap_or("");
        let problems = [
            (status != case.status).then(|| format!("status {status}, expected {}", case.status)),
            (!content_type.starts_with("application/json"))
                .then(|| format!("content type {content_type:?}")),
            message.is_empty().then(|| "no error.message".to_string()),
            (!error["type"].is_string()).then(|| "no error.type".to_string()),
            (!error
                .as_object()
                .is_some_and(|e| e.contains_key("param") && e.contains_key("code")))
            .then(|| "error.param or error.code missing".to_string()),
            case.param
                .filter(|p| error["param"].as_str() != Some(p))
                .map(|p| format!("param {:?}, expected {p:?}", error["param"])),
        ];
        for problem in problems.into_iter().flatten() {
            failures.push(format!(
                "{}: {problem}; body: {}",
                case.name,
                text.chars().take(300).collect::<String>()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );

    let response = client
        .post(format!("{}/v1/completions", server.base))
        .json(&json!({"model": MODEL, "prompt": "Hello, the", "max_tokens": 3, "temperature": 0}))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::OK);
    let body: Value = response.json().await.expect("json");
    assert!(
        body["usage"]["completion_tokens"]
            .as_u64()
            .is_some_and(|n| (1..=3).contains(&n)),
        "{body}"
    );
    assert_eq!(body["choices"].as_array().map(Vec::len), Some(1), "{body}");
}

#[tokio::test]
async fn context_errors_say_how_long_the_context_is() {
    let server = server();
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.base))
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": 1000}))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let body: Value = response.json().await.expect("json");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
    assert!(
        message.contains("512") && message.contains("1003"),
        "{message}"
    );
}

#[tokio::test]
async fn health_models_and_metrics() {
    let server = server();
    let client = reqwest::Client::new();
    let health = client
        .get(format!("{}/health", server.base))
        .send()
        .await
        .expect("health");
    assert_eq!(health.status(), StatusCode::OK);

    let models: Value = client
        .get(format!("{}/v1/models", server.base))
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("json");
    assert_eq!(models["object"], "list");
    let card = &models["data"][0];
    assert_eq!(
        (
            card["id"].as_str(),
            card["object"].as_str(),
            card["owned_by"].as_str()
        ),
        (Some(MODEL), Some("model"), Some("plughost"))
    );
    assert_eq!(card["max_model_len"], 512);
    assert!(
        card["created"].as_u64().is_some_and(|c| c > 1_600_000_000),
        "{card}"
    );

    let metrics = client
        .get(format!("{}/metrics", server.base))
        .send()
        .await
        .expect("metrics");
    assert_eq!(metrics.status(), StatusCode::OK);
    let content_type = metrics
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let text = metrics.text().await.expect("text");
    assert!(
        text.contains("plughost_time_to_first_token_seconds"),
        "{text}"
    );
}
