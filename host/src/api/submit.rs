//! Hands a validated request's choices to the engine and merges their event channels into one stream.
//!
//! The merged stream owns every choice's receiver. Dropping it (the client went away, or one
//! choice failed) drops them all, which tells the engine to abort those requests and free
//! their KV blocks; nothing else may hold a receiver.

use std::sync::Arc;

use futures::StreamExt;
use futures::stream::{self, BoxStream, SelectAll};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{
    EngineError, EngineHandle, FinishReason, GenerationEvent, GenerationRequest, PromptLogprob,
    TokenLogprob, Usage,
};

use super::access_log::AccessRecord;
use super::error::ApiError;
use super::openai;
use super::request_id::RequestId;
use super::validation::ResponseShape;

/// One choice's event, tagged with the choice index.
#[derive(Debug)]
pub enum ChoiceEvent {
    Delta {
        text: String,
        /// The tokens behind the text, including those of a stop string the text leaves out.
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
        /// The prompt's logprobs, in the choice's first delta when the request asked for them.
        prompt_logprobs: Vec<PromptLogprob>,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    /// The choice cannot finish: the engine failed it or stopped.
    Failed(ApiError),
}

/// Every choice's events, interleaved as they arrive.
pub type ChoiceEvents = SelectAll<BoxStream<'static, (usize, ChoiceEvent)>>;

/// Submits each choice (in index order) under one deployment, tagged with the API request's
/// id for the engine's log lines, and merges their channels; with the deployment's
/// `system_fingerprint`.
pub fn submit(
    engine: &EngineHandle,
    request_id: &RequestId,
    requests: Vec<GenerationRequest>,
) -> Result<(ChoiceEvents, String), ApiError> {
    let tag: Arc<str> = Arc::from(request_id.as_str());
    let pinned = engine.pin()?;
    let mut merged = SelectAll::new();
    for (index, mut request) in requests.into_iter().enumerate() {
        request.request_id = Some(tag.clone());
        // On an error, `merged` drops with the choices already submitted, aborting them.
        let (engine_id, receiver) = engine.submit_pinned(&pinned, request)?;
        // The engine's own log lines name both ids; this line ties them to the request's span.
        tracing::debug!(engine_request = engine_id, choice = index, "submitted");
        merged.push(choice_stream(index, receiver));
    }
    Ok((merged, pinned.fingerprint().to_string()))
}

/// One choice's events; ends after its last event and reports a channel that closed early.
fn choice_stream(
    index: usize,
    receiver: UnboundedReceiver<GenerationEvent>,
) -> BoxStream<'static, (usize, ChoiceEvent)> {
    stream::unfold(Some(receiver), move |receiver| async move {
        let mut receiver = receiver?;
        let event = match receiver.recv().await {
            Some(GenerationEvent::Delta {
                text,
                token_ids,
                logprobs,
                prompt_logprobs,
            }) => {
                let delta = ChoiceEvent::Delta {
                    text,
                    token_ids,
                    logprobs,
                    prompt_logprobs,
                };
                return Some(((index, delta), Some(receiver)));
            }
            Some(GenerationEvent::Finished { reason, usage }) => {
                ChoiceEvent::Finished { reason, usage }
            }
            Some(GenerationEvent::Failed { message }) => {
                ChoiceEvent::Failed(ApiError::GenerationFailed { message })
            }
            Some(GenerationEvent::Unavailable { message }) => {
                ChoiceEvent::Failed(ApiError::Unavailable(EngineError::Faulted(message)))
            }
            Some(GenerationEvent::Rejected(rejection)) => {
                ChoiceEvent::Failed(ApiError::PluginRejected(rejection))
            }
            None => ChoiceEvent::Failed(ApiError::Unavailable(EngineError::Stopped)),
        };
        Some(((index, event), None))
    })
    .boxed()
}

/// Everything one choice produced, for a non-streaming response.
#[derive(Debug, Clone)]
pub struct ChoiceOutput {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// The prompt's logprobs from its second token on, when the request asked for them.
    pub prompt_logprobs: Vec<PromptLogprob>,
    pub finish_reason: FinishReason,
}

/// Waits for every choice; the first failure fails the request (and aborts the others).
pub async fn collect(
    mut events: ChoiceEvents,
    shape: &ResponseShape,
    usage: &mut UsageTally,
) -> Result<Vec<ChoiceOutput>, ApiError> {
    let num_choices = shape.num_choices();
    let mut texts = vec![String::new(); num_choices];
    let mut tokens = vec![Vec::new(); num_choices];
    let mut logprobs = vec![Vec::new(); num_choices];
    let mut prompt_logprobs = vec![Vec::new(); num_choices];
    let mut reasons = vec![None; num_choices];
    while let Some((index, event)) = events.next().await {
        match event {
            ChoiceEvent::Delta {
                text,
                token_ids,
                logprobs: l,
                prompt_logprobs: p,
            } => {
                usage.first_text();
                texts[index].push_str(&text);
                tokens[index].extend(token_ids);
                logprobs[index].extend(l);
                prompt_logprobs[index].extend(p);
            }
            ChoiceEvent::Finished { reason, usage: u } => {
                usage.add(index, &u);
                reasons[index] = Some(reason);
            }
            ChoiceEvent::Failed(error) => return Err(error),
        }
    }
    texts
        .into_iter()
        .zip(tokens)
        .zip(logprobs)
        .zip(prompt_logprobs)
        .zip(reasons)
        .map(
            |((((text, token_ids), logprobs), prompt_logprobs), reason)| {
                let finish_reason = reason.ok_or(ApiError::Unavailable(EngineError::Stopped))?;
                Ok(ChoiceOutput {
                    text,
                    token_ids,
                    logprobs,
                    prompt_logprobs,
                    finish_reason,
                })
            },
        )
        .collect()
}

/// The output of a request's only choice (the Messages and Responses APIs have no `n`).
pub async fn collect_one(
    events: ChoiceEvents,
    shape: &ResponseShape,
    usage: &mut UsageTally,
) -> Result<ChoiceOutput, ApiError> {
    collect(events, shape, usage)
        .await?
        .into_iter()
        .next()
        .ok_or(ApiError::Internal {
            message: "the request ran no choice".into(),
        })
}

/// Token counts over a request's choices: each prompt counts once, every choice's output counts.
#[derive(Debug, Clone)]
pub struct UsageTally {
    n: usize,
    prompt_lens: Vec<u32>,
    completion_tokens: u64,
    /// Per prompt, the most prompt tokens any of its choices found in the prefix cache.
    cached_tokens: Vec<u32>,
    plugin_fallback_tokens: u64,
    /// The request's access-log record, told the same counts and the first token's time.
    access: Option<AccessRecord>,
}

impl UsageTally {
    pub fn new(shape: &ResponseShape) -> UsageTally {
        UsageTally {
            n: shape.n.max(1),
            prompt_lens: shape.prompt_lens.clone(),
            completion_tokens: 0,
            cached_tokens: vec![0; shape.prompt_lens.len()],
            plugin_fallback_tokens: 0,
            access: None,
        }
    }

    /// Also reports to the request's access log.
    pub fn reporting_to(mut self, access: AccessRecord) -> UsageTally {
        let prompt_tokens: u64 = self.prompt_lens.iter().map(|&l| l as u64).sum();
        access.set_prompt_tokens(prompt_tokens);
        self.access = Some(access);
        self
    }

    /// Some choice produced text.
    pub fn first_text(&self) {
        if let Some(access) = &self.access {
            access.first_token();
        }
    }

    pub fn add(&mut self, choice: usize, usage: &Usage) {
        self.completion_tokens += usage.completion_tokens as u64;
        if let Some(access) = &self.access {
            access.add_completion_tokens(usage.completion_tokens as u64);
        }
        self.plugin_fallback_tokens += usage.plugin_fallback_tokens as u64;
        if let Some(cached) = self.cached_tokens.get_mut(choice / self.n) {
            *cached = (*cached).max(usage.cached_tokens);
        }
    }

    pub fn usage(&self) -> openai::Usage {
        let prompt_tokens: u64 = self.prompt_lens.iter().map(|&l| l as u64).sum();
        openai::Usage {
            prompt_tokens,
            completion_tokens: self.completion_tokens,
            total_tokens: prompt_tokens + self.completion_tokens,
            prompt_tokens_details: openai::PromptTokensDetails {
                cached_tokens: self.cached_tokens.iter().map(|&c| c as u64).sum(),
            },
            plugin_fallback_tokens: self.plugin_fallback_tokens,
        }
    }
}
