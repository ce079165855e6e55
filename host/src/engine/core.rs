//! The engine step, split into its phases: schedule, preempt, admit, execute, sample, emit.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use plughost_sdk::sampler::{Sampled, SamplingParams};

use crate::grammar::{GrammarMatcher, MaskState, Progress};
use crate::kv::KvCacheManager;
use crate::metrics::Metrics;
use crate::model::Tokenizer;
use crate::plugins::generation::{LoadedComponent, LoadedSampler, Slot};
use crate::plugins::logits::{LogitsBatch, NativeRow, TokenHistory};
use crate::plugins::sampler::{RowFailure, SequenceToSample};
use crate::plugins::scheduler::SchedulerPlugin;
use crate::plugins::{Generation, OnFailure, PluginError, PluginRejection};
use crate::profile::{Profiler, Track};
use crate::runtime::{Runtime, RuntimeError, StepSequence};
use crate::sched::{self, Phase, Plan, RequestView, Resources};

use super::health::EngineHealth;
use super::masks::StepMasks;
use super::request::{FinishReason, GenerationEvent, TokenLogprob, Usage};
use super::state::RequestState;
use super::stop::StopOutcome;

/// Sizes the engine schedules within.
#[derive(Debug, Clone, Copy)]
pub struct EngineLimits {
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub max_model_len: u32,
}

pub struct EngineCore {
    pub runtime: Runtime,
    /// The active deployment: its scheduler plans every step; new requests take its sampler.
    pub deployment: Arc<Generation>,
    pub kv: KvCacheManager,
    pub tokenizer: Tokenizer,
    pub eos_token_ids: Vec<u32>,
    pub limits: EngineLimits,
    pub metrics: Arc<Metrics>,
    pub requests: HashMap<u64, RequestState>,
    /// Running requests in admission order.
    pub running: Vec<u64>,
    /// Waiting and preempted requests.
    pub waiting: Vec<u64>,
    pub logits: Vec<f32>,
    pub last_prefix_stats: crate::kv::PrefixCacheStats,
    /// Spans of every step, when a profile was asked for.
    pub profiler: Option<Profiler>,
    pub num_steps: u64,
    /// Progress stamps for the watchdog, and the requests it fails if the engine cannot.
    pub health: Arc<EngineHealth>,
    /// Constrained decoding's mask thread and per-step buffers.
    pub masks: StepMasks,
}

impl EngineCore {
    pub fn has_work(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Makes `generation` the active deployment from the next step on. Requests in flight keep
    /// the sampler of the generation they started with.
    pub fn install(&mut self, generation: Arc<Generation>) {
        tracing::debug!(
            from = self.deployment.number(),
            to = generation.number(),
            "swapping the deployment between two steps"
        );
        self.deployment = generation;
    }

    /// Queues a request, looking up its cached prefix once; fails at once a request that could
    /// never run, so it cannot wait forever.
    pub fn add(&mut self, mut state: RequestState) {
        if let Some(reason) = self.never_runs(&state) {
            tracing::warn!(
                request = state.id,
                request_id = state.request_id(),
                "refused: {reason}"
            );
            self.health.in_flight.remove(state.id);
            let _ = state
                .events
                .send(GenerationEvent::Failed { message: reason });
            return;
        }
        self.metrics.prompt_tokens.inc_by(state.prompt.len() as u64);
        self.lookup_prefix(&mut state);
        self.waiting.push(state.id);
        self.requests.insert(state.id, state);
    }

    /// Why `state` can never finish in this engine, if so. The API refuses such requests
    /// before they get here; this guards every other caller of the engine.
    fn never_runs(&self, state: &RequestState) -> Option<String> {
        let prompt_len = state.prompt.len() as u64;
        if prompt_len == 0 {
            return Some("the prompt is empty".into());
        }
        let max_tokens = u64::from(state.request.max_tokens);
        let max_model_len = u64::from(self.limits.max_model_len);
        if prompt_len + max_tokens > max_model_len {
            return Some(format!(
                "the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the \
                 context of {max_model_len} tokens"
            ));
        }
        let block_size = u64::from(self.kv.block_size().max(1));
        let blocks = (prompt_len + max_tokens).div_ceil(block_size);
        if blocks > u64::from(self.kv.num_blocks()) {
            return Some(format!(
                "{} tokens need {blocks} KV blocks of {block_size}; the cache has {}",
                prompt_len + max_tokens,
                self.kv.num_blocks()
            ));
        }
        None
    }

    fn lookup_prefix(&mut self, state: &mut RequestState) {
        let prefix = self.kv.find_cached_prefix(&state.tokens);
        state.num_computed = prefix.num_tokens;
        state.num_cached_prefix = prefix.num_tokens;
        state.pending_prefix = (prefix.num_tokens > 0).then_some(prefix);
    }

    /// Records one part of the step in the metrics and, when profiling, as a trace span.
    pub(super) fn record(
        &mut self,
        part: &'static str,
        track: Track,
        start: Instant,
        duration: Duration,
    ) {
        self.metrics
            .step_seconds
            .with_label_values(&[part])
            .observe(duration.as_secs_f64());
        if let Some(profiler) = self.profiler.as_mut() {
            profiler.span(part, track, start, duration, self.num_steps);
        }
    }

    /// One engine step. Returns after emitting every token it produced. A step the device
    /// fails twice fails the requests in it; the others go on.
    pub fn step(&mut self) {
        self.abort_abandoned();
        if self.requests.is_empty() {
            // The last requests may just have been aborted: publish the blocks they freed.
            self.update_gauges();
            return;
        }
        self.num_steps += 1;
        let started = Instant::now();
        let plan = self.schedule();
        self.preempt(&plan.preempt);
        let scheduled = self.admit(&plan);
        self.record("schedule", Track::Host, started, started.elapsed());
        if scheduled.is_empty() {
            // A step that only preempted has freed blocks; the next one admits from the queue.
            if self.running.is_empty() && plan.run.is_empty() && plan.preempt.is_empty() {
                self.fail_unschedulable();
            }
            self.update_gauges();
            return;
        }
        self.begin_masks(&scheduled);
        let executed = self.execute_with_retry(&scheduled);
        self.finish_masks();
        let emitting = match executed {
            Ok(emitting) => emitting,
            Err(e) => {
                tracing::error!("engine step failed: {e}");
                let ids: Vec<u64> = scheduled.iter().map(|&(id, _)| id).collect();
                self.fail_requests(&ids, &format!("engine step failed: {e}"));
                self.update_gauges();
                return;
            }
        };
        self.health.liveness.progressed();
        let sample_started = Instant::now();
        let sampled = self.sample(&emitting);
        self.record(
            "sample",
            Track::Host,
            sample_started,
            sample_started.elapsed(),
        );
        let emit_started = Instant::now();
        for (id, row) in emitting.iter().zip(sampled) {
            let (sampled, fallback, culprit) = match row {
                SampledRow::Token(sampled) => (sampled, false, false),
                SampledRow::Fallback { sampled, culprit } => (sampled, true, culprit),
                SampledRow::Rejected(rejection) => {
                    self.reject(*id, rejection);
                    continue;
                }
            };
            if let Some(state) = self.requests.get_mut(id) {
                let record = &mut state.sampler_fallback;
                if fallback || record.native_from_now_on {
                    record.tokens += 1;
                }
                record.native_from_now_on |= culprit;
            }
            self.emit(*id, sampled);
        }
        self.record("emit", Track::Host, emit_started, emit_started.elapsed());
        self.update_gauges();
    }

    /// Nothing runs and the built-in FCFS, which admits the oldest request whenever it fits
    /// the free cache, admitted none: the oldest can never run. Failing it keeps the rest
    /// moving; waiting would spin forever.
    fn fail_unschedulable(&mut self) {
        let oldest = self
            .waiting
            .iter()
            .filter_map(|id| self.requests.get(id))
            .min_by_key(|r| (r.arrival_us, r.id));
        let Some(state) = oldest else {
            return;
        };
        let block_size = self.kv.block_size().max(1);
        let needed = (state.tokens.len() as u32).div_ceil(block_size);
        let message = format!(
            "the request cannot be scheduled: its {} tokens need {needed} KV blocks of \
             {block_size}, the cache has {} ({} free), at most {} tokens per step and {} \
             sequences",
            state.tokens.len(),
            self.kv.num_blocks(),
            self.kv.num_free_blocks(),
            self.limits.max_num_batched_tokens,
            self.limits.max_num_seqs,
        );
        let id = state.id;
        self.fail_requests(&[id], &message);
    }

    /// Runs the step; a device failure is retried once by recomputing the same step, which
    /// rewrites the same KV entries, so a transient fault costs only the time of one step.
    fn execute_with_retry(&mut self, scheduled: &[(u64, u32)]) -> Result<Vec<u64>, RuntimeError> {
        match self.execute(scheduled) {
            Err(RuntimeError::Device(e)) => {
                tracing::warn!("device step failed, recomputing it once: {e}");
                self.metrics.device_step_retries.inc();
                self.execute(scheduled)
            }
            other => other,
        }
    }

    fn views(&self) -> Vec<RequestView> {
        let mut waiting: Vec<&RequestState> = self
            .waiting
            .iter()
            .filter_map(|id| self.requests.get(id))
            .collect();
        waiting.sort_by_key(|r| (r.arrival_us, r.id));
        self.running
            .iter()
            .filter_map(|id| self.requests.get(id))
            .chain(waiting)
            .map(|r| r.view(self.kv.block_table(r.id).len() as u32))
            .collect()
    }

    /// The scheduler plugin's plan for this step, checked. A refused plan, a plugin fault, and a
    /// plan that neither runs nor preempts anything while requests are queued or running (it
    /// would stop the engine for good, since nothing changes between steps) are faults of the
    /// component. A faulted or backed-off scheduler gets its failure policy: under `fallback`
    /// the built-in FCFS decides the step; under `reject` the waiting requests fail and FCFS
    /// runs on the ones already running.
    fn schedule(&mut self) -> Plan {
        let views = self.views();
        let resources = self.resources();
        let deployment = self.deployment.clone();
        let Some(component) = deployment.scheduler() else {
            return sched::fallback_plan(&views, &resources);
        };
        let failure = match Self::plan_from(component, &views, &resources) {
            Ok(plan) => return plan,
            Err(failure) => failure,
        };
        self.metrics.scheduler_fallbacks.inc();
        if component.faults().on_failure() == OnFailure::Reject {
            let rejection = scheduler_rejection(component, failure);
            let waiting = self.waiting.clone();
            for id in waiting {
                self.reject(id, rejection.clone());
            }
            return sched::fallback_plan(&self.views(), &resources);
        }
        sched::fallback_plan(&views, &resources)
    }

    /// The component's checked plan; a fault is counted against its failure policy.
    fn plan_from(
        component: &LoadedComponent<SchedulerPlugin>,
        views: &[RequestView],
        resources: &Resources,
    ) -> Result<Plan, PluginError> {
        let plan = match component.plugin().schedule(views, resources) {
            Ok(plan) => plan,
            Err(e) => {
                if e.is_unavailable() {
                    tracing::debug!("{e}; the scheduler's failure policy decides this step");
                } else {
                    tracing::warn!(
                        "scheduler plugin failed: {e}; its failure policy decides this step"
                    );
                }
                return Err(e);
            }
        };
        let refused = match sched::validate_plan(&plan, views, resources) {
            Err(e) => Some(format!("invalid plan: {e}")),
            Ok(()) if plan.run.is_empty() && plan.preempt.is_empty() && !views.is_empty() => {
                Some(format!(
                    "a plan that runs nothing with {} requests queued or running",
                    views.len()
                ))
            }
            Ok(()) => None,
        };
        match refused {
            None => Ok(plan),
            Some(message) => {
                let error = PluginError::Refused {
                    plugin: component.name(),
                    message,
                };
                tracing::warn!("{error}; its failure policy decides this step");
                component.faults().record_fault(&error);
                Err(error)
            }
        }
    }

    fn resources(&self) -> Resources {
        Resources {
            token_budget: self.limits.max_num_batched_tokens,
            max_running: self.limits.max_num_seqs,
            block_size: self.kv.block_size(),
            free_blocks: self.kv.num_free_blocks(),
            total_blocks: self.kv.num_blocks(),
        }
    }

    fn preempt(&mut self, ids: &[u64]) {
        for &id in ids {
            self.kv.free(id);
            self.running.retain(|r| *r != id);
            let Some(mut state) = self.requests.remove(&id) else {
                continue;
            };
            tracing::debug!(
                request = id,
                request_id = state.request_id(),
                "preempted: its KV blocks are freed and it waits to run again"
            );
            state.phase = Phase::Preempted;
            self.lookup_prefix(&mut state);
            self.metrics.preemptions.inc();
            self.waiting.push(id);
            self.requests.insert(id, state);
        }
    }

    /// Allocates KV blocks for the plan's requests; returns (request, tokens) in batch order.
    fn admit(&mut self, plan: &Plan) -> Vec<(u64, u32)> {
        let mut scheduled = Vec::with_capacity(plan.run.len());
        for s in &plan.run {
            let Some(state) = self.requests.get_mut(&s.id) else {
                continue;
            };
            let total = state.num_computed + s.num_tokens;
            let prefix = state.pending_prefix.take();
            if self.kv.allocate(s.id, total, prefix.as_ref()).is_none() {
                // Validation counted the blocks, so this happens when the cached prefix found at
                // admission was evicted meanwhile: look it up again and wait for the next step.
                match prefix {
                    Some(p) if !self.kv.is_prefix_cached(&p) => {
                        let fresh = self.kv.find_cached_prefix(&state.tokens);
                        state.num_computed = fresh.num_tokens;
                        state.num_cached_prefix = fresh.num_tokens;
                        state.pending_prefix = (fresh.num_tokens > 0).then_some(fresh);
                    }
                    other => state.pending_prefix = other,
                }
                tracing::debug!(
                    request = s.id,
                    request_id = state.request_id(),
                    "no KV blocks for a planned request; it waits"
                );
                continue;
            }
            if state.phase != Phase::Running {
                state.phase = Phase::Running;
                self.waiting.retain(|w| *w != s.id);
                self.running.push(s.id);
                if state.first_scheduled.is_none() {
                    state.first_scheduled = Some(Instant::now());
                    self.metrics
                        .queue_time
                        .observe(state.arrival.elapsed().as_secs_f64());
                }
            }
            scheduled.push((s.id, s.num_tokens));
        }
        scheduled
    }

    /// Runs the batch; returns the requests that emit a token, in logits-row order.
    fn execute(&mut self, scheduled: &[(u64, u32)]) -> Result<Vec<u64>, RuntimeError> {
        let mut batch = Vec::with_capacity(scheduled.len());
        let mut emitting = Vec::new();
        for &(id, n) in scheduled {
            let Some(state) = self.requests.get(&id) else {
                continue;
            };
            let start = state.num_computed as usize;
            let end = start + n as usize;
            let emit = end == state.tokens.len();
            if emit {
                emitting.push(id);
            }
            batch.push(StepSequence {
                id,
                tokens: &state.tokens[start..end],
                computed_len: state.num_computed,
                block_table: self.kv.block_table(id),
                emit,
            });
        }
        let started = Instant::now();
        self.health.liveness.device_step_started();
        let timing = self.runtime.execute(&batch, &mut self.logits);
        self.health.liveness.device_step_finished();
        let timing = timing?;
        // The runtime reports durations; lay them out in the order they happened.
        let dispatch_start = started + timing.prepare_inputs;
        let read_start = dispatch_start + timing.dispatch + timing.device;
        self.record(
            "prepare_inputs",
            Track::Host,
            started,
            timing.prepare_inputs,
        );
        // The device runs inside the dispatch window; the host's share is what remains.
        self.record("dispatch", Track::Host, dispatch_start, timing.dispatch);
        self.record("device", Track::Device, dispatch_start, timing.device);
        self.record("read_logits", Track::Host, read_start, timing.read_logits);
        for &(id, n) in scheduled {
            if let Some(state) = self.requests.get_mut(&id) {
                state.num_computed += n;
                self.kv
                    .cache_full_blocks(id, &state.tokens, state.num_computed);
            }
        }
        Ok(emitting)
    }

    /// Samples one token per emitting request, each with the sampler of the generation it
    /// started with. One generation (the usual case) samples the whole batch in one call;
    /// while requests of several generations run, each generation samples its own rows.
    fn sample(&mut self, emitting: &[u64]) -> Vec<SampledRow> {
        let vocab = self.runtime.model_info().vocab_size as usize;
        self.shape_rows(emitting);
        let mut batch = LogitsBatch::new(std::mem::take(&mut self.logits), vocab);
        let mut sequences = Vec::with_capacity(emitting.len());
        let mut samplers: Vec<Option<Arc<LoadedSampler>>> = Vec::with_capacity(emitting.len());
        for (row, id) in emitting.iter().enumerate() {
            let Some(state) = self.requests.get(id) else {
                continue;
            };
            if !state.request.sampling.penalties.is_none() {
                batch.set_history(
                    row,
                    TokenHistory {
                        prompt: state.prompt.clone(),
                        output: state.output.clone(),
                    },
                );
            }
            sequences.push(SequenceToSample {
                request: *id,
                position: state.output.len() as u32,
                // Log-probabilities cost a pass over the row; only requests that return them pay it.
                params: SamplingParams {
                    logprobs: state.request.logprobs,
                    ..state.request.sampling
                },
            });
            // A request whose own row failed the plugin under `fallback` stays native.
            samplers.push(match state.sampler_fallback.native_from_now_on {
                true => None,
                false => state.sampler.clone(),
            });
        }
        let same = |a: &Option<Arc<LoadedSampler>>, b: &Option<Arc<LoadedSampler>>| match (a, b) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        let mut sampled = match samplers.first() {
            Some(first) if samplers.iter().any(|s| !same(s, first)) => {
                self.sample_by_generation(&mut batch, &sequences, &samplers, same)
            }
            first => {
                let sampler = first.cloned().flatten();
                self.sample_with(sampler.as_deref(), &mut batch, &sequences)
            }
        };
        self.enforce_masks(&mut batch, emitting, &sequences, &samplers, &mut sampled);
        self.logits = batch.into_values();
        self.fail_lost_grammars();
        sampled
    }

    /// Splits the batch by sampler, samples each part, and puts the tokens back in row order.
    fn sample_by_generation(
        &mut self,
        batch: &mut LogitsBatch,
        sequences: &[SequenceToSample],
        samplers: &[Option<Arc<LoadedSampler>>],
        same: impl Fn(&Option<Arc<LoadedSampler>>, &Option<Arc<LoadedSampler>>) -> bool,
    ) -> Vec<SampledRow> {
        let vocab = batch.vocab();
        let mut out: Vec<Option<SampledRow>> = vec![None; sequences.len()];
        let mut done = vec![false; sequences.len()];
        for first in 0..sequences.len() {
            if done[first] {
                continue;
            }
            let rows: Vec<usize> = (first..sequences.len())
                .filter(|&r| !done[r] && same(&samplers[r], &samplers[first]))
                .collect();
            let mut values = Vec::with_capacity(rows.len() * vocab);
            for &r in &rows {
                values.extend_from_slice(batch.row(r).unwrap_or(&[]));
            }
            let mut part = LogitsBatch::new(values, vocab);
            for (i, &r) in rows.iter().enumerate() {
                if let Some((_, history)) = batch.row_mut(r) {
                    part.set_history(i, history.clone());
                }
            }
            let part_sequences: Vec<SequenceToSample> =
                rows.iter().map(|&r| sequences[r]).collect();
            let sampled = self.sample_with(samplers[first].as_deref(), &mut part, &part_sequences);
            for (&r, s) in rows.iter().zip(sampled) {
                out[r] = Some(s);
                done[r] = true;
            }
        }
        out.into_iter()
            .map(|s| {
                s.unwrap_or(SampledRow::Token(Sampled {
                    token: 0,
                    logprob: f32::NEG_INFINITY,
                    top_logprobs: Vec::new(),
                }))
            })
            .collect()
    }

    /// Samples `batch` with `sampler`, or natively when there is none. A row the plugin failed
    /// (alone: the plugin isolates its culprits) or could not take (backed off, disabled) gets
    /// the component's failure policy: the native standard sampler under `fallback`, a
    /// rejection under `reject`. The other rows keep the plugin's tokens.
    fn sample_with(
        &mut self,
        sampler: Option<&LoadedSampler>,
        batch: &mut LogitsBatch,
        sequences: &[SequenceToSample],
    ) -> Vec<SampledRow> {
        let Some(component) = sampler else {
            return (0..sequences.len())
                .map(|row| SampledRow::Token(native_sample_row(batch, sequences, row)))
                .collect();
        };
        let rows = component.plugin().sample_rows(batch, sequences);
        let on_failure = component.faults().on_failure();
        let mut out = Vec::with_capacity(rows.len());
        for (row, result) in rows.into_iter().enumerate() {
            out.push(match result {
                Ok(sampled) => SampledRow::Token(sampled),
                Err(failure) => match on_failure {
                    OnFailure::Fallback => {
                        self.metrics.sampler_fallbacks.inc();
                        SampledRow::Fallback {
                            sampled: native_sample_row(batch, sequences, row),
                            culprit: matches!(failure, RowFailure::Faulted(_)),
                        }
                    }
                    OnFailure::Reject => {
                        SampledRow::Rejected(sampler_rejection(component, failure))
                    }
                },
            });
        }
        out
    }

    fn emit(&mut self, id: u64, sampled: Sampled) {
        let Some(state) = self.requests.get_mut(&id) else {
            return;
        };
        if let Some(MaskState::DeadEnd(cause)) = state.grammar.as_deref().map(GrammarMatcher::state)
        {
            let cause = cause.clone();
            self.end_at_dead_end(id, &cause);
            return;
        }
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
        let token = sampled.token;
        state.output.push(token);
        state.tokens.push(token);
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
            match state.detokenizer.step(token) {
                Ok(Some(piece)) => match state.stop.push(&piece) {
                    StopOutcome::Continue(t) => text = t,
                    StopOutcome::Stopped(t) => {
                        text = t;
                        finish = Some(FinishReason::Stop);
                        stop_string_matched = true;
                    }
                },
                Ok(None) => {}
                Err(e) => tracing::warn!(
                    request = id,
                    request_id = state.request_id(),
                    "detokenizing failed: {e}"
                ),
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
            match progress {
                Progress::Continue => {}
                Progress::Complete => finish = Some(FinishReason::Stop),
                Progress::DeadEnd(cause) => {
                    tracing::warn!(request = id, request_id = state.request_id(), "{cause}");
                    finish = Some(FinishReason::GrammarDeadEnd);
                }
            }
        }
        if finish.is_none()
            && (state.output.len() as u32 >= state.request.max_tokens
                || state.tokens.len() as u32 >= self.limits.max_model_len)
        {
            finish = Some(FinishReason::Length);
        }
        if finish.is_some() && !stop_string_matched {
            // The stream ends here: release text held back for a possible stop string and an
            // incomplete character, unless a stop string ended it (then the rest is dropped).
            let mut rest = match state.detokenizer.flush() {
                Ok(Some(rest)) => rest,
                _ => String::new(),
            };
            match state.stop.push(&rest) {
                StopOutcome::Continue(t) => {
                    text.push_str(&t);
                    rest = state.stop.finish();
                    text.push_str(&rest);
                }
                StopOutcome::Stopped(t) => text.push_str(&t),
            }
        }
        let _ = state.events.send(GenerationEvent::Delta {
            text,
            token_ids: vec![token],
            logprobs,
        });
        if let Some(reason) = finish {
            self.finish(id, reason);
        }
    }

    pub(super) fn finish(&mut self, id: u64, reason: FinishReason) {
        self.health.in_flight.remove(id);
        self.health.liveness.progressed();
        self.kv.free(id);
        self.running.retain(|r| *r != id);
        self.waiting.retain(|r| *r != id);
        let Some(state) = self.requests.remove(&id) else {
            return;
        };
        let usage = Usage {
            prompt_tokens: state.prompt.len() as u32,
            completion_tokens: state.output.len() as u32,
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
        let _ = state
            .events
            .send(GenerationEvent::Finished { reason, usage });
    }

    /// Requests whose client went away release their blocks.
    pub fn abort_abandoned(&mut self) {
        let gone: Vec<u64> = self
            .requests
            .values()
            .filter(|r| r.is_abandoned())
            .map(|r| r.id)
            .collect();
        for id in gone {
            self.finish(id, FinishReason::Abort);
        }
    }

    /// Ends every request, e.g. at shutdown.
    pub fn abort_all(&mut self) {
        let all: Vec<u64> = self.requests.keys().copied().collect();
        for id in all {
            self.finish(id, FinishReason::Abort);
        }
        self.update_gauges();
    }

    /// Ends `ids` with a failure carrying `message`, logged for each; the engine keeps serving
    /// the others.
    pub fn fail_requests(&mut self, ids: &[u64], message: &str) {
        for &id in ids {
            self.health.in_flight.remove(id);
            self.kv.free(id);
            self.running.retain(|r| *r != id);
            self.waiting.retain(|r| *r != id);
            if let Some(state) = self.requests.remove(&id) {
                tracing::error!(
                    request = id,
                    request_id = state.request_id(),
                    "request failed: {message}"
                );
                self.metrics
                    .requests_finished
                    .with_label_values(&["error"])
                    .inc();
                let _ = state.events.send(GenerationEvent::Failed {
                    message: message.to_string(),
                });
            }
        }
        self.health.liveness.progressed();
    }

    /// Ends `id` with a plugin's rejection; the engine keeps serving the others.
    fn reject(&mut self, id: u64, rejection: PluginRejection) {
        self.health.in_flight.remove(id);
        self.kv.free(id);
        self.running.retain(|r| *r != id);
        self.waiting.retain(|r| *r != id);
        if let Some(state) = self.requests.remove(&id) {
            tracing::warn!(
                request = id,
                request_id = state.request_id(),
                "request rejected: {rejection}"
            );
            self.metrics
                .requests_finished
                .with_label_values(&["error"])
                .inc();
            let _ = state.events.send(GenerationEvent::Rejected(rejection));
        }
        self.health.liveness.progressed();
    }

    fn update_gauges(&mut self) {
        if let Ok(stats) = self.runtime.device().stats() {
            self.metrics.record_device(&stats);
        }
        self.metrics
            .load
            .set(self.waiting.len(), self.running.len(), self.kv.usage());
        self.metrics
            .kv_blocks_free
            .set(self.kv.num_free_blocks() as i64);
        let stats = self.kv.prefix_cache_stats();
        self.metrics.prefix_cache_queries.inc_by(
            stats
                .num_queries
                .saturating_sub(self.last_prefix_stats.num_queries),
        );
        self.metrics.prefix_cache_hits.inc_by(
            stats
                .num_hits
                .saturating_sub(self.last_prefix_stats.num_hits),
        );
        self.last_prefix_stats = stats;
    }
}

/// What sampling gave one emitting row.
#[derive(Debug, Clone)]
pub(super) enum SampledRow {
    Token(Sampled),
    /// Sampled natively because the sampler failed the row (`culprit`: on the row's own
    /// input) or is backed off, under its `fallback` policy.
    Fallback {
        sampled: Sampled,
        culprit: bool,
    },
    /// The sampler failed the row and its policy is `reject`.
    Rejected(PluginRejection),
}

fn sampler_rejection(component: &LoadedSampler, failure: RowFailure) -> PluginRejection {
    match failure {
        RowFailure::Unavailable(u) => {
            PluginRejection::unavailable(Slot::Sampler, &component.name(), u)
        }
        RowFailure::Faulted(cause) => PluginRejection::Faulted {
            slot: Slot::Sampler,
            plugin: component.name(),
            cause,
        },
    }
}

fn scheduler_rejection(
    component: &LoadedComponent<SchedulerPlugin>,
    error: PluginError,
) -> PluginRejection {
    match RowFailure::from(error) {
        RowFailure::Unavailable(u) => {
            PluginRejection::unavailable(Slot::Scheduler, &component.name(), u)
        }
        RowFailure::Faulted(cause) => PluginRejection::Faulted {
            slot: Slot::Scheduler,
            plugin: component.name(),
            cause,
        },
    }
}

/// The standard sampler run natively on one row: what a deployment without a sampler plugin
/// runs, and the fallback of one that fails.
fn native_sample_row(
    batch: &mut LogitsBatch,
    sequences: &[SequenceToSample],
    row: usize,
) -> Sampled {
    match (batch.row_mut(row), sequences.get(row)) {
        (Some((values, history)), Some(seq)) => {
            let history = history.clone();
            let native = NativeRow::new(values, &history);
            plughost_sampler_standard::sample_sequence(
                &native,
                &seq.params,
                seq.request,
                seq.position,
            )
        }
        _ => Sampled {
            token: 0,
            logprob: f32::NEG_INFINITY,
            top_logprobs: Vec::new(),
        },
    }
}
