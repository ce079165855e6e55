//! `POST /v1/completions`: prompts in, one choice set per prompt, as JSON or as a stream of chunks.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use crate::engine::{FinishReason, PromptLogprob, TokenLogprob};
use crate::model::Tokenizer;

use super::access_log::AccessRecord;
use super::admission::AdmissionTicket;
use super::body::ApiJson;
use super::error::ApiError;
use super::openai::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, GenerationBody,
    Usage,
};
use super::prompt_logprobs::{PromptEcho, vllm_prompt_logprobs};
use super::stream::{ChunkFormat, StreamConfig, to_json};
use super::submit::{self, UsageTally};
use super::validation;
use super::{AppState, RequestId, ResponseMeta, validate_off_thread};

const OBJECT: &str = "text_completion";

pub async fn create(
    State(app): State<Arc<AppState>>,
    Extension(request_id): Extension<RequestId>,
    Extension(ticket): Extension<AdmissionTicket>,
    Extension(access): Extension<AccessRecord>,
    ApiJson(body): ApiJson<GenerationBody<CompletionRequest>>,
) -> Result<Response, ApiError> {
    let summary = app.engine.summary()?;
    let tokenizer = summary.tokenizer.clone();
    let validated =
        validate_off_thread(move || validation::validate_completion(body, &summary)).await?;
    let (requests, shape) = validated.into_parts();
    ticket.reserve(shape.num_choices())?;
    let (events, fingerprint) = submit::submit(&app.engine, &request_id, requests)?;
    let meta = ResponseMeta::new("cmpl", &request_id, &shape.model, fingerprint);
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
            text_offsets: vec![0; shape.num_choices()],
            logprobs: shape.logprobs,
            echo: shape.echo.clone(),
            n: shape.n,
            echoed: vec![false; shape.num_choices()],
            prompt_scores: vec![Vec::new(); shape.num_choices()],
        };
        return Ok(super::stream::sse(events, format, usage, config));
    }
    let outputs = submit::collect(events, &shape, &mut usage).await?;
    let choices = outputs
        .into_iter()
        .enumerate()
        .map(|(index, output)| {
            let echo = shape.echo.as_ref().and_then(|e| e.get(index / shape.n));
            let logprobs = shape.logprobs.map(|k| {
                choice_logprobs(
                    &tokenizer,
                    echo,
                    &output.prompt_logprobs,
                    &output.logprobs,
                    k,
                    &mut 0,
                )
            });
            let prompt_logprobs = shape
                .prompt_logprobs
                .map(|k| vllm_prompt_logprobs(&tokenizer, &output.prompt_logprobs, k));
            CompletionChoice {
                index,
                text: match echo {
                    Some(echo) => echo.text.clone() + &output.text,
                    None => output.text,
                },
                logprobs,
                finish_reason: Some(output.finish_reason.as_str()),
                stop_reason: output.finish_reason.stop_reason(),
                prompt_logprobs,
            }
        })
        .collect();
    Ok(Json(response(&meta, choices, Some(usage.usage()))).into_response())
}

/// A choice's legacy logprobs: those of its echoed prompt, if any, then its output's, whose
/// text offsets continue from `offset` (the characters already sent).
fn choice_logprobs(
    tokenizer: &Tokenizer,
    echo: Option<&PromptEcho>,
    prompt: &[PromptLogprob],
    output: &[TokenLogprob],
    num_top: u32,
    offset: &mut usize,
) -> CompletionLogprobs {
    match echo {
        Some(echo) => {
            let logprobs = echo.logprobs(tokenizer, prompt, output, num_top);
            *offset = echo.text.chars().count()
                + output
                    .iter()
                    .map(|lp| {
                        super::logprobs::token_text(tokenizer, lp.token)
                            .0
                            .chars()
                            .count()
                    })
                    .sum::<usize>();
            logprobs
        }
        None => super::logprobs::completion_logprobs(tokenizer, output, num_top, offset),
    }
}

fn response(
    meta: &ResponseMeta,
    choices: Vec<CompletionChoice>,
    usage: Option<Usage>,
) -> CompletionResponse {
    CompletionResponse {
        id: meta.id.clone(),
        object: OBJECT,
        created: meta.created,
        model: meta.model.clone(),
        system_fingerprint: meta.system_fingerprint.clone(),
        choices,
        usage,
    }
}

/// Stream chunks: the same shape as the response, one choice each.
struct Chunks {
    meta: ResponseMeta,
    tokenizer: Tokenizer,
    /// Per choice, the characters sent so far (for `text_offset`).
    text_offsets: Vec<usize>,
    logprobs: Option<u32>,
    /// Per prompt, what `echo` sends before the output, and the choices per prompt.
    echo: Option<Vec<PromptEcho>>,
    n: usize,
    /// Per choice, whether its prompt went out (in its first chunk).
    echoed: Vec<bool>,
    /// Per choice, its prompt's logprobs until its first chunk sends them.
    prompt_scores: Vec<Vec<PromptLogprob>>,
}

impl Chunks {
    fn chunk(&self, choice: CompletionChoice) -> String {
        to_json(&response(&self.meta, vec![choice], None))
    }
}

impl ChunkFormat for Chunks {
    fn opening(&mut self, _index: usize) -> Option<String> {
        None
    }

    fn prompt_logprobs(&mut self, index: usize, scored: Vec<PromptLogprob>) {
        if let Some(slot) = self.prompt_scores.get_mut(index) {
            *slot = scored;
        }
    }

    fn delta(&mut self, index: usize, text: String, logprobs: &[TokenLogprob]) -> Option<String> {
        let echo = match self.echoed.get_mut(index) {
            Some(echoed) if !*echoed => {
                *echoed = true;
                let n = self.n.max(1);
                self.echo.as_ref().and_then(|e| e.get(index / n))
            }
            _ => None,
        };
        let scored = self
            .prompt_scores
            .get_mut(index)
            .map(std::mem::take)
            .unwrap_or_default();
        let logprobs = match (self.logprobs, self.text_offsets.get_mut(index)) {
            (Some(k), Some(offset)) => Some(choice_logprobs(
                &self.tokenizer,
                echo,
                &scored,
                logprobs,
                k,
                offset,
            )),
            _ => None,
        };
        let text = match echo {
            Some(echo) => echo.text.clone() + &text,
            None => text,
        };
        if text.is_empty() && logprobs.is_none() {
            return None;
        }
        Some(self.chunk(CompletionChoice {
            index,
            text,
            logprobs,
            finish_reason: None,
            stop_reason: None,
            prompt_logprobs: None,
        }))
    }

    fn finish(&mut self, index: usize, reason: FinishReason) -> Vec<String> {
        vec![self.chunk(CompletionChoice {
            index,
            text: String::new(),
            logprobs: None,
            finish_reason: Some(reason.as_str()),
            stop_reason: reason.stop_reason(),
            prompt_logprobs: None,
        })]
    }

    fn usage(&mut self, usage: Usage) -> String {
        to_json(&response(&self.meta, Vec::new(), Some(usage)))
    }
}
