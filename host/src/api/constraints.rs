//! The request fields that shape the output before sampling: `response_format`, vLLM's `structured_outputs` and `logit_bias`, checked and turned into a compiled grammar and a bias.
//!
//! At most one field may constrain the output; the tools layer adds its own forced-call
//! constraint through [`ConstraintSource`] and [`single_source`] so the same rule holds there.

use serde_json::Value;

use crate::engine::ModelSummary;
use crate::grammar::{CompiledGrammar, Constraint, LogitBias, MAX_LOGIT_BIAS};

use super::error::ApiError;
use super::openai::SamplingFields;

/// A constraint and the request field it came from (named in errors).
#[derive(Debug, Clone, PartialEq)]
pub struct ConstraintSource {
    pub field: String,
    pub constraint: Constraint,
}

impl ConstraintSource {
    fn new(field: &str, constraint: Constraint) -> ConstraintSource {
        ConstraintSource {
            field: field.to_string(),
            constraint,
        }
    }

    /// Compiles the constraint for the model (once per distinct constraint; later requests hit
    /// the cache). An invalid schema, regex or grammar is a 400 with llguidance's message.
    pub fn compile(&self, model: &ModelSummary) -> Result<CompiledGrammar, ApiError> {
        model
            .grammars
            .compile(&self.constraint)
            .map_err(|source| ApiError::Grammar {
                param: self.field.clone(),
                source,
            })
    }
}

/// The one source among `sources` that constrains the output; two are a 400 naming both.
pub fn single_source(
    sources: impl IntoIterator<Item = Option<ConstraintSource>>,
) -> Result<Option<ConstraintSource>, ApiError> {
    let mut found: Option<ConstraintSource> = None;
    for source in sources.into_iter().flatten() {
        if let Some(first) = &found {
            return Err(ApiError::ConflictingConstraints {
                first: first.field.clone(),
                second: source.field,
            });
        }
        found = Some(source);
    }
    Ok(found)
}

/// The output shaping of a request: its compiled grammar, if any, and its bias.
#[derive(Debug, Clone, Default)]
pub struct OutputShaping {
    pub constraint: Option<CompiledGrammar>,
    pub logit_bias: LogitBias,
}

/// Reads `response_format`, `structured_outputs` and `logit_bias`, takes the grammar a
/// required tool call needs, refuses more than one constraint, and compiles the one there is.
pub fn output_shaping(
    fields: &SamplingFields,
    model: &ModelSummary,
    forced_tool_call: Option<ConstraintSource>,
) -> Result<OutputShaping, ApiError> {
    let source = single_source([
        response_format(fields.response_format.as_ref())?,
        structured_outputs(fields.structured_outputs.as_ref())?,
        forced_tool_call,
    ])?;
    let logit_bias = logit_bias(fields.logit_bias.as_ref(), model.vocab_size)?;
    let constraint = source.map(|s| s.compile(model)).transpose()?;
    Ok(OutputShaping {
        constraint,
        logit_bias,
    })
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema` with
/// `json_schema.schema` (and optional `name`, `description`, `strict`).
pub fn response_format(value: Option<&Value>) -> Result<Option<ConstraintSource>, ApiError> {
    const FIELD: &str = "response_format";
    let object = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(object)) => object,
        Some(_) => {
            return Err(ApiError::invalid(
                FIELD,
                "`response_format` must be an object",
            ));
        }
    };
    for key in object.keys() {
        if !matches!(key.as_str(), "type" | "json_schema") {
            return Err(ApiError::invalid(
                format!("{FIELD}.{key}"),
                format!(
                    "unknown field `{key}` in `response_format`; expected `type` and `json_schema`"
                ),
            ));
        }
    }
    let kind = object.get("type").and_then(Value::as_str);
    let has_schema = object.get("json_schema").is_some_and(|v| !v.is_null());
    match kind {
        Some("text") | Some("json_object") if has_schema => Err(ApiError::invalid(
            format!("{FIELD}.json_schema"),
            "`response_format.json_schema` goes with `type: \"json_schema\"`",
        )),
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ConstraintSource::new(FIELD, Constraint::JsonObject))),
        Some("json_schema") => {
            let schema = json_schema_spec(object.get("json_schema"))?;
            Ok(Some(ConstraintSource::new(
                "response_format.json_schema.schema",
                Constraint::JsonSchema(schema),
            )))
        }
        Some(other) => Err(ApiError::invalid(
            format!("{FIELD}.type"),
            format!(
                "unknown `response_format.type` `{other}`; expected `text`, `json_object` or `json_schema`"
            ),
        )),
        None => Err(ApiError::invalid(
            format!("{FIELD}.type"),
            "`response_format.type` is required: `text`, `json_object` or `json_schema`",
        )),
    }
}

/// The schema of `response_format.json_schema`, its other keys checked.
fn json_schema_spec(value: Option<&Value>) -> Result<Value, ApiError> {
    const FIELD: &str = "response_format.json_schema";
    let Some(Value::Object(spec)) = value else {
        return Err(ApiError::invalid(
            FIELD,
            "`response_format.json_schema` must be an object holding `name` and `schema`",
        ));
    };
    for (key, value) in spec {
        let ok = match key.as_str() {
            "name" | "description" => value.is_string() || value.is_null(),
            "strict" => value.is_boolean() || value.is_null(),
            "schema" => value.is_object() || value.is_boolean(),
            _ => {
                return Err(ApiError::invalid(
                    format!("{FIELD}.{key}"),
                    format!(
                        "unknown field `{key}` in `{FIELD}`; expected `name`, `description`, `schema` and `strict`"
                    ),
                ));
            }
        };
        if !ok {
            let expected = match key.as_str() {
                "strict" => "a boolean",
                "schema" => "a JSON schema (an object)",
                _ => "a string",
            };
            return Err(ApiError::invalid(
                format!("{FIELD}.{key}"),
                format!("`{FIELD}.{key}` must be {expected}"),
            ));
        }
    }
    spec.get("schema").cloned().ok_or_else(|| {
        ApiError::invalid(
            format!("{FIELD}.schema"),
            "`response_format.json_schema.schema` is required",
        )
    })
}

/// vLLM's `structured_outputs`: exactly one of `json` (a schema, or its JSON text), `regex`,
/// `choice` (a list of strings) or `grammar` (Lark, as llguidance reads it).
pub fn structured_outputs(value: Option<&Value>) -> Result<Option<ConstraintSource>, ApiError> {
    const FIELD: &str = "structured_outputs";
    let object = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(object)) => object,
        Some(_) => {
            return Err(ApiError::invalid(
                FIELD,
                "`structured_outputs` must be an object",
            ));
        }
    };
    let set: Vec<(&String, &Value)> = object.iter().filter(|(_, v)| !v.is_null()).collect();
    let [(key, value)] = set.as_slice() else {
        return Err(ApiError::invalid(
            FIELD,
            format!(
                "`structured_outputs` must set exactly one of `json`, `regex`, `choice` and `grammar`; it sets {}",
                set.len()
            ),
        ));
    };
    let field = format!("{FIELD}.{key}");
    let wrong = |expected: &str| ApiError::invalid(&field, format!("`{field}` must be {expected}"));
    let constraint = match (key.as_str(), value) {
        ("json", Value::Object(_) | Value::Bool(_)) => Constraint::JsonSchema((*value).clone()),
        ("json", Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(schema @ (Value::Object(_) | Value::Bool(_))) => Constraint::JsonSchema(schema),
            _ => return Err(wrong("a JSON schema (an object, or its JSON text)")),
        },
        ("json", _) => return Err(wrong("a JSON schema (an object, or its JSON text)")),
        ("regex", Value::String(regex)) => Constraint::Regex(regex.clone()),
        ("regex", _) => return Err(wrong("a string")),
        ("grammar", Value::String(grammar)) => Constraint::Lark(grammar.clone()),
        ("grammar", _) => return Err(wrong("a string holding a Lark grammar")),
        ("choice", Value::Array(items)) if !items.is_empty() => {
            let choices: Option<Vec<String>> = items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect();
            match choices {
                Some(choices) => Constraint::Choice(choices),
                None => return Err(wrong("a non-empty list of strings")),
            }
        }
        ("choice", _) => return Err(wrong("a non-empty list of strings")),
        (other, _) => {
            return Err(ApiError::Unsupported {
                param: field.clone(),
                message: format!(
                    "`structured_outputs.{other}` is not supported; use `json`, `regex`, `choice` or `grammar`"
                ),
            });
        }
    };
    Ok(Some(ConstraintSource::new(&field, constraint)))
}

/// OpenAI's `logit_bias`: token ids (as strings) to offsets in [-100, 100].
pub fn logit_bias(value: Option<&Value>, vocab_size: u32) -> Result<LogitBias, ApiError> {
    const FIELD: &str = "logit_bias";
    let object = match value {
        None | Some(Value::Null) => return Ok(LogitBias::default()),
        Some(Value::Object(object)) => object,
        Some(_) => {
            return Err(ApiError::invalid(
                FIELD,
                "`logit_bias` must be an object mapping token ids to numbers",
            ));
        }
    };
    let mut entries = Vec::with_capacity(object.len());
    for (key, value) in object {
        let token: u32 = key.trim().parse().map_err(|_| {
            ApiError::invalid(
                FIELD,
                format!("`logit_bias` keys must be token ids; `{key}` is not one"),
            )
        })?;
        if token >= vocab_size {
            return Err(ApiError::invalid(
                FIELD,
                format!(
                    "token id {token} in `logit_bias` is outside the vocabulary (0..{vocab_size})"
                ),
            ));
        }
        let bias = value
            .as_f64()
            .filter(|b| b.abs() <= f64::from(MAX_LOGIT_BIAS));
        let Some(bias) = bias else {
            return Err(ApiError::invalid(
                FIELD,
                format!(
                    "`logit_bias` values must be numbers from -100 to 100; token {token} has {value}"
                ),
            ));
        };
        entries.push((token, bias as f32));
    }
    Ok(LogitBias::new(entries))
}
