//! A Messages API body read and turned into the chat request it stands for: system prompt, content blocks, tools, tool choice, thinking and stop sequences.
//!
//! The translation checks the Anthropic shapes itself, so that a bad block or tool is named by
//! its Anthropic path; the chat validation then checks values and renders the conversation.

use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::api::body::{FromJsonBody, typed};
use crate::api::error::ApiError;
use crate::api::openai::{ChatCompletionRequest, GenerationBody};
use crate::api::translated::{ChatBody, string_field, tool_param, unsupported};

/// `POST /v1/messages` and `/v1/messages/count_tokens`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    /// A string or a list of text blocks.
    pub system: Option<Value>,
    pub messages: Option<Vec<Value>>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub stop_sequences: Option<Vec<String>>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub stream: Option<bool>,
    /// `{"user_id": ...}`: a tag for the caller's own records, with no effect on the answer.
    pub metadata: Option<Map<String, Value>>,
    /// `{"type": "enabled" | "disabled" | "adaptive", ...}`: a thinking model's reasoning on or off.
    pub thinking: Option<Value>,
    pub service_tier: Option<String>,
    /// `{"format": {"type": "json_schema", "schema": ...}}`: structured output; `effort` is refused.
    pub output_config: Option<Value>,
    // Anthropic's hosted features, refused when set.
    pub container: Option<Value>,
    pub mcp_servers: Option<Value>,
    pub context_management: Option<Value>,
}

impl FromJsonBody for MessagesRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }
}

/// Which route the body came to: only `/v1/messages` needs `max_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Generate,
    CountTokens,
}

fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

impl MessagesRequest {
    /// The chat request this body stands for.
    pub fn to_chat(
        &self,
        purpose: Purpose,
    ) -> Result<GenerationBody<ChatCompletionRequest>, ApiError> {
        self.refuse_hosted_features()?;
        let mut chat = ChatBody::new(self.model.as_ref(), self.chat_messages()?);
        match (self.max_tokens, purpose) {
            (Some(m), _) if m < 1 => {
                return Err(invalid(
                    "max_tokens",
                    format!("`max_tokens` must be at least 1, got {m}"),
                ));
            }
            (Some(m), Purpose::Generate) => chat.set("max_tokens", m),
            (None, Purpose::Generate) => {
                return Err(invalid("max_tokens", "`max_tokens` is required"));
            }
            (_, Purpose::CountTokens) => {}
        }
        chat.set_present([
            ("temperature", self.temperature.map(Value::from)),
            ("top_p", self.top_p.map(Value::from)),
            ("top_k", self.top_k.map(Value::from)),
            ("stop", self.stop_sequences.clone().map(Value::from)),
        ]);
        chat.set_tools(self.tools.as_deref(), function_tool)?;
        if let Some(choice) = self.tool_choice.as_ref().filter(|c| !c.is_null()) {
            let (choice, parallel) = tool_choice(choice)?;
            chat.set("tool_choice", choice);
            chat.set_present([("parallel_tool_calls", parallel.map(Value::from))]);
        }
        chat.set_present([
            ("response_format", self.response_format()?),
            (
                "chat_template_kwargs",
                self.thinking_enabled()?
                    .map(|thinking| json!({ "enable_thinking": thinking })),
            ),
        ]);
        chat.finish(anthropic_name)
    }

    fn refuse_hosted_features(&self) -> Result<(), ApiError> {
        let hosted = [
            ("container", &self.container, "code-execution containers"),
            ("mcp_servers", &self.mcp_servers, "remote MCP servers"),
            (
                "context_management",
                &self.context_management,
                "context management",
            ),
        ];
        if let Some((name, _, what)) = hosted
            .into_iter()
            .find(|(_, v, _)| v.as_ref().is_some_and(|v| !v.is_null()))
        {
            return Err(unsupported(
                name,
                format!("`{name}`: {what} are not supported by this server"),
            ));
        }
        if let Some(tier) = &self.service_tier
            && !matches!(tier.as_str(), "auto" | "standard_only")
        {
            return Err(unsupported(
                "service_tier",
                "this server has one service tier: `service_tier` is `auto` or `standard_only`",
            ));
        }
        Ok(())
    }

    /// `output_config.format` as chat's `response_format`.
    fn response_format(&self) -> Result<Option<Value>, ApiError> {
        let Some(config) = self.output_config.as_ref().filter(|c| !c.is_null()) else {
            return Ok(None);
        };
        if config.get("effort").is_some_and(|e| !e.is_null()) {
            return Err(unsupported(
                "output_config.effort",
                "`output_config.effort` is not supported; `thinking` turns a thinking model's reasoning on or off",
            ));
        }
        let Some(format) = config.get("format").filter(|f| !f.is_null()) else {
            return Ok(None);
        };
        match (
            format.get("type").and_then(Value::as_str),
            format.get("schema"),
        ) {
            (Some("json_schema"), Some(schema @ Value::Object(_))) => Ok(Some(json!({
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema, "strict": true},
            }))),
            _ => Err(invalid(
                "output_config.format",
                "`output_config.format` is {\"type\": \"json_schema\", \"schema\": {...}}",
            )),
        }
    }

    /// `thinking` as the chat template's `enable_thinking`; `None` leaves the template's default.
    fn thinking_enabled(&self) -> Result<Option<bool>, ApiError> {
        let Some(thinking) = self.thinking.as_ref().filter(|t| !t.is_null()) else {
            return Ok(None);
        };
        match thinking.get("type").and_then(Value::as_str) {
            Some("enabled" | "adaptive") => Ok(Some(true)),
            Some("disabled") => Ok(Some(false)),
            _ => Err(invalid(
                "thinking.type",
                "`thinking.type` is \"enabled\", \"adaptive\" or \"disabled\"",
            )),
        }
    }

    /// The system prompt and the conversation as chat messages.
    fn chat_messages(&self) -> Result<Vec<Value>, ApiError> {
        let mut out = Vec::new();
        match self.system.as_ref() {
            None | Some(Value::Null) => {}
            Some(Value::String(text)) => out.push(json!({"role": "system", "content": text})),
            Some(Value::Array(blocks)) => {
                let texts = blocks
                    .iter()
                    .enumerate()
                    .map(|(i, block)| text_of(&format!("system[{i}]"), block))
                    .collect::<Result<Vec<_>, _>>()?;
                out.push(json!({"role": "system", "content": texts.join("\n")}));
            }
            Some(_) => {
                return Err(invalid(
                    "system",
                    "`system` must be a string or a list of text blocks",
                ));
            }
        }
        let messages = self
            .messages
            .as_deref()
            .ok_or_else(|| invalid("messages", "`messages` is required"))?;
        if messages.is_empty() {
            return Err(invalid(
                "messages",
                "`messages` must hold at least one message",
            ));
        }
        for (i, message) in messages.iter().enumerate() {
            chat_turn(i, message, &mut out)?;
        }
        Ok(out)
    }
}

/// One Anthropic message as chat messages: a user turn's tool results become `tool` messages
/// before its text; an assistant turn's `tool_use` blocks become its tool calls.
fn chat_turn(index: usize, message: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let param = format!("messages[{index}]");
    let role = match message.get("role").and_then(Value::as_str) {
        Some(role @ ("user" | "assistant")) => role,
        _ => {
            return Err(invalid(
                format!("{param}.role"),
                "a message's `role` is \"user\" or \"assistant\"",
            ));
        }
    };
    let blocks = match message.get("content") {
        Some(Value::String(text)) => {
            out.push(json!({"role": role, "content": text}));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(invalid(
                format!("{param}.content"),
                "`content` must be a string or a list of content blocks",
            ));
        }
    };
    let mut texts = Vec::new();
    let mut calls = Vec::new();
    let mut thinking = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let param = format!("{param}.content[{j}]");
        let kind = block.get("type").and_then(Value::as_str);
        match (role, kind) {
            (_, Some("text")) => texts.push(text_of(&param, block)?),
            ("user", Some("tool_result")) => out.push(tool_result(&param, block)?),
            ("assistant", Some("tool_use")) => calls.push(tool_use(&param, block)?),
            ("assistant", Some("thinking")) => {
                thinking.push(string_field(&param, block, "thinking")?.to_string());
            }
            // Another provider's encrypted reasoning: nothing a local model can read.
            ("assistant", Some("redacted_thinking")) => {}
            (_, Some(other)) => {
                return Err(unsupported(
                    format!("{param}.type"),
                    format!(
                        "content blocks of type `{other}` are not supported in a {role} message"
                    ),
                ));
            }
            (_, None) => {
                return Err(invalid(
                    format!("{param}.type"),
                    "a content block needs a string `type`",
                ));
            }
        }
    }
    if !texts.is_empty() || !calls.is_empty() || role == "assistant" {
        let mut turn = json!({"role": role, "content": texts.join("\n")});
        if !calls.is_empty() {
            turn["tool_calls"] = Value::Array(calls);
        }
        if !thinking.is_empty() {
            turn["reasoning_content"] = thinking.join("\n").into();
        }
        out.push(turn);
    }
    Ok(())
}

fn text_of(param: &str, block: &Value) -> Result<String, ApiError> {
    match block.get("type").and_then(Value::as_str) {
        Some("text") => Ok(string_field(param, block, "text")?.to_string()),
        _ => Err(unsupported(
            format!("{param}.type"),
            "only `text` blocks are supported here",
        )),
    }
}

fn tool_use(param: &str, block: &Value) -> Result<Value, ApiError> {
    let id = string_field(param, block, "id")?;
    let name = string_field(param, block, "name")?;
    let input = match block.get("input") {
        None | Some(Value::Null) => json!({}),
        Some(input @ Value::Object(_)) => input.clone(),
        Some(_) => {
            return Err(invalid(
                format!("{param}.input"),
                "a `tool_use` block's `input` is an object",
            ));
        }
    };
    Ok(
        json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}),
    )
}

fn tool_result(param: &str, block: &Value) -> Result<Value, ApiError> {
    let id = string_field(param, block, "tool_use_id")?;
    let mut text = match block.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .enumerate()
            .map(|(k, b)| text_of(&format!("{param}.content[{k}]"), b))
            .collect::<Result<Vec<_>, _>>()?
            .join("\n"),
        Some(_) => {
            return Err(invalid(
                format!("{param}.content"),
                "a `tool_result` block's `content` is a string or a list of text blocks",
            ));
        }
    };
    if block.get("is_error").and_then(Value::as_bool) == Some(true) {
        text.insert_str(0, "Error: ");
    }
    Ok(json!({"role": "tool", "tool_call_id": id, "content": text}))
}

/// An Anthropic tool (`name`, `description`, `input_schema`) as a chat function tool.
fn function_tool(index: usize, tool: &Value) -> Result<Value, ApiError> {
    let param = format!("tools[{index}]");
    match tool.get("type") {
        None | Some(Value::Null) => {}
        Some(Value::String(kind)) if kind == "custom" => {}
        Some(other) => {
            return Err(unsupported(
                format!("{param}.type"),
                format!("only client tools (`custom`) are supported; {param}.type is {other}"),
            ));
        }
    }
    let name = string_field(&param, tool, "name")?;
    let schema = match tool.get("input_schema") {
        Some(schema @ Value::Object(_)) => schema.clone(),
        _ => {
            return Err(invalid(
                format!("{param}.input_schema"),
                "a tool needs an `input_schema` object",
            ));
        }
    };
    let mut function = json!({"name": name, "parameters": schema});
    if let Some(description) = tool.get("description").and_then(Value::as_str) {
        function["description"] = description.into();
    }
    Ok(json!({"type": "function", "function": function}))
}

/// Anthropic's `tool_choice` as chat's, and whether it allows parallel calls.
fn tool_choice(choice: &Value) -> Result<(Value, Option<bool>), ApiError> {
    let parallel = choice
        .get("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        .map(|disabled| !disabled);
    let chat = match choice.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = string_field("tool_choice", choice, "name")?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => {
            return Err(invalid(
                "tool_choice.type",
                "`tool_choice.type` is \"auto\", \"any\", \"tool\" or \"none\"",
            ));
        }
    };
    Ok((chat, parallel))
}

/// A chat request's parameter as the Messages API names it.
fn anthropic_name(param: String) -> String {
    fn field(path: &str) -> &str {
        match path {
            ".function.parameters" => ".input_schema",
            ".function.name" => ".name",
            ".function" => "",
            other => other,
        }
    }
    fn other(param: String) -> String {
        match param.as_str() {
            "stop" => "stop_sequences".into(),
            _ => param,
        }
    }
    tool_param(param, field, other)
}

/// A chat validation error with the parameter named as the Messages API names it.
pub fn anthropic_names(error: ApiError) -> ApiError {
    error.with_param_renamed(anthropic_name)
}
