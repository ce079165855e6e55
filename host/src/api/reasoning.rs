//! A thinking model's reasoning split from its answer: the `<think>…</think>` block goes to `reasoning_content`, whole or as streamed deltas.
//!
//! Qwen3 opens its answer with `<think>`, reasons, closes with `</think>` and answers after a
//! blank line. Templates that open the block in the prompt (the generation prompt ends in
//! `<think>`) leave only the closing tag to the model; the parser then starts inside the block.
//! An answer that does not open with the block has no reasoning. A generation cut off inside
//! the block has only reasoning.

use super::marker::{MarkerScan, Scanned};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Which reasoning syntax to split out, from `--reasoning-parser` or the chat template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningSyntax {
    /// `<think>…</think>`, as Qwen3 and DeepSeek-R1 write it.
    Think,
}

impl ReasoningSyntax {
    /// The text that opens a block.
    pub fn open(self) -> &'static str {
        match self {
            ReasoningSyntax::Think => OPEN,
        }
    }

    /// The text that closes a block.
    pub fn close(self) -> &'static str {
        match self {
            ReasoningSyntax::Think => CLOSE,
        }
    }
}

/// One piece of parsed output.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReasoningDelta {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace yet: the block may still open.
    Start,
    Thinking,
    /// After the block; `started` once any answer text went out.
    Answer {
        started: bool,
    },
}

/// Splits one choice's text as it streams.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    phase: Phase,
    scan: MarkerScan,
    /// Text of the `Start` phase, held until it is known whether the block opens.
    start: String,
    reasoning_started: bool,
}

impl ReasoningParser {
    /// Whether a rendered prompt leaves the model inside an open block.
    pub fn prompt_opens_block(_syntax: ReasoningSyntax, prompt: &str) -> bool {
        prompt.trim_end().ends_with(OPEN)
    }

    /// A parser for one answer; `opened`: the prompt left the model inside the block.
    pub fn new(_syntax: ReasoningSyntax, opened: bool) -> ReasoningParser {
        ReasoningParser {
            phase: if opened {
                Phase::Thinking
            } else {
                Phase::Start
            },
            scan: MarkerScan::default(),
            start: String::new(),
            reasoning_started: false,
        }
    }

    /// Splits the next piece of generated text.
    pub fn push(&mut self, text: &str) -> ReasoningDelta {
        let mut out = ReasoningDelta::default();
        self.feed(text, &mut out);
        out
    }

    /// The text held back when the generation ends.
    pub fn finish(&mut self) -> ReasoningDelta {
        let mut out = ReasoningDelta::default();
        match self.phase {
            Phase::Start => {
                let held = std::mem::take(&mut self.start);
                self.answer(&held, &mut out);
            }
            Phase::Thinking => {
                let rest = self.scan.flush();
                self.reason(&rest, &mut out);
            }
            Phase::Answer { .. } => {}
        }
        out
    }

    fn feed(&mut self, text: &str, out: &mut ReasoningDelta) {
        match self.phase {
            Phase::Start => {
                self.start.push_str(text);
                let trimmed = self.start.trim_start();
                let opened = trimmed.strip_prefix(OPEN).map(str::to_string);
                let undecided = OPEN.starts_with(trimmed);
                if let Some(rest) = opened {
                    self.start.clear();
                    self.phase = Phase::Thinking;
                    self.feed(&rest, out);
                } else if !undecided {
                    let held = std::mem::take(&mut self.start);
                    self.answer(&held, out);
                }
            }
            Phase::Thinking => match self.scan.push(text, CLOSE) {
                Scanned::Before(before) => self.reason(&before, out),
                Scanned::Found { before, after } => {
                    self.reason(&before, out);
                    self.phase = Phase::Answer { started: false };
                    self.answer(&after, out);
                }
            },
            Phase::Answer { .. } => self.answer(text, out),
        }
    }

    fn reason(&mut self, text: &str, out: &mut ReasoningDelta) {
        let text = if self.reasoning_started {
            text
        } else {
            text.trim_start_matches('\n')
        };
        if !text.is_empty() {
            self.reasoning_started = true;
            out.reasoning.push_str(text);
        }
    }

    /// Answer text; the blank line after the block is not part of it.
    fn answer(&mut self, text: &str, out: &mut ReasoningDelta) {
        let started = match self.phase {
            Phase::Answer { started } => started,
            _ => {
                self.phase = Phase::Answer { started: false };
                false
            }
        };
        let text = if started { text } else { text.trim_start() };
        if !text.is_empty() {
            self.phase = Phase::Answer { started: true };
            out.content.push_str(text);
        }
    }
}

/// The reasoning and the answer of a whole text.
pub fn split_whole(syntax: ReasoningSyntax, prompt: &str, text: &str) -> ReasoningDelta {
    let opened = ReasoningParser::prompt_opens_block(syntax, prompt);
    let mut parser = ReasoningParser::new(syntax, opened);
    let mut out = parser.push(text);
    let rest = parser.finish();
    out.reasoning.push_str(&rest.reasoning);
    out.content.push_str(&rest.content);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3_ANSWER: &str = "<think>\nThe user asks for the capital of France. That is Paris.\n</think>\n\nThe capital of France is Paris.";

    fn streamed(prompt: &str, text: &str, piece: usize) -> ReasoningDelta {
        let opened = ReasoningParser::prompt_opens_block(ReasoningSyntax::Think, prompt);
        let mut parser = ReasoningParser::new(ReasoningSyntax::Think, opened);
        let mut out = ReasoningDelta::default();
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(piece) {
            let d = parser.push(&chunk.iter().collect::<String>());
            out.reasoning.push_str(&d.reasoning);
            out.content.push_str(&d.content);
        }
        let d = parser.finish();
        out.reasoning.push_str(&d.reasoning);
        out.content.push_str(&d.content);
        out
    }

    #[test]
    fn a_qwen3_answer_splits_whole_and_in_every_piece_size() {
        let expected = ReasoningDelta {
            reasoning: "The user asks for the capital of France. That is Paris.\n".into(),
            content: "The capital of France is Paris.".into(),
        };
        let prompt = "<|im_start|>assistant\n";
        assert_eq!(
            split_whole(ReasoningSyntax::Think, prompt, QWEN3_ANSWER),
            expected
        );
        for piece in 1..12 {
            assert_eq!(
                streamed(prompt, QWEN3_ANSWER, piece),
                expected,
                "pieces of {piece}"
            );
        }
    }

    #[test]
    fn thinking_off_an_open_block_and_a_cut_off_block() {
        // enable_thinking=false: the template closed an empty block in the prompt.
        let off = split_whole(
            ReasoningSyntax::Think,
            "<|im_start|>assistant\n<think>\n\n</think>\n\n",
            "Paris.",
        );
        assert_eq!(
            (off.reasoning.as_str(), off.content.as_str()),
            ("", "Paris.")
        );
        // The prompt opened the block: the model only closes it.
        let opened = split_whole(
            ReasoningSyntax::Think,
            "assistant\n<think>\n",
            "hmm\n</think>\n\nParis.",
        );
        assert_eq!(
            (opened.reasoning.as_str(), opened.content.as_str()),
            ("hmm\n", "Paris.")
        );
        // Cut off by max_tokens inside the block.
        let cut = streamed("", "<think>\nstill thinking <", 3);
        assert_eq!(
            (cut.reasoning.as_str(), cut.content.as_str()),
            ("still thinking <", "")
        );
        // No block at all, and text that only looks like the start of one.
        let plain = streamed("", "  <thin ice", 2);
        assert_eq!(
            (plain.reasoning.as_str(), plain.content.as_str()),
            ("", "<thin ice")
        );
    }
}
