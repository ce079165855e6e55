//! `POST /v1/chat/completions`: messages rendered with the model's chat template, answered as JSON or as a stream.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use crate::engine::{FinishReason, TokenLogprob};
use crate::model::Tokenizer;

use super::admission::AdmissionTicket;
use super::body::ApiJson;
use super::error::ApiError;
use super::logprobs::chat_logprobs;
use super::openai::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatMessageOut, GenerationBody, Usage,
};
use super::stream::{ChunkFormat, StreamConfig, to_json};
use super::submit::{self, UsageTally};
use super::validation;
use super::{AppState, RequestId, ResponseMeta, validate_off_thread};

const ASSISTANT: &str = "assistant";

pub async fn create(
    State(app): State<Arc<AppState>>,
    Extension(request_id): Extension<RequestId>,
    Extension(ticket): Extension<AdmissionTicket>,
    ApiJson(body): ApiJson<GenerationBody<ChatCompletionRequest>>,
) -> Result<Response, ApiError> {
    let summary = app.engine.summary()?;
    let tokenizer = summary.tokenizer.clone();
    let validated = validate_off_thread(move || validation::validate_chat(body, &summary)).await?;
    let (requests, shape) = validated.into_parts();
    ticket.reserve(shape.num_choices())?;
    let events = submit::submit(&app.engine, &request_id, requests)?;
    let meta = ResponseMeta::new("chatcmpl", &request_id, &shape.model);
    let mut usage = UsageTally::new(&shape);
    if let Some(settings) = shape.stream {
        let config = StreamConfig {
            num_choices: shape.num_choices(),
            include_usage: settings.include_usage,
            keep_alive: app.config.keep_alive,
        };
        let format = Chunks {
            meta,
            tokenizer,
            logprobs: shape.logprobs,
        };
        return Ok(super::stream::sse(events, format, usage, config));
    }
    let outputs = submit::collect(events, &shape, &mut usage).await?;
    let choices = outputs
        .into_iter()
        .enumerate()
        .map(|(index, output)| ChatChoice {
            index,
            message: ChatMessageOut {
                role: ASSISTANT,
                content: output.text,
            },
            logprobs: shape
                .logprobs
                .map(|k| chat_logprobs(&tokenizer, &output.logprobs, k)),
            finish_reason: output.finish_reason.as_str(),
            stop_reason: output.finish_reason.stop_reason(),
        })
        .collect();
    let response = ChatCompletionResponse {
        id: meta.id,
        object: "chat.completion",
        created: meta.created,
        model: meta.model,
        choices,
        usage: usage.usage(),
    };
    Ok(Json(response).into_response())
}

struct Chunks {
    meta: ResponseMeta,
    tokenizer: Tokenizer,
    logprobs: Option<u32>,
}

impl Chunks {
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> String {
        to_json(&ChatCompletionChunk {
            id: self.meta.id.clone(),
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: self.meta.model.clone(),
            choices,
            usage,
        })
    }
}

impl ChunkFormat for Chunks {
    fn opening(&mut self, index: usize) -> Option<String> {
        let delta = ChatDelta {
            role: Some(ASSISTANT),
            content: Some(String::new()),
        };
        Some(self.chunk(
            vec![ChatChunkChoice {
                index,
                delta,
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            }],
            None,
        ))
    }

    fn delta(&mut self, index: usize, text: String, logprobs: &[TokenLogprob]) -> Option<String> {
        let logprobs = self
            .logprobs
            .map(|k| chat_logprobs(&self.tokenizer, logprobs, k));
        if text.is_empty() && logprobs.is_none() {
            return None;
        }
        let delta = ChatDelta {
            role: None,
            content: Some(text),
        };
        Some(self.chunk(
            vec![ChatChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason: None,
                stop_reason: None,
            }],
            None,
        ))
    }

    fn finish(&mut self, index: usize, reason: FinishReason) -> String {
        let choice = ChatChunkChoice {
            index,
            delta: ChatDelta::default(),
            logprobs: None,
            finish_reason: Some(reason.as_str()),
            stop_reason: reason.stop_reason(),
        };
        self.chunk(vec![choice], None)
    }

    fn usage(&mut self, usage: Usage) -> String {
        self.chunk(Vec::new(), Some(usage))
    }
}
