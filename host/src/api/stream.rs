//! Server-sent events for streaming responses: chunks per choice, the usage chunk, `[DONE]`,
//! keep-alive comments, and errors that happen after the stream started sent as events.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use futures::stream;
use serde::Serialize;
use tracing::Instrument;

use crate::engine::{FinishReason, PromptLogprob, TokenLogprob};

use super::error::{ApiError, ErrorResponse};
use super::openai::Usage;
use super::submit::{ChoiceEvent, ChoiceEvents, UsageTally};

/// How one endpoint writes its chunks; the stream machinery is shared.
pub trait ChunkFormat: Send + 'static {
    /// A chunk sent for each choice before any token (chat announces the assistant role).
    fn opening(&mut self, index: usize) -> Option<String>;
    /// The prompt's logprobs of one choice, just before its first delta; formats that show
    /// them keep them for that delta.
    fn prompt_logprobs(&mut self, _index: usize, _scored: Vec<PromptLogprob>) {}
    /// New text of one choice; `None` when there is nothing to send.
    fn delta(&mut self, index: usize, text: String, logprobs: &[TokenLogprob]) -> Option<String>;
    /// The last chunks of one choice: what its readers held back, then its finish reason.
    fn finish(&mut self, index: usize, reason: FinishReason) -> Vec<String>;
    /// The chunk with no choices and the request's usage.
    fn usage(&mut self, usage: Usage) -> String;
}

/// What the stream sends besides the chunks.
#[derive(Debug, Clone, Copy)]
pub struct StreamConfig {
    pub num_choices: usize,
    pub include_usage: bool,
    pub keep_alive: Duration,
}

/// Serializes a chunk; our response types always serialize.
pub fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| {
        format!("{{\"error\":{{\"message\":\"cannot serialize a chunk: {e}\"}}}}")
    })
}

struct State<F> {
    outbox: Outbox,
    format: F,
    usage: UsageTally,
    include_usage: bool,
}

impl<F: ChunkFormat> State<F> {
    fn on_event(&mut self, index: usize, event: ChoiceEvent) {
        match event {
            ChoiceEvent::Delta {
                text,
                logprobs,
                prompt_logprobs,
                ..
            } => {
                self.usage.first_text();
                if !prompt_logprobs.is_empty() {
                    self.format.prompt_logprobs(index, prompt_logprobs);
                }
                if let Some(chunk) = self.format.delta(index, text, &logprobs) {
                    self.outbox.queued.push_back(Event::default().data(chunk));
                }
            }
            ChoiceEvent::Finished { reason, usage } => {
                self.usage.add(index, &usage);
                for chunk in self.format.finish(index, reason) {
                    self.outbox.queued.push_back(Event::default().data(chunk));
                }
            }
            ChoiceEvent::Failed(error) => {
                self.outbox.queued.push_back(error_event(error));
                self.outbox.done = true;
            }
        }
    }

    fn on_end(&mut self) {
        if self.include_usage {
            let usage = self.usage.usage();
            self.outbox
                .queued
                .push_back(Event::default().data(self.format.usage(usage)));
        }
        self.outbox
            .queued
            .push_back(Event::default().data("[DONE]"));
        self.outbox.done = true;
    }
}

/// An error after the response started: the body the status table gives, as a `data:` event.
pub fn error_event(error: ApiError) -> Event {
    let (status, Json(body)): (StatusCode, Json<ErrorResponse>) = error.into();
    tracing::warn!(
        status = status.as_u16(),
        "stream ended by an error: {}",
        body.error.message
    );
    Event::default().data(to_json(&body))
}

/// The SSE response of a streaming request. The body owns the merged choice events, so a
/// client that disconnects drops them and the engine aborts every choice.
pub fn sse<F: ChunkFormat>(
    events: ChoiceEvents,
    mut format: F,
    usage: UsageTally,
    config: StreamConfig,
) -> Response {
    let queued = (0..config.num_choices)
        .filter_map(|i| format.opening(i))
        .map(|chunk| Event::default().data(chunk))
        .collect();
    let state = State {
        outbox: Outbox::new(events, queued),
        format,
        usage,
        include_usage: config.include_usage,
    };
    respond(state, config.keep_alive)
}

/// A stream being sent: the events ready to go, and the choices' events still to read.
pub struct Outbox {
    events: ChoiceEvents,
    pub queued: VecDeque<Event>,
    /// Nothing more is read once the queued events are sent.
    pub done: bool,
}

impl Outbox {
    pub fn new(events: ChoiceEvents, queued: VecDeque<Event>) -> Outbox {
        Outbox {
            events,
            queued,
            done: false,
        }
    }
}

/// How a stream turns the choices' events into SSE events.
pub trait EventSource: Send + 'static {
    fn outbox(&mut self) -> &mut Outbox;
    /// Takes the next choice event, `None` when every choice has ended.
    fn take(&mut self, next: Option<(usize, ChoiceEvent)>);
}

/// The SSE response that sends `source`'s events, with keep-alive comments. The body is
/// polled after the handler returned, so it carries the request's span for its log lines.
pub fn respond<S: EventSource>(source: S, keep_alive: Duration) -> Response {
    let span = tracing::Span::current();
    let body = stream::unfold(source, move |mut source| {
        async move {
            loop {
                let outbox = source.outbox();
                if let Some(event) = outbox.queued.pop_front() {
                    return Some((Ok::<_, Infallible>(event), source));
                }
                if outbox.done {
                    return None;
                }
                let next = outbox.events.next().await;
                source.take(next);
            }
        }
        .instrument(span.clone())
    });
    Sse::new(body.boxed())
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}

impl<F: ChunkFormat> EventSource for State<F> {
    fn outbox(&mut self) -> &mut Outbox {
        &mut self.outbox
    }

    fn take(&mut self, next: Option<(usize, ChoiceEvent)>) {
        match next {
            Some((index, event)) => self.on_event(index, event),
            None => self.on_end(),
        }
    }
}
