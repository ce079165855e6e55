//! OpenAI's Responses API: `POST /v1/responses`, translated into a chat request and run on the chat path, and `GET` / `DELETE /v1/responses/{id}` over the per-process store of responses.
//!
//! A request continues a stored response (`previous_response_id`) by prepending that
//! response's conversation to its input. Ids are random and a stored response answers only
//! to the key that made it: another key gets the same 404 as an id that never existed.

mod output;
mod request;
pub mod store;

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{Map, Value, json};

use super::access_log::AccessRecord;
use super::admission::AdmissionTicket;
use super::auth::KeyOwner;
use super::body::ApiJson;
use super::error::ApiError;
use super::submit::{self, UsageTally};
use super::tool_calls::random_id;
use super::validation::{self, BudgetBeyondContext};
use super::{AppState, RequestId, unix_seconds, validate_off_thread};

use output::{ResponseBuilder, ResponseContext, StoreTarget};
use request::{ResponsesRequest, responses_names};

pub async fn create(
    State(app): State<Arc<AppState>>,
    Extension(request_id): Extension<RequestId>,
    Extension(ticket): Extension<AdmissionTicket>,
    Extension(access): Extension<AccessRecord>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    body.refuse_what_cannot_be_honoured()?;
    let owner = KeyOwner::of(&headers);
    let mut conversation = match &body.previous_response_id {
        Some(id) => {
            let previous =
                app.responses
                    .get(id, owner)
                    .ok_or_else(|| ApiError::StoredResponseNotFound {
                        id: id.clone(),
                        param: Some("previous_response_id".into()),
                    })?;
            previous.conversation
        }
        None => Vec::new(),
    };
    conversation.extend(body.input_messages()?);
    let chat = body.to_chat(&conversation)?;
    let summary = app.engine.summary()?;
    let tokenizer = summary.tokenizer.clone();
    let reasoning_parser = app.config.reasoning_parser;
    let validated = validate_off_thread(move || {
        validation::validate_conversation(
            chat,
            &summary,
            reasoning_parser,
            BudgetBeyondContext::Refuse,
        )
        .map_err(responses_names)
    })
    .await?;
    let (requests, shape) = validated.into_parts();
    ticket.reserve(shape.num_choices())?;
    tracing::debug!(request = %request_id, "a Responses API request");
    let (events, _) = submit::submit(&app.engine, &request_id, requests)?;
    let mut usage = UsageTally::new(&shape).reporting_to(access);
    let store = (body.store != Some(false)).then(|| StoreTarget {
        store: app.responses.clone(),
        owner,
        conversation,
    });
    let context = ResponseContext {
        id: random_id("resp"),
        created_at: unix_seconds(),
        model: shape.model.clone(),
        echo: echo(&body),
        tokenizer,
        store,
    };
    let builder = ResponseBuilder::new(context, shape.chat_output.reader());
    if body.stream == Some(true) {
        let keep_alive = app.config.keep_alive;
        return Ok(super::named_stream::sse(events, builder, usage, keep_alive));
    }
    let output = submit::collect_one(events, &shape, &mut usage).await?;
    let response = builder.whole(&output.text, output.finish_reason, usage.usage());
    Ok(Json(response).into_response())
}

/// The request's fields as the response object repeats them, with OpenAI's defaults.
fn echo(body: &ResponsesRequest) -> Map<String, Value> {
    let text_format = body
        .text
        .as_ref()
        .and_then(|t| t.get("format"))
        .filter(|f| !f.is_null())
        .cloned()
        .unwrap_or_else(|| json!({"type": "text"}));
    let fields = json!({
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata.clone().unwrap_or_default(),
        "parallel_tool_calls": body.parallel_tool_calls.unwrap_or(true),
        "previous_response_id": body.previous_response_id,
        "store": body.store.unwrap_or(true),
        "temperature": body.temperature.unwrap_or(1.0),
        "top_p": body.top_p.unwrap_or(1.0),
        "tools": body.tools.clone().unwrap_or_default(),
        "tool_choice": body.tool_choice.clone().filter(|c| !c.is_null()).unwrap_or_else(|| json!("auto")),
        "text": {"format": text_format},
        "truncation": "disabled",
        "user": body.user,
        "background": false,
        "reasoning": {"effort": null, "summary": null},
        "service_tier": "default",
    });
    let mut fields = match fields {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    // OpenAI's schema has no `null` user: absent when the request named none.
    if body.user.is_none() {
        fields.remove("user");
    }
    fields
}

/// `GET /v1/responses/{id}`: a stored response, to the key that made it.
pub async fn retrieve(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let stored = app
        .responses
        .get(&id, KeyOwner::of(&headers))
        .ok_or(ApiError::StoredResponseNotFound { id, param: None })?;
    Ok(Json(stored.response))
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(app): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    if !app.responses.delete(&id, KeyOwner::of(&headers)) {
        return Err(ApiError::StoredResponseNotFound { id, param: None });
    }
    Ok(Json(
        json!({"id": id, "object": "response.deleted", "deleted": true}),
    ))
}
