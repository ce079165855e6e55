//! `POST /v1/chat/completions`: messages rendered with the model's chat template, answered as JSON or as a stream.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use crate::engine::{FinishReason, TokenLogprob};
use crate::model::Tokenizer;

use super::access_log::AccessRecord;
use super::admission::AdmissionTicket;
use super::body::ApiJson;
use super::chat_output::{ChatOutputPlan, ChoiceDelta, ChoiceReader};
use super::error::ApiError;
use super::logprobs::chat_logprobs;
use super::openai::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatMessageOut, FunctionCallOut, GenerationBody,
    ToolCallOut, Usage,
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
    Extension(access): Extension<AccessRecord>,
    ApiJson(body): ApiJson<GenerationBody<ChatCompletionRequest>>,
) -> Result<Response, ApiError> {
    let summary = app.engine.summary()?;
    let tokenizer = summary.tokenizer.clone();
    let reasoning_parser = app.config.reasoning_parser;
    let validated =
        validate_off_thread(move || validation::validate_chat(body, &summary, reasoning_parser))
            .await?;
    let (requests, shape) = validated.into_parts();
    ticket.reserve(shape.num_choices())?;
    let (events, fingerprint) = submit::submit(&app.engine, &request_id, requests)?;
    let meta = ResponseMeta::new("chatcmpl", &request_id, &shape.model, fingerprint);
    let mut usage = UsageTally::new(&shape).reporting_to(access);
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
            readers: (0..shape.num_choices())
                .map(|_| shape.chat_output.reader())
                .collect(),
        };
        return Ok(super::stream::sse(events, format, usage, config));
    }
    let outputs = submit::collect(events, &shape, &mut usage).await?;
    // The conversation is one prompt: every choice scored it alike.
    let prompt_logprobs = shape.prompt_logprobs.map(|k| {
        let scored = outputs.first().map_or(&[][..], |o| &o.prompt_logprobs);
        super::prompt_logprobs::vllm_prompt_logprobs(&tokenizer, scored, k)
    });
    let choices = outputs
        .into_iter()
        .enumerate()
        .map(|(index, output)| {
            let read = shape.chat_output.reader().read_whole(&output.text);
            ChatChoice {
                index,
                finish_reason: finish_reason(output.finish_reason, !read.calls.is_empty()),
                message: message(&shape.chat_output, read),
                stop_reason: output.finish_reason.stop_reason(),
                logprobs: shape
                    .logprobs
                    .map(|k| chat_logprobs(&tokenizer, &output.logprobs, k)),
            }
        })
        .collect();
    let response = ChatCompletionResponse {
        id: meta.id,
        object: "chat.completion",
        created: meta.created,
        model: meta.model,
        system_fingerprint: meta.system_fingerprint,
        usage: usage.usage(),
        prompt_logprobs,
        choices,
    };
    Ok(Json(response).into_response())
}

/// The whole answer of one choice.
fn message(plan: &ChatOutputPlan, read: ChoiceDelta) -> ChatMessageOut {
    let only_calls = read.content.is_empty() && !read.calls.is_empty();
    ChatMessageOut {
        role: ASSISTANT,
        content: (!only_calls).then_some(read.content),
        refusal: None,
        reasoning_content: plan.splits_reasoning().then_some(read.reasoning),
        tool_calls: tool_calls(read.calls, false),
    }
}

fn tool_calls(
    calls: Vec<(usize, crate::api::tool_calls::ParsedToolCall)>,
    indexed: bool,
) -> Vec<ToolCallOut> {
    calls
        .into_iter()
        .map(|(index, call)| ToolCallOut {
            index: indexed.then_some(index),
            id: call.id,
            kind: "function",
            function: FunctionCallOut {
                name: call.name,
                arguments: call.arguments,
            },
        })
        .collect()
}

/// A choice that ended after calling functions finished because of them.
fn finish_reason(reason: FinishReason, made_calls: bool) -> &'static str {
    match reason {
        FinishReason::Stop if made_calls => "tool_calls",
        other => other.as_str(),
    }
}

struct Chunks {
    meta: ResponseMeta,
    tokenizer: Tokenizer,
    logprobs: Option<u32>,
    /// One per choice.
    readers: Vec<ChoiceReader>,
}

impl Chunks {
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> String {
        to_json(&ChatCompletionChunk {
            id: self.meta.id.clone(),
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: self.meta.model.clone(),
            system_fingerprint: self.meta.system_fingerprint.clone(),
            choices,
            usage,
        })
    }
}

impl Chunks {
    /// A chunk of one choice's reasoning, content and calls, each only when present.
    fn delta_chunk(
        &self,
        index: usize,
        read: ChoiceDelta,
        logprobs: Option<super::openai::ChatLogprobs>,
    ) -> String {
        let delta = ChatDelta {
            role: None,
            // Content goes out even when empty if nothing else does, as before the readers.
            content: (!read.content.is_empty()
                || (read.reasoning.is_empty() && read.calls.is_empty()))
            .then_some(read.content),
            reasoning_content: (!read.reasoning.is_empty()).then_some(read.reasoning),
            tool_calls: tool_calls(read.calls, true),
        };
        self.chunk(
            vec![ChatChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason: None,
                stop_reason: None,
            }],
            None,
        )
    }
}

impl ChunkFormat for Chunks {
    fn opening(&mut self, index: usize) -> Option<String> {
        let delta = ChatDelta {
            role: Some(ASSISTANT),
            content: Some(String::new()),
            ..ChatDelta::default()
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
        let read = self.readers.get_mut(index)?.push(&text);
        if read.is_empty() && logprobs.is_none() {
            return None;
        }
        Some(self.delta_chunk(index, read, logprobs))
    }

    fn finish(&mut self, index: usize, reason: FinishReason) -> Vec<String> {
        let mut chunks = Vec::new();
        let mut made_calls = false;
        if let Some(reader) = self.readers.get_mut(index) {
            let rest = reader.finish();
            made_calls = reader.made_calls();
            if !rest.is_empty() {
                chunks.push(self.delta_chunk(index, rest, None));
            }
        }
        let choice = ChatChunkChoice {
            index,
            delta: ChatDelta::default(),
            logprobs: None,
            finish_reason: Some(finish_reason(reason, made_calls)),
            stop_reason: reason.stop_reason(),
        };
        chunks.push(self.chunk(vec![choice], None));
        chunks
    }

    fn usage(&mut self, usage: Usage) -> String {
        self.chunk(Vec::new(), Some(usage))
    }
}
