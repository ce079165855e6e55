//! Server-sent events of the APIs whose events carry names (Anthropic's Messages, OpenAI's Responses): one choice, each event an `event:` line and a JSON `data:` line, and no `[DONE]`.

use std::time::Duration;

use axum::response::Response;
use axum::response::sse::Event;
use serde::Serialize;

use crate::engine::{EngineError, FinishReason};

use super::error::ApiError;
use super::openai::Usage;
use super::stream::{EventSource, Outbox, respond, to_json};
use super::submit::{ChoiceEvent, ChoiceEvents, UsageTally};

/// How one API names and writes the events of its single choice.
pub trait NamedEvents: Send + 'static {
    /// The events before any token (the response announced).
    fn opening(&mut self) -> Vec<Event>;
    /// New text and the tokens behind it.
    fn delta(&mut self, text: &str, token_ids: &[u32]) -> Vec<Event>;
    /// The last events: what the readers held back, the stop reason, the usage.
    fn finish(&mut self, reason: FinishReason, usage: Usage) -> Vec<Event>;
    /// The error event that ends a stream that failed after it started.
    fn failure(&mut self, error: ApiError) -> Vec<Event>;
}

/// An event named `name` with `data` as its JSON.
pub fn named<T: Serialize>(name: &str, data: &T) -> Event {
    Event::default().event(name).data(to_json(data))
}

struct State<F> {
    outbox: Outbox,
    format: F,
    usage: UsageTally,
}

impl<F: NamedEvents> State<F> {
    fn on_event(&mut self, event: ChoiceEvent) {
        let events = match event {
            ChoiceEvent::Delta {
                text, token_ids, ..
            } => {
                self.usage.first_text();
                self.format.delta(&text, &token_ids)
            }
            ChoiceEvent::Finished { reason, usage } => {
                self.usage.add(0, &usage);
                self.outbox.done = true;
                self.format.finish(reason, self.usage.usage())
            }
            ChoiceEvent::Failed(error) => {
                self.outbox.done = true;
                self.failure(error)
            }
        };
        self.outbox.queued.extend(events);
    }

    fn failure(&mut self, error: ApiError) -> Vec<Event> {
        tracing::warn!("stream ended by an error: {error}");
        self.format.failure(error)
    }
}

impl<F: NamedEvents> EventSource for State<F> {
    fn outbox(&mut self) -> &mut Outbox {
        &mut self.outbox
    }

    fn take(&mut self, next: Option<(usize, ChoiceEvent)>) {
        match next {
            Some((_, event)) => self.on_event(event),
            None => {
                self.outbox.done = true;
                let events = self.failure(ApiError::Unavailable(EngineError::Stopped));
                self.outbox.queued.extend(events);
            }
        }
    }
}

/// The SSE response of a streaming request with one choice. As in [`super::stream::sse`], the
/// body owns the choice's events, so a client that goes away aborts the generation.
pub fn sse<F: NamedEvents>(
    events: ChoiceEvents,
    mut format: F,
    usage: UsageTally,
    keep_alive: Duration,
) -> Response {
    let state = State {
        outbox: Outbox::new(events, format.opening().into()),
        format,
        usage,
    };
    respond(state, keep_alive)
}
