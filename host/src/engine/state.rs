//! One request inside the engine: its tokens, progress, KV standing, output state and channel.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::grammar::GrammarMatcher;
use crate::kv::ComputedPrefix;
use crate::model::DecodeStream;
use crate::plugins::Generation;
use crate::plugins::generation::LoadedSampler;
use crate::sched::{Phase, RequestView};

use super::request::{GenerationEvent, GenerationRequest, RequestId};
use super::stop::StopMatcher;

pub struct RequestState {
    pub id: RequestId,
    pub request: GenerationRequest,
    pub prompt: Arc<[u32]>,
    pub output: Vec<u32>,
    /// Prompt and output, the tokens whose KV entries the request needs.
    pub tokens: Vec<u32>,
    pub phase: Phase,
    /// Tokens whose KV entries are in the cache.
    pub num_computed: u32,
    /// Prompt tokens the prefix cache supplied at (the last) admission.
    pub num_cached_prefix: u32,
    /// Found at admission, taken by the first allocation.
    pub pending_prefix: Option<ComputedPrefix>,
    pub arrival: Instant,
    /// Microseconds since the engine started, for the scheduler's view.
    pub arrival_us: u64,
    pub first_scheduled: Option<Instant>,
    pub last_token: Option<Instant>,
    pub detokenizer: DecodeStream,
    pub stop: StopMatcher,
    pub events: UnboundedSender<GenerationEvent>,
    /// The deployment generation active when the request arrived: held while the request
    /// runs, so the admin listing shows it as draining until its last request ends.
    pub _deployment: Arc<Generation>,
    /// The sampler of that generation the request chose: it samples every token of the
    /// request, whatever reloads happen meanwhile. `None`: the built-in one, run natively.
    pub sampler: Option<Arc<LoadedSampler>>,
    /// Tokens the host's built-in sampler chose in place of a failed sampler plugin.
    pub sampler_fallback: SamplerFallback,
    /// Where the output stands in the request's grammar; `None` for unconstrained requests,
    /// and while the mask worker holds it during a step.
    pub grammar: Option<Box<GrammarMatcher>>,
}

/// How much of a request the built-in sampler served under a sampler's `fallback` policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SamplerFallback {
    /// The plugin failed this request's own row (found by re-running it alone): the host
    /// samples it natively from then on, so it cannot fault the plugin again.
    pub native_from_now_on: bool,
    /// Tokens sampled natively, for the response's usage.
    pub tokens: u32,
}

impl RequestState {
    /// The API request's id, for log lines about this sequence.
    pub fn request_id(&self) -> Option<&str> {
        self.request.request_id.as_deref()
    }

    pub fn view(&self, blocks_held: u32) -> RequestView {
        RequestView {
            id: self.id,
            phase: self.phase,
            priority: self.request.priority,
            arrival_us: self.arrival_us,
            prompt_len: self.prompt.len() as u32,
            computed_len: self.num_computed,
            cached_prefix_len: self.num_cached_prefix,
            output_len: self.output.len() as u32,
            max_output: self.request.max_tokens,
            blocks_held,
        }
    }

    /// Whether the client is gone.
    pub fn is_abandoned(&self) -> bool {
        self.events.is_closed()
    }
}
