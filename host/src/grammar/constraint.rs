//! The output constraints a request may set, as one value other code builds and compares.

use llguidance::api::TopLevelGrammar;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// What the generated text must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid under this JSON schema.
    JsonSchema(Value),
    /// Text the whole of which matches this regular expression.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

impl Constraint {
    /// The compile cache's key: equal constraints (same kind, same text) share one compiled
    /// grammar. A digest rather than the text keeps big schemas out of the cache's keys.
    pub fn cache_key(&self) -> [u8; 32] {
        let mut hash = Sha256::new();
        let (kind, text) = match self {
            Constraint::JsonObject => ("json_object", String::new()),
            Constraint::JsonSchema(schema) => ("json_schema", schema.to_string()),
            Constraint::Regex(regex) => ("regex", regex.clone()),
            // The JSON list keeps the boundaries between choices unambiguous.
            Constraint::Choice(choices) => ("choice", Value::from(choices.clone()).to_string()),
            Constraint::Lark(grammar) => ("lark", grammar.clone()),
        };
        hash.update(kind.as_bytes());
        hash.update([0]);
        hash.update(text.as_bytes());
        hash.finalize().into()
    }

    /// The grammar llguidance compiles for this constraint.
    pub(super) fn to_grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(with_layout(
                serde_json::json!({"type": "object"}),
            )),
            Constraint::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(with_layout(schema.clone()))
            }
            Constraint::Regex(regex) => TopLevelGrammar::from_regex(regex),
            Constraint::Choice(choices) => {
                let alternatives: Vec<String> =
                    choices.iter().map(|c| regex_syntax::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
            Constraint::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
        }
    }
}

/// Fixes the JSON layout to Python's `json.dumps` style (`, ` and `: `, no other whitespace)
/// unless the schema chooses its own through llguidance's `x-guidance` options. Free
/// whitespace would let a model pad its output with blanks until `max_tokens` runs out.
fn with_layout(mut schema: Value) -> Value {
    if let Value::Object(object) = &mut schema
        && !object.contains_key("x-guidance")
    {
        object.insert(
            "x-guidance".into(),
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            }),
        );
    }
    schema
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_tell_kinds_and_texts_apart() {
        let a = Constraint::Regex("a|b".into()).cache_key();
        assert_eq!(a, Constraint::Regex("a|b".into()).cache_key());
        assert_ne!(a, Constraint::Lark("a|b".into()).cache_key());
        assert_ne!(
            Constraint::Choice(vec!["a,b".into()]).cache_key(),
            Constraint::Choice(vec!["a".into(), "b".into()]).cache_key()
        );
    }
}
