//! Hot deployments seen from outside: the deployment file, the admin endpoints, the metrics, and greedy streams that record what they received.

use std::path::Path;

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::Value;

/// Replaces `path`'s content in one step, as editors and config tools do.
pub fn write_file(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write the deployment");
    std::fs::rename(&tmp, path).expect("replace the deployment");
}

/// A deployment file's text naming `component` in the `[sampler]` slot.
pub fn sampler_deployment(component: &Path, config: &str) -> String {
    format!(
        "[sampler]\ncomponent = {:?}\nconfig = {config}\n",
        component.display().to_string()
    )
}

/// `POST /admin/reload` with the admin key: the status and the JSON body.
pub async fn reload(client: &reqwest::Client, base: &str, key: &str) -> (StatusCode, Value) {
    let response = client
        .post(format!("{base}/admin/reload"))
        .bearer_auth(key)
        .send()
        .await
        .expect("reload sent");
    let status = response.status();
    (status, response.json().await.expect("a JSON body"))
}

/// `GET /admin/deployment` with the admin key.
pub async fn deployment_status(client: &reqwest::Client, base: &str, key: &str) -> Value {
    let response = client
        .get(format!("{base}/admin/deployment"))
        .bearer_auth(key)
        .send()
        .await
        .expect("listing sent");
    assert_eq!(response.status(), StatusCode::OK);
    response.json().await.expect("a JSON listing")
}

pub async fn metrics(client: &reqwest::Client, base: &str) -> String {
    client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text")
}

/// The value of the series whose line starts with `series` (name and labels).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// The listing's component in `slot`.
pub fn component<'a>(listing: &'a Value, slot: &str) -> &'a Value {
    listing["components"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["slot"] == slot))
        .unwrap_or_else(|| panic!("no {slot} in {listing}"))
}

/// What one streamed completion delivered.
#[derive(Debug, Default)]
pub struct Streamed {
    /// The tokens, as the `logprobs.tokens` of the chunks list them.
    pub tokens: Vec<String>,
    /// The first token's alternatives, most likely first.
    pub first_choices: Vec<String>,
    pub finish_reason: Option<String>,
    /// An `error` event's body, if one came.
    pub error: Option<Value>,
    pub done: bool,
}

/// Streams the completion `body` (which asks for `stream` and `logprobs`); adds a permit to
/// `started` once the first token has arrived.
pub async fn stream(
    client: reqwest::Client,
    base: String,
    body: Value,
    started: std::sync::Arc<tokio::sync::Semaphore>,
) -> Streamed {
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("stream sent");
    assert_eq!(response.status(), StatusCode::OK);
    let mut chunks = response.bytes_stream();
    let mut pending = String::new();
    let mut streamed = Streamed::default();
    while let Some(chunk) = chunks.next().await {
        pending.push_str(&String::from_utf8_lossy(&chunk.expect("stream chunk")));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                streamed.done = true;
                continue;
            }
            let value: Value = serde_json::from_str(data).expect("an SSE JSON chunk");
            if value.get("error").is_some() {
                streamed.error = Some(value);
                continue;
            }
            let choice = &value["choices"][0];
            if let Some(reason) = choice["finish_reason"].as_str() {
                streamed.finish_reason = Some(reason.to_string());
            }
            let logprobs = &choice["logprobs"];
            let first = streamed.tokens.is_empty();
            for token in logprobs["tokens"].as_array().into_iter().flatten() {
                streamed
                    .tokens
                    .push(token.as_str().expect("a token").to_string());
            }
            if first && !streamed.tokens.is_empty() {
                if let Some(top) = logprobs["top_logprobs"][0].as_object() {
                    let mut choices: Vec<(&String, f64)> = top
                        .iter()
                        .map(|(t, l)| (t, l.as_f64().unwrap_or(f64::NEG_INFINITY)))
                        .collect();
                    choices.sort_by(|a, b| b.1.total_cmp(&a.1));
                    streamed.first_choices = choices.into_iter().map(|(t, _)| t.clone()).collect();
                }
                started.add_permits(1);
            }
        }
    }
    streamed
}
