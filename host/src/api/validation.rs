//! Turns OpenAI request bodies into validated engine requests: the model checked, parameters in
//! range, prompts tokenized, token ids in the vocabulary and every choice within the context.
//!
//! [`ValidatedRequest`] is the only producer of [`GenerationRequest`]s in the API layer: a
//! handler that has one knows the engine can run every choice as given.

use plughost_sdk::sampler::{Penalties, SamplingParams};
use serde_json::Value;

use crate::engine::{GenerationRequest, ModelSummary, StopConditions};
use crate::model::{Bounded, ChatMessage, GenerationDefaults, RenderOptions, ToolCall};

use super::chat_output::ChatOutputPlan;
use super::constraints::ConstraintSource;
use super::error::ApiError;
use super::openai::{
    ChatCompletionRequest, ChatMessageIn, CompletionRequest, GenerationBody, SamplingFields,
};
use super::options::ReasoningParserChoice;
use super::reasoning::{ReasoningParser, ReasoningSyntax};
use super::tools::ChatTools;
use crate::grammar::{Constraint, ReasoningBlock};

/// Most choices (`n`) per prompt.
pub const MAX_N: i64 = 128;
/// Most engine requests one HTTP request may start (prompts × `n`).
pub const MAX_CHOICES: usize = 1024;
/// Most alternatives per token in `logprobs` / `top_logprobs`.
pub const MAX_TOP_LOGPROBS: i64 = 20;
/// Most stop strings, as in the OpenAI API.
pub const MAX_STOP_STRINGS: usize = 4;
/// OpenAI's `max_tokens` for completions that leave it out.
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

/// The output budget of a request that states no `max_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DefaultMaxTokens {
    /// At most this many, fewer if the context ends first (OpenAI's completions).
    UpTo(u32),
    /// Until the context ends (chat, as OpenAI's chat does).
    ContextEnd,
}

/// How the response is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamSettings {
    /// Send a final chunk with `usage` and no choices.
    pub include_usage: bool,
}

/// What the response needs to know besides the engine's events.
#[derive(Debug, Clone)]
pub struct ResponseShape {
    /// The served model's name, echoed in responses.
    pub model: String,
    /// Choices per prompt; prompt `p`'s choice `i` has index `p * n + i`.
    pub n: usize,
    /// Tokens of each prompt, for `usage`.
    pub prompt_lens: Vec<u32>,
    /// `None`: one JSON response once every choice finished.
    pub stream: Option<StreamSettings>,
    /// `Some(k)`: return each token's logprob with `k` alternatives.
    pub logprobs: Option<u32>,
    /// How chat choices are read into reasoning, content and tool calls.
    pub chat_output: ChatOutputPlan,
}

impl ResponseShape {
    pub fn num_choices(&self) -> usize {
        self.prompt_lens.len() * self.n
    }
}

/// A request that passed validation: one engine request per choice, in choice-index order.
#[derive(Debug, Clone)]
pub struct ValidatedRequest {
    pub shape: ResponseShape,
    choices: Vec<GenerationRequest>,
}

impl ValidatedRequest {
    pub fn choices(&self) -> &[GenerationRequest] {
        &self.choices
    }

    pub fn into_parts(self) -> (Vec<GenerationRequest>, ResponseShape) {
        (self.choices, self.shape)
    }
}

pub fn validate_completion(
    body: GenerationBody<CompletionRequest>,
    model: &ModelSummary,
) -> Result<ValidatedRequest, ApiError> {
    let GenerationBody { request, sampling } = body;
    check_model(request.model.as_deref(), model)?;
    if request.echo == Some(true) {
        return Err(unsupported("echo", "`echo` is not supported"));
    }
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("suffix", "`suffix` is not supported"));
    }
    if request.best_of.is_some_and(|b| b > 1) {
        return Err(unsupported(
            "best_of",
            "`best_of` is not supported; use `n`",
        ));
    }
    let logprobs = match request.logprobs {
        None => None,
        Some(k) => Some(top_logprobs_count("logprobs", k)?),
    };
    let prompts = completion_prompts(request.prompt.as_ref(), model)?;
    let default = DefaultMaxTokens::UpTo(COMPLETIONS_DEFAULT_MAX_TOKENS);
    build(&sampling, prompts, logprobs, default, model, None)
}

pub fn validate_chat(
    body: GenerationBody<ChatCompletionRequest>,
    model: &ModelSummary,
    reasoning_parser: ReasoningParserChoice,
) -> Result<ValidatedRequest, ApiError> {
    let GenerationBody { request, sampling } = body;
    check_model(request.model.as_deref(), model)?;
    refuse_what_chat_cannot_honour(&request)?;
    let logprobs = chat_logprobs(request.logprobs, request.top_logprobs)?;
    let template = model
        .chat_template
        .as_ref()
        .ok_or_else(|| ApiError::NoChatTemplate {
            model: model.name.clone(),
        })?;
    let mut messages = chat_messages(request.messages.as_deref())?;
    let tools = ChatTools::from_request(
        request.tools.as_ref(),
        request.tool_choice.as_ref(),
        request.parallel_tool_calls,
    )?
    .filter(ChatTools::in_use);
    let tools_json = offer_tools(tools.as_ref(), template, &mut messages);
    let options = RenderOptions {
        add_generation_prompt: true,
        tools_json: tools_json.as_deref(),
        kwargs: request.chat_template_kwargs.unwrap_or_default(),
    };
    let mut text =
        template
            .render_with(&messages, &options)
            .map_err(|e| ApiError::ChatTemplate {
                message: e.to_string(),
            })?;
    let syntax = match reasoning_parser {
        ReasoningParserChoice::None => None,
        ReasoningParserChoice::Qwen3 => Some(ReasoningSyntax::Think),
        ReasoningParserChoice::Auto => template.thinks().then_some(ReasoningSyntax::Think),
    };
    // A required or named call is forced by a grammar, so its arguments always parse.
    let forced_tool_call = tools
        .as_ref()
        .and_then(|t| t.grammar(template.tool_call_syntax()))
        .map(|grammar| ConstraintSource {
            field: "tool_choice".into(),
            constraint: Constraint::Lark(grammar),
        });
    // A constrained answer of a model that reasons first starts after its reasoning block.
    // The prompt opens the block when the template left that to the model, so the grammar
    // never has to guess whether the model's first words are reasoning or the answer.
    // The same readers `build` uses decide whether the request is constrained.
    let constrained = forced_tool_call.is_some()
        || super::constraints::response_format(sampling.response_format.as_ref())?.is_some()
        || super::constraints::structured_outputs(sampling.structured_outputs.as_ref())?.is_some();
    if let Some(syntax) = syntax
        && constrained
        && !ReasoningParser::prompt_opens_block(syntax, &text)
        && !text.trim_end().ends_with(syntax.close())
    {
        text.push_str(syntax.open());
        text.push('\n');
    }
    let tokens = encode(&text, false, model)?;
    if tokens.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "the rendered conversation is empty",
        ));
    }
    let reasoning =
        syntax.map(|syntax| (syntax, ReasoningParser::prompt_opens_block(syntax, &text)));
    let chat_output = ChatOutputPlan::new(
        reasoning,
        tools
            .as_ref()
            .map(|t| (template.tool_call_syntax(), t.names())),
    );
    let mut validated = build(
        &sampling,
        vec![tokens],
        logprobs,
        DefaultMaxTokens::ContextEnd,
        model,
        forced_tool_call,
    )?;
    validated.shape.chat_output = chat_output;
    // A model that reasons first gets its grammar after the reasoning block, unless the
    // prompt already closed it (`enable_thinking: false`).
    if let Some((syntax, opened)) = reasoning
        && !text.trim_end().ends_with(syntax.close())
    {
        let block = ReasoningBlock {
            open: (!opened).then(|| syntax.open().to_string()),
            close: syntax.close().to_string(),
        };
        for choice in &mut validated.choices {
            choice.constraint = choice
                .constraint
                .take()
                .map(|grammar| grammar.after_reasoning(block.clone()));
        }
    }
    Ok(validated)
}

/// OpenAI chat fields this server cannot honour: each is fine absent, null or asking for
/// nothing beyond plain text generation, and refused with 400 naming it otherwise.
fn refuse_what_chat_cannot_honour(request: &ChatCompletionRequest) -> Result<(), ApiError> {
    let set = |v: &Option<Value>| v.as_ref().filter(|v| !v.is_null()).cloned();
    if let Some(modalities) = set(&request.modalities)
        && modalities != serde_json::json!(["text"])
    {
        return Err(unsupported(
            "modalities",
            "only the text modality is supported: `[\"text\"]`",
        ));
    }
    let refused: [(&str, &Option<Value>, &str); 7] = [
        ("audio", &request.audio, "audio output is not supported"),
        (
            "prediction",
            &request.prediction,
            "predicted outputs are not supported",
        ),
        (
            "reasoning_effort",
            &request.reasoning_effort,
            "`reasoning_effort` is not supported; a thinking model's `chat_template_kwargs: {\"enable_thinking\": false}` turns its reasoning off",
        ),
        (
            "web_search_options",
            &request.web_search_options,
            "web search is not supported",
        ),
        (
            "functions",
            &request.functions,
            "`functions` is deprecated and not supported; use `tools`",
        ),
        (
            "function_call",
            &request.function_call,
            "`function_call` is deprecated and not supported; use `tool_choice`",
        ),
        (
            "verbosity",
            &request.verbosity,
            "`verbosity` is not supported",
        ),
    ];
    if let Some((param, _, message)) = refused.into_iter().find(|(_, v, _)| set(v).is_some()) {
        return Err(unsupported(param, message));
    }
    if let Some(tier) = set(&request.service_tier)
        && !matches!(tier.as_str(), Some("auto" | "default"))
    {
        return Err(unsupported(
            "service_tier",
            "this server has one service tier: `auto` or `default`",
        ));
    }
    if set(&request.store).is_some_and(|s| s != Value::Bool(false)) {
        return Err(unsupported(
            "store",
            "stored completions are not supported; `store` may only be false",
        ));
    }
    Ok(())
}

/// Shows the request's tools to the model: the template's `tools` JSON when it renders them;
/// else a system prompt that lists them, with earlier calls written into the assistant turns
/// in the syntax that prompt asks for.
fn offer_tools(
    tools: Option<&ChatTools>,
    template: &crate::model::ChatTemplate,
    messages: &mut Vec<ChatMessage>,
) -> Option<String> {
    let tools = tools?;
    if template.renders_tools() {
        return Some(tools.template_json());
    }
    for message in messages.iter_mut() {
        for call in std::mem::take(&mut message.tool_calls) {
            if !message.content.is_empty() {
                message.content.push('\n');
            }
            message.content.push_str(&format!(
                "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
                Value::String(call.name),
                call.arguments
            ));
        }
    }
    let prompt = tools.fallback_prompt();
    match messages.first_mut() {
        Some(first) if first.role == "system" => {
            first.content.push_str("\n\n");
            first.content.push_str(&prompt);
        }
        _ => messages.insert(0, ChatMessage::new("system", prompt)),
    }
    None
}

pub(super) fn check_model(requested: Option<&str>, model: &ModelSummary) -> Result<(), ApiError> {
    match requested {
        Some(name) if name != model.name => Err(ApiError::ModelNotFound {
            model: name.to_string(),
        }),
        _ => Ok(()),
    }
}

fn unsupported(param: &str, message: &str) -> ApiError {
    ApiError::Unsupported {
        param: param.into(),
        message: message.into(),
    }
}

/// The engine requests of every prompt's choices, with the shared parameters checked once.
fn build(
    fields: &SamplingFields,
    prompts: Vec<Vec<u32>>,
    logprobs: Option<u32>,
    default_max_tokens: DefaultMaxTokens,
    model: &ModelSummary,
    forced_tool_call: Option<ConstraintSource>,
) -> Result<ValidatedRequest, ApiError> {
    let fields = &with_model_defaults(fields, &model.generation_defaults);
    let default_max_tokens = match model.generation_defaults.max_new_tokens {
        Some(n) => DefaultMaxTokens::UpTo(n),
        None => default_max_tokens,
    };
    let sampling = SamplingParams {
        num_top_logprobs: logprobs.unwrap_or(0),
        ..sampling_params(fields)?
    };
    let n = choices_per_prompt(fields.n, prompts.len())?;
    let stop = stop_conditions(fields, model)?;
    let stream = stream_settings(fields)?;
    let priority = match fields.priority {
        None => 0,
        Some(p) => i32::try_from(p).map_err(|_| {
            ApiError::invalid(
                "priority",
                format!("`priority` must fit in 32 bits, got {p}"),
            )
        })?,
    };
    let seed = seed(fields.seed.as_ref())?;
    let shaping = super::constraints::output_shaping(fields, model, forced_tool_call)?;
    let requested = fields.max_completion_tokens.or(fields.max_tokens);
    let mut choices = Vec::with_capacity(prompts.len() * n);
    let mut prompt_lens = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let max_tokens = max_tokens(requested, default_max_tokens, prompt.len(), model)?;
        prompt_lens.push(prompt.len() as u32);
        for i in 0..n {
            // With a seed, choice i draws from seed + i: repeatable, and the choices differ.
            let seed = seed.map_or_else(rand::random, |s| s.wrapping_add(i as u64));
            choices.push(GenerationRequest {
                prompt_tokens: prompt.clone(),
                sampling: SamplingParams { seed, ..sampling },
                max_tokens,
                stop: stop.clone(),
                logprobs: logprobs.is_some(),
                priority,
                sampler: fields.sampler.clone(),
                // Set at submission, where the request's id is known.
                request_id: None,
                constraint: shaping.constraint.clone(),
                logit_bias: shaping.logit_bias.clone(),
            });
        }
    }
    let shape = ResponseShape {
        model: model.name.clone(),
        n,
        prompt_lens,
        stream,
        logprobs,
        chat_output: ChatOutputPlan::default(),
    };
    Ok(ValidatedRequest { shape, choices })
}

/// The request's sampling fields, with the model's `generation_config.json` values where the
/// request is silent (OpenAI's defaults apply after both).
fn with_model_defaults(fields: &SamplingFields, model: &GenerationDefaults) -> SamplingFields {
    let mut fields = fields.clone();
    fields.temperature = fields.temperature.or(model.temperature);
    fields.top_p = fields.top_p.or(model.top_p);
    fields.top_k = fields.top_k.or(model.top_k);
    fields.min_p = fields.min_p.or(model.min_p);
    fields.repetition_penalty = fields.repetition_penalty.or(model.repetition_penalty);
    fields
}

/// Checks an optional number against a rule; `rule` completes "`name` must be ...".
fn ranged(
    name: &str,
    value: Option<f64>,
    default: f64,
    ok: impl Fn(f64) -> bool,
    rule: &str,
) -> Result<f32, ApiError> {
    match value {
        None => Ok(default as f32),
        Some(v) if v.is_finite() && ok(v) => Ok(v as f32),
        Some(v) => Err(ApiError::invalid(
            name,
            format!("`{name}` must be {rule}, got {v}"),
        )),
    }
}

fn sampling_params(fields: &SamplingFields) -> Result<SamplingParams, ApiError> {
    let temperature = ranged(
        "temperature",
        fields.temperature,
        1.0,
        |v| (0.0..=2.0).contains(&v),
        "between 0 and 2",
    )?;
    let top_p = ranged(
        "top_p",
        fields.top_p,
        1.0,
        |v| v > 0.0 && v <= 1.0,
        "greater than 0 and at most 1",
    )?;
    let min_p = ranged(
        "min_p",
        fields.min_p,
        0.0,
        |v| (0.0..=1.0).contains(&v),
        "between 0 and 1",
    )?;
    let penalty = |name, value| {
        ranged(
            name,
            value,
            0.0,
            |v| (-2.0..=2.0).contains(&v),
            "between -2 and 2",
        )
    };
    let penalties = Penalties {
        presence: penalty("presence_penalty", fields.presence_penalty)?,
        frequency: penalty("frequency_penalty", fields.frequency_penalty)?,
        repetition: ranged(
            "repetition_penalty",
            fields.repetition_penalty,
            1.0,
            |v| v > 0.0,
            "greater than 0",
        )?,
    };
    let top_k = match fields.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k >= 1 => u32::try_from(k).unwrap_or(u32::MAX),
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1 or 0 (disabled) or at least 1, got {k}"),
            ));
        }
    };
    Ok(SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        penalties,
        seed: 0,
        // The engine turns log-probabilities on for requests that return them.
        logprobs: false,
        num_top_logprobs: 0,
    })
}

fn choices_per_prompt(n: Option<i64>, num_prompts: usize) -> Result<usize, ApiError> {
    let n = n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("`n` must be between 1 and {MAX_N}, got {n}"),
        ));
    }
    let n = n as usize;
    if n.saturating_mul(num_prompts) > MAX_CHOICES {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{num_prompts} prompts × n = {n} is more than {MAX_CHOICES} choices in one request"
            ),
        ));
    }
    Ok(n)
}

fn seed(seed: Option<&serde_json::Number>) -> Result<Option<u64>, ApiError> {
    let Some(number) = seed else { return Ok(None) };
    // A negative seed is accepted as its two's-complement bits, as Python's `int` seeds are.
    match (number.as_u64(), number.as_i64()) {
        (Some(s), _) => Ok(Some(s)),
        (None, Some(s)) => Ok(Some(s as u64)),
        _ => Err(ApiError::invalid(
            "seed",
            format!("`seed` must be an integer, got {number}"),
        )),
    }
}

fn top_logprobs_count(name: &str, k: i64) -> Result<u32, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS).contains(&k) {
        return Err(ApiError::invalid(
            name,
            format!("`{name}` must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
        ));
    }
    Ok(k as u32)
}

fn chat_logprobs(
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
) -> Result<Option<u32>, ApiError> {
    let top = match top_logprobs {
        None => 0,
        Some(k) => top_logprobs_count("top_logprobs", k)?,
    };
    match logprobs {
        Some(true) => Ok(Some(top)),
        _ if top > 0 => Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        )),
        _ => Ok(None),
    }
}

fn stop_conditions(
    fields: &SamplingFields,
    model: &ModelSummary,
) -> Result<StopConditions, ApiError> {
    let stop_strings = match &fields.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP_STRINGS {
                let message = format!(
                    "`stop` takes at most {MAX_STOP_STRINGS} strings, got {}",
                    items.len()
                );
                return Err(ApiError::invalid("stop", message));
            }
            let strings: Option<Vec<String>> = items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect();
            strings.ok_or_else(|| {
                ApiError::invalid("stop", "`stop` must be a string or a list of strings")
            })?
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "`stop` must be a string or a list of strings",
            ));
        }
    };
    let mut stop_token_ids = Vec::new();
    for &id in fields.stop_token_ids.as_deref().unwrap_or_default() {
        stop_token_ids.push(token_id("stop_token_ids", id, model)?);
    }
    Ok(StopConditions {
        stop_strings,
        stop_token_ids,
        ignore_eos: fields.ignore_eos.unwrap_or(false),
    })
}

fn stream_settings(fields: &SamplingFields) -> Result<Option<StreamSettings>, ApiError> {
    match (fields.stream.unwrap_or(false), &fields.stream_options) {
        (true, options) => {
            let include_usage = options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false);
            Ok(Some(StreamSettings { include_usage }))
        }
        (false, Some(_)) => Err(ApiError::invalid(
            "stream_options",
            "`stream_options` needs `stream: true`",
        )),
        (false, None) => Ok(None),
    }
}

/// The output budget of one prompt: as asked if it fits the context (else 400); unasked, the
/// default capped to the rest of the context.
fn max_tokens(
    requested: Option<i64>,
    default: DefaultMaxTokens,
    prompt_len: usize,
    model: &ModelSummary,
) -> Result<u32, ApiError> {
    let context = model.max_model_len as u64;
    let prompt = prompt_len as u64;
    let too_long = |max_tokens: u64| ApiError::ContextLengthExceeded {
        max_model_len: model.max_model_len,
        requested: prompt + max_tokens,
        prompt_tokens: prompt_len.try_into().unwrap_or(u32::MAX),
        max_tokens,
    };
    match requested {
        Some(m) if m < 1 => Err(ApiError::invalid(
            "max_tokens",
            format!("`max_tokens` must be at least 1, got {m}"),
        )),
        Some(m) if prompt + m as u64 > context => Err(too_long(m as u64)),
        Some(m) => Ok(m as u32),
        None if prompt >= context => Err(too_long(1)),
        None => {
            let room = (context - prompt) as u32;
            Ok(match default {
                DefaultMaxTokens::UpTo(limit) => limit.min(room),
                DefaultMaxTokens::ContextEnd => room,
            })
        }
    }
}

pub(super) fn token_id(name: &str, id: i64, model: &ModelSummary) -> Result<u32, ApiError> {
    if id < 0 || id >= model.vocab_size as i64 {
        let message = format!(
            "token id {id} in `{name}` is outside the vocabulary (0..{})",
            model.vocab_size
        );
        return Err(ApiError::invalid(name, message));
    }
    Ok(id as u32)
}

/// The prompts of a completions request, tokenized; each becomes its own set of choices.
fn completion_prompts(
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

/// A prompt's tokens; a prompt far beyond the context is refused without tokenizing all of it.
fn encode(
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
pub(super) fn chat_messages(
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

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::api::body::parse_body;
    use crate::grammar::GrammarCompiler;
    use crate::model::{ChatTemplate, Tokenizer};

    fn model() -> ModelSummary {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-qwen3");
        let tokenizer = Tokenizer::from_dir(&dir).expect("tokenizer");
        ModelSummary {
            name: "tiny".into(),
            root: dir.display().to_string(),
            generation_defaults: Default::default(),
            max_model_len: 64,
            vocab_size: 448,
            eos_token_ids: vec![447],
            grammars: Arc::new(GrammarCompiler::new(tokenizer.clone(), 448, vec![447])),
            tokenizer,
            chat_template: Some(Arc::new(ChatTemplate::from_dir(&dir).expect("template"))),
        }
    }

    #[test]
    fn a_template_without_tools_gets_them_in_a_fallback_system_prompt() {
        // The tiny model's template renders only roles and contents, as SmolLM2's does.
        let body = r#"{"messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}"#;
        let roomy = || ModelSummary {
            max_model_len: 4096,
            ..model()
        };
        let validate = |body: &str| {
            validate_chat(
                parse_body(body.as_bytes()).expect("body"),
                &roomy(),
                ReasoningParserChoice::Auto,
            )
            .expect("valid")
        };
        let validated = validate(body);
        let prompt = model()
            .tokenizer
            .decode(&validated.choices()[0].prompt_tokens, false)
            .expect("decodes");
        let system = prompt.find("<|im_start|>system\nYou can call the functions");
        assert_eq!(system, Some(0), "{prompt}");
        assert!(prompt.contains(r#""name":"get_weather""#), "{prompt}");
        assert!(
            prompt.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"),
            "the earlier call is written into its turn: {prompt}"
        );
        assert!(prompt.contains("<|im_start|>tool\nsunny"), "{prompt}");
        // tool_choice "none": no tools shown, the answer is not read for calls.
        let none = body.replace(r#""tools""#, r#""tool_choice": "none", "tools""#);
        let validated = validate(&none);
        let prompt = model()
            .tokenizer
            .decode(&validated.choices()[0].prompt_tokens, false)
            .expect("decodes");
        assert!(!prompt.contains("You can call the functions"), "{prompt}");
    }

    #[test]
    fn chat_fields_beyond_text_are_refused_naming_them() {
        let messages = r#""messages": [{"role": "user", "content": "hi"}]"#;
        for (field, value) in [
            ("modalities", r#"["text", "audio"]"#),
            ("audio", r#"{"voice": "alloy", "format": "wav"}"#),
            ("prediction", r#"{"type": "content", "content": "x"}"#),
            ("reasoning_effort", r#""low""#),
            ("web_search_options", "{}"),
            ("functions", r#"[{"name": "f"}]"#),
            ("function_call", r#""auto""#),
            ("verbosity", r#""low""#),
            ("service_tier", r#""flex""#),
            ("store", "true"),
        ] {
            let body = format!(r#"{{{messages}, "{field}": {value}}}"#);
            let error = chat(&body).expect_err(&body);
            let (status, axum::Json(shown)) = <(
                axum::http::StatusCode,
                axum::Json<super::super::ErrorResponse>,
            )>::from(error);
            assert_eq!(status, 400, "{body}");
            assert_eq!(shown.error.param.as_deref(), Some(field), "{body}");
        }
        for (field, value) in [
            ("modalities", r#"["text"]"#),
            ("service_tier", r#""auto""#),
            ("store", "false"),
            ("audio", "null"),
            ("user", r#""someone""#),
        ] {
            let body = format!(r#"{{{messages}, "{field}": {value}}}"#);
            assert!(chat(&body).is_ok(), "{body}");
        }
    }

    #[test]
    fn generation_config_fills_what_the_request_leaves_out() {
        let mut qwen3_like = model();
        qwen3_like.generation_defaults = GenerationDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            max_new_tokens: Some(8),
            ..Default::default()
        };
        let silent = validate_completion(
            parse_body(br#"{"prompt": "hi"}"#).expect("body"),
            &qwen3_like,
        )
        .expect("valid");
        let choice = &silent.choices()[0];
        assert_eq!(choice.sampling.temperature, 0.6);
        assert_eq!((choice.sampling.top_k, choice.sampling.top_p), (20, 0.95));
        assert_eq!(
            choice.max_tokens, 8,
            "max_new_tokens comes before OpenAI's 16"
        );
        let explicit = validate_completion(
            parse_body(br#"{"prompt": "hi", "temperature": 0, "top_k": -1, "max_tokens": 3}"#)
                .expect("body"),
            &qwen3_like,
        )
        .expect("valid");
        let choice = &explicit.choices()[0];
        assert_eq!(
            (choice.sampling.temperature, choice.sampling.top_k),
            (0.0, 0)
        );
        assert_eq!(choice.max_tokens, 3);
        let plain = completion(r#"{"prompt": "hi"}"#).expect("valid");
        assert_eq!(plain.choices()[0].sampling.temperature, 1.0);
        assert_eq!(plain.choices()[0].max_tokens, 16);
    }

    fn completion(json: &str) -> Result<ValidatedRequest, ApiError> {
        validate_completion(parse_body(json.as_bytes())?, &model())
    }

    fn chat(json: &str) -> Result<ValidatedRequest, ApiError> {
        validate_chat(
            parse_body(json.as_bytes())?,
            &model(),
            ReasoningParserChoice::Auto,
        )
    }

    #[test]
    fn invalid_parameters_are_refused_with_the_parameter_named() {
        let cases: &[(&str, &str)] = &[
            (r#"{"prompt": "hi", "max_tokens": -1}"#, "max_tokens"),
            (r#"{"prompt": "hi", "temperature": 2.5}"#, "temperature"),
            (r#"{"prompt": "hi", "top_p": 0}"#, "top_p"),
            (r#"{"prompt": "hi", "top_k": -5}"#, "top_k"),
            (r#"{"prompt": "hi", "min_p": 2}"#, "min_p"),
            (r#"{"prompt": "hi", "n": 0}"#, "n"),
            (
                r#"{"prompt": "hi", "presence_penalty": 5}"#,
                "presence_penalty",
            ),
            (
                r#"{"prompt": "hi", "repetition_penalty": 0}"#,
                "repetition_penalty",
            ),
            (r#"{"prompt": "hi", "logprobs": 50}"#, "logprobs"),
            (
                r#"{"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}"#,
                "stop",
            ),
            (r#"{"prompt": "hi", "stop": 3}"#, "stop"),
            (
                r#"{"prompt": "hi", "stop_token_ids": [448]}"#,
                "stop_token_ids",
            ),
            (r#"{"prompt": "hi", "seed": 1.5}"#, "seed"),
            (
                r#"{"prompt": "hi", "stream_options": {"include_usage": true}}"#,
                "stream_options",
            ),
            (r#"{"prompt": []}"#, "prompt"),
            (r#"{"prompt": [""]}"#, "prompt"),
            (r#"{"prompt": [1, 448]}"#, "prompt"),
            (r#"{"prompt": [[1], "a"]}"#, "prompt"),
            (r#"{"prompt": {"a": 1}}"#, "prompt"),
            (r#"{}"#, "prompt"),
        ];
        for (json, param) in cases {
            match completion(json) {
                Err(ApiError::InvalidParam { param: Some(p), .. }) => {
                    assert_eq!(p, *param, "{json}")
                }
                other => panic!("{json}: {other:?}"),
            }
        }
    }

    #[test]
    fn output_constraints_are_checked_and_compiled() {
        let ok: &[&str] = &[
            r#"{"prompt": "hi", "response_format": {"type": "text"}}"#,
            r#"{"prompt": "hi", "response_format": {"type": "json_object"}}"#,
            r#"{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}"#,
            r#"{"prompt": "hi", "structured_outputs": {"regex": "[a-c]+"}}"#,
            r#"{"prompt": "hi", "structured_outputs": {"choice": ["yes", "no"]}}"#,
            r#"{"prompt": "hi", "structured_outputs": {"grammar": "start: \"a\" | \"b\""}}"#,
            r#"{"prompt": "hi", "structured_outputs": {"json": "{\"type\": \"string\"}"}}"#,
            r#"{"prompt": "hi", "logit_bias": {"5": -100, "7": 100, "9": 0.5}}"#,
        ];
        for json in ok {
            completion(json).unwrap_or_else(|e| panic!("{json}: {e:?}"));
        }
        let v = completion(r#"{"prompt": "hi", "response_format": {"type": "json_object"}}"#)
            .expect("valid");
        assert!(v.choices()[0].constraint.is_some());
        let text =
            completion(r#"{"prompt": "hi", "response_format": {"type": "text"}}"#).expect("valid");
        assert!(text.choices()[0].constraint.is_none());

        let refused: &[(&str, &str)] = &[
            (
                r#"{"prompt": "hi", "logit_bias": {"5": 101}}"#,
                "logit_bias",
            ),
            (
                r#"{"prompt": "hi", "logit_bias": {"5": "x"}}"#,
                "logit_bias",
            ),
            (
                r#"{"prompt": "hi", "logit_bias": {"448": 1}}"#,
                "logit_bias",
            ),
            (r#"{"prompt": "hi", "logit_bias": {"a": 1}}"#, "logit_bias"),
            (r#"{"prompt": "hi", "logit_bias": [1]}"#, "logit_bias"),
            (
                r#"{"prompt": "hi", "response_format": {"type": "xml"}}"#,
                "response_format.type",
            ),
            (
                r#"{"prompt": "hi", "response_format": {"type": "json_schema"}}"#,
                "response_format.json_schema",
            ),
            (
                r#"{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}"#,
                "response_format.json_schema.schema",
            ),
            (
                r#"{"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}"#,
                "structured_outputs",
            ),
            (
                r#"{"prompt": "hi", "structured_outputs": {}}"#,
                "structured_outputs",
            ),
            (
                r#"{"prompt": "hi", "structured_outputs": {"choice": []}}"#,
                "structured_outputs.choice",
            ),
            (
                r#"{"prompt": "hi", "structured_outputs": {"regex": 5}}"#,
                "structured_outputs.regex",
            ),
        ];
        for (json, param) in refused {
            match completion(json) {
                Err(ApiError::InvalidParam { param: Some(p), .. }) => {
                    assert_eq!(p, *param, "{json}")
                }
                other => panic!("{json}: {other:?}"),
            }
        }
        match completion(r#"{"prompt": "hi", "structured_outputs": {"regex": "(a"}}"#) {
            Err(ApiError::Grammar { param, .. }) => assert_eq!(param, "structured_outputs.regex"),
            other => panic!("{other:?}"),
        }
        match completion(
            r#"{"prompt": "hi", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}"#,
        ) {
            Err(ApiError::ConflictingConstraints { first, second }) => {
                assert_eq!(
                    (first.as_str(), second.as_str()),
                    ("response_format", "structured_outputs.regex")
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn context_limits_cap_or_refuse() {
        let ok = completion(r#"{"prompt": [1, 2, 3, 4]}"#).expect("fits");
        assert_eq!(ok.choices()[0].max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS);
        let near_the_end = format!("{{\"prompt\": {:?}}}", vec![1; 60]);
        let capped = completion(&near_the_end).expect("fits");
        assert_eq!(capped.choices()[0].max_tokens, 4);
        let chat_room =
            chat(r#"{"messages": [{"role": "user", "content": "Hi"}]}"#).expect("valid chat");
        assert_eq!(
            chat_room.choices()[0].max_tokens as usize,
            64 - chat_room.shape.prompt_lens[0] as usize,
            "chat generates until the context ends"
        );
        assert!(matches!(
            completion(r#"{"prompt": [1, 2, 3, 4], "max_tokens": 61}"#),
            Err(ApiError::ContextLengthExceeded { .. })
        ));
        let long = format!("{{\"prompt\": {:?}}}", vec![1; 64]);
        assert!(matches!(
            completion(&long),
            Err(ApiError::ContextLengthExceeded { .. })
        ));
        assert_eq!(
            completion(r#"{"prompt": [1, 2, 3, 4], "max_tokens": 60}"#)
                .expect("fits")
                .choices()[0]
                .max_tokens,
            60
        );
    }

    #[test]
    fn prompts_and_choices_are_laid_out_by_index() {
        let v = completion(r#"{"prompt": [[5, 6, 7], [8]], "n": 2, "seed": 10, "temperature": 0.5, "top_k": -1, "logprobs": 3}"#)
            .expect("valid");
        let seeds: Vec<u64> = v.choices().iter().map(|c| c.sampling.seed).collect();
        assert_eq!(
            seeds,
            [10, 11, 10, 11],
            "choice i of every prompt draws from seed + i"
        );
        assert_eq!(v.choices()[2].prompt_tokens, [8]);
        assert_eq!(v.shape.prompt_lens, [3, 1]);
        assert_eq!(
            (v.shape.n, v.shape.num_choices(), v.shape.logprobs),
            (2, 4, Some(3))
        );
        let c = &v.choices()[0];
        assert_eq!(
            (
                c.sampling.temperature,
                c.sampling.top_k,
                c.sampling.num_top_logprobs,
                c.logprobs
            ),
            (0.5, 0, 3, true)
        );
    }

    #[test]
    fn chat_messages_render_through_the_template() {
        let v = chat(
            r#"{"messages": [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the time?"}]}],
                "max_completion_tokens": 5, "logprobs": true, "top_logprobs": 2}"#,
        )
        .expect("valid");
        let m = model();
        let text = m
            .tokenizer
            .decode(&v.choices()[0].prompt_tokens, false)
            .expect("decode");
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is\nthe time?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!((v.choices()[0].max_tokens, v.shape.logprobs), (5, Some(2)));

        let refused: &[&str] = &[
            r#"{"messages": []}"#,
            r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#,
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#,
            r#"{"messages": [{"role": "user", "content": 5}]}"#,
            r#"{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}"#,
            r#"{"messages": [{"role": "user", "content": "hi"}], "model": "other"}"#,
            r#"{"prompt": "hi"}"#,
        ];
        for json in refused {
            assert!(chat(json).is_err(), "{json}");
        }
        let mut no_template = model();
        no_template.chat_template = None;
        let body =
            parse_body(br#"{"messages": [{"role": "user", "content": "hi"}]}"#).expect("parse");
        assert!(matches!(
            validate_chat(body, &no_template, ReasoningParserChoice::Auto),
            Err(ApiError::NoChatTemplate { .. })
        ));
    }
}
