//! A response's output as the Responses API shows it: `reasoning`, `message` and `function_call` items built from the generated text, the response object around them, and the typed stream events with their `sequence_number`.
//!
//! One builder serves both ways of answering: the streamed response sends the events it
//! makes as the text arrives, the whole one feeds it the whole text and keeps only the
//! final object, so both carry the same items.

use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::sse::Event;
use serde_json::{Map, Value, json};

use crate::api::auth::KeyOwner;
use crate::api::chat_output::{ChoiceDelta, ChoiceReader};
use crate::api::error::{ApiError, ErrorResponse};
use crate::api::named_stream::{NamedEvents, named};
use crate::api::openai::Usage;
use crate::api::tool_calls::random_id;
use crate::engine::FinishReason;
use crate::model::Tokenizer;

use super::store::{ResponseStore, StoredResponse};

/// Where a finished response is kept, when the request asked for `store`.
pub struct StoreTarget {
    pub store: Arc<ResponseStore>,
    pub owner: KeyOwner,
    /// The conversation so far (earlier turns and this input) as chat messages.
    pub conversation: Vec<Value>,
}

/// What the response knows before its first token.
pub struct ResponseContext {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    /// The request's fields the response object repeats.
    pub echo: Map<String, Value>,
    pub tokenizer: Tokenizer,
    pub store: Option<StoreTarget>,
}

#[derive(Debug, Clone)]
enum Item {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

impl Item {
    fn json(&self, status: &str) -> Value {
        match self {
            Item::Reasoning { id, text } => json!({
                "type": "reasoning", "id": id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}],
            }),
            Item::Message { id, text } => json!({
                "type": "message", "id": id, "status": status, "role": "assistant",
                "content": [output_text(text)],
            }),
            Item::Call {
                id,
                call_id,
                name,
                arguments,
            } => json!({
                "type": "function_call", "id": id, "call_id": call_id, "name": name,
                "arguments": arguments, "status": status,
            }),
        }
    }

    fn id(&self) -> &str {
        match self {
            Item::Reasoning { id, .. } | Item::Message { id, .. } | Item::Call { id, .. } => id,
        }
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn reasoning_text(text: &str) -> Value {
    json!({"type": "reasoning_text", "text": text})
}

/// Builds the output items of one response and the events that announce them.
pub struct ResponseBuilder {
    context: ResponseContext,
    reader: ChoiceReader,
    items: Vec<Item>,
    /// Whether the last item still takes text (a reasoning or message item).
    last_open: bool,
    sequence_number: u64,
}

impl ResponseBuilder {
    pub fn new(context: ResponseContext, reader: ChoiceReader) -> ResponseBuilder {
        ResponseBuilder {
            context,
            reader,
            items: Vec::new(),
            last_open: false,
            sequence_number: 0,
        }
    }

    fn event(&mut self, kind: &str, mut data: Value) -> Event {
        data["type"] = kind.into();
        data["sequence_number"] = self.sequence_number.into();
        self.sequence_number += 1;
        named(kind, &data)
    }

    /// The response object with the items so far.
    fn response(&self, status: &str, usage: Option<&Usage>, incomplete: Option<&str>) -> Value {
        let item_status = match status {
            "in_progress" => "in_progress",
            "incomplete" => "incomplete",
            _ => "completed",
        };
        let output: Vec<Value> = self.items.iter().map(|i| i.json(item_status)).collect();
        let mut response = self.context.echo.clone();
        response.insert("id".into(), self.context.id.clone().into());
        response.insert("object".into(), "response".into());
        response.insert("created_at".into(), self.context.created_at.into());
        response.insert("model".into(), self.context.model.clone().into());
        response.insert("status".into(), status.into());
        response.insert("error".into(), Value::Null);
        response.insert(
            "incomplete_details".into(),
            incomplete.map_or(Value::Null, |reason| json!({ "reason": reason })),
        );
        response.insert("output".into(), Value::Array(output));
        // Absent until the response ends: OpenAI's schema has no `null` usage.
        if let Some(usage) = usage {
            response.insert("usage".into(), self.usage(usage));
        }
        if status == "completed" {
            response.insert("completed_at".into(), crate::api::unix_seconds().into());
        }
        Value::Object(response)
    }

    fn usage(&self, usage: &Usage) -> Value {
        let reasoning: usize = self
            .items
            .iter()
            .filter_map(|item| match item {
                Item::Reasoning { text, .. } => self.context.tokenizer.encode(text, false).ok(),
                _ => None,
            })
            .map(|tokens| tokens.len())
            .sum();
        json!({
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage.total_tokens,
        })
    }

    /// Ends the open item, if any.
    fn close(&mut self, status: &str) -> Vec<Event> {
        if !std::mem::take(&mut self.last_open) {
            return Vec::new();
        }
        let index = self.items.len() - 1;
        let item = self.items[index].clone();
        let at = json!({"item_id": item.id(), "output_index": index, "content_index": 0});
        let (done, part) = match &item {
            Item::Reasoning { text, .. } => (
                self.event(
                    "response.reasoning_text.done",
                    with(&at, "text", text.as_str()),
                ),
                reasoning_text(text),
            ),
            Item::Message { text, .. } => {
                let mut data = with(&at, "text", text.as_str());
                data["logprobs"] = json!([]);
                (
                    self.event("response.output_text.done", data),
                    output_text(text),
                )
            }
            Item::Call { .. } => return Vec::new(),
        };
        vec![
            done,
            self.event("response.content_part.done", with(&at, "part", part)),
            self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item.json(status)}),
            ),
        ]
    }

    /// Text for a reasoning or message item: the open one if it is of that kind, else a new one.
    fn text(&mut self, reasoning: bool, delta: String, events: &mut Vec<Event>) {
        let same_kind = match self.items.last() {
            Some(Item::Reasoning { .. }) => reasoning,
            Some(Item::Message { .. }) => !reasoning,
            _ => false,
        };
        if !(self.last_open && same_kind) {
            events.extend(self.close("completed"));
            let item = match reasoning {
                true => Item::Reasoning {
                    id: random_id("rs"),
                    text: String::new(),
                },
                false => Item::Message {
                    id: random_id("msg"),
                    text: String::new(),
                },
            };
            let index = self.items.len();
            let part = if reasoning {
                reasoning_text("")
            } else {
                output_text("")
            };
            let at = json!({"item_id": item.id(), "output_index": index, "content_index": 0});
            events.push(self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": item.json("in_progress")}),
            ));
            events.push(self.event("response.content_part.added", with(&at, "part", part)));
            self.items.push(item);
            self.last_open = true;
        }
        let index = self.items.len() - 1;
        let (kind, id) = match &mut self.items[index] {
            Item::Reasoning { id, text } | Item::Message { id, text } => {
                text.push_str(&delta);
                (reasoning, id.clone())
            }
            Item::Call { .. } => return,
        };
        let at = json!({"item_id": id, "output_index": index, "content_index": 0});
        let event = match kind {
            true => self.event("response.reasoning_text.delta", with(&at, "delta", delta)),
            false => {
                let mut data = with(&at, "delta", delta);
                data["logprobs"] = json!([]);
                self.event("response.output_text.delta", data)
            }
        };
        events.push(event);
    }

    /// What a piece of the choice's text adds.
    fn push(&mut self, read: ChoiceDelta) -> Vec<Event> {
        let mut events = Vec::new();
        if !read.reasoning.is_empty() {
            self.text(true, read.reasoning, &mut events);
        }
        if !read.content.is_empty() {
            self.text(false, read.content, &mut events);
        }
        for (_, call) in read.calls {
            events.extend(self.close("completed"));
            let item = Item::Call {
                id: random_id("fc"),
                call_id: call.id,
                name: call.name.clone(),
                arguments: String::new(),
            };
            let index = self.items.len();
            events.push(self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": item.json("in_progress")}),
            ));
            let at = json!({"item_id": item.id(), "output_index": index});
            events.push(self.event(
                "response.function_call_arguments.delta",
                with(&at, "delta", call.arguments.as_str()),
            ));
            let mut done = with(&at, "arguments", call.arguments.as_str());
            done["name"] = call.name.into();
            events.push(self.event("response.function_call_arguments.done", done));
            let item = match item {
                Item::Call {
                    id, call_id, name, ..
                } => Item::Call {
                    id,
                    call_id,
                    name,
                    arguments: call.arguments,
                },
                other => other,
            };
            events.push(self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item.json("completed")}),
            ));
            self.items.push(item);
        }
        events
    }

    /// The whole response of a finished choice; kept in the store when the request asked.
    pub fn whole(mut self, text: &str, reason: FinishReason, usage: Usage) -> Value {
        let read = self.reader.clone().read_whole(text);
        self.push(read);
        let (response, _) = self.finish_events(reason, usage);
        response
    }

    fn finish_events(&mut self, reason: FinishReason, usage: Usage) -> (Value, Vec<Event>) {
        let (status, incomplete) = match reason {
            FinishReason::Length => ("incomplete", Some("max_output_tokens")),
            // The engine shut down under the request.
            FinishReason::Abort => ("incomplete", None),
            FinishReason::Stop | FinishReason::GrammarDeadEnd => ("completed", None),
        };
        let item_status = if status == "incomplete" {
            "incomplete"
        } else {
            "completed"
        };
        let mut events = self.close(item_status);
        let response = self.response(status, Some(&usage), incomplete);
        self.keep(&response);
        let kind = match status {
            "incomplete" => "response.incomplete",
            _ => "response.completed",
        };
        events.push(self.event(kind, json!({ "response": response })));
        (response, events)
    }

    /// Stores the finished response with its conversation.
    fn keep(&mut self, response: &Value) {
        let Some(target) = self.context.store.take() else {
            return;
        };
        let mut conversation = target.conversation;
        conversation.push(self.as_chat_message());
        let stored = StoredResponse {
            response: response.clone(),
            conversation,
        };
        target
            .store
            .insert(self.context.id.clone(), target.owner, stored);
    }

    /// The output as the assistant turn a follow-up request continues from.
    fn as_chat_message(&self) -> Value {
        let mut content = String::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        for item in &self.items {
            match item {
                Item::Reasoning { text, .. } => reasoning.push_str(text),
                Item::Message { text, .. } => content.push_str(text),
                Item::Call {
                    call_id,
                    name,
                    arguments,
                    ..
                } => calls.push(json!({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}})),
            }
        }
        let mut message = json!({"role": "assistant", "content": content});
        if !reasoning.is_empty() {
            message["reasoning_content"] = reasoning.into();
        }
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        message
    }
}

fn with(at: &Value, key: &str, value: impl Into<Value>) -> Value {
    let mut data = at.clone();
    data[key] = value.into();
    data
}

impl NamedEvents for ResponseBuilder {
    fn opening(&mut self) -> Vec<Event> {
        let response = self.response("in_progress", None, None);
        vec![
            self.event("response.created", json!({ "response": response })),
            self.event("response.in_progress", json!({ "response": response })),
        ]
    }

    fn delta(&mut self, text: &str, _token_ids: &[u32]) -> Vec<Event> {
        let read = self.reader.push(text);
        self.push(read)
    }

    fn finish(&mut self, reason: FinishReason, usage: Usage) -> Vec<Event> {
        let rest = self.reader.finish();
        let mut events = self.push(rest);
        events.extend(self.finish_events(reason, usage).1);
        events
    }

    fn failure(&mut self, error: ApiError) -> Vec<Event> {
        let (_, axum::Json(ErrorResponse { error })): (StatusCode, axum::Json<ErrorResponse>) =
            error.into();
        let data = json!({"code": error.code, "message": error.message, "param": error.param});
        vec![self.event("error", data)]
    }
}
