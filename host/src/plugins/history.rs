//! The tokens a sequence has seen, as penalties read them: counted once as each token arrives, so sampling a row never walks its history.

use std::collections::HashMap;
use std::collections::hash_map::{DefaultHasher, Entry};
use std::hash::BuildHasherDefault;
use std::sync::Arc;

/// Token ids come from the model, not from a client that could pick colliding keys, so the
/// fixed-key hasher is enough; it also lets [`SeenTokens::EMPTY`] be a constant.
type TokenIndex = HashMap<u32, Option<u32>, BuildHasherDefault<DefaultHasher>>;

/// Every distinct token of a sequence's prompt and output, and how often each came in the
/// output: what the repetition, presence and frequency penalties need, in space and time
/// proportional to the distinct tokens, whatever the length.
///
/// Invariants: `distinct` holds each token of prompt and output once, in the order first seen;
/// `output` holds each token of the output once with its count, in the order first generated;
/// `index` maps every token of `distinct` to its place in `output`, if it has one.
#[derive(Debug, Clone)]
pub struct SeenTokens {
    distinct: Vec<u32>,
    output: Vec<(u32, u32)>,
    index: TokenIndex,
}

/// The history of a row nobody gave one: penalties leave it as it is.
pub(crate) static NO_TOKENS: SeenTokens = SeenTokens::EMPTY;

impl Default for SeenTokens {
    fn default() -> Self {
        SeenTokens::EMPTY
    }
}

impl SeenTokens {
    /// A sequence with no tokens yet.
    pub const EMPTY: SeenTokens = SeenTokens {
        distinct: Vec::new(),
        output: Vec::new(),
        index: HashMap::with_hasher(BuildHasherDefault::new()),
    };

    /// A sequence that has its prompt and has generated nothing yet.
    pub fn from_prompt(prompt: &[u32]) -> SeenTokens {
        let mut seen = SeenTokens::EMPTY;
        for &token in prompt {
            if let Entry::Vacant(entry) = seen.index.entry(token) {
                entry.insert(None);
                seen.distinct.push(token);
            }
        }
        seen
    }

    /// Counts one generated token: O(1), whatever the length so far.
    pub fn push_output(&mut self, token: u32) {
        let place = match self.index.entry(token) {
            Entry::Occupied(mut entry) => match *entry.get() {
                Some(place) => place,
                None => {
                    let place = self.output.len() as u32;
                    entry.insert(Some(place));
                    self.output.push((token, 0));
                    place
                }
            },
            Entry::Vacant(entry) => {
                let place = self.output.len() as u32;
                entry.insert(Some(place));
                self.distinct.push(token);
                self.output.push((token, 0));
                place
            }
        };
        if let Some((_, count)) = self.output.get_mut(place as usize) {
            *count += 1;
        }
    }

    /// Each token of prompt and output, once.
    pub fn distinct(&self) -> &[u32] {
        &self.distinct
    }

    /// Each token of the output, once, with the times it was generated.
    pub fn output_counts(&self) -> &[(u32, u32)] {
        &self.output
    }
}

/// A sequence's tokens as two lists, for callers that have them at hand (tests, tools); the
/// sampler reads them as [`SeenTokens`].
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    pub prompt: Arc<[u32]>,
    pub output: Vec<u32>,
}

impl From<&TokenHistory> for SeenTokens {
    fn from(history: &TokenHistory) -> SeenTokens {
        let mut seen = SeenTokens::from_prompt(&history.prompt);
        for &token in &history.output {
            seen.push_output(token);
        }
        seen
    }
}

impl From<TokenHistory> for Arc<SeenTokens> {
    fn from(history: TokenHistory) -> Arc<SeenTokens> {
        Arc::new(SeenTokens::from(&history))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_counted_once_each_in_the_order_first_seen() {
        let mut seen = SeenTokens::from_prompt(&[4, 2, 4, 7]);
        assert_eq!(seen.distinct(), &[4, 2, 7]);
        assert!(seen.output_counts().is_empty());
        for token in [2, 9, 2, 2, 9, 5] {
            seen.push_output(token);
        }
        assert_eq!(seen.distinct(), &[4, 2, 7, 9, 5]);
        assert_eq!(seen.output_counts(), &[(2, 3), (9, 2), (5, 1)]);
        let lists = TokenHistory {
            prompt: Arc::from(vec![4u32, 2, 4, 7]),
            output: vec![2, 9, 2, 2, 9, 5],
        };
        let from_lists = SeenTokens::from(&lists);
        assert_eq!(from_lists.distinct(), seen.distinct());
        assert_eq!(from_lists.output_counts(), seen.output_counts());
    }
}
