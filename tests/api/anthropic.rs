//! Anthropic's Messages API against real servers: the official anthropic client (plain, streamed, a forced tool, count_tokens, a typed error), the stream's named events, `max_tokens` clamped to the context, errors in Anthropic's shape, and `x-api-key` checked like a Bearer key.

use plughost::api::{ApiConfig, ApiKeys};
use serde_json::{Value, json};

use crate::common::api::{MODEL, run_client_check, server, spawn_server, sse_data};

fn post(base: &str, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, String) {
    let mut request = reqwest::blocking::Client::new()
        .post(format!("{base}{path}"))
        .json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().expect("sent");
    let status = response.status().as_u16();
    (status, response.text().expect("a body"))
}

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn hello(max_tokens: i64) -> Value {
    json!({
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me a story."}],
    })
}

#[test]
fn the_anthropic_python_client_works_unchanged() {
    run_client_check("anthropic_client_check.py", super::tools::server());
}

#[test]
fn a_max_tokens_beyond_the_context_is_clamped_to_what_fits() {
    let base = &server().base;
    let (status, text) = post(base, "/v1/messages", &[], &hello(1_000_000));
    assert_eq!(status, 200, "{text}");
    let message = json_of(&text);
    let usage = &message["usage"];
    let prompt = usage["input_tokens"].as_u64().expect("input_tokens")
        + usage["cache_read_input_tokens"].as_u64().unwrap_or(0);
    let output = usage["output_tokens"].as_u64().expect("output_tokens");
    let context = 512;
    match message["stop_reason"].as_str() {
        Some("max_tokens") => assert_eq!(prompt + output, context, "{message}"),
        Some("end_turn") => assert!(prompt + output <= context, "{message}"),
        other => panic!("stop_reason {other:?}: {message}"),
    }
    // OpenAI's routes refuse the same budget.
    let chat = json!({"model": MODEL, "max_tokens": 1_000_000, "messages": [{"role": "user", "content": "hi"}]});
    let (status, text) = post(base, "/v1/chat/completions", &[], &chat);
    assert_eq!(status, 400, "{text}");
}

#[test]
fn the_stream_sends_anthropics_named_events_in_order() {
    let mut body = hello(5);
    body["stream"] = json!(true);
    let response = reqwest::blocking::Client::new()
        .post(format!("{}/v1/messages", server().base))
        .json(&body)
        .send()
        .expect("sent");
    assert_eq!(response.status().as_u16(), 200);
    let text = response.text().expect("a body");
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    let data: Vec<Value> = sse_data(&text).iter().map(|d| json_of(d)).collect();
    assert_eq!(names.len(), data.len(), "{text}");
    for (name, data) in names.iter().zip(&data) {
        assert_eq!(data["type"], *name, "{text}");
    }
    assert_eq!(names.first(), Some(&"message_start"), "{text}");
    assert_eq!(names.last(), Some(&"message_stop"), "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    let delta = data
        .iter()
        .find(|d| d["type"] == "message_delta")
        .expect("a message_delta");
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens", "{delta}");
    assert_eq!(delta["usage"]["output_tokens"], 5, "{delta}");
    let starts = names
        .iter()
        .filter(|n| **n == "content_block_start")
        .count();
    let stops = names.iter().filter(|n| **n == "content_block_stop").count();
    assert!(starts >= 1 && starts == stops, "{text}");
}

#[test]
fn errors_on_the_messages_routes_take_anthropics_shape() {
    let base = &server().base;
    let no_budget = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let image = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]});
    let server_tool = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}]});
    let other_model = json!({"model": "claude-sonnet", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let cases = [
        (
            "/v1/messages",
            no_budget,
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            "/v1/messages",
            image,
            400,
            "invalid_request_error",
            "messages[0].content[0].type",
        ),
        (
            "/v1/messages",
            server_tool,
            400,
            "invalid_request_error",
            "tools[0].type",
        ),
        (
            "/v1/messages",
            other_model,
            404,
            "not_found_error",
            "claude-sonnet",
        ),
        (
            "/v1/messages/count_tokens",
            json!({"model": MODEL}),
            400,
            "invalid_request_error",
            "messages",
        ),
    ];
    for (path, body, status, kind, named) in cases {
        let (got, text) = post(base, path, &[], &body);
        let error = json_of(&text);
        assert_eq!(got, status, "{body} → {text}");
        assert_eq!(error["type"], "error", "{text}");
        assert_eq!(error["error"]["type"], kind, "{text}");
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(named), "{text}");
    }
    // A body that is not JSON fails before any handler and still gets the shape.
    let response = reqwest::blocking::Client::new()
        .post(format!("{base}/v1/messages"))
        .header("content-type", "application/json")
        .body("{")
        .send()
        .expect("sent");
    assert_eq!(response.status().as_u16(), 400);
    let error = json_of(&response.text().expect("a body"));
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    // OpenAI's routes keep theirs.
    let (_, text) = post(base, "/v1/chat/completions", &[], &json!({"model": MODEL}));
    assert!(json_of(&text)["error"]["message"].is_string(), "{text}");
}

#[test]
fn an_x_api_key_header_is_checked_like_a_bearer_key() {
    let config = ApiConfig {
        api_keys: ApiKeys::new(["sk-anthropic"]).expect("a valid key"),
        ..ApiConfig::default()
    };
    let base = format!("http://{}", spawn_server(server().engine.clone(), config));
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let path = "/v1/messages/count_tokens";
    let (status, text) = post(&base, path, &[("x-api-key", "sk-anthropic")], &body);
    assert_eq!(status, 200, "{text}");
    assert!(
        json_of(&text)["input_tokens"]
            .as_u64()
            .is_some_and(|n| n > 0),
        "{text}"
    );
    let (status, _) = post(
        &base,
        path,
        &[("authorization", "Bearer sk-anthropic")],
        &body,
    );
    assert_eq!(status, 200);
    for headers in [&[("x-api-key", "sk-wrong")][..], &[]] {
        let (status, text) = post(&base, path, headers, &body);
        assert_eq!(status, 401, "{text}");
        assert_eq!(
            json_of(&text)["error"]["type"],
            "authentication_error",
            "{text}"
        );
    }
    // The same header opens the OpenAI routes too.
    let models = reqwest::blocking::Client::new()
        .get(format!("{base}/v1/models"))
        .header("x-api-key", "sk-anthropic")
        .send()
        .expect("sent");
    assert_eq!(models.status().as_u16(), 200);
}

#[test]
fn a_thinking_models_reasoning_is_a_thinking_block_unless_thinking_is_disabled() {
    let base = super::tools::server();
    // A constrained answer of a thinking model starts after its reasoning block, which the
    // prompt opens: the random model then reasons until `max_tokens`.
    let mut body = hello(6);
    body["output_config"] =
        json!({"format": {"type": "json_schema", "schema": {"type": "object"}}});
    let (status, text) = post(base, "/v1/messages", &[], &body);
    assert_eq!(status, 200, "{text}");
    let message = json_of(&text);
    assert_eq!(message["content"][0]["type"], "thinking", "{message}");
    assert!(
        message["content"][0]["thinking"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{message}"
    );
    body["thinking"] = json!({"type": "disabled"});
    let (status, text) = post(base, "/v1/messages", &[], &body);
    assert_eq!(status, 200, "{text}");
    let message = json_of(&text);
    let kinds: Vec<&Value> = message["content"]
        .as_array()
        .expect("content")
        .iter()
        .map(|b| &b["type"])
        .collect();
    assert!(kinds.iter().all(|k| *k != "thinking"), "{message}");
}
