//! Stop strings over streamed text: finds them across token boundaries and holds back text that might start one.

/// Tracks the generated text of one request against its stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stop_strings: Vec<String>,
    /// Generated text not yet released to the client.
    pending: String,
    /// Bytes of the longest stop string, minus one: the most text that can be a partial match.
    holdback: usize,
}

/// What one piece of new text did.
#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text that can safely be sent now.
    Continue(String),
    /// A stop string matched: the text before it, to send, and then the request ends.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stop_strings: &[String]) -> Self {
        let stop_strings: Vec<String> = stop_strings
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect();
        let holdback = stop_strings
            .iter()
            .map(|s| s.len())
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        StopMatcher {
            stop_strings,
            pending: String::new(),
            holdback,
        }
    }

    /// Adds new text and returns what can be released.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        self.pending.push_str(text);
        let first_match = self
            .stop_strings
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first_match {
            let released = self.pending[..at].to_string();
            self.pending.clear();
            return StopOutcome::Stopped(released);
        }
        // Keep only the tail that could still grow into a stop string.
        let mut keep_from = self.pending.len().saturating_sub(self.holdback);
        while !self.pending.is_char_boundary(keep_from) {
            keep_from -= 1;
        }
        let keep_from = (keep_from..self.pending.len())
            .filter(|&i| self.pending.is_char_boundary(i))
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stop_strings.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.pending.len());
        let released = self.pending[..keep_from].to_string();
        self.pending.drain(..keep_from);
        StopOutcome::Continue(released)
    }

    /// Releases what is held back, at the end of the request.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Continue(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_strings_across_pieces_are_found_and_not_returned() {
        let cases: &[(&[&str], &[&str], &str, bool)] = &[
            (&["STOP"], &["hello ", "ST", "OP there"], "hello ", true),
            (&["\n\n"], &["a\n", "\nb"], "a", true),
            (&["xyz"], &["abc", "xy", "q"], "abcxyq", false),
            (&[], &["plain", " text"], "plain text", false),
            (&["é!"], &["caf", "é", "!"], "caf", true),
            // "friend" holds "end" before its final "d".
            (&["end", "d"], &["frien", "d"], "fri", true),
        ];
        for (stops, pieces, want, stopped) in cases {
            assert_eq!(
                run(stops, pieces),
                (want.to_string(), *stopped),
                "{stops:?} {pieces:?}"
            );
        }
    }

    #[test]
    fn text_that_cannot_start_a_stop_string_is_released_at_once() {
        let mut m = StopMatcher::new(&["<|end|>".to_string()]);
        assert_eq!(m.push("hello"), StopOutcome::Continue("hello".into()));
        assert_eq!(m.push(" <|e"), StopOutcome::Continue(" ".into()));
        assert_eq!(m.push("nx"), StopOutcome::Continue("<|enx".into()));
    }
}
