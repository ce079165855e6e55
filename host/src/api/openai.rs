//! The OpenAI wire format: request bodies as clients send them and the responses and stream chunks we send back.
//!
//! Request fields keep loose types (`i64`, `f64`, JSON values) so that a value of the
//! right type but out of range reaches validation and gets a message naming the
//! rule; fields this server does not know are ignored, as OpenAI clients send extras.

use std::collections::BTreeMap;

use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// A string, a list of strings, a list of token ids or a list of token-id lists.
    pub prompt: Option<Value>,
    /// The number of most likely alternatives to return per token (0..=20).
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Option<Vec<ChatMessageIn>>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Function tools, passed to the chat template (or a fallback system prompt) as `tools`.
    pub tools: Option<Value>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name": ...}}`.
    pub tool_choice: Option<Value>,
    /// Whether a required choice may make several calls (default true).
    pub parallel_tool_calls: Option<bool>,
    /// OpenAI fields this server cannot honour unless they ask for nothing beyond text: each
    /// is refused with 400 naming it when set otherwise (see `validation`).
    pub modalities: Option<Value>,
    pub audio: Option<Value>,
    pub prediction: Option<Value>,
    pub reasoning_effort: Option<Value>,
    pub service_tier: Option<Value>,
    pub web_search_options: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub verbosity: Option<Value>,
    pub store: Option<Value>,
    /// Extra chat-template variables (vLLM's extension), e.g. `enable_thinking`.
    pub chat_template_kwargs: Option<BTreeMap<String, Value>>,
}

/// A generation request body: the endpoint's own fields and the shared parameters, both read
/// from the same JSON object (two plain structs rather than `#[serde(flatten)]`, which would
/// lose the name of a bad field in errors).
#[derive(Debug, Clone, Default)]
pub struct GenerationBody<R> {
    pub request: R,
    pub sampling: SamplingFields,
}

/// The generation parameters both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<serde_json::Number>,
    /// A string or a list of up to four strings.
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub ignore_eos: Option<bool>,
    pub priority: Option<i64>,
    /// The deployment's sampler to use, by name (`[samplers.NAME]`, or `default`).
    pub sampler: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    // Output shaping, read by `constraints.rs`: kept as JSON so each rule names its field.
    /// OpenAI's `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`.
    pub response_format: Option<Value>,
    /// vLLM's `{"json" | "regex" | "choice" | "grammar": ...}`.
    pub structured_outputs: Option<Value>,
    /// Token ids (as strings) to offsets in [-100, 100].
    pub logit_bias: Option<Value>,
    /// vLLM's extra field: each prompt token's logprob with this many alternatives (0..=20).
    pub prompt_logprobs: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, a list of content parts, or null.
    #[serde(default)]
    pub content: Option<Value>,
    pub reasoning_content: Option<String>,
    pub tool_calls: Option<Vec<ToolCallIn>>,
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ToolCallIn {
    pub id: Option<String>,
    pub function: FunctionCallIn,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct FunctionCallIn {
    pub name: String,
    /// JSON text as OpenAI sends it; an object is accepted too.
    pub arguments: Option<Value>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    pub prompt_tokens_details: PromptTokensDetails,
    /// Output tokens the host's built-in sampler chose because the deployment's sampler plugin
    /// failed or was backed off (`on_failure = "fallback"`); absent when none.
    #[serde(skip_serializing_if = "is_zero")]
    pub plugin_fallback_tokens: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u64,
}

/// A completion response and, with `object: "text_completion"` too, each stream chunk.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    /// The deployment fingerprint: the same value means the same tokens for the same request.
    pub system_fingerprint: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// Why a `"stop"` happened when no stop condition caused it (vLLM's extra field), e.g.
    /// `grammar_dead_end`; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<&'static str>,
    /// vLLM's `prompt_logprobs`, when the request asked for them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// The legacy completions logprobs: parallel lists, one entry per token. An echoed prompt's
/// first token has nothing before it: its logprob and alternatives are `null`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<TopLogprobMap>>,
    pub text_offset: Vec<usize>,
}

/// vLLM's prompt logprobs: per prompt token, `null` for the first, then `{token id:
/// {logprob, rank, decoded_token}}` holding the prompt token and the most likely ones.
pub type PromptLogprobs = Vec<Option<PromptTokenLogprobs>>;

/// One prompt position's entries, the prompt token first, keyed by token id.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptTokenLogprobs(pub Vec<(u32, RankedLogprob)>);

impl Serialize for PromptTokenLogprobs {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (id, entry) in &self.0 {
            map.serialize_entry(&id.to_string(), entry)?;
        }
        map.end()
    }
}

/// vLLM's `Logprob`: the value, its rank among the vocabulary (1: most likely) and the text.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankedLogprob {
    pub logprob: f32,
    pub rank: u32,
    pub decoded_token: String,
}

/// `{token: logprob}` in the order given (most likely first).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobMap(pub Vec<(String, f32)>);

impl Serialize for TopLogprobMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (token, logprob) in &self.0 {
            map.serialize_entry(token, logprob)?;
        }
        map.end()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    /// The deployment fingerprint: the same value means the same tokens for the same request.
    pub system_fingerprint: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// vLLM's `prompt_logprobs` of the rendered conversation, when the request asked for them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
    /// Why a `"stop"` happened when no stop condition caused it (vLLM's extra field), e.g.
    /// `grammar_dead_end`; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    /// `null` when the answer is only tool calls.
    pub content: Option<String>,
    /// Always `null`: no model here refuses by a separate channel, and OpenAI's schema
    /// requires the field.
    pub refusal: Option<String>,
    /// The thinking block of a reasoning model, when the server splits it out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// A call the model made, as OpenAI shows it.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallOut {
    /// Its place among the choice's calls; only in stream chunks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallOut,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCallOut {
    pub name: String,
    /// The arguments object as JSON text.
    pub arguments: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    /// Always `null` (no refusal tokens), and required by OpenAI's schema.
    pub refusal: Option<Vec<ChatTokenLogprob>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    /// The deployment fingerprint: the same value means the same tokens for the same request.
    pub system_fingerprint: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// Why a `"stop"` happened when no stop condition caused it (vLLM's extra field), e.g.
    /// `grammar_dead_end`; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// The model folder the server loaded.
    pub root: String,
    /// Always `null`: no served model derives from another here.
    pub parent: Option<String>,
    /// What requests that start now report as `system_fingerprint`.
    pub system_fingerprint: String,
    pub max_model_len: u32,
}
