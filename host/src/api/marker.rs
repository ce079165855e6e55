//! Finding a marker in text that arrives in pieces: what can be released now, and what must wait because it may be the start of the marker.

/// Text held back between pieces while it may still turn into a marker.
#[derive(Debug, Default, Clone)]
pub struct MarkerScan {
    pending: String,
}

/// What one piece of text gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Scanned {
    /// No marker yet; `0` is text that certainly comes before one.
    Before(String),
    /// The marker, with the text before it and the text after it.
    Found { before: String, after: String },
}

impl MarkerScan {
    /// Adds `text` and looks for `marker` in everything not yet released.
    pub fn push(&mut self, text: &str, marker: &str) -> Scanned {
        self.pending.push_str(text);
        if let Some(at) = self.pending.find(marker) {
            let after = self.pending[at + marker.len()..].to_string();
            self.pending.truncate(at);
            let before = std::mem::take(&mut self.pending);
            return Scanned::Found { before, after };
        }
        let held = held_back(&self.pending, marker);
        let release = self.pending.len() - held;
        let rest = self.pending.split_off(release);
        Scanned::Before(std::mem::replace(&mut self.pending, rest))
    }

    /// Everything held back: the text ended without the marker.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// The length of the longest end of `text` that is a proper start of `marker`.
fn held_back(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && marker.is_char_boundary(n)
                && text.ends_with(&marker[..n])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` and returns the text released before the marker, and what followed it.
    fn scan(pieces: &[&str], marker: &str) -> (String, Option<String>) {
        let mut scan = MarkerScan::default();
        let mut before = String::new();
        for piece in pieces {
            match scan.push(piece, marker) {
                Scanned::Before(text) => before.push_str(&text),
                Scanned::Found { before: b, after } => {
                    before.push_str(&b);
                    return (before, Some(after));
                }
            }
        }
        before.push_str(&scan.flush());
        (before, None)
    }

    #[test]
    fn a_marker_split_over_pieces_is_found() {
        assert_eq!(
            scan(&["abc<to", "ol_c", "all>{\"x\"", "}"], "<tool_call>"),
            ("abc".to_string(), Some("{\"x\"".to_string()))
        );
        assert_eq!(
            scan(&["<think>"], "<think>"),
            (String::new(), Some(String::new()))
        );
    }

    #[test]
    fn a_partial_marker_is_held_and_released_when_it_turns_out_otherwise() {
        let mut scan = MarkerScan::default();
        assert_eq!(
            scan.push("x <too", "<tool_call>"),
            Scanned::Before("x ".into())
        );
        assert_eq!(
            scan.push("th", "<tool_call>"),
            Scanned::Before("<tooth".into())
        );
        assert_eq!(scan.push("é<", "<tool_call>"), Scanned::Before("é".into()));
        assert_eq!(scan.flush(), "<");
    }
}
