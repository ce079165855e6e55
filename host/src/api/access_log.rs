//! One access-log line per request, written when its response ends (the last byte sent, or the client gone): id, method, route, status, prompt and completion tokens, time to first token and total time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use axum::response::Response;

use super::held_body::HeldBody;

/// What the handlers tell the access log about one request; shared through the request's
/// extensions, so it is filled while the response streams.
#[derive(Debug, Clone)]
pub struct AccessRecord(Arc<Counts>);

#[derive(Debug)]
struct Counts {
    started: Instant,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    /// Microseconds from the start to the first generated text, plus one; 0 while none came.
    first_token_us: AtomicU64,
}

impl AccessRecord {
    pub fn start() -> AccessRecord {
        AccessRecord(Arc::new(Counts {
            started: Instant::now(),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            first_token_us: AtomicU64::new(0),
        }))
    }

    pub fn set_prompt_tokens(&self, n: u64) {
        self.0.prompt_tokens.store(n, Ordering::Relaxed);
    }

    pub fn add_completion_tokens(&self, n: u64) {
        self.0.completion_tokens.fetch_add(n, Ordering::Relaxed);
    }

    /// Marks the first generated text; later calls change nothing.
    pub fn first_token(&self) {
        let us = self.0.started.elapsed().as_micros() as u64 + 1;
        let _ = self
            .0
            .first_token_us
            .compare_exchange(0, us, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// The request line's parts the log names.
pub struct AccessLine {
    pub method: String,
    pub route: String,
    pub status: u16,
    /// Probes and scrapes are logged at debug level only.
    pub quiet: bool,
    pub span: tracing::Span,
}

/// `response` with a body that writes the access line when it is dropped.
pub fn log_at_end(response: Response, record: AccessRecord, line: AccessLine) -> Response {
    HeldBody::around(response, AccessLog { record, line })
}

/// Writes its line when dropped, with the response body that holds it.
struct AccessLog {
    record: AccessRecord,
    line: AccessLine,
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        let counts = &self.record.0;
        let total_ms = counts.started.elapsed().as_secs_f64() * 1e3;
        let first = counts.first_token_us.load(Ordering::Relaxed);
        let ttft_ms = (first > 0).then(|| (first - 1) as f64 / 1e3);
        let prompt_tokens = counts.prompt_tokens.load(Ordering::Relaxed);
        let completion_tokens = counts.completion_tokens.load(Ordering::Relaxed);
        let AccessLine {
            method,
            route,
            status,
            quiet,
            span,
        } = &self.line;
        span.in_scope(|| {
            if *quiet {
                tracing::debug!(status, total_ms, "{method} {route}");
            } else {
                tracing::info!(
                    target: "plughost::access",
                    status,
                    prompt_tokens,
                    completion_tokens,
                    ttft_ms,
                    total_ms,
                    "{method} {route}"
                );
            }
        });
    }
}
