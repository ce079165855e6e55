//! Prompts read and tokenized: completions' strings and token lists, chat messages and their
//! content parts.

use serde_json::Value;

use crate::api::error::ApiError;
use crate::api::openai::ChatMessageIn;
use crate::api::prompt_logprobs::PromptEcho;
use crate::engine::ModelSummary;
use crate::model::{Bounded, ChatMessage, ToolCall};

use super::sampling::token_id;

/// The prompts of a completions request, tokenized; each becomes its own set of choices.
pub(super) fn completion_prompts(
    prompt: Option<&Value>,
    model: &ModelSummary,
) -> Result<Vec<Vec<u32>>, ApiError> {
    const SHAPE: &str = "`prompt` must be a string, a list of strings, a list of token ids or a list of token-id lists";
    let shape_error = || ApiError::invalid("prompt", SHAPE);
    let prompts = match prompt {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("prompt", "`prompt` is required"));
        }
        Some(Value::String(text)) => vec![encode(text, true, model)?],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::invalid("prompt", "`prompt` is an empty list"));
        }
        Some(Value::Array(items)) => match &items[0] {
            Value::String(_) => {
                let texts = items.iter().map(|v| v.as_str().ok_or_else(shape_error));
                texts
                    .map(|t| encode(t?, true, model))
                    .collect::<Result<_, _>>()?
            }
            Value::Number(_) => vec![token_list(items, model)?],
            Value::Array(_) => {
                let lists = items.iter().map(|v| v.as_array().ok_or_else(shape_error));
                lists
                    .map(|l| token_list(l?, model))
                    .collect::<Result<_, _>>()?
            }
            _ => return Err(shape_error()),
        },
        Some(_) => return Err(shape_error()),
    };
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        return Err(ApiError::invalid("prompt", format!("prompt {i} is empty")));
    }
    Ok(prompts)
}

/// What completions' `echo` puts before each prompt's output: a text prompt as sent, a
/// token-id prompt decoded.
pub(super) fn echo_texts(
    prompt: Option<&Value>,
    prompts: &[Vec<u32>],
    model: &ModelSummary,
) -> Vec<PromptEcho> {
    let sent: Vec<Option<&str>> = match prompt {
        Some(Value::String(text)) => vec![Some(text.as_str())],
        Some(Value::Array(items)) => items.iter().map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    prompts
        .iter()
        .enumerate()
        .map(|(i, tokens)| PromptEcho {
            text: match sent.get(i).copied().flatten() {
                Some(text) => text.to_string(),
                None => model.tokenizer.decode(tokens, false).unwrap_or_default(),
            },
            first_token: tokens.first().copied().unwrap_or(0),
        })
        .collect()
}

/// A prompt's tokens; a prompt far beyond the context is refused without tokenizing all of it.
pub(super) fn encode(
    text: &str,
    add_special_tokens: bool,
    model: &ModelSummary,
) -> Result<Vec<u32>, ApiError> {
    let encoded = model
        .tokenizer
        .encode_within(text, add_special_tokens, model.max_model_len as usize)
        .map_err(|e| ApiError::Internal {
            message: e.to_string(),
        })?;
    match encoded {
        Bounded::Tokens(tokens) => Ok(tokens),
        Bounded::TooLong {
            prefix_bytes,
            prefix_tokens,
        } => Err(ApiError::PromptTooLong {
            max_model_len: model.max_model_len,
            prefix_bytes,
            prefix_tokens,
        }),
    }
}

fn token_list(items: &[Value], model: &ModelSummary) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| match v.as_i64() {
            Some(id) => token_id("prompt", id, model),
            None => Err(ApiError::invalid(
                "prompt",
                format!("a token id must be an integer, got {v}"),
            )),
        })
        .collect()
}

/// The conversation as the chat template reads it.
pub(in crate::api) fn chat_messages(
    messages: Option<&[ChatMessageIn]>,
) -> Result<Vec<ChatMessage>, ApiError> {
    let messages =
        messages.ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| chat_message(i, m))
        .collect()
}

fn chat_message(index: usize, message: &ChatMessageIn) -> Result<ChatMessage, ApiError> {
    let role = match message.role.as_str() {
        "developer" => "system",
        role @ ("system" | "user" | "assistant" | "tool") => role,
        other => {
            let message = format!(
                "unknown role `{other}`; expected system, developer, user, assistant or tool"
            );
            return Err(ApiError::invalid(
                format!("messages[{index}].role"),
                message,
            ));
        }
    };
    let tool_calls = message
        .tool_calls
        .iter()
        .flatten()
        .map(|call| ToolCall {
            id: call.id.clone(),
            name: call.function.name.clone(),
            arguments: match &call.function.arguments {
                None | Some(Value::Null) => "{}".to_string(),
                Some(Value::String(text)) => text.clone(),
                Some(other) => other.to_string(),
            },
        })
        .collect();
    Ok(ChatMessage {
        role: role.to_string(),
        content: message_content(index, message.content.as_ref())?,
        reasoning_content: message.reasoning_content.clone(),
        tool_calls,
        tool_call_id: message.tool_call_id.clone(),
    })
}

/// A string, or text parts joined with newlines as vLLM joins them.
fn message_content(index: usize, content: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{index}].content");
    let parts = match content {
        None | Some(Value::Null) => return Ok(String::new()),
        Some(Value::String(text)) => return Ok(text.clone()),
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            return Err(ApiError::invalid(
                param,
                "message content must be a string or a list of content parts",
            ));
        }
    };
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let param = format!("{param}[{j}]");
        let kind = part.get("type").and_then(Value::as_str);
        match (kind, part.get("text").and_then(Value::as_str)) {
            (Some("text"), Some(text)) => texts.push(text),
            (Some("text"), None) => {
                return Err(ApiError::invalid(
                    param,
                    "a text part needs a string `text`",
                ));
            }
            (Some(other), _) => {
                let message = format!(
                    "content parts of type `{other}` are not supported; only `text` parts are"
                );
                return Err(ApiError::Unsupported {
                    param: format!("{param}.type"),
                    message,
                });
            }
            (None, _) => {
                return Err(ApiError::invalid(
                    param,
                    "a content part needs a string `type`",
                ));
            }
        }
    }
    Ok(texts.join("\n"))
}
