//! A Responses API body read and turned into the chat request it stands for: input items, instructions, tools, tool choice and text format; and the fields this server refuses.
//!
//! The translation checks the Responses shapes itself, so that a bad item or tool is named by
//! its Responses path; the chat validation then checks values and renders the conversation.

use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::api::body::{FromJsonBody, typed};
use crate::api::error::ApiError;
use crate::api::openai::{ChatCompletionRequest, GenerationBody};
use crate::api::translated::{ChatBody, string_field, tool_param, unsupported};

/// `POST /v1/responses`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// A string, or a list of items.
    pub input: Option<Value>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}, "verbosity": ...}`.
    pub text: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Echoed in the response and kept with it.
    pub metadata: Option<Map<String, Value>>,
    /// Echoed in the response.
    pub user: Option<String>,
    pub stream: Option<bool>,
    /// OpenAI's default is true.
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    // Refused unless they ask for nothing (see `refuse_what_cannot_be_honoured`).
    pub background: Option<bool>,
    pub include: Option<Vec<Value>>,
    pub reasoning: Option<Value>,
    pub prompt: Option<Value>,
    pub conversation: Option<Value>,
    pub max_tool_calls: Option<Value>,
    pub truncation: Option<String>,
    pub top_logprobs: Option<i64>,
    pub service_tier: Option<String>,
}

impl FromJsonBody for ResponsesRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }
}

fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

impl ResponsesRequest {
    /// Fields that ask for what this server does not do: each is fine absent, null or empty.
    pub fn refuse_what_cannot_be_honoured(&self) -> Result<(), ApiError> {
        if self.background == Some(true) {
            return Err(unsupported(
                "background",
                "background responses are not supported; `background` may only be false",
            ));
        }
        if let Some(item) = self.include.iter().flatten().next() {
            return Err(unsupported(
                "include",
                format!("`include` may only be empty; {item} is not supported"),
            ));
        }
        let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
        let reasoning_asks = self
            .reasoning
            .as_ref()
            .and_then(Value::as_object)
            .is_some_and(|r| r.values().any(|v| !v.is_null()));
        let refused = [
            (
                "reasoning",
                reasoning_asks,
                "`reasoning` options are not supported",
            ),
            (
                "prompt",
                set(&self.prompt),
                "prompt templates are not supported",
            ),
            (
                "conversation",
                set(&self.conversation),
                "conversations are not supported; use `previous_response_id`",
            ),
            (
                "max_tool_calls",
                set(&self.max_tool_calls),
                "`max_tool_calls` is not supported",
            ),
            (
                "truncation",
                self.truncation.as_deref().is_some_and(|t| t != "disabled"),
                "`truncation` may only be \"disabled\": a prompt beyond the context gets 400",
            ),
            (
                "top_logprobs",
                self.top_logprobs.is_some_and(|k| k != 0),
                "logprobs are not supported on /v1/responses; use /v1/chat/completions",
            ),
            (
                "service_tier",
                self.service_tier
                    .as_deref()
                    .is_some_and(|t| !matches!(t, "auto" | "default")),
                "this server has one service tier: `auto` or `default`",
            ),
        ];
        if let Some((name, _, message)) = refused.into_iter().find(|(_, refused, _)| *refused) {
            return Err(unsupported(name, message));
        }
        if let Some(verbosity) = self.text.as_ref().and_then(|t| t.get("verbosity"))
            && !verbosity.is_null()
            && verbosity != "medium"
        {
            return Err(unsupported(
                "text.verbosity",
                "`text.verbosity` is not supported",
            ));
        }
        Ok(())
    }

    /// The request's input as chat messages (without `instructions`).
    pub fn input_messages(&self) -> Result<Vec<Value>, ApiError> {
        match &self.input {
            None | Some(Value::Null) => Err(invalid("input", "`input` is required")),
            Some(Value::String(text)) => Ok(vec![json!({"role": "user", "content": text})]),
            Some(Value::Array(items)) => {
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    input_item(i, item, &mut out)?;
                }
                Ok(out)
            }
            Some(_) => Err(invalid(
                "input",
                "`input` must be a string or a list of items",
            )),
        }
    }

    /// The chat request of `conversation` (earlier turns, then this input) after the
    /// instructions.
    pub fn to_chat(
        &self,
        conversation: &[Value],
    ) -> Result<GenerationBody<ChatCompletionRequest>, ApiError> {
        let mut messages = Vec::with_capacity(conversation.len() + 1);
        if let Some(instructions) = &self.instructions {
            messages.push(json!({"role": "system", "content": instructions}));
        }
        messages.extend_from_slice(conversation);
        let mut chat = ChatBody::new(self.model.as_ref(), messages);
        chat.set_present([
            ("max_tokens", self.max_output_tokens.map(Value::from)),
            ("temperature", self.temperature.map(Value::from)),
            ("top_p", self.top_p.map(Value::from)),
            (
                "parallel_tool_calls",
                self.parallel_tool_calls.map(Value::from),
            ),
        ]);
        chat.set_tools(self.tools.as_deref(), function_tool)?;
        if let Some(choice) = self.tool_choice.as_ref().filter(|c| !c.is_null()) {
            chat.set("tool_choice", tool_choice(choice)?);
        }
        chat.set_present([("response_format", self.response_format()?)]);
        chat.finish(responses_name)
    }

    /// `text.format` as chat's `response_format`.
    fn response_format(&self) -> Result<Option<Value>, ApiError> {
        let Some(format) = self
            .text
            .as_ref()
            .and_then(|t| t.get("format"))
            .filter(|f| !f.is_null())
        else {
            return Ok(None);
        };
        match format.get("type").and_then(Value::as_str) {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
            Some("json_schema") => {
                let mut schema = Map::new();
                for key in ["name", "description", "schema", "strict"] {
                    if let Some(value) = format.get(key) {
                        schema.insert(key.into(), value.clone());
                    }
                }
                Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
            }
            _ => Err(invalid(
                "text.format.type",
                "`text.format.type` is \"text\", \"json_object\" or \"json_schema\"",
            )),
        }
    }
}

/// One input item as chat messages. Function calls join the assistant turn just before them,
/// or start one; a reasoning item's text goes to the assistant turn it belongs to.
fn input_item(index: usize, item: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let param = format!("input[{index}]");
    let kind = item.get("type").and_then(Value::as_str);
    match kind {
        None | Some("message") => out.push(message_item(&param, item)?),
        Some("function_call") => {
            let call_id = string_field(&param, item, "call_id")?;
            let name = string_field(&param, item, "name")?;
            let arguments = string_field(&param, item, "arguments")?;
            let call = json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}});
            let turn = assistant_turn(out);
            match turn.get_mut("tool_calls").and_then(Value::as_array_mut) {
                Some(calls) => calls.push(call),
                None => turn["tool_calls"] = json!([call]),
            }
        }
        Some("function_call_output") => {
            let call_id = string_field(&param, item, "call_id")?;
            let output = match item.get("output") {
                Some(Value::String(text)) => text.clone(),
                Some(Value::Array(parts)) => text_parts(&format!("{param}.output"), parts)?,
                _ => {
                    return Err(invalid(
                        format!("{param}.output"),
                        "a `function_call_output` needs an `output` string or text parts",
                    ));
                }
            };
            out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
        }
        Some("reasoning") => {
            let parts = item.get("content").and_then(Value::as_array);
            let text: Vec<&str> = parts
                .into_iter()
                .flatten()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect();
            if !text.is_empty() {
                let turn = assistant_turn(out);
                turn["reasoning_content"] = text.join("\n").into();
            }
        }
        Some(other) => {
            return Err(unsupported(
                format!("{param}.type"),
                format!(
                    "input items of type `{other}` are not supported; only `message`, `function_call`, `function_call_output` and `reasoning` are"
                ),
            ));
        }
    }
    Ok(())
}

/// The assistant turn at the end of `out`, added when the last message is not one, or is
/// one that already answered in text (a later call is a new step).
fn assistant_turn(out: &mut Vec<Value>) -> &mut Value {
    let open = out
        .last()
        .is_some_and(|m| m["role"] == "assistant" && m.get("content").is_none_or(|c| c == ""));
    if !open {
        out.push(json!({"role": "assistant", "content": ""}));
    }
    let last = out.len() - 1;
    &mut out[last]
}

fn message_item(param: &str, item: &Value) -> Result<Value, ApiError> {
    let role = match item.get("role").and_then(Value::as_str) {
        Some("developer") => "system",
        Some(role @ ("user" | "system" | "assistant")) => role,
        _ => {
            return Err(invalid(
                format!("{param}.role"),
                "a message's `role` is \"user\", \"system\", \"developer\" or \"assistant\"",
            ));
        }
    };
    let content = match item.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => text_parts(&format!("{param}.content"), parts)?,
        _ => {
            return Err(invalid(
                format!("{param}.content"),
                "a message's `content` is a string or a list of content parts",
            ));
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// `input_text` and `output_text` parts joined with newlines.
fn text_parts(param: &str, parts: &[Value]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let param = format!("{param}[{j}]");
        match part.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text" | "text") => {
                texts.push(string_field(&param, part, "text")?);
            }
            Some(other) => {
                return Err(unsupported(
                    format!("{param}.type"),
                    format!(
                        "content parts of type `{other}` are not supported; only text parts are"
                    ),
                ));
            }
            None => {
                return Err(invalid(
                    format!("{param}.type"),
                    "a content part needs a string `type`",
                ));
            }
        }
    }
    Ok(texts.join("\n"))
}

/// A Responses function tool (`name`, `description`, `parameters`, `strict` at the top level)
/// as a chat one; the built-in tools are refused.
fn function_tool(index: usize, tool: &Value) -> Result<Value, ApiError> {
    let param = format!("tools[{index}]");
    match tool.get("type").and_then(Value::as_str) {
        Some("function") => {}
        other => {
            let kind = other.unwrap_or("missing");
            return Err(unsupported(
                format!("{param}.type"),
                format!("only function tools are supported; {param}.type is {kind}"),
            ));
        }
    }
    let mut function = Map::new();
    for key in ["name", "description", "parameters", "strict"] {
        if let Some(value) = tool.get(key) {
            function.insert(key.into(), value.clone());
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

fn tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        object if object.get("type").and_then(Value::as_str) == Some("function") => {
            let name = string_field("tool_choice", object, "name")?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        _ => Err(unsupported(
            "tool_choice",
            "`tool_choice` is \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}",
        )),
    }
}

/// A chat request's parameter as the Responses API names it.
fn responses_name(param: String) -> String {
    fn field(path: &str) -> &str {
        path.strip_prefix(".function").unwrap_or(path)
    }
    fn other(param: String) -> String {
        let renamed = match param.as_str() {
            "max_tokens" => "max_output_tokens",
            "response_format" => "text.format",
            "messages" => "input",
            _ => return param,
        };
        renamed.into()
    }
    tool_param(param, field, other)
}

/// A chat validation error with the parameter named as the Responses API names it.
pub fn responses_names(error: ApiError) -> ApiError {
    error.with_param_renamed(responses_name)
}
