//! The function tools of a chat request: checked, shown to the model (by its chat template, or by a fallback system prompt for templates without tools), and the grammar that makes a required call parse.

use serde_json::{Value, json};

use crate::model::ToolCallSyntax;

use super::error::ApiError;

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionTool {
    pub name: String,
    pub description: Option<String>,
    /// The JSON schema of the arguments object.
    pub parameters: Value,
}

/// What the request allows or demands of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No call: the tools are not shown and the output is not parsed.
    None,
    /// The model decides; calls in the output are parsed.
    Auto,
    /// At least one call, enforced by a grammar.
    Required,
    /// A call of this function, enforced by a grammar.
    Named(String),
}

/// A request's tools and its choice among them.
#[derive(Debug, Clone)]
pub struct ChatTools {
    tools: Vec<FunctionTool>,
    choice: ToolChoice,
    /// Several calls in one answer (OpenAI's `parallel_tool_calls`, default true).
    parallel: bool,
    /// The `tools` list as the client wrote it, for the chat template.
    as_sent: Value,
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

impl ChatTools {
    /// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` when no tool is offered.
    pub fn from_request(
        tools: Option<&Value>,
        tool_choice: Option<&Value>,
        parallel_tool_calls: Option<bool>,
    ) -> Result<Option<ChatTools>, ApiError> {
        let list = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) => list.clone(),
            Some(_) => return Err(invalid("tools", "`tools` must be a list of tools")),
        };
        let mut functions: Vec<FunctionTool> = Vec::with_capacity(list.len());
        for (i, tool) in list.iter().enumerate() {
            let function = function_tool(i, tool)?;
            if functions.iter().any(|f| f.name == function.name) {
                return Err(invalid(
                    &format!("tools[{i}].function.name"),
                    format!("two tools are named `{}`", function.name),
                ));
            }
            functions.push(function);
        }
        let choice = tool_choice_of(tool_choice, &functions)?;
        if functions.is_empty() {
            return Ok(None);
        }
        Ok(Some(ChatTools {
            tools: functions,
            choice,
            parallel: parallel_tool_calls.unwrap_or(true),
            as_sent: Value::Array(list),
        }))
    }

    pub fn choice(&self) -> &ToolChoice {
        &self.choice
    }

    /// Whether the model sees the tools and its output is read for calls.
    pub fn in_use(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The `tools` list for the chat template.
    pub fn template_json(&self) -> String {
        self.as_sent.to_string()
    }

    pub fn has(&self, name: &str) -> bool {
        self.tools.iter().any(|t| t.name == name)
    }

    /// The names of the functions offered.
    pub fn names(&self) -> Vec<String> {
        self.tools.iter().map(|t| t.name.clone()).collect()
    }

    /// The system text that offers the tools to a model whose template cannot, asking for
    /// calls in the `<tool_call>` syntax the output parser reads.
    pub fn fallback_prompt(&self) -> String {
        let mut text = String::from(
            "You can call the functions listed below. To call one, answer with only this, once \
             per call:\n<tool_call>\n{\"name\": \"FUNCTION NAME\", \"arguments\": {ARGUMENTS AS \
             A JSON OBJECT}}\n</tool_call>\nOtherwise answer normally.\n\nFunctions:",
        );
        for tool in &self.tools {
            let entry = json!({
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
            });
            text.push('\n');
            text.push_str(&entry.to_string());
        }
        text
    }

    /// A Lark grammar (llguidance's dialect) whose every sentence is a call (several when
    /// parallel calls are allowed) of a function the choice allows, with arguments that
    /// match its schema; `None` when the choice enforces nothing.
    pub fn grammar(&self, syntax: ToolCallSyntax) -> Option<String> {
        let allowed: Vec<&FunctionTool> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.tools.iter().collect(),
            ToolChoice::Named(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
        };
        let arguments_key = match syntax {
            ToolCallSyntax::Tagged => "arguments",
            ToolCallSyntax::Json => "parameters",
        };
        let calls: Vec<Value> = allowed
            .iter()
            .map(|tool| {
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": tool.name},
                        arguments_key: tool.parameters,
                    },
                    "required": ["name", arguments_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        // Python's `json.dumps` layout and no free whitespace, so a model cannot pad a call
        // with blanks until `max_tokens` runs out.
        let schema = json!({
            "anyOf": calls,
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
        });
        let several = self.parallel && self.choice == ToolChoice::Required;
        let call = match syntax {
            ToolCallSyntax::Tagged => {
                format!("\"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"")
            }
            ToolCallSyntax::Json => format!("%json {schema}"),
        };
        let separator = match syntax {
            ToolCallSyntax::Tagged => "\"\\n\"",
            ToolCallSyntax::Json => "\"; \"",
        };
        Some(if several {
            format!("start: call ({separator} call)*\ncall: {call}\n")
        } else {
            format!("start: call\ncall: {call}\n")
        })
    }
}

fn function_tool(index: usize, tool: &Value) -> Result<FunctionTool, ApiError> {
    let param = format!("tools[{index}]");
    let kind = tool.get("type").and_then(Value::as_str);
    if kind != Some("function") {
        return Err(invalid(
            &format!("{param}.type"),
            format!(
                "only function tools are supported; tools[{index}].type is {}",
                tool.get("type")
                    .map_or("missing".to_string(), |t| t.to_string())
            ),
        ));
    }
    let function = tool
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| {
            invalid(
                &format!("{param}.function"),
                "a function tool needs a `function` object",
            )
        })?;
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| valid_name(n))
        .ok_or_else(|| {
            invalid(
                &format!("{param}.function.name"),
                "a function name is 1 to 64 letters, digits, `_` or `-`",
            )
        })?;
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(_) => {
            return Err(invalid(
                &format!("{param}.function.parameters"),
                "`parameters` must be a JSON schema object",
            ));
        }
    };
    Ok(FunctionTool {
        name: name.to_string(),
        description: function
            .get("description")
            .and_then(Value::as_str)
            .map(str::to_string),
        parameters,
    })
}

/// OpenAI's rule for function names.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn tool_choice_of(choice: Option<&Value>, tools: &[FunctionTool]) -> Result<ToolChoice, ApiError> {
    let choice = match choice {
        None | Some(Value::Null) => {
            return Ok(if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            });
        }
        Some(Value::String(mode)) => match mode.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` is \"none\", \"auto\", \"required\" or a function, not {other:?}"
                    ),
                ));
            }
        },
        Some(object) => {
            let name = (object.get("type").and_then(Value::as_str) == Some("function"))
                .then(|| object.pointer("/function/name").and_then(Value::as_str))
                .flatten()
                .ok_or_else(|| {
                    invalid(
                        "tool_choice",
                        "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": NAME}}",
                    )
                })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(invalid(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not among the request's tools"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required) {
        return Err(invalid(
            "tool_choice",
            "`tool_choice: \"required\"` needs at least one tool in `tools`",
        ));
    }
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
        }}, {"type": "function", "function": {"name": "get_time"}}])
    }

    #[test]
    fn tools_and_choices_are_read() {
        let tools = weather();
        let auto = ChatTools::from_request(Some(&tools), None, None)
            .unwrap()
            .unwrap();
        assert_eq!(auto.choice(), &ToolChoice::Auto);
        assert!(auto.has("get_time") && !auto.has("get_date"));
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let named = ChatTools::from_request(Some(&tools), Some(&named), Some(false))
            .unwrap()
            .unwrap();
        assert_eq!(named.choice(), &ToolChoice::Named("get_time".into()));
        assert!(
            ChatTools::from_request(None, Some(&json!("auto")), None)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn bad_tools_and_choices_are_refused_naming_the_field() {
        let tools = weather();
        let cases = [
            (json!({"a": 1}), Value::Null, "tools"),
            (json!([{"type": "retrieval"}]), Value::Null, "tools[0].type"),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                Value::Null,
                "tools[0].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
                Value::Null,
                "tools[0].function.parameters",
            ),
            (tools.clone(), json!("sometimes"), "tool_choice"),
            (
                tools.clone(),
                json!({"type": "function", "function": {"name": "nope"}}),
                "tool_choice",
            ),
            (Value::Null, json!("required"), "tool_choice"),
        ];
        for (tools, choice, param) in cases {
            let choice = (!choice.is_null()).then_some(&choice);
            let error = ChatTools::from_request(Some(&tools), choice, None).expect_err(param);
            let (_, axum::Json(body)) = <(
                axum::http::StatusCode,
                axum::Json<super::super::ErrorResponse>,
            )>::from(error);
            assert_eq!(
                body.error.param.as_deref(),
                Some(param),
                "{}",
                body.error.message
            );
        }
    }

    #[test]
    fn the_grammar_forces_calls_of_the_allowed_functions() {
        let tools = weather();
        let auto = ChatTools::from_request(Some(&tools), None, None)
            .unwrap()
            .unwrap();
        assert_eq!(auto.grammar(ToolCallSyntax::Tagged), None);
        let required = ChatTools::from_request(Some(&tools), Some(&json!("required")), None)
            .unwrap()
            .unwrap();
        let grammar = required.grammar(ToolCallSyntax::Tagged).unwrap();
        assert!(
            grammar.starts_with("start: call (\"\\n\" call)*\ncall: \"<tool_call>\\n\" %json {"),
            "{grammar}"
        );
        assert!(
            grammar.contains(r#"{"const":"get_weather"}"#)
                && grammar.contains(r#"{"const":"get_time"}"#)
        );
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let named = ChatTools::from_request(Some(&tools), Some(&named), None)
            .unwrap()
            .unwrap();
        let grammar = named.grammar(ToolCallSyntax::Json).unwrap();
        assert!(
            grammar.starts_with("start: call\ncall: %json {"),
            "{grammar}"
        );
        assert!(grammar.contains("\"parameters\"") && !grammar.contains("get_weather"));
    }
}
