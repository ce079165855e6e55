//! A request's sampling fields checked into engine parameters: value ranges, the seed, choices
//! per prompt, logprobs, stop conditions, stream settings and the output budget.

use plughost_sdk::sampler::{Penalties, SamplingParams};
use serde_json::Value;

use crate::api::error::ApiError;
use crate::api::openai::SamplingFields;
use crate::engine::{ModelSummary, StopConditions};

use super::{
    BudgetBeyondContext, DefaultMaxTokens, MAX_CHOICES, MAX_N, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS,
    StreamSettings,
};

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

pub(super) fn sampling_params(fields: &SamplingFields) -> Result<SamplingParams, ApiError> {
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

pub(super) fn choices_per_prompt(n: Option<i64>, num_prompts: usize) -> Result<usize, ApiError> {
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

pub(super) fn seed(seed: Option<&serde_json::Number>) -> Result<Option<u64>, ApiError> {
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

pub(super) fn top_logprobs_count(name: &str, k: i64) -> Result<u32, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS).contains(&k) {
        return Err(ApiError::invalid(
            name,
            format!("`{name}` must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
        ));
    }
    Ok(k as u32)
}

/// vLLM's `prompt_logprobs`, which it refuses on streams, as here: they would hold back the
/// first chunk until the whole prompt is scored.
pub(super) fn prompt_logprobs_count(fields: &SamplingFields) -> Result<Option<u32>, ApiError> {
    let Some(k) = fields.prompt_logprobs else {
        return Ok(None);
    };
    let k = top_logprobs_count("prompt_logprobs", k)?;
    if fields.stream == Some(true) {
        return Err(ApiError::invalid(
            "prompt_logprobs",
            "`prompt_logprobs` is not available with `stream: true`",
        ));
    }
    Ok(Some(k))
}

pub(super) fn chat_logprobs(
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

pub(super) fn stop_conditions(
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

pub(super) fn stream_settings(fields: &SamplingFields) -> Result<Option<StreamSettings>, ApiError> {
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

/// The output budget of one prompt: as asked if it fits the context (else 400, or the rest of
/// the context where the route clamps); unasked, the default capped to the rest of the context.
pub(super) fn max_tokens(
    requested: Option<i64>,
    default: DefaultMaxTokens,
    beyond_context: BudgetBeyondContext,
    allow_zero: bool,
    prompt_len: usize,
    model: &ModelSummary,
) -> Result<u32, ApiError> {
    let least = i64::from(!allow_zero);
    let context = model.max_model_len as u64;
    let prompt = prompt_len as u64;
    let too_long = |max_tokens: u64| ApiError::ContextLengthExceeded {
        max_model_len: model.max_model_len,
        requested: prompt + max_tokens,
        prompt_tokens: prompt_len.try_into().unwrap_or(u32::MAX),
        max_tokens,
    };
    match requested {
        Some(m) if m < least => Err(ApiError::invalid(
            "max_tokens",
            format!("`max_tokens` must be at least {least}, got {m}"),
        )),
        Some(m) if beyond_context == BudgetBeyondContext::Clamp && prompt < context => {
            Ok((m as u64).min(context - prompt) as u32)
        }
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

pub(in crate::api) fn token_id(name: &str, id: i64, model: &ModelSummary) -> Result<u32, ApiError> {
    if id < 0 || id >= model.vocab_size as i64 {
        let message = format!(
            "token id {id} in `{name}` is outside the vocabulary (0..{})",
            model.vocab_size
        );
        return Err(ApiError::invalid(name, message));
    }
    Ok(id as u32)
}
