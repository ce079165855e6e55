//! Tool calls in generated text: found, parsed and checked against the request's tools, whole or as the text streams.
//!
//! In the tagged syntax each call is a `<tool_call>…</tool_call>` block holding
//! `{"name": ..., "arguments": {...}}`; text outside the blocks stays content. In the JSON
//! syntax (Llama 3) an answer that starts with `{` is held to its end and read as calls
//! separated by `;`. A block that does not parse, or names a function the request did not
//! offer, is returned as content, as written.

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::model::ToolCallSyntax;

use super::marker::{MarkerScan, Scanned};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One call the model made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedToolCall {
    /// `call_` and 24 random letters and digits.
    pub id: String,
    pub name: String,
    /// The arguments object as JSON text, as the model wrote it.
    pub arguments: String,
}

/// A piece of output, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputPiece {
    Content(String),
    Call(ParsedToolCall),
}

#[derive(Deserialize)]
struct CallBody {
    name: String,
    #[serde(alias = "parameters")]
    arguments: Box<RawValue>,
}

#[derive(Debug, Clone)]
enum State {
    Outside,
    /// Inside a tagged block: its text so far.
    Inside(String),
    /// The JSON syntax: not yet known whether the answer is calls.
    Undecided(String),
    /// The JSON syntax: the answer starts with `{`, held to the end.
    Holding(String),
    /// The JSON syntax: plain content.
    Content,
}

/// Reads one choice's content for calls of `names`.
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    syntax: ToolCallSyntax,
    names: Vec<String>,
    scan: MarkerScan,
    state: State,
}

impl ToolCallParser {
    pub fn new(syntax: ToolCallSyntax, names: Vec<String>) -> ToolCallParser {
        let state = match syntax {
            ToolCallSyntax::Tagged => State::Outside,
            ToolCallSyntax::Json => State::Undecided(String::new()),
        };
        ToolCallParser {
            syntax,
            names,
            scan: MarkerScan::default(),
            state,
        }
    }

    /// Reads the next piece of content.
    pub fn push(&mut self, text: &str) -> Vec<OutputPiece> {
        let mut out = Vec::new();
        self.feed(text, &mut out);
        merge_content(out)
    }

    /// What is held back when the generation ends.
    pub fn finish(&mut self) -> Vec<OutputPiece> {
        let mut out = Vec::new();
        match std::mem::replace(&mut self.state, State::Content) {
            State::Outside => content(&mut out, self.scan.flush()),
            State::Inside(mut text) => {
                // A block the generation cut off is returned as written.
                text.push_str(&self.scan.flush());
                content(&mut out, format!("{OPEN}{text}"));
            }
            State::Undecided(text) => content(&mut out, text),
            State::Holding(text) => match self.json_calls(&text) {
                Some(calls) => out.extend(calls.into_iter().map(OutputPiece::Call)),
                None => content(&mut out, text),
            },
            State::Content => {}
        }
        merge_content(out)
    }

    fn feed(&mut self, text: &str, out: &mut Vec<OutputPiece>) {
        match &mut self.state {
            State::Outside => match self.scan.push(text, OPEN) {
                Scanned::Before(before) => content(out, before),
                Scanned::Found { before, after } => {
                    content(out, before);
                    self.state = State::Inside(String::new());
                    self.feed(&after, out);
                }
            },
            State::Inside(held) => match self.scan.push(text, CLOSE) {
                Scanned::Before(before) => held.push_str(&before),
                Scanned::Found { before, after } => {
                    held.push_str(&before);
                    let block = std::mem::take(held);
                    match self.tagged_call(&block) {
                        Some(call) => out.push(OutputPiece::Call(call)),
                        None => content(out, format!("{OPEN}{block}{CLOSE}")),
                    }
                    self.state = State::Outside;
                    self.feed(&after, out);
                }
            },
            State::Undecided(held) => {
                held.push_str(text);
                let trimmed = held.trim_start();
                if trimmed.starts_with('{') {
                    self.state = State::Holding(std::mem::take(held));
                } else if !trimmed.is_empty() {
                    let text = std::mem::take(held);
                    self.state = State::Content;
                    content(out, text);
                }
            }
            State::Holding(held) => held.push_str(text),
            State::Content => content(out, text.to_string()),
        }
    }

    fn tagged_call(&self, block: &str) -> Option<ParsedToolCall> {
        self.call(serde_json::from_str::<CallBody>(block.trim()).ok()?)
    }

    /// Every `;`-separated object of a JSON-syntax answer as a call, or `None` if any is not one.
    fn json_calls(&self, text: &str) -> Option<Vec<ParsedToolCall>> {
        debug_assert_eq!(self.syntax, ToolCallSyntax::Json);
        let mut calls = Vec::new();
        let mut rest = text.trim();
        while !rest.is_empty() {
            let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<CallBody>();
            match stream.next() {
                Some(Ok(body)) => calls.push(self.call(body)?),
                _ => return None,
            }
            rest = rest[stream.byte_offset()..].trim_start();
            rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
        }
        (!calls.is_empty()).then_some(calls)
    }

    fn call(&self, body: CallBody) -> Option<ParsedToolCall> {
        if !self.names.contains(&body.name) {
            return None;
        }
        let arguments = body.arguments.get();
        if !arguments.trim_start().starts_with('{') {
            return None;
        }
        Some(ParsedToolCall {
            id: call_id(),
            name: body.name,
            arguments: arguments.to_string(),
        })
    }
}

fn content(out: &mut Vec<OutputPiece>, text: String) {
    if !text.is_empty() {
        out.push(OutputPiece::Content(text));
    }
}

fn merge_content(pieces: Vec<OutputPiece>) -> Vec<OutputPiece> {
    let mut out: Vec<OutputPiece> = Vec::with_capacity(pieces.len());
    for piece in pieces {
        match (out.last_mut(), piece) {
            (Some(OutputPiece::Content(last)), OutputPiece::Content(text)) => last.push_str(&text),
            (_, piece) => out.push(piece),
        }
    }
    out
}

fn call_id() -> String {
    random_id("call")
}

/// `PREFIX_` and 24 random letters and digits (about 143 bits): ids of calls, stored
/// responses and their items, which no client can guess.
pub fn random_id(prefix: &str) -> String {
    use rand::Rng;
    use rand::distr::Alphanumeric;
    let suffix: String = rand::rng()
        .sample_iter(&Alphanumeric)
        .take(24)
        .map(char::from)
        .collect();
    format!("{prefix}_{suffix}")
}

/// The calls and the content of a whole text.
pub fn parse_whole(syntax: ToolCallSyntax, names: Vec<String>, text: &str) -> Vec<OutputPiece> {
    let mut parser = ToolCallParser::new(syntax, names);
    let mut pieces = parser.push(text);
    pieces.extend(parser.finish());
    merge_content(pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["get_weather".into(), "get_time".into()]
    }

    /// The pieces with call ids blanked, since they are random.
    fn shown(pieces: Vec<OutputPiece>) -> Vec<(String, String)> {
        pieces
            .into_iter()
            .map(|p| match p {
                OutputPiece::Content(text) => ("content".to_string(), text),
                OutputPiece::Call(call) => {
                    assert!(call.id.starts_with("call_") && call.id.len() == 29);
                    (call.name, call.arguments)
                }
            })
            .collect()
    }

    fn streamed(syntax: ToolCallSyntax, text: &str, piece: usize) -> Vec<OutputPiece> {
        let mut parser = ToolCallParser::new(syntax, names());
        let chars: Vec<char> = text.chars().collect();
        let mut pieces = Vec::new();
        for chunk in chars.chunks(piece) {
            pieces.extend(parser.push(&chunk.iter().collect::<String>()));
        }
        pieces.extend(parser.finish());
        merge_content(pieces)
    }

    #[test]
    fn tagged_calls_are_parsed_whole_and_streamed() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let expected = vec![
            ("content".to_string(), "Let me check.\n".to_string()),
            (
                "get_weather".to_string(),
                "{\"city\": \"Paris\"}".to_string(),
            ),
            ("content".to_string(), "\n".to_string()),
            ("get_time".to_string(), "{}".to_string()),
        ];
        assert_eq!(
            shown(parse_whole(ToolCallSyntax::Tagged, names(), text)),
            expected
        );
        for piece in [1, 2, 3, 7, 40] {
            assert_eq!(
                shown(streamed(ToolCallSyntax::Tagged, text, piece)),
                expected,
                "{piece}"
            );
        }
    }

    #[test]
    fn blocks_that_are_not_calls_stay_content_as_written() {
        for text in [
            "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>",
            "<tool_call>not json</tool_call>",
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": 3}\n</tool_call>",
            "<tool_call>\n{\"name\": \"get_time\", \"argu",
        ] {
            assert_eq!(
                shown(parse_whole(ToolCallSyntax::Tagged, names(), text)),
                vec![("content".to_string(), text.to_string())]
            );
        }
    }

    #[test]
    fn json_syntax_reads_a_whole_answer_of_calls() {
        let text = " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}; {\"name\": \"get_time\", \"parameters\": {}}";
        let expected = vec![
            (
                "get_weather".to_string(),
                "{\"city\": \"Oslo\"}".to_string(),
            ),
            ("get_time".to_string(), "{}".to_string()),
        ];
        for piece in [1, 5, 200] {
            assert_eq!(shown(streamed(ToolCallSyntax::Json, text, piece)), expected);
        }
        let prose = "It is sunny {mostly}.";
        assert_eq!(
            shown(streamed(ToolCallSyntax::Json, prose, 3)),
            vec![("content".to_string(), prose.to_string())]
        );
        let unknown = "{\"name\": \"launch\", \"parameters\": {}}";
        assert_eq!(
            shown(parse_whole(ToolCallSyntax::Json, names(), unknown)),
            vec![("content".to_string(), unknown.to_string())]
        );
    }
}
