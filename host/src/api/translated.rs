//! What the routes that translate their bodies into chat requests (Anthropic's Messages, OpenAI's Responses) share: the chat body being written, and the checks and names of their fields.

use serde_json::{Map, Value};

use super::body::FromJsonBody;
use super::error::ApiError;
use super::openai::{ChatCompletionRequest, GenerationBody};

/// A chat request body written from another API's body.
pub struct ChatBody {
    fields: Map<String, Value>,
}

impl ChatBody {
    pub fn new(model: Option<&String>, messages: Vec<Value>) -> ChatBody {
        let mut fields = Map::new();
        if let Some(model) = model {
            fields.insert("model".into(), model.clone().into());
        }
        fields.insert("messages".into(), Value::Array(messages));
        ChatBody { fields }
    }

    pub fn set(&mut self, name: &str, value: impl Into<Value>) {
        self.fields.insert(name.into(), value.into());
    }

    /// Sets each field that has a value.
    pub fn set_present<'a>(&mut self, fields: impl IntoIterator<Item = (&'a str, Option<Value>)>) {
        for (name, value) in fields {
            if let Some(value) = value {
                self.set(name, value);
            }
        }
    }

    /// `tools`, each converted to a chat function tool by `convert(index, tool)`.
    pub fn set_tools(
        &mut self,
        tools: Option<&[Value]>,
        convert: impl Fn(usize, &Value) -> Result<Value, ApiError>,
    ) -> Result<(), ApiError> {
        if let Some(tools) = tools {
            let tools = tools
                .iter()
                .enumerate()
                .map(|(i, tool)| convert(i, tool))
                .collect::<Result<Vec<_>, _>>()?;
            self.set("tools", Value::Array(tools));
        }
        Ok(())
    }

    /// The typed chat request; an error names the field by `rename`, the route's own name.
    pub fn finish(
        self,
        rename: impl Fn(String) -> String,
    ) -> Result<GenerationBody<ChatCompletionRequest>, ApiError> {
        GenerationBody::from_json(&Value::Object(self.fields))
            .map_err(|e| e.with_param_renamed(rename))
    }
}

pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::Unsupported {
        param: param.into(),
        message: message.into(),
    }
}

/// The string `field` of a block or item at `param`, or 400 naming `param.field`.
pub fn string_field<'a>(param: &str, item: &'a Value, field: &str) -> Result<&'a str, ApiError> {
    item.get(field).and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            format!("{param}.{field}"),
            format!("`{param}` needs a string `{field}`"),
        )
    })
}

/// A chat tool's parameter (`tools[i].function.FIELD`) as the route names it: `FIELD` mapped
/// by `field`. Other parameters pass through `other`.
pub fn tool_param(param: String, field: fn(&str) -> &str, other: fn(String) -> String) -> String {
    if let Some(rest) = param.strip_prefix("tools[")
        && let Some((index, path)) = rest.split_once(']')
    {
        return format!("tools[{index}]{}", field(path));
    }
    other(param)
}
