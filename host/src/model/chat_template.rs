//! The chat template of a model folder, rendered with minijinja the way Hugging Face renders it.
//!
//! HF uses Jinja2 with `trim_blocks`, `lstrip_blocks` and loop controls, and adds
//! `raise_exception`, `strftime_now` and a `tojson` that is `json.dumps` without HTML escaping.
//! Templates also call Python string and dict methods (`.startswith`, `.split`, `.items()`),
//! which `minijinja-contrib`'s pycompat callback provides, and print values the Python way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, State, Value};
use serde::Deserialize;

use super::error::ModelError;
use super::pyfmt::{self, JsonOptions};

const TEMPLATE_NAME: &str = "chat";
const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// Newer `transformers` versions save the template in its own file, which then takes priority.
const JINJA_FILE: &str = "chat_template.jinja";
const LEGACY_JSON_FILE: &str = "chat_template.json";

/// One message of a conversation, in the shape HF chat templates read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// Set only when the client sent it; templates test `reasoning_content is defined`.
    pub reasoning_content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    /// For `role: tool` messages, the call this message answers.
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..ChatMessage::default()
        }
    }
}

/// A function call an assistant message made.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ToolCall {
    pub id: Option<String>,
    pub name: String,
    /// The arguments as JSON text (as in the OpenAI API). Templates see them parsed, keys in
    /// their written order, as HF-compatible servers pass them; text that is not JSON is
    /// passed as a string.
    pub arguments: String,
}

/// Everything a render can take beyond the messages.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions<'a> {
    pub add_generation_prompt: bool,
    /// The request's `tools` list as JSON text, so `tool | tojson` keeps the written key order.
    pub tools_json: Option<&'a str>,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`).
    pub kwargs: BTreeMap<String, serde_json::Value>,
}

/// How a model writes a tool call, as its chat template teaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallSyntax {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Qwen, Hermes), also
    /// what the fallback prompt asks of models whose template shows no tools.
    Tagged,
    /// A bare `{"name": ..., "parameters": {...}}` object (Llama 3).
    Json,
}

/// What a template's text says about the model's conventions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TemplateTraits {
    renders_tools: bool,
    tool_call_syntax: ToolCallSyntax,
    thinks: bool,
}

impl TemplateTraits {
    fn of(source: &str) -> TemplateTraits {
        let tagged = source.contains("<tool_call>");
        TemplateTraits {
            renders_tools: source.contains("tools"),
            tool_call_syntax: if tagged || !source.contains("parameters") {
                ToolCallSyntax::Tagged
            } else {
                ToolCallSyntax::Json
            },
            thinks: source.contains("<think>"),
        }
    }
}

/// A compiled chat template plus the special tokens it may print.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The file the template text came from, named in every error.
    path: PathBuf,
    special_tokens: Vec<(&'static str, String)>,
    traits: TemplateTraits,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("path", &self.path)
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

#[derive(Deserialize)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<TemplateField>,
    #[serde(default)]
    bos_token: Option<TokenField>,
    #[serde(default)]
    eos_token: Option<TokenField>,
    #[serde(default)]
    unk_token: Option<TokenField>,
    #[serde(default)]
    pad_token: Option<TokenField>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

/// A special token: a plain string, or an AddedToken object.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenField {
    Text(String),
    Added { content: String },
}

impl TokenField {
    fn into_text(self) -> String {
        match self {
            TokenField::Text(text) | TokenField::Added { content: text } => text,
        }
    }
}

#[derive(Deserialize)]
struct LegacyTemplateFile {
    chat_template: String,
}

/// The message a template passed to `raise_exception`, carried through minijinja's error.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TemplateException(String);

impl ChatTemplate {
    /// Loads the template of a model folder: `chat_template.jinja` if present, else the
    /// `chat_template` of `tokenizer_config.json` (the `default` one of a named list), else
    /// `chat_template.json`. Special tokens come from `tokenizer_config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, ModelError> {
        let dir = dir.as_ref();
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config = if config_path.is_file() {
            Some(read_json::<TokenizerConfig>(
                &config_path,
                "tokenizer config",
            )?)
        } else {
            None
        };
        let (path, source, config) = find_template(dir, &config_path, config)?;

        let mut special_tokens = Vec::new();
        if let Some(config) = config {
            let fields = [
                ("bos_token", config.bos_token),
                ("eos_token", config.eos_token),
                ("unk_token", config.unk_token),
                ("pad_token", config.pad_token),
            ];
            for (name, field) in fields {
                if let Some(field) = field {
                    special_tokens.push((name, field.into_text()));
                }
            }
        }
        Self::new(path, source, special_tokens)
    }

    /// Compiles `source`; `path` names where it came from in errors.
    pub fn new(
        path: PathBuf,
        source: String,
        special_tokens: Vec<(&'static str, String)>,
    ) -> Result<Self, ModelError> {
        let mut env = hf_environment();
        let traits = TemplateTraits::of(&source);
        if let Err(e) = env.add_template_owned(TEMPLATE_NAME, source) {
            return Err(ModelError::ChatTemplate {
                message: describe(&e),
                path,
            });
        }
        Ok(ChatTemplate {
            env,
            path,
            special_tokens,
            traits,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the template shows the request's `tools` to the model.
    pub fn renders_tools(&self) -> bool {
        self.traits.renders_tools
    }

    /// The syntax the model writes tool calls in.
    pub fn tool_call_syntax(&self) -> ToolCallSyntax {
        self.traits.tool_call_syntax
    }

    /// Whether the model reasons in a `<think>` block before it answers.
    pub fn thinks(&self) -> bool {
        self.traits.thinks
    }

    /// Renders a conversation with no tools and no extra variables.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        let options = RenderOptions {
            add_generation_prompt,
            ..RenderOptions::default()
        };
        self.render_with(messages, &options)
    }

    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        options: &RenderOptions<'_>,
    ) -> Result<String, ModelError> {
        let tools = match options.tools_json {
            None => Value::from(()),
            Some(text) => {
                serde_json::from_str::<Value>(text).map_err(|e| ModelError::ChatTemplate {
                    path: self.path.clone(),
                    message: format!("tools are not valid JSON: {e}"),
                })?
            }
        };
        let mut context: Vec<(String, Value)> = Vec::new();
        for (name, token) in &self.special_tokens {
            context.push((name.to_string(), Value::from(token.as_str())));
        }
        for (name, value) in &options.kwargs {
            context.push((name.clone(), Value::from(minijinja::value::Serde(value))));
        }
        context.push(("messages".into(), messages_value(messages)));
        context.push(("tools".into(), tools));
        context.push(("documents".into(), Value::from(())));
        context.push((
            "add_generation_prompt".into(),
            Value::from(options.add_generation_prompt),
        ));

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| self.render_error(&e))?;
        template
            .render(Value::from_pairs(context))
            .map_err(|e| self.render_error(&e))
    }

    fn render_error(&self, error: &Error) -> ModelError {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
        while let Some(current) = source {
            if let Some(TemplateException(message)) = current.downcast_ref::<TemplateException>() {
                return ModelError::ChatTemplateRaised {
                    path: self.path.clone(),
                    message: message.clone(),
                };
            }
            source = current.source();
        }
        ModelError::ChatTemplate {
            path: self.path.clone(),
            message: describe(error),
        }
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(
    path: &Path,
    what: &'static str,
) -> Result<T, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        what,
        source,
    })
}

type FoundTemplate = (PathBuf, String, Option<TokenizerConfig>);

fn find_template(
    dir: &Path,
    config_path: &Path,
    mut config: Option<TokenizerConfig>,
) -> Result<FoundTemplate, ModelError> {
    let jinja_path = dir.join(JINJA_FILE);
    if jinja_path.is_file() {
        let source = std::fs::read_to_string(&jinja_path).map_err(|source| ModelError::Io {
            path: jinja_path.clone(),
            source,
        })?;
        return Ok((jinja_path, source, config));
    }
    let from_config = config.as_mut().and_then(|c| c.chat_template.take());
    match from_config {
        Some(TemplateField::One(source)) => {
            return Ok((config_path.to_path_buf(), source, config));
        }
        Some(TemplateField::Named(list)) => {
            let names: Vec<String> = list.iter().map(|t| t.name.clone()).collect();
            if let Some(default) = list.into_iter().find(|t| t.name == "default") {
                return Ok((config_path.to_path_buf(), default.template, config));
            }
            return Err(ModelError::ChatTemplateMissing {
                dir: dir.to_path_buf(),
                searched: format!(
                    "{TOKENIZER_CONFIG_FILE} has templates {names:?} but none named \"default\""
                ),
            });
        }
        None => {}
    }
    let legacy_path = dir.join(LEGACY_JSON_FILE);
    if legacy_path.is_file() {
        let legacy: LegacyTemplateFile = read_json(&legacy_path, "chat template file")?;
        return Ok((legacy_path, legacy.chat_template, config));
    }
    Err(ModelError::ChatTemplateMissing {
        dir: dir.to_path_buf(),
        searched: format!(
            "none of {JINJA_FILE}, the \"chat_template\" field of {TOKENIZER_CONFIG_FILE}, \
             {LEGACY_JSON_FILE}"
        ),
    })
}

/// The environment HF's `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
/// extensions=[loopcontrols])` corresponds to.
fn hf_environment() -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build();
    if let Ok(syntax) = syntax {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

/// Prints values as Jinja2 does: through Python's `str`.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &mut State,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        minijinja::value::ValueKind::String | minijinja::value::ValueKind::Undefined => {
            minijinja::escape_formatter(out, state, value)
        }
        minijinja::value::ValueKind::Number if value.is_integer() => {
            minijinja::escape_formatter(out, state, value)
        }
        _ => out
            .write_str(&pyfmt::py_str(value))
            .map_err(|e| Error::new(ErrorKind::WriteFailure, "cannot write output").with_source(e)),
    }
}

/// HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`;
/// `separators` and `sort_keys` are taken by keyword only.
fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let pick = |positional: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        match positional {
            Some(value) => Ok(Some(value)),
            None => kwargs.get::<Option<Value>>(name),
        }
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?;
    let indent = pick(indent, "indent")?;
    let separators = pick(None, "separators")?;
    let sort_keys = pick(None, "sort_keys")?;
    kwargs.assert_all_used()?;

    let mut options = JsonOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..JsonOptions::default()
    };
    match indent {
        Some(indent) if indent.is_none() || indent.is_undefined() => {}
        Some(indent) => {
            options.indent = Some(match indent.as_str() {
                Some(text) => text.to_string(),
                None => {
                    let width = indent.as_i64().ok_or_else(|| {
                        Error::new(
                            ErrorKind::InvalidOperation,
                            "tojson: indent must be an int or a string",
                        )
                    })?;
                    " ".repeat(width.max(0) as usize)
                }
            });
            options.item_separator = ",".to_string();
        }
        None => {}
    }
    if let Some(separators) = separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        let pair: Vec<Value> = separators.try_iter()?.collect();
        match pair.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                options.item_separator = item.as_str().unwrap_or(",").to_string();
                options.key_separator = key.as_str().unwrap_or(":").to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ));
            }
        }
    }
    pyfmt::to_json(value, &options)
        .map(Value::from)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, "tojson failed").with_source(e))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(TemplateException(message)))
}

/// `datetime.now().strftime(format)`, in local time as HF does.
fn strftime_now(format: String) -> Result<Value, Error> {
    use std::fmt::Write;
    let items = chrono::format::StrftimeItems::new(&format)
        .parse()
        .map_err(|e| {
            Error::new(
                ErrorKind::InvalidOperation,
                format!("strftime_now: bad format {format:?}: {e}"),
            )
        })?;
    let mut out = String::new();
    write!(
        out,
        "{}",
        chrono::Local::now().format_with_items(items.iter())
    )
    .map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format {format:?}"),
        )
    })?;
    Ok(Value::from(out))
}

/// The messages as HF passes them: a list of dicts, optional keys absent rather than null.
fn messages_value(messages: &[ChatMessage]) -> Value {
    messages.iter().map(message_value).collect()
}

fn message_value(message: &ChatMessage) -> Value {
    let mut fields: Vec<(&str, Value)> = vec![
        ("role", Value::from(message.role.as_str())),
        ("content", Value::from(message.content.as_str())),
    ];
    if let Some(reasoning) = &message.reasoning_content {
        fields.push(("reasoning_content", Value::from(reasoning.as_str())));
    }
    if !message.tool_calls.is_empty() {
        let calls: Value = message.tool_calls.iter().map(tool_call_value).collect();
        fields.push(("tool_calls", calls));
    }
    if let Some(id) = &message.tool_call_id {
        fields.push(("tool_call_id", Value::from(id.as_str())));
    }
    Value::from_pairs(fields)
}

fn tool_call_value(call: &ToolCall) -> Value {
    let arguments = serde_json::from_str::<Value>(&call.arguments)
        .unwrap_or_else(|_| Value::from(call.arguments.as_str()));
    let function = Value::from_pairs([
        ("name", Value::from(call.name.as_str())),
        ("arguments", arguments),
    ]);
    let mut fields: Vec<(&str, Value)> = Vec::new();
    if let Some(id) = &call.id {
        fields.push(("id", Value::from(id.as_str())));
    }
    fields.push(("type", Value::from("function")));
    fields.push(("function", function));
    Value::from_pairs(fields)
}

/// minijinja's message with its template location, plus the chain of causes.
fn describe(error: &Error) -> String {
    let mut message = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests;
