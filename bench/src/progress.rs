//! Progress of a bench phase on stderr: a bar of completed requests, drawn only on a terminal.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

const TEMPLATE: &str =
    "{prefix:>14} {wide_bar} {pos}/{len} requests [{elapsed_precise}, ETA {eta}] {msg}";

/// Completed and failed requests of one phase (the warm-up, or one concurrency level).
pub struct PhaseProgress {
    bar: ProgressBar,
    failed: u64,
}

impl PhaseProgress {
    /// A bar of `total` requests labelled `label`. `show` false (`--no-progress`) hides it;
    /// so does a stderr that is not a terminal, which indicatif detects, so that logs and
    /// pipes never collect redraw escapes.
    pub fn new(label: String, total: usize, show: bool) -> Self {
        let target = if show {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(total as u64), target).with_prefix(label);
        if !bar.is_hidden() {
            // The template is a constant; should it ever be rejected, the default style still works.
            if let Ok(style) = ProgressStyle::with_template(TEMPLATE) {
                bar.set_style(style);
            }
            // Requests can take minutes; a steady tick keeps the elapsed time moving meanwhile.
            // Only a visible bar gets one, because the tick runs on its own thread.
            bar.enable_steady_tick(Duration::from_millis(250));
        }
        Self { bar, failed: 0 }
    }

    /// Whether nothing is drawn.
    pub fn is_hidden(&self) -> bool {
        self.bar.is_hidden()
    }

    /// Counts one finished request.
    pub fn complete(&mut self, success: bool) {
        if !success {
            self.failed += 1;
            self.bar.set_message(format!("({} failed)", self.failed));
        }
        self.bar.inc(1);
    }

    /// Removes the bar, so the report that follows starts on a clean line.
    pub fn finish(self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disabled_bar_is_hidden_and_still_counts() {
        let mut progress = PhaseProgress::new("run".into(), 3, false);
        assert!(progress.is_hidden());
        progress.complete(true);
        progress.complete(false);
        assert_eq!((progress.bar.position(), progress.failed), (2, 1));
        progress.finish();
    }

    #[test]
    fn a_bar_on_a_stderr_that_is_not_a_terminal_is_hidden() {
        use std::io::IsTerminal;
        let progress = PhaseProgress::new("run".into(), 3, true);
        // Under a test harness stderr is usually captured or piped; on a terminal the bar shows.
        assert_eq!(
            progress.is_hidden(),
            !std::io::stderr().is_terminal() || dumb_terminal()
        );
        progress.finish();
    }

    /// indicatif also hides bars when TERM is unset or `dumb`.
    fn dumb_terminal() -> bool {
        !std::env::var("TERM").is_ok_and(|t| t != "dumb")
    }
}
