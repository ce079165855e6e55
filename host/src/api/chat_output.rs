//! One chat choice's generated text as the response shows it: reasoning, content and tool calls, whole or as it streams.

use crate::model::ToolCallSyntax;

use super::reasoning::{ReasoningParser, ReasoningSyntax};
use super::tool_calls::{OutputPiece, ParsedToolCall, ToolCallParser};

/// How a request's choices are read, decided at validation.
#[derive(Debug, Clone, Default)]
pub struct ChatOutputPlan {
    /// The reasoning syntax, and whether the prompt left the model inside the block.
    reasoning: Option<(ReasoningSyntax, bool)>,
    /// The call syntax and the names of the functions offered.
    tools: Option<(ToolCallSyntax, Vec<String>)>,
}

impl ChatOutputPlan {
    pub fn new(
        reasoning: Option<(ReasoningSyntax, bool)>,
        tools: Option<(ToolCallSyntax, Vec<String>)>,
    ) -> ChatOutputPlan {
        ChatOutputPlan { reasoning, tools }
    }

    /// Whether responses carry `reasoning_content`.
    pub fn splits_reasoning(&self) -> bool {
        self.reasoning.is_some()
    }

    /// A reader of one choice.
    pub fn reader(&self) -> ChoiceReader {
        ChoiceReader {
            reasoning: self
                .reasoning
                .map(|(syntax, opened)| ReasoningParser::new(syntax, opened)),
            tools: self
                .tools
                .as_ref()
                .map(|(syntax, names)| ToolCallParser::new(*syntax, names.clone())),
            calls: 0,
        }
    }
}

/// What a piece of text gave, in the order the response shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChoiceDelta {
    pub reasoning: String,
    pub content: String,
    /// Each with its index among the choice's calls.
    pub calls: Vec<(usize, ParsedToolCall)>,
}

impl ChoiceDelta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.calls.is_empty()
    }

    fn append(&mut self, other: ChoiceDelta) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self.calls.extend(other.calls);
    }
}

/// Reads one choice's text.
#[derive(Debug, Clone)]
pub struct ChoiceReader {
    reasoning: Option<ReasoningParser>,
    tools: Option<ToolCallParser>,
    calls: usize,
}

impl ChoiceReader {
    pub fn push(&mut self, text: &str) -> ChoiceDelta {
        let (reasoning, content) = match &mut self.reasoning {
            Some(parser) => {
                let d = parser.push(text);
                (d.reasoning, d.content)
            }
            None => (String::new(), text.to_string()),
        };
        let pieces = match &mut self.tools {
            Some(parser) => parser.push(&content),
            None => vec![OutputPiece::Content(content)],
        };
        self.delta(reasoning, pieces)
    }

    /// What the readers held back, once the generation has ended.
    pub fn finish(&mut self) -> ChoiceDelta {
        let mut out = match &mut self.reasoning {
            Some(parser) => {
                let d = parser.finish();
                let pieces = match &mut self.tools {
                    Some(tools) => tools.push(&d.content),
                    None => vec![OutputPiece::Content(d.content)],
                };
                self.delta(d.reasoning, pieces)
            }
            None => ChoiceDelta::default(),
        };
        if let Some(tools) = &mut self.tools {
            let pieces = tools.finish();
            let rest = self.delta(String::new(), pieces);
            out.append(rest);
        }
        out
    }

    /// The whole text of a finished choice.
    pub fn read_whole(mut self, text: &str) -> ChoiceDelta {
        let mut out = self.push(text);
        out.append(self.finish());
        out
    }

    /// Whether the choice called a function so far.
    pub fn made_calls(&self) -> bool {
        self.calls > 0
    }

    fn delta(&mut self, reasoning: String, pieces: Vec<OutputPiece>) -> ChoiceDelta {
        let mut out = ChoiceDelta {
            reasoning,
            ..ChoiceDelta::default()
        };
        for piece in pieces {
            match piece {
                OutputPiece::Content(text) => out.content.push_str(&text),
                OutputPiece::Call(call) => {
                    out.calls.push((self.calls, call));
                    self.calls += 1;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_then_a_call_then_nothing() {
        let plan = ChatOutputPlan::new(
            Some((ReasoningSyntax::Think, false)),
            Some((ToolCallSyntax::Tagged, vec!["get_time".into()])),
        );
        let text = "<think>\nI need the time.\n</think>\n\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let whole = plan.reader().read_whole(text);
        assert_eq!(whole.reasoning, "I need the time.\n");
        assert_eq!(whole.content, "");
        assert_eq!(whole.calls.len(), 1);
        assert_eq!(
            (whole.calls[0].0, whole.calls[0].1.name.as_str()),
            (0, "get_time")
        );
        let mut reader = plan.reader();
        let mut streamed = ChoiceDelta::default();
        for c in text.chars() {
            streamed.append(reader.push(&c.to_string()));
        }
        streamed.append(reader.finish());
        assert!(reader.made_calls());
        assert_eq!(
            (streamed.reasoning, streamed.content),
            (whole.reasoning, whole.content)
        );
        assert_eq!(streamed.calls[0].1.arguments, "{}");
    }

    #[test]
    fn without_a_plan_text_is_content() {
        let whole = ChatOutputPlan::default()
            .reader()
            .read_whole("<think>x</think> y");
        assert_eq!(whole.content, "<think>x</think> y");
        assert!(whole.reasoning.is_empty() && whole.calls.is_empty());
    }
}
