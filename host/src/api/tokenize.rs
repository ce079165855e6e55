//! `POST /tokenize` and `POST /detokenize` in vLLM's shapes: a prompt or chat messages to token ids (as the generation routes would see them), and ids back to text.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::AppState;
use super::body::{ApiJson, FromJsonBody, typed};
use super::error::ApiError;
use super::openai::ChatMessageIn;
use super::validation;
use crate::model::RenderOptions;

/// `/tokenize`: a completions-style `prompt`, or chat `messages`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Default true for a prompt, false for messages (the template writes its own).
    pub add_special_tokens: Option<bool>,
    /// For messages: end with the assistant's turn opened (default true).
    pub add_generation_prompt: Option<bool>,
    pub chat_template_kwargs: Option<std::collections::BTreeMap<String, Value>>,
    pub tools: Option<Value>,
    /// Also return each token's text.
    pub return_token_strs: Option<bool>,
    /// vLLM's; refused when set, since this server renders only the model's own template
    /// and always ends with a fresh turn.
    pub continue_final_message: Option<bool>,
    pub chat_template: Option<Value>,
}

impl FromJsonBody for TokenizeRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: u32,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

/// `/detokenize`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Option<Vec<i64>>,
}

impl FromJsonBody for DetokenizeRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

pub async fn tokenize(
    State(app): State<Arc<AppState>>,
    ApiJson(request): ApiJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let model = app.engine.summary()?;
    validation::check_model(request.model.as_deref(), &model)?;
    if request.continue_final_message == Some(true) {
        return Err(ApiError::invalid(
            "continue_final_message",
            "`continue_final_message` is not supported",
        ));
    }
    if request.chat_template.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(ApiError::invalid(
            "chat_template",
            "a request's own `chat_template` is not supported; the model's template is used",
        ));
    }
    let tokens = match (&request.prompt, &request.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "send either `prompt` or `messages`, not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` (a string) or `messages` is required",
            ));
        }
        (Some(prompt), None) => model
            .tokenizer
            .encode(prompt, request.add_special_tokens.unwrap_or(true))
            .map_err(|e| ApiError::Internal {
                message: e.to_string(),
            })?,
        (None, Some(messages)) => {
            let template =
                model
                    .chat_template
                    .as_ref()
                    .ok_or_else(|| ApiError::NoChatTemplate {
                        model: model.name.clone(),
                    })?;
            let messages = validation::chat_messages(Some(messages))?;
            let tools_json = request
                .tools
                .as_ref()
                .filter(|t| !t.is_null())
                .map(Value::to_string);
            let options = RenderOptions {
                add_generation_prompt: request.add_generation_prompt.unwrap_or(true),
                tools_json: tools_json.as_deref(),
                kwargs: request.chat_template_kwargs.clone().unwrap_or_default(),
            };
            let text =
                template
                    .render_with(&messages, &options)
                    .map_err(|e| ApiError::ChatTemplate {
                        message: e.to_string(),
                    })?;
            model
                .tokenizer
                .encode(&text, request.add_special_tokens.unwrap_or(false))
                .map_err(|e| ApiError::Internal {
                    message: e.to_string(),
                })?
        }
    };
    let token_strs = request.return_token_strs.unwrap_or(false).then(|| {
        tokens
            .iter()
            .map(|&id| model.tokenizer.id_to_token(id).unwrap_or_default())
            .collect()
    });
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: model.max_model_len,
        tokens,
        token_strs,
    }))
}

pub async fn detokenize(
    State(app): State<Arc<AppState>>,
    ApiJson(request): ApiJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let model = app.engine.summary()?;
    validation::check_model(request.model.as_deref(), &model)?;
    let ids = request
        .tokens
        .ok_or_else(|| ApiError::invalid("tokens", "`tokens` (a list of token ids) is required"))?
        .into_iter()
        .map(|id| validation::token_id("tokens", id, &model))
        .collect::<Result<Vec<u32>, ApiError>>()?;
    let prompt = model
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| ApiError::Internal {
            message: e.to_string(),
        })?;
    Ok(Json(DetokenizeResponse { prompt }))
}
