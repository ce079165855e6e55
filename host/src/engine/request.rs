//! What the engine accepts (a validated generation request) and what it streams back.

use std::sync::Arc;

use plughost_sdk::sampler::{Candidate, SamplingParams};

use crate::grammar::{CompiledGrammar, LogitBias};

pub type RequestId = u64;

/// When generation stops, besides `max_tokens`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StopConditions {
    /// Texts that end generation; the stop text itself is not returned.
    pub stop_strings: Vec<String>,
    /// Tokens that end generation (the token is not returned as text).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's end-of-sequence tokens.
    pub ignore_eos: bool,
}

/// A request the API layer has validated: tokens within the context, parameters in range.
/// The engine accepts nothing else.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt_tokens: Vec<u32>,
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: u32,
    pub stop: StopConditions,
    /// Return the chosen token's log-probability (and `sampling.num_top_logprobs` alternatives).
    pub logprobs: bool,
    /// `Some(k)`: also return every prompt token's log-probability given the tokens before
    /// it, with `k` alternatives, from the prefill's own logits rows. Such a request skips the
    /// prefix cache, so every prompt row is computed.
    pub prompt_logprobs: Option<u32>,
    /// Higher is scheduled first by priority-aware schedulers.
    pub priority: i32,
    /// The deployment's sampler to use, by name; `None`: the deployment's default.
    pub sampler: Option<String>,
    /// The id of the API request this sequence serves (its `X-Request-Id`), named by every
    /// engine log line about the sequence; `None` outside the API.
    pub request_id: Option<Arc<str>>,
    /// The grammar the output must follow (structured outputs); each choice gets its own matcher.
    pub constraint: Option<CompiledGrammar>,
    /// Offsets added to the logits before the grammar mask and the sampler.
    pub logit_bias: LogitBias,
}

impl GenerationRequest {
    /// `max_tokens` tokens after `prompt_tokens`, drawn by `sampling`, with everything else
    /// at its default: the model's own stop tokens, no logprobs, no grammar, no bias, the
    /// deployment's default sampler and priority 0.
    pub fn new(prompt_tokens: Vec<u32>, sampling: SamplingParams, max_tokens: u32) -> Self {
        GenerationRequest {
            prompt_tokens,
            sampling,
            max_tokens,
            stop: StopConditions::default(),
            logprobs: false,
            prompt_logprobs: None,
            priority: 0,
            sampler: None,
            request_id: None,
            constraint: None,
            logit_bias: LogitBias::default(),
        }
    }
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the model's context length.
    Length,
    /// The client went away or the engine shut down.
    Abort,
    /// The request's grammar allowed no token: reported as `"stop"`, with the cause in
    /// [`FinishReason::stop_reason`].
    GrammarDeadEnd,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::GrammarDeadEnd => "stop",
        }
    }

    /// Why a `"stop"` that no stop condition caused happened, for the response's extra
    /// `stop_reason` field.
    pub fn stop_reason(self) -> Option<&'static str> {
        match self {
            FinishReason::GrammarDeadEnd => Some("grammar_dead_end"),
            _ => None,
        }
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
    /// Output tokens the host's built-in sampler chose because the sampler plugin failed
    /// (`on_failure = "fallback"`).
    pub plugin_fallback_tokens: u32,
}

/// One generated token's log-probability and the top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<Candidate>,
}

/// One prompt token's log-probability under the model given the tokens before it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    pub token: u32,
    pub logprob: f32,
    /// 1 for the most likely token; ties share the better rank.
    pub rank: u32,
    /// The most likely tokens at this position, most likely first, with their logprobs.
    pub top: Vec<Candidate>,
}

/// What the engine streams for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// New text (possibly empty while a stop string or a character is pending) and the tokens behind it.
    Delta {
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
        /// In the request's first delta only, for a request with `prompt_logprobs`: the
        /// prompt's tokens from the second on (the first has nothing before it).
        prompt_logprobs: Vec<PromptLogprob>,
    },
    /// The last event of a request.
    Finished { reason: FinishReason, usage: Usage },
    /// The request failed inside the engine; the last event of the request.
    Failed { message: String },
    /// The server can no longer serve (its device is broken) and is on its way out; the
    /// last event of the request. Another replica can take it.
    Unavailable { message: String },
    /// A plugin failed the request under its `on_failure = "reject"` policy; the last event
    /// of the request.
    Rejected(crate::plugins::PluginRejection),
}
