//! OpenAI's Responses API against real servers: the official openai client and the Agents SDK (plain, streamed, stored, continued, a forced function call, structured output), stored responses visible only to the key that made them under random ids, and fields it cannot honour refused naming them.

use plughost::api::{ApiConfig, ApiKeys};
use serde_json::{Value, json};

use crate::common::api::{MODEL, run_client_check, server, spawn_server};

fn send(
    method: reqwest::Method,
    url: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> (u16, Value) {
    let mut request = reqwest::blocking::Client::new().request(method, url);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    if let Some(body) = body {
        request = request.json(body);
    }
    let response = request.send().expect("sent");
    let status = response.status().as_u16();
    let text = response.text().expect("a body");
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}")),
    )
}

#[test]
fn the_openai_client_and_the_agents_sdk_work_unchanged() {
    run_client_check("responses_client_check.py", &server().base);
}

#[test]
fn a_stored_response_answers_only_the_key_that_made_it_under_a_random_id() {
    let config = ApiConfig {
        api_keys: ApiKeys::new(["sk-alice", "sk-bob"]).expect("valid keys"),
        ..ApiConfig::default()
    };
    let base = format!("http://{}", spawn_server(server().engine.clone(), config));
    let url = format!("{base}/v1/responses");
    let body = json!({"model": MODEL, "input": "Hello", "max_output_tokens": 2});
    let mut ids = Vec::new();
    for _ in 0..2 {
        let response = reqwest::blocking::Client::new()
            .post(&url)
            .bearer_auth("sk-alice")
            .header("x-request-id", "same-id")
            .json(&body)
            .send()
            .expect("sent");
        assert_eq!(response.status().as_u16(), 200);
        let created: Value = response.json().expect("JSON");
        ids.push(created["id"].as_str().expect("an id").to_string());
    }
    assert_ne!(ids[0], ids[1]);
    assert!(
        ids.iter()
            .all(|id| id.starts_with("resp_") && !id.contains("same-id")),
        "{ids:?}"
    );
    let one = format!("{url}/{}", ids[0]);
    let (status, got) = send(reqwest::Method::GET, &one, Some("sk-alice"), None);
    assert_eq!(
        (status, got["id"].as_str()),
        (200, Some(ids[0].as_str())),
        "{got}"
    );
    for (method, key) in [
        (reqwest::Method::GET, "sk-bob"),
        (reqwest::Method::DELETE, "sk-bob"),
    ] {
        let (status, error) = send(method, &one, Some(key), None);
        assert_eq!(status, 404, "{error}");
        assert_eq!(error["error"]["code"], "not_found", "{error}");
    }
    let follow = json!({"model": MODEL, "input": "Hi", "max_output_tokens": 1, "previous_response_id": ids[0]});
    let (status, error) = send(reqwest::Method::POST, &url, Some("sk-bob"), Some(&follow));
    assert_eq!(
        (status, error["error"]["param"].as_str()),
        (404, Some("previous_response_id")),
        "{error}"
    );
    let (status, deleted) = send(reqwest::Method::DELETE, &one, Some("sk-alice"), None);
    assert_eq!(
        (status, &deleted["deleted"]),
        (200, &json!(true)),
        "{deleted}"
    );
    let (status, _) = send(reqwest::Method::GET, &one, Some("sk-alice"), None);
    assert_eq!(status, 404);
}

#[test]
fn fields_it_cannot_honour_are_refused_naming_them() {
    let url = format!("{}/v1/responses", server().base);
    let base = json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2});
    let cases = [
        (json!({"background": true}), "background"),
        (
            json!({"include": ["reasoning.encrypted_content"]}),
            "include",
        ),
        (
            json!({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}),
            "tools[0].type",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0].type",
        ),
        (
            json!({"input": [{"type": "item_reference", "id": "x"}]}),
            "input[0].type",
        ),
        (json!({"reasoning": {"effort": "high"}}), "reasoning"),
        (json!({"truncation": "auto"}), "truncation"),
        (
            json!({"text": {"format": {"type": "yaml"}}}),
            "text.format.type",
        ),
        (json!({"max_output_tokens": 100000}), "max_output_tokens"),
        (json!({"temperature": 7}), "temperature"),
        (json!({"input": null}), "input"),
    ];
    for (extra, param) in cases {
        let mut body = base.clone();
        for (key, value) in extra.as_object().expect("an object") {
            body[key] = value.clone();
        }
        let (status, error) = send(reqwest::Method::POST, &url, None, Some(&body));
        assert_eq!(status, 400, "{body} → {error}");
        let named = error["error"]["param"].as_str() == Some(param)
            || error["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(param))
            || (param == "max_output_tokens"
                && error["error"]["code"] == "context_length_exceeded");
        assert!(named, "{body} → {error}");
    }
    let (status, error) = send(
        reqwest::Method::GET,
        &format!("{url}/resp_unknown"),
        None,
        None,
    );
    assert_eq!(status, 404, "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("resp_unknown")),
        "{error}"
    );
}

#[test]
fn a_thinking_models_reasoning_is_a_reasoning_item_whole_and_streamed() {
    let url = format!("{}/v1/responses", super::tools::server());
    // A constrained answer of a thinking model starts after its reasoning block, which the
    // prompt opens: the random model then reasons until `max_output_tokens`.
    let body = json!({"model": MODEL, "input": "Hi", "max_output_tokens": 6, "temperature": 0,
        "text": {"format": {"type": "json_object"}}});
    let (status, whole) = send(reqwest::Method::POST, &url, None, Some(&body));
    assert_eq!(status, 200, "{whole}");
    let reasoning = &whole["output"][0];
    assert_eq!(reasoning["type"], "reasoning", "{whole}");
    let text = reasoning["content"][0]["text"]
        .as_str()
        .expect("reasoning text");
    assert!(!text.is_empty(), "{whole}");
    let counted = &whole["usage"]["output_tokens_details"]["reasoning_tokens"];
    assert!(counted.as_u64().is_some_and(|n| n > 0), "{whole}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let response = reqwest::blocking::Client::new()
        .post(&url)
        .json(&streamed)
        .send()
        .expect("sent");
    let events: Vec<Value> = crate::common::api::sse_data(&response.text().expect("a body"))
        .iter()
        .map(|d| serde_json::from_str(d).expect("JSON"))
        .collect();
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.reasoning_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert_eq!(deltas, text);
    let last = events.last().expect("events");
    assert_eq!(
        last["response"]["output"][0]["content"][0]["text"], text,
        "{last}"
    );
}
