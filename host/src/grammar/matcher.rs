//! One request's place in its grammar: the mask of tokens allowed next, and committing the token sampled.

use llguidance::{Matcher, TokenParser};
use toktrie::SimpleVob;

/// Whether the mask of the coming step is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MaskState {
    /// Not computed since the last commit.
    Pending,
    /// Computed: at least one token is allowed.
    Ready,
    /// No token can continue the grammar; the cause, for the response.
    DeadEnd(String),
}

/// What committing a token did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// The grammar goes on.
    Continue,
    /// The grammar is complete: nothing but the end of the sequence can follow.
    Complete,
    /// The token could not be committed; the cause.
    DeadEnd(String),
}

/// A request's grammar state. Owned by the request; moved to the mask worker and back each step.
pub struct GrammarMatcher {
    matcher: Matcher,
    /// The last computed mask: bit `t` set when token `t` may come next.
    mask: SimpleVob,
    state: MaskState,
}

impl GrammarMatcher {
    pub(super) fn new(parser: TokenParser) -> GrammarMatcher {
        GrammarMatcher {
            matcher: Matcher::new(Ok(parser)),
            mask: SimpleVob::new(),
            state: MaskState::Pending,
        }
    }

    pub fn state(&self) -> &MaskState {
        &self.state
    }

    /// Computes the mask of the next token (the expensive part, meant for the mask worker).
    pub fn compute_mask(&mut self) {
        if self.state != MaskState::Pending {
            return;
        }
        self.state = match self.matcher.compute_mask() {
            Ok(mask) if mask.is_zero() => {
                MaskState::DeadEnd("grammar dead end: no token can continue the output".into())
            }
            Ok(mask) => {
                self.mask = mask;
                MaskState::Ready
            }
            Err(e) => MaskState::DeadEnd(dead_end(&e)),
        };
    }

    /// Whether the computed mask allows `token`.
    pub fn allows(&self, token: u32) -> bool {
        self.state == MaskState::Ready && self.mask.is_allowed(token)
    }

    /// Sets every token the mask forbids to `-inf` in `row`, a logits row of the model.
    pub fn apply_mask(&self, row: &mut [f32]) {
        if self.state != MaskState::Ready {
            row.fill(f32::NEG_INFINITY);
            return;
        }
        // Most words of a grammar's mask are all-forbidden or all-allowed: those take a fill
        // or nothing, and only mixed words go bit by bit.
        for (chunk, &word) in row.chunks_mut(32).zip(self.mask.as_slice()) {
            match word {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                // Branch-free, so the loop compiles to vector blends.
                _ => {
                    for (bit, logit) in chunk.iter_mut().enumerate() {
                        let allowed = (word >> bit) & 1 != 0;
                        *logit = if allowed { *logit } else { f32::NEG_INFINITY };
                    }
                }
            }
        }
        // A mask shorter than the row allows nothing past its end.
        let covered = self.mask.as_slice().len() * 32;
        if let Some(rest) = row.get_mut(covered..) {
            rest.fill(f32::NEG_INFINITY);
        }
    }

    /// Advances the grammar by `token`, which the mask allowed.
    pub fn commit(&mut self, token: u32) -> Progress {
        self.state = MaskState::Pending;
        match self.matcher.consume_token(token) {
            Ok(()) if self.matcher.is_stopped() => Progress::Complete,
            Ok(()) => Progress::Continue,
            Err(e) => Progress::DeadEnd(dead_end(&e)),
        }
    }

    /// Whether the output so far is a complete match, so the end of the sequence may come.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

/// The cause of a dead end from llguidance's error: its first line (the rest dumps the
/// parser's state).
fn dead_end(error: &impl std::fmt::Display) -> String {
    let text = error.to_string();
    let first = text.lines().next().unwrap_or("the grammar failed");
    format!("grammar dead end: {first}")
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::grammar::{Constraint, GrammarCompiler};
    use crate::model::Tokenizer;

    fn compiler() -> GrammarCompiler {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-qwen3");
        let tokenizer = Tokenizer::from_dir(&dir).expect("tokenizer");
        GrammarCompiler::new(tokenizer, 448, vec![447])
    }

    fn tokens(text: &str) -> Vec<u32> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-qwen3");
        Tokenizer::from_dir(&dir)
            .expect("tokenizer")
            .encode(text, false)
            .expect("tokens")
    }

    #[test]
    fn a_choice_masks_commits_and_completes() {
        let compiler = compiler();
        let grammar = compiler
            .compile(&Constraint::Choice(vec!["yes".into(), "no".into()]))
            .expect("compiles");
        let mut matcher = grammar.matcher();
        matcher.compute_mask();
        assert_eq!(matcher.state(), &MaskState::Ready);
        let z = tokens("z")[0];
        assert!(!matcher.allows(z), "`z` starts neither choice");
        let mut row = vec![1.0f32; 448];
        matcher.apply_mask(&mut row);
        assert_eq!(row[z as usize], f32::NEG_INFINITY);
        assert!(
            !matcher.allows(447),
            "EOS is not allowed before a choice is complete"
        );
        let mut progress = Progress::Continue;
        for token in tokens("no") {
            matcher.compute_mask();
            assert!(matcher.allows(token));
            progress = matcher.commit(token);
        }
        assert!(progress == Progress::Complete || matcher.is_accepting());
    }

    #[test]
    fn an_empty_language_is_a_dead_end_with_a_one_line_cause() {
        let grammar = compiler()
            .compile(&Constraint::Regex("[^\\s\\S]".into()))
            .expect("compiles");
        let mut matcher = grammar.matcher();
        matcher.compute_mask();
        match matcher.state() {
            MaskState::DeadEnd(cause) => assert!(
                cause.starts_with("grammar dead end") && !cause.contains('\n'),
                "{cause}"
            ),
            other => panic!("{other:?}"),
        }
        let mut row = vec![0.0f32; 448];
        matcher.apply_mask(&mut row);
        assert!(row.iter().all(|v| *v == f32::NEG_INFINITY));
    }

    #[test]
    fn the_cache_compiles_each_constraint_once() {
        let compiler = compiler();
        let schema = Constraint::JsonSchema(serde_json::json!({"type": "integer"}));
        let a = compiler.compile(&schema).expect("compiles");
        let b = compiler.compile(&schema).expect("compiles");
        assert!(std::sync::Arc::ptr_eq(&a.parser, &b.parser));
        let bad = Constraint::JsonSchema(serde_json::json!({"type": "no-such-type"}));
        assert!(matches!(
            compiler.compile(&bad),
            Err(crate::grammar::GrammarError::Invalid(_))
        ));
    }
}
