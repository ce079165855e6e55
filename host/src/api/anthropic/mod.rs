//! Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`, served by translating each body into a chat request, and errors in Anthropic's shape on these routes.
//!
//! A Messages request goes through the chat validation (template, tools, grammar) and the one
//! engine path; only the wire shapes differ. A `max_tokens` beyond the context is clamped to
//! what fits, since Anthropic's clients send large values whatever the model.

mod answer;
mod request;

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Serialize;
use serde_json::{Value, json};

use super::access_log::AccessRecord;
use super::admission::AdmissionTicket;
use super::body::ApiJson;
use super::error::ApiError;
use super::submit::{self, UsageTally};
use super::validation::{self, BudgetBeyondContext, ValidatedRequest};
use super::{AppState, RequestId, validate_off_thread};

pub use answer::error_body;
use answer::{Message, MessageEvents, MessageStart};
use request::{MessagesRequest, Purpose, anthropic_names};

/// The routes whose errors take Anthropic's shape.
const ROUTE_PREFIX: &str = "/v1/messages";

/// Most bytes of an error body read to reshape it; ours are far smaller.
const MAX_ERROR_BODY_BYTES: usize = 64 << 10;

pub async fn create(
    State(app): State<Arc<AppState>>,
    Extension(request_id): Extension<RequestId>,
    Extension(ticket): Extension<AdmissionTicket>,
    Extension(access): Extension<AccessRecord>,
    ApiJson(body): ApiJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let tokenizer = app.engine.summary()?.tokenizer;
    let stream = body.stream.unwrap_or(false);
    let stop_sequences = body.stop_sequences.clone().unwrap_or_default();
    let validated = validate(&app, body, Purpose::Generate).await?;
    let (requests, shape) = validated.into_parts();
    ticket.reserve(shape.num_choices())?;
    let (events, _) = submit::submit(&app.engine, &request_id, requests)?;
    let mut usage = UsageTally::new(&shape).reporting_to(access);
    let start = MessageStart {
        id: format!("msg_{request_id}"),
        model: shape.model.clone(),
        input_tokens: shape.prompt_lens.iter().map(|&l| l as u64).sum(),
        tokenizer,
        stop_sequences,
    };
    if stream {
        let format = MessageEvents::new(start, shape.chat_output.reader());
        return Ok(super::named_stream::sse(
            events,
            format,
            usage,
            app.config.keep_alive,
        ));
    }
    let output = submit::collect_one(events, &shape, &mut usage).await?;
    let message = Message::whole(start, shape.chat_output.reader(), output, usage.usage());
    Ok(Json(message).into_response())
}

/// The chat request a Messages body stands for, validated off the async threads.
async fn validate(
    app: &AppState,
    body: MessagesRequest,
    purpose: Purpose,
) -> Result<ValidatedRequest, ApiError> {
    let summary = app.engine.summary()?;
    let reasoning_parser = app.config.reasoning_parser;
    validate_off_thread(move || {
        let chat = body.to_chat(purpose)?;
        validation::validate_conversation(
            chat,
            &summary,
            reasoning_parser,
            BudgetBeyondContext::Clamp,
        )
        .map_err(anthropic_names)
    })
    .await
}

#[derive(Serialize)]
pub struct TokenCount {
    input_tokens: u64,
}

/// The prompt's tokens as `/v1/messages` would render it, without running it.
pub async fn count_tokens(
    State(app): State<Arc<AppState>>,
    ApiJson(body): ApiJson<MessagesRequest>,
) -> Result<Json<TokenCount>, ApiError> {
    let validated = validate(&app, body, Purpose::CountTokens).await?;
    Ok(Json(TokenCount {
        input_tokens: validated.shape.prompt_lens.iter().map(|&l| l as u64).sum(),
    }))
}

/// On the Messages routes, gives every error response (from a handler, a layer, a panic or
/// the router) Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, its type
/// chosen by the status. Other routes pass through.
pub async fn error_shape(request: Request, next: Next) -> Response {
    if !request.uri().path().starts_with(ROUTE_PREFIX) {
        return next.run(request).await;
    }
    let response = next.run(request).await;
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let openai: Value = match axum::body::to_bytes(body, MAX_ERROR_BODY_BYTES).await {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    let error = &openai["error"];
    let mut message = error["message"]
        .as_str()
        .or_else(|| status.canonical_reason())
        .unwrap_or("error")
        .to_string();
    if let Some(param) = error["param"].as_str()
        && !message.contains(param)
    {
        message = format!("{param}: {message}");
    }
    let body = error_body(status, message);
    parts.headers.remove(CONTENT_LENGTH);
    parts
        .headers
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Response::from_parts(parts, Body::from(json!(body).to_string()))
}
