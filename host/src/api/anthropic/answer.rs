//! A Messages answer as Anthropic shows it: content blocks (`thinking`, `text`, `tool_use`), the stop reason and usage, whole or as the stream of `message_start` … `message_stop` events.

use axum::http::StatusCode;
use axum::response::sse::Event;
use serde::Serialize;
use serde_json::{Value, json};

use crate::api::chat_output::{ChoiceDelta, ChoiceReader};
use crate::api::error::{ApiError, ErrorResponse};
use crate::api::named_stream::{NamedEvents, named};
use crate::api::openai::Usage;
use crate::api::submit::ChoiceOutput;
use crate::engine::FinishReason;
use crate::model::Tokenizer;

/// What the answer knows before its first token.
pub struct MessageStart {
    pub id: String,
    pub model: String,
    pub input_tokens: u64,
    pub tokenizer: Tokenizer,
    pub stop_sequences: Vec<String>,
}

/// Anthropic's error envelope; its `type` follows the status.
#[derive(Debug, Clone, Serialize)]
pub struct AnthropicError {
    #[serde(rename = "type")]
    kind: &'static str,
    error: AnthropicErrorBody,
}

#[derive(Debug, Clone, Serialize)]
struct AnthropicErrorBody {
    #[serde(rename = "type")]
    kind: &'static str,
    message: String,
}

pub fn error_body(status: StatusCode, message: String) -> AnthropicError {
    let kind = match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500.. => "api_error",
        _ => "invalid_request_error",
    };
    AnthropicError {
        kind: "error",
        error: AnthropicErrorBody { kind, message },
    }
}

#[derive(Debug, Clone, Serialize)]
struct MessageUsage {
    input_tokens: u64,
    output_tokens: u64,
    cache_creation_input_tokens: u64,
    cache_read_input_tokens: u64,
}

/// Anthropic counts prompt tokens read from the cache apart from the others.
fn message_usage(usage: &Usage) -> MessageUsage {
    let cached = usage.prompt_tokens_details.cached_tokens;
    MessageUsage {
        input_tokens: usage.prompt_tokens - cached.min(usage.prompt_tokens),
        output_tokens: usage.completion_tokens,
        cache_creation_input_tokens: 0,
        cache_read_input_tokens: cached,
    }
}

/// A whole answer.
#[derive(Debug, Clone, Serialize)]
pub struct Message {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: String,
    content: Vec<Value>,
    stop_reason: Option<&'static str>,
    stop_sequence: Option<String>,
    usage: MessageUsage,
}

impl Message {
    pub fn whole(
        start: MessageStart,
        reader: ChoiceReader,
        output: ChoiceOutput,
        usage: Usage,
    ) -> Message {
        let read = reader.read_whole(&output.text);
        let made_calls = !read.calls.is_empty();
        let mut content = Vec::new();
        if !read.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": read.reasoning, "signature": ""}));
        }
        if !read.content.is_empty() {
            content.push(json!({"type": "text", "text": read.content}));
        }
        for (_, call) in read.calls {
            content.push(json!({
                "type": "tool_use", "id": call.id, "name": call.name, "input": input_of(&call.arguments),
            }));
        }
        let (stop_reason, stop_sequence) = stop_reason(
            &start,
            output.finish_reason,
            made_calls,
            &output.token_ids,
            &output.text,
        );
        Message {
            id: start.id,
            kind: "message",
            role: "assistant",
            model: start.model,
            content,
            stop_reason,
            stop_sequence,
            usage: message_usage(&usage),
        }
    }
}

/// A call's arguments as the `input` object; the parser only passes JSON, and a call whose
/// arguments are not an object gets them under `arguments`.
fn input_of(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(object @ Value::Object(_)) => object,
        Ok(other) => json!({ "arguments": other }),
        Err(_) => json!({ "arguments": arguments }),
    }
}

/// Anthropic's stop reason, and the stop sequence that ended the answer if one did.
fn stop_reason(
    start: &MessageStart,
    reason: FinishReason,
    made_calls: bool,
    token_ids: &[u32],
    text: &str,
) -> (Option<&'static str>, Option<String>) {
    match reason {
        FinishReason::Stop if made_calls => (Some("tool_use"), None),
        FinishReason::Stop => match matched_stop(start, token_ids, text) {
            Some(stop) => (Some("stop_sequence"), Some(stop)),
            None => (Some("end_turn"), None),
        },
        FinishReason::GrammarDeadEnd => (Some("end_turn"), None),
        FinishReason::Length => (Some("max_tokens"), None),
        FinishReason::Abort => (None, None),
    }
}

/// Which stop sequence ended the text, if any: the engine leaves a stop string out of the text,
/// so it is the first one found in the text of all the tokens past what was sent.
fn matched_stop(start: &MessageStart, token_ids: &[u32], text: &str) -> Option<String> {
    if start.stop_sequences.is_empty() {
        return None;
    }
    let full = start.tokenizer.decode(token_ids, true).ok()?;
    // The text the client got is a prefix of the tokens' text; the engine stops at a stop
    // string's first occurrence, so none occurs inside that prefix.
    let rest = full.get(text.len()..).unwrap_or(&full);
    start
        .stop_sequences
        .iter()
        .filter_map(|stop| rest.find(stop.as_str()).map(|at| (at, stop)))
        .min_by_key(|(at, _)| *at)
        .map(|(_, stop)| stop.clone())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Thinking,
    Text,
}

/// The streamed answer: one content block open at a time, numbered in order.
pub struct MessageEvents {
    start: MessageStart,
    reader: ChoiceReader,
    open: Option<BlockKind>,
    next_index: usize,
    text: String,
    token_ids: Vec<u32>,
}

impl MessageEvents {
    pub fn new(start: MessageStart, reader: ChoiceReader) -> MessageEvents {
        MessageEvents {
            start,
            reader,
            open: None,
            next_index: 0,
            text: String::new(),
            token_ids: Vec::new(),
        }
    }

    fn close(&mut self, events: &mut Vec<Event>) {
        if self.open.take().is_some() {
            let index = self.next_index - 1;
            events.push(named(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    fn start_block(&mut self, block: Value, events: &mut Vec<Event>) -> usize {
        self.close(events);
        let index = self.next_index;
        self.next_index += 1;
        events.push(named(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    fn block_delta(&mut self, kind: BlockKind, delta: Value, events: &mut Vec<Event>) {
        if self.open != Some(kind) {
            let block = match kind {
                BlockKind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                BlockKind::Text => json!({"type": "text", "text": ""}),
            };
            self.start_block(block, events);
            self.open = Some(kind);
        }
        let index = self.next_index - 1;
        events.push(named(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
    }

    fn blocks(&mut self, read: ChoiceDelta) -> Vec<Event> {
        let mut events = Vec::new();
        if !read.reasoning.is_empty() {
            let delta = json!({"type": "thinking_delta", "thinking": read.reasoning});
            self.block_delta(BlockKind::Thinking, delta, &mut events);
        }
        if !read.content.is_empty() {
            let delta = json!({"type": "text_delta", "text": read.content});
            self.block_delta(BlockKind::Text, delta, &mut events);
        }
        for (_, call) in read.calls {
            let block = json!({"type": "tool_use", "id": call.id, "name": call.name, "input": {}});
            let index = self.start_block(block, &mut events);
            let delta = json!({"type": "input_json_delta", "partial_json": call.arguments});
            events.push(named(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": index, "delta": delta}),
            ));
            events.push(named(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            ));
        }
        events
    }
}

impl NamedEvents for MessageEvents {
    fn opening(&mut self) -> Vec<Event> {
        let message = json!({
            "id": self.start.id, "type": "message", "role": "assistant", "model": self.start.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.start.input_tokens, "output_tokens": 0},
        });
        vec![
            named(
                "message_start",
                &json!({"type": "message_start", "message": message}),
            ),
            named("ping", &json!({"type": "ping"})),
        ]
    }

    fn delta(&mut self, text: &str, token_ids: &[u32]) -> Vec<Event> {
        self.text.push_str(text);
        self.token_ids.extend_from_slice(token_ids);
        let read = self.reader.push(text);
        self.blocks(read)
    }

    fn finish(&mut self, reason: FinishReason, usage: Usage) -> Vec<Event> {
        let rest = self.reader.finish();
        let mut events = self.blocks(rest);
        self.close(&mut events);
        let made_calls = self.reader.made_calls();
        let (stop_reason, stop_sequence) =
            stop_reason(&self.start, reason, made_calls, &self.token_ids, &self.text);
        let delta = json!({
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": message_usage(&usage),
        });
        events.push(named("message_delta", &delta));
        events.push(named("message_stop", &json!({"type": "message_stop"})));
        events
    }

    fn failure(&mut self, error: ApiError) -> Vec<Event> {
        let (status, axum::Json(body)): (StatusCode, axum::Json<ErrorResponse>) = error.into();
        vec![named("error", &error_body(status, body.error.message))]
    }
}
