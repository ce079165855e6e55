//! Real responses of every OpenAI route, streaming and not, with and without logprobs, tools and `n > 1`, and the error bodies, validated against the schemas of OpenAI's OpenAPI description (copied by `tests/reference/openai_schemas.py` from a pinned commit).
//!
//! The deviations the schemas cannot express are patched in a copy before validation, each
//! in [`deviations`] with its reason, and listed in the README.

use std::sync::OnceLock;

use reqwest::blocking::Client;
use serde_json::{Value, json};

use crate::common::api::{MODEL, server, sse_data};

fn schemas() -> &'static Value {
    static SCHEMAS: OnceLock<Value> = OnceLock::new();
    SCHEMAS.get_or_init(|| {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/openai-schemas/schemas.json");
        let text = std::fs::read_to_string(&path).expect("the copied schemas");
        serde_json::from_str(&text).expect("JSON")
    })
}

/// A validator of the spec's schema `root`, resolving references within the copy.
fn validator(root: &str) -> jsonschema::Validator {
    let schema = json!({
        "$ref": format!("#/components/schemas/{root}"),
        "components": schemas()["components"],
    });
    jsonschema::validator_for(&schema).unwrap_or_else(|e| panic!("{root} compiles: {e}"))
}

/// Fails with the first errors when `instance` does not match `root`.
fn assert_matches(root: &str, instance: &Value) {
    let validator = validator(root);
    let errors: Vec<String> = validator
        .iter_errors(instance)
        .take(5)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{instance} does not match {root}:\n{}",
        errors.join("\n")
    );
}

/// The schema of one Responses stream event: the member of `ResponseStreamEvent` whose
/// `type` is `kind`, so a mismatch is reported field by field rather than as "none of".
fn event_schema(kind: &str) -> String {
    let all = &schemas()["components"]["schemas"];
    let members = all["ResponseStreamEvent"]["anyOf"]
        .as_array()
        .expect("ResponseStreamEvent lists its events");
    members
        .iter()
        .filter_map(|m| m["$ref"].as_str()?.strip_prefix("#/components/schemas/"))
        .find(|name| all[*name]["properties"]["type"]["enum"][0] == kind)
        .unwrap_or_else(|| panic!("the spec has no stream event `{kind}`"))
        .to_string()
}

mod deviations {
    use serde_json::Value;

    /// A streamed completion chunk's `finish_reason` is `null` until the choice's last chunk,
    /// as OpenAI sends it, while `CreateCompletionResponse`, which the spec gives for chunks
    /// too, allows no `null`; and the usage chunk has no choices at all.
    pub fn completion_chunk(mut chunk: Value) -> Value {
        for choice in chunk["choices"].as_array_mut().into_iter().flatten() {
            if choice["finish_reason"].is_null() {
                choice["finish_reason"] = "stop".into();
            }
        }
        chunk
    }

    /// An echoed prompt's first token has no logprob: its `token_logprobs` and `top_logprobs`
    /// entries are `null` (as OpenAI's legacy completions and vLLM send them), which the
    /// spec's lists of numbers and objects do not allow.
    pub fn echoed_prompt(mut response: Value) -> Value {
        for choice in response["choices"].as_array_mut().into_iter().flatten() {
            let Some(logprobs) = choice["logprobs"].as_object_mut() else {
                continue;
            };
            for (list, filler) in [
                ("token_logprobs", 0.0.into()),
                ("top_logprobs", Value::Object(Default::default())),
            ] {
                let entries = logprobs.get_mut(list).and_then(Value::as_array_mut);
                for entry in entries.into_iter().flatten() {
                    if entry.is_null() {
                        *entry = filler.clone();
                    }
                }
            }
        }
        response
    }
}

fn post(path: &str, body: &Value) -> (u16, String) {
    post_to(&server().base, path, body)
}

fn post_to(base: &str, path: &str, body: &Value) -> (u16, String) {
    let response = Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .expect("sent");
    let status = response.status().as_u16();
    (status, response.text().expect("a body"))
}

fn json_ok(path: &str, body: &Value) -> Value {
    let (status, text) = post(path, body);
    assert_eq!(status, 200, "{body} → {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn stream(path: &str, body: &Value) -> Vec<Value> {
    let (status, text) = post(path, body);
    assert_eq!(status, 200, "{body} → {text}");
    sse_data(&text)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{d}: {e}")))
        .collect()
}

fn with(mut body: Value, extra: Value) -> Value {
    for (key, value) in extra.as_object().expect("an object") {
        body[key] = value.clone();
    }
    body
}

#[test]
fn models_completions_and_their_chunks_match_the_schema() {
    let models = Client::new()
        .get(format!("{}/v1/models", server().base))
        .send()
        .expect("sent")
        .json::<Value>()
        .expect("JSON");
    assert_matches("ListModelsResponse", &models);
    let body = json!({"model": MODEL, "prompt": ["Once upon", "a time"], "max_tokens": 4});
    for extra in [json!({}), json!({"n": 2, "logprobs": 2})] {
        let body = with(body.clone(), extra);
        assert_matches(
            "CreateCompletionResponse",
            &json_ok("/v1/completions", &body),
        );
        let streamed = with(
            body,
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        );
        let chunks = stream("/v1/completions", &streamed);
        let (usage, chunks) = chunks.split_last().expect("chunks");
        for chunk in chunks {
            assert_matches(
                "CreateCompletionResponse",
                &deviations::completion_chunk(chunk.clone()),
            );
        }
        assert!(usage["usage"].is_object(), "{usage}");
        assert_matches("CreateCompletionResponse", usage);
    }
}

#[test]
fn echoed_completions_and_prompt_logprobs_match_the_schema() {
    let body = json!({"model": MODEL, "prompt": ["Once upon", "a time"], "max_tokens": 3,
        "echo": true, "logprobs": 2, "n": 2});
    let patched = |v: Value| deviations::echoed_prompt(deviations::completion_chunk(v));
    assert_matches(
        "CreateCompletionResponse",
        &patched(json_ok("/v1/completions", &body)),
    );
    let scored = with(body.clone(), json!({"max_tokens": 0, "prompt_logprobs": 2}));
    assert_matches(
        "CreateCompletionResponse",
        &patched(json_ok("/v1/completions", &scored)),
    );
    let streamed = with(body, json!({"stream": true}));
    for chunk in stream("/v1/completions", &streamed) {
        assert_matches("CreateCompletionResponse", &patched(chunk));
    }
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2, "prompt_logprobs": 1, "logprobs": true});
    assert_matches(
        "CreateChatCompletionResponse",
        &json_ok("/v1/chat/completions", &chat),
    );
}

#[test]
fn chat_responses_and_chunks_match_the_schema() {
    let body =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let tool = json!([{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]);
    for extra in [
        json!({}),
        json!({"n": 2, "logprobs": true, "top_logprobs": 2}),
        json!({"tools": tool, "tool_choice": "required", "max_tokens": 120}),
    ] {
        let body = with(body.clone(), extra);
        let whole = json_ok("/v1/chat/completions", &body);
        assert_matches("CreateChatCompletionResponse", &whole);
        let streamed = with(
            body,
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        );
        for chunk in stream("/v1/chat/completions", &streamed) {
            assert_matches("CreateChatCompletionStreamResponse", &chunk);
        }
    }
}

#[test]
fn error_bodies_match_the_schema() {
    let cases = [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [], "temperature": 9}),
        ),
        (
            "/v1/completions",
            json!({"model": "no-such-model", "prompt": "x"}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "echo": true, "max_tokens": -1}),
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "input": "x", "background": true}),
        ),
    ];
    for (path, body) in cases {
        let (status, text) = post(path, &body);
        assert!(status >= 400, "{body} → {text}");
        assert_matches("ErrorResponse", &serde_json::from_str(&text).expect("JSON"));
    }
    let missing = Client::new()
        .get(format!("{}/v1/responses/resp_missing", server().base))
        .send()
        .expect("sent");
    assert_eq!(missing.status().as_u16(), 404);
    assert_matches("ErrorResponse", &missing.json().expect("JSON"));
}

#[test]
fn responses_and_their_events_match_the_schema() {
    let body =
        json!({"model": MODEL, "input": "Hi", "instructions": "Be terse.", "max_output_tokens": 4});
    let tools = json!([{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}, "strict": true}]);
    let city = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": false});
    for extra in [
        json!({}),
        json!({"tools": tools, "tool_choice": "required", "max_output_tokens": 120}),
        json!({"text": {"format": {"type": "json_schema", "name": "city", "schema": city}}, "max_output_tokens": 60}),
        json!({"metadata": {"run": "schemas"}, "user": "tester", "temperature": 0.5, "top_p": 0.9}),
    ] {
        let body = with(body.clone(), extra);
        let whole = json_ok("/v1/responses", &body);
        assert_matches("Response", &whole);
        let id = whole["id"].as_str().expect("an id");
        let stored = Client::new()
            .get(format!("{}/v1/responses/{id}", server().base))
            .send()
            .expect("sent")
            .json::<Value>()
            .expect("JSON");
        assert_matches("Response", &stored);
        let events = stream("/v1/responses", &with(body, json!({"stream": true})));
        assert!(events.len() >= 3, "{events:?}");
        for event in events {
            let kind = event["type"].as_str().expect("a type");
            assert_matches(&event_schema(kind), &event);
            assert_matches("ResponseStreamEvent", &event);
        }
    }
}

#[test]
fn reasoning_items_and_their_events_match_the_schema() {
    // A constrained answer of the thinking model starts after its reasoning block, which the
    // prompt opens: the random model reasons greedily until `max_output_tokens`. Sampled, it
    // may end its reasoning (or the answer) at once, and the test would depend on the draw.
    let body = json!({"model": MODEL, "input": "Hi", "max_output_tokens": 5, "temperature": 0,
        "text": {"format": {"type": "json_object"}}});
    let base = super::tools::server();
    let (status, text) = post_to(base, "/v1/responses", &body);
    assert_eq!(status, 200, "{text}");
    let whole: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(whole["output"][0]["type"], "reasoning", "{whole}");
    assert_matches("Response", &whole);
    let (status, text) = post_to(base, "/v1/responses", &with(body, json!({"stream": true})));
    assert_eq!(status, 200, "{text}");
    let events: Vec<Value> = sse_data(&text)
        .iter()
        .map(|d| serde_json::from_str(d).expect("JSON"))
        .collect();
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "response.reasoning_text.delta"),
        "{events:?}"
    );
    for event in events {
        let kind = event["type"].as_str().expect("a type");
        assert_matches(&event_schema(kind), &event);
    }
}
