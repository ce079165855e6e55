//! One streaming request to an OpenAI-compatible server, timed chunk by chunk into a record.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;
use serde_json::Value;

/// What one request measured. Times are seconds; `start_s` is from the start of the run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RequestRecord {
    pub index: usize,
    /// The `priority` the request sent, if it sent one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<i64>,
    pub success: bool,
    pub error: Option<String>,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub start_s: f64,
    /// Time to the first chunk that carries text.
    pub ttft_s: f64,
    pub e2e_s: f64,
    /// Gaps between consecutive chunks that carry text.
    pub itl_s: Vec<f64>,
}

impl RequestRecord {
    /// Time per output token after the first; `None` with fewer than two output tokens.
    pub fn tpot_s(&self) -> Option<f64> {
        (self.output_tokens > 1)
            .then(|| (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) as f64)
    }
}

/// Why one request failed. The record keeps the message, so failures land in the summary
/// instead of stopping the run.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("cannot reach {url}: {cause}")]
    Unreachable { url: String, cause: String },
    #[error("HTTP {status}: {message}")]
    Status { status: u16, message: String },
    #[error("the stream broke: {0}")]
    Broken(String),
    #[error("a chunk is not JSON ({cause}): {data}")]
    NotJson { cause: String, data: String },
    #[error("error event: {0}")]
    ErrorEvent(String),
    #[error("the stream ended without [DONE]")]
    NoDone,
    #[error("the response carried no text")]
    NoText,
    #[error("timed out: no complete response within {} s (--request-timeout)", .0.as_secs_f64())]
    Timeout(Duration),
}

/// Where a request goes and what it sends.
pub struct RequestSpec<'a> {
    pub index: usize,
    pub priority: Option<i64>,
    pub url: &'a str,
    pub body: &'a Value,
    /// The instant the run started, for `start_s`.
    pub run_start: Instant,
    /// The longest the whole request (connect, headers and the full stream) may take.
    pub timeout: Duration,
}

/// What the stream has shown so far.
struct Progress {
    sent: Instant,
    first_text: Option<Instant>,
    last_text: Option<Instant>,
    itl_s: Vec<f64>,
    num_text_chunks: u64,
    usage: Option<(u64, u64)>,
}

impl Progress {
    fn on_text(&mut self, now: Instant) {
        if let Some(last) = self.last_text {
            self.itl_s.push((now - last).as_secs_f64());
        }
        self.first_text.get_or_insert(now);
        self.last_text = Some(now);
        self.num_text_chunks += 1;
    }

    /// Reads one `data:` payload; `Ok(true)` at `[DONE]`.
    fn on_data(&mut self, data: &str, now: Instant) -> Result<bool, RequestError> {
        if data == "[DONE]" {
            return Ok(true);
        }
        let chunk: Value = serde_json::from_str(data).map_err(|e| RequestError::NotJson {
            cause: e.to_string(),
            data: data.to_string(),
        })?;
        if let Some(error) = chunk.get("error") {
            return Err(RequestError::ErrorEvent(error_message(error)));
        }
        if chunk_text(&chunk).is_some_and(|t| !t.is_empty()) {
            self.on_text(now);
        }
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            let field = |name: &str| usage.get(name).and_then(Value::as_u64).unwrap_or(0);
            self.usage = Some((field("prompt_tokens"), field("completion_tokens")));
        }
        Ok(false)
    }
}

/// The text of a completions chunk (`choices[0].text`) or a chat chunk (`choices[0].delta.content`).
fn chunk_text(chunk: &Value) -> Option<&str> {
    let choice = chunk.get("choices")?.get(0)?;
    choice
        .get("text")
        .or_else(|| choice.get("delta")?.get("content"))
        .and_then(Value::as_str)
}

fn error_message(error: &Value) -> String {
    error
        .get("message")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| error.to_string())
}

/// Sends one request and follows its event stream; every failure, a timeout included, ends up
/// in the record.
pub async fn send(client: &reqwest::Client, spec: RequestSpec<'_>) -> RequestRecord {
    let sent = Instant::now();
    let mut record = RequestRecord {
        index: spec.index,
        priority: spec.priority,
        start_s: (sent - spec.run_start).as_secs_f64(),
        ..Default::default()
    };
    let mut progress = Progress {
        sent,
        first_text: None,
        last_text: None,
        itl_s: Vec::new(),
        num_text_chunks: 0,
        usage: None,
    };
    // The deadline wraps the whole exchange, not just the connection: a server that accepts and
    // then never answers, or stalls mid-stream, must still end as a failed request.
    let outcome = tokio::time::timeout(spec.timeout, stream(client, &spec, &mut progress))
        .await
        .unwrap_or(Err(RequestError::Timeout(spec.timeout)))
        .and_then(|()| finish(&mut record, progress));
    if let Err(error) = outcome {
        record.error = Some(error.to_string());
    }
    record
}

async fn stream(
    client: &reqwest::Client,
    spec: &RequestSpec<'_>,
    progress: &mut Progress,
) -> Result<(), RequestError> {
    let response = client
        .post(spec.url)
        .json(spec.body)
        .send()
        .await
        .map_err(|e| RequestError::Unreachable {
            url: spec.url.to_string(),
            cause: error_chain(&e),
        })?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v.get("error").map(error_message))
            .unwrap_or(body);
        return Err(RequestError::Status {
            status: status.as_u16(),
            message,
        });
    }
    let mut body = response.bytes_stream();
    let mut buffer = Vec::new();
    while let Some(bytes) = body.next().await {
        let bytes = bytes.map_err(|e| RequestError::Broken(error_chain(&e)))?;
        let now = Instant::now();
        buffer.extend_from_slice(&bytes);
        while let Some(end) = buffer.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim_end().strip_prefix("data:") else {
                continue;
            };
            if progress.on_data(data.trim_start(), now)? {
                return Ok(());
            }
        }
    }
    Err(RequestError::NoDone)
}

fn finish(record: &mut RequestRecord, progress: Progress) -> Result<(), RequestError> {
    let now = Instant::now();
    let first = progress.first_text.ok_or(RequestError::NoText)?;
    let (prompt_tokens, output_tokens) = progress.usage.unwrap_or((0, progress.num_text_chunks));
    record.success = true;
    record.prompt_tokens = prompt_tokens;
    record.output_tokens = output_tokens;
    record.ttft_s = (first - progress.sent).as_secs_f64();
    record.e2e_s = (now - progress.sent).as_secs_f64();
    record.itl_s = progress.itl_s;
    Ok(())
}

/// reqwest's top-level message hides the cause ("error sending request"); the chain names it.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress() -> Progress {
        Progress {
            sent: Instant::now(),
            first_text: None,
            last_text: None,
            itl_s: Vec::new(),
            num_text_chunks: 0,
            usage: None,
        }
    }

    #[test]
    fn chunks_are_read_by_shape() {
        let cases: &[(&str, Result<bool, ()>, u64)] = &[
            (r#"{"choices":[{"index":0,"text":"hi"}]}"#, Ok(false), 1),
            (
                r#"{"choices":[{"index":0,"delta":{"content":"hi"}}]}"#,
                Ok(false),
                1,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#,
                Ok(false),
                0,
            ),
            (r#"{"choices":[{"index":0,"text":""}]}"#, Ok(false), 0),
            ("[DONE]", Ok(true), 0),
            (r#"{"error":{"message":"boom"}}"#, Err(()), 0),
            ("not json", Err(()), 0),
        ];
        for (data, expected, num_text) in cases {
            let mut p = progress();
            let got = p.on_data(data, Instant::now()).map_err(|_| ());
            assert_eq!(&got, expected, "{data}");
            assert_eq!(p.num_text_chunks, *num_text, "{data}");
        }
    }

    #[test]
    fn usage_chunks_give_the_token_counts() {
        let mut p = progress();
        let data = r#"{"choices":[],"usage":{"prompt_tokens":16,"completion_tokens":8}}"#;
        assert!(matches!(p.on_data(data, Instant::now()), Ok(false)));
        assert_eq!(p.usage, Some((16, 8)));
    }

    #[test]
    fn time_per_output_token_excludes_the_first_token() {
        let record = RequestRecord {
            output_tokens: 5,
            ttft_s: 0.2,
            e2e_s: 1.0,
            ..Default::default()
        };
        assert!((record.tpot_s().unwrap() - 0.2).abs() < 1e-9);
        let single = RequestRecord {
            output_tokens: 1,
            ..record
        };
        assert_eq!(single.tpot_s(), None);
    }
}
