//! Turns OpenAI request bodies into validated engine requests: the model checked, parameters in
//! range, prompts tokenized, token ids in the vocabulary and every choice within the context.
//!
//! [`ValidatedRequest`] is the only producer of [`GenerationRequest`]s in the API layer: a
//! handler that has one knows the engine can run every choice as given.

use plughost_sdk::sampler::SamplingParams;
use serde_json::Value;

use crate::engine::{GenerationRequest, ModelSummary};
use crate::model::{ChatMessage, GenerationDefaults, RenderOptions};

use super::chat_output::ChatOutputPlan;
use super::constraints::ConstraintSource;
use super::error::ApiError;
use super::openai::{ChatCompletionRequest, CompletionRequest, GenerationBody, SamplingFields};
use super::options::ReasoningParserChoice;
use super::prompt_logprobs::PromptEcho;
use super::reasoning::{ReasoningParser, ReasoningSyntax};
use super::tools::ChatTools;
use crate::grammar::{Constraint, ReasoningBlock};

mod prompts;
mod sampling;
#[cfg(test)]
mod tests;

pub(super) use prompts::chat_messages;
use prompts::{completion_prompts, echo_texts, encode};
pub(super) use sampling::token_id;
use sampling::{
    chat_logprobs, choices_per_prompt, max_tokens, prompt_logprobs_count, sampling_params, seed,
    stop_conditions, stream_settings, top_logprobs_count,
};

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
pub(super) enum DefaultMaxTokens {
    /// At most this many, fewer if the context ends first (OpenAI's completions).
    UpTo(u32),
    /// Until the context ends (chat, as OpenAI's chat does).
    ContextEnd,
}

/// What happens to a `max_tokens` that does not fit in the context beside the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetBeyondContext {
    /// 400 `context_length_exceeded`, as OpenAI's routes answer.
    Refuse,
    /// Cut to what fits: Anthropic's clients send a large `max_tokens` whatever the model.
    Clamp,
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
    /// Completions' `echo`: per prompt, what goes before its choices' output.
    pub echo: Option<Vec<PromptEcho>>,
    /// vLLM's `prompt_logprobs`: `Some(k)` returns each prompt token's logprob with `k`
    /// alternatives.
    pub prompt_logprobs: Option<u32>,
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
    let echo = request.echo == Some(true);
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
    let echoes = echo.then(|| echo_texts(request.prompt.as_ref(), &prompts, model));
    let default = DefaultMaxTokens::UpTo(COMPLETIONS_DEFAULT_MAX_TOKENS);
    let budget = Budget {
        default,
        beyond_context: BudgetBeyondContext::Refuse,
        // An echoed prompt alone is an answer: evaluation harnesses score prompts this way.
        allow_zero: echo,
    };
    let mut validated = build(&sampling, prompts, logprobs, budget, model, None)?;
    if let (Some(echoes), Some(k)) = (&echoes, logprobs) {
        // The echoed prompt's logprobs come with the output's, `logprobs` alternatives each.
        for choice in &mut validated.choices {
            choice.prompt_logprobs = Some(choice.prompt_logprobs.unwrap_or(0).max(k));
        }
        debug_assert_eq!(echoes.len(), validated.shape.prompt_lens.len());
    }
    validated.shape.echo = echoes;
    Ok(validated)
}

pub fn validate_chat(
    body: GenerationBody<ChatCompletionRequest>,
    model: &ModelSummary,
    reasoning_parser: ReasoningParserChoice,
) -> Result<ValidatedRequest, ApiError> {
    validate_conversation(body, model, reasoning_parser, BudgetBeyondContext::Refuse)
}

/// A chat request, whichever API it came in by: the Messages and Responses routes translate
/// their bodies into one and validate it here, so every route shares the template, the
/// tools, the grammar and the engine path.
pub fn validate_conversation(
    body: GenerationBody<ChatCompletionRequest>,
    model: &ModelSummary,
    reasoning_parser: ReasoningParserChoice,
    beyond_context: BudgetBeyondContext,
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
        Budget {
            default: DefaultMaxTokens::ContextEnd,
            beyond_context,
            allow_zero: false,
        },
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

/// The output budget rules of a route.
#[derive(Debug, Clone, Copy)]
struct Budget {
    default: DefaultMaxTokens,
    beyond_context: BudgetBeyondContext,
    /// `max_tokens: 0` is allowed (the prompt is the answer).
    allow_zero: bool,
}

/// The engine requests of every prompt's choices, with the shared parameters checked once.
fn build(
    fields: &SamplingFields,
    prompts: Vec<Vec<u32>>,
    logprobs: Option<u32>,
    budget: Budget,
    model: &ModelSummary,
    forced_tool_call: Option<ConstraintSource>,
) -> Result<ValidatedRequest, ApiError> {
    let fields = &with_model_defaults(fields, &model.generation_defaults);
    let default_max_tokens = match model.generation_defaults.max_new_tokens {
        Some(n) => DefaultMaxTokens::UpTo(n),
        None => budget.default,
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
    let prompt_logprobs = prompt_logprobs_count(fields)?;
    let shaping = super::constraints::output_shaping(fields, model, forced_tool_call)?;
    let requested = fields.max_completion_tokens.or(fields.max_tokens);
    let mut choices = Vec::with_capacity(prompts.len() * n);
    let mut prompt_lens = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let max_tokens = max_tokens(
            requested,
            default_max_tokens,
            budget.beyond_context,
            budget.allow_zero,
            prompt.len(),
            model,
        )?;
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
                prompt_logprobs,
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
        echo: None,
        prompt_logprobs,
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
