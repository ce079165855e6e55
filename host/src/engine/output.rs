//! The output processor: a step's sampled token turned into a request's events — detokenized, checked against every stop condition, streamed, and the finish decided and reported.

use std::sync::Arc;
use std::time::Instant;

use plughost_sdk::sampler::Sampled;
use tokio::sync::mpsc::UnboundedSender;

use crate::grammar::{GrammarMatcher, MaskState, Progress};
use crate::metrics::Metrics;
use crate::model::{DecodeStream, Tokenizer};

use super::request::{FinishReason, GenerationEvent, TokenLogprob, Usage};
use super::state::RequestState;
use super::stop::{StopMatcher, StopOutcome};

/// One request's output text: tokens decoded into text as they come, and that text held back
/// while it might be the start of a stop string.
pub struct OutputText {
    detokenizer: DecodeStream,
    stop: StopMatcher,
}

/// The text one token released.
struct Piece {
    text: String,
    /// A stop string matched: `text` is what came before it, and the request ends.
    stopped: bool,
}

impl OutputText {
    fn new(tokenizer: &Tokenizer, stop_strings: &[String]) -> OutputText {
        OutputText {
            detokenizer: tokenizer.decode_stream(true),
            stop: StopMatcher::new(stop_strings),
        }
    }

    /// Decodes `token` and releases what text can go out now.
    fn push(&mut self, token: u32, state_id: u64, request_id: Option<&str>) -> Piece {
        match self.detokenizer.step(token) {
            Ok(Some(piece)) => match self.stop.push(&piece) {
                StopOutcome::Continue(text) => Piece {
                    text,
                    stopped: false,
                },
                StopOutcome::Stopped(text) => Piece {
                    text,
                    stopped: true,
                },
            },
            Ok(None) => Piece {
                text: String::new(),
                stopped: false,
            },
            Err(e) => {
                tracing::warn!(request = state_id, request_id, "detokenizing failed: {e}");
                Piece {
                    text: String::new(),
                    stopped: false,
                }
            }
        }
    }

    /// The stream ends without a stop string: releases text held back for a possible stop
    /// string and an incomplete character (up to a stop string the rest completes).
    fn flush(&mut self) -> String {
        let rest = match self.detokenizer.flush() {
            Ok(Some(rest)) => rest,
            _ => String::new(),
        };
        match self.stop.push(&rest) {
            StopOutcome::Continue(text) => text + &self.stop.finish(),
            StopOutcome::Stopped(text) => text,
        }
    }
}

/// Turns sampled tokens into events, for every request of the engine, and hands them out.
pub(super) struct OutputProcessor {
    tokenizer: Tokenizer,
    /// The model's end-of-sequence tokens.
    eos_token_ids: Vec<u32>,
    max_model_len: u32,
    metrics: Arc<Metrics>,
    /// Events not yet sent, in the order they were made. Sending wakes a thread of the HTTP
    /// runtime; the engine holds a step's events until the next step's launches are with a
    /// worker process's device ([`OutputProcessor::deliver`]), so that wake-up, and the
    /// thread it wakes, take no time between two steps.
    held: Vec<(UnboundedSender<GenerationEvent>, GenerationEvent)>,
}

impl OutputProcessor {
    pub(super) fn new(
        tokenizer: Tokenizer,
        eos_token_ids: Vec<u32>,
        max_model_len: u32,
        metrics: Arc<Metrics>,
    ) -> OutputProcessor {
        OutputProcessor {
            tokenizer,
            eos_token_ids,
            max_model_len,
            metrics,
            held: Vec::new(),
        }
    }

    /// Queues `event` for `events`, behind every event queued before it.
    pub(super) fn send(
        &mut self,
        events: &UnboundedSender<GenerationEvent>,
        event: GenerationEvent,
    ) {
        self.held.push((events.clone(), event));
    }

    /// Sends every queued event, in order. A request whose client is gone drops its events.
    pub(super) fn deliver(&mut self) {
        for (events, event) in self.held.drain(..) {
            let _ = events.send(event);
        }
    }

    /// The output text of a new request that stops at `stop_strings`.
    pub(super) fn text_for(&self, stop_strings: &[String]) -> OutputText {
        OutputText::new(&self.tokenizer, stop_strings)
    }

    /// The token a row at a grammar dead end keeps, so any sampler stays well-defined.
    pub(super) fn first_eos(&self) -> Option<u32> {
        self.eos_token_ids.first().copied()
    }

    /// Appends `sampled` to `state`, streams its delta and says whether, and why, the request
    /// finishes with it. A request whose grammar reached a dead end while its mask was built
    /// ends without the token.
    pub(super) fn process(
        &mut self,
        state: &mut RequestState,
        sampled: Sampled,
    ) -> Option<FinishReason> {
        if let Some(MaskState::DeadEnd(cause)) = state.grammar.as_deref().map(GrammarMatcher::state)
        {
            let cause = cause.clone();
            self.end_at_dead_end(state, &cause);
            return Some(FinishReason::GrammarDeadEnd);
        }
        self.observe_latency(state);
        let token = sampled.token;
        state.push_output(token);
        let logprobs = if state.request.logprobs {
            // Masked tokens (-inf) are not alternatives; no JSON carries -inf or NaN.
            let mut top = sampled.top_logprobs;
            top.retain(|c| c.value.is_finite());
            vec![TokenLogprob {
                token,
                logprob: sampled.logprob,
                top,
            }]
        } else {
            Vec::new()
        };
        let is_eos = !state.request.stop.ignore_eos && self.eos_token_ids.contains(&token);
        let is_stop_token = state.request.stop.stop_token_ids.contains(&token);
        let progress = match state.grammar.as_mut() {
            Some(grammar) if !is_eos && !is_stop_token => grammar.commit(token),
            _ => Progress::Continue,
        };
        let mut finish = None;
        let mut stop_string_matched = false;
        let mut text = String::new();
        if is_eos || is_stop_token {
            finish = Some(FinishReason::Stop);
        } else {
            let request_id = state.request.request_id.as_deref();
            let piece = state.text.push(token, state.id, request_id);
            text = piece.text;
            if piece.stopped {
                finish = Some(FinishReason::Stop);
                stop_string_matched = true;
            }
        }
        if let Some(dormant) = state.dormant_grammar.as_mut()
            && let Some(matcher) = dormant.read(&text)
        {
            // The reasoning block ended: the grammar applies from the next token on.
            state.grammar = Some(matcher);
            state.dormant_grammar = None;
        }
        if finish.is_none() {
            finish = match progress {
                Progress::Continue => None,
                Progress::Complete => Some(FinishReason::Stop),
                Progress::DeadEnd(cause) => {
                    tracing::warn!(
                        request = state.id,
                        request_id = state.request_id(),
                        "{cause}"
                    );
                    Some(FinishReason::GrammarDeadEnd)
                }
            };
        }
        if finish.is_none()
            && (state.output().len() as u32 >= state.request.max_tokens
                || state.tokens().len() as u32 >= self.max_model_len)
        {
            finish = Some(FinishReason::Length);
        }
        if finish.is_some() && !stop_string_matched {
            // The stream ends here: what was held back goes out, unless a stop string ended it
            // (then the rest is dropped).
            text.push_str(&state.text.flush());
        }
        let prompt_logprobs = state.deliver_prompt_logprobs();
        self.send(
            &state.events,
            GenerationEvent::Delta {
                text,
                token_ids: vec![token],
                logprobs,
                prompt_logprobs,
            },
        );
        finish
    }

    fn observe_latency(&self, state: &mut RequestState) {
        let now = Instant::now();
        match state.last_token {
            None => self
                .metrics
                .time_to_first_token
                .observe((now - state.arrival).as_secs_f64()),
            Some(last) => self
                .metrics
                .inter_token_latency
                .observe((now - last).as_secs_f64()),
        }
        state.last_token = Some(now);
        self.metrics.generation_tokens.inc();
    }

    /// A request whose grammar allows no token: the text held back for stop strings goes out;
    /// it then finishes `"stop"` with the dead end as its stop reason.
    fn end_at_dead_end(&mut self, state: &mut RequestState, cause: &str) {
        tracing::warn!(
            request = state.id,
            request_id = state.request_id(),
            "{cause}"
        );
        let text = state.text.flush();
        if !text.is_empty() {
            self.send(
                &state.events,
                GenerationEvent::Delta {
                    text,
                    token_ids: Vec::new(),
                    logprobs: Vec::new(),
                    prompt_logprobs: Vec::new(),
                },
            );
        }
    }

    /// The last event of a request that finished: its reason and usage.
    pub(super) fn finished(&mut self, state: RequestState, reason: FinishReason) {
        let usage = Usage {
            prompt_tokens: state.prompt().len() as u32,
            completion_tokens: state.output().len() as u32,
            cached_tokens: state.num_cached_prefix,
            plugin_fallback_tokens: state.sampler_fallback.tokens,
        };
        self.metrics
            .e2e_latency
            .observe(state.arrival.elapsed().as_secs_f64());
        self.metrics
            .requests_finished
            .with_label_values(&[reason.as_str()])
            .inc();
        if reason == FinishReason::GrammarDeadEnd {
            self.metrics.grammar_dead_ends.inc();
        }
        self.send(&state.events, GenerationEvent::Finished { reason, usage });
    }
}
