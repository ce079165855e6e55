//! The engine core: one step as an overview of its phases (schedule, preempt, admit, execute, sample, emit), and the ways a request leaves the engine.
//!
//! The phases live in the submodules: `schedule` (the scheduler side: plans, preemption,
//! admission), `sample` (one sampler call per step) and `masks` (constrained decoding). The
//! request table and its queues are a [`RequestTable`], the KV blocks a [`KvCacheManager`],
//! the output side an [`OutputProcessor`]; the core holds one of each and is the only place
//! that changes more than one of them, so a request leaves all three at once.

mod masks;
mod offload;
mod prompt_rows;
mod sample;
mod schedule;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use plughost_sdk::sampler::Sampled;
use tokio::sync::mpsc::UnboundedSender;

use crate::device::{DeviceError, DeviceIsolation};
use crate::kv::offload::KvOffload;
use crate::kv::{BlockHash, BlockId, ComputedPrefix, KvCacheManager, PrefixCacheStats};
use crate::metrics::Metrics;
use crate::plugins::{Generation, PluginRejection};
use crate::profile::{Profiler, Track};
use crate::runtime::{Runtime, RuntimeError, StepSequence};

use super::callable_times::CallableTimes;
use super::health::EngineHealth;
use super::output::OutputProcessor;
use super::queues::RequestTable;
use super::recovery::DeviceRecovery;
use super::request::{FinishReason, GenerationEvent, GenerationRequest, RequestId};
use super::state::{Admitted, RequestState};

use masks::StepMasks;
use prompt_rows::ScoredChunk;
use sample::SampledRow;

/// Sizes the engine schedules within.
#[derive(Debug, Clone, Copy)]
pub struct EngineLimits {
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub max_model_len: u32,
}

/// The engine's state on its thread. Invariant: a request held by `requests` holds KV blocks
/// only while it is there, and is in the health's in-flight list until it ends; every way out
/// goes through [`EngineCore::release`].
pub struct EngineCore {
    runtime: Runtime,
    /// The active deployment: its scheduler plans every step; new requests take its sampler.
    deployment: Arc<Generation>,
    kv: KvCacheManager,
    /// The prefix-cache counters as last published, so the metrics get the increments.
    last_prefix_stats: PrefixCacheStats,
    limits: EngineLimits,
    metrics: Arc<Metrics>,
    requests: RequestTable,
    output: OutputProcessor,
    /// The step's logits, reused from step to step.
    logits: Vec<f32>,
    /// Spans of every step, when a profile was asked for.
    profiler: Option<Profiler>,
    /// Each step's device time by callable, for the metrics and the profile.
    callable_times: CallableTimes,
    /// Steps run since the engine started: the number a scheduler plugin plans each step by.
    num_steps: u64,
    /// Progress stamps for the watchdog, and the requests it fails if the engine cannot.
    health: Arc<EngineHealth>,
    /// Constrained decoding's mask thread and per-step buffers.
    masks: StepMasks,
    /// With the device in a worker process: how to start another when it is lost.
    recovery: Option<DeviceRecovery>,
    /// Set when the device is broken for good: the engine computes nothing more.
    broken: bool,
    /// The KV tiers below the device, when `--kv-offload-*` asks for any.
    offload: Option<KvOffload>,
    /// Requests waiting for blocks to load from a lower tier, with their device prefix's
    /// length in blocks; they join the queue when the load completes.
    loading: Vec<(RequestState, u32)>,
    /// Blocks that became cached-free, reused from step to step.
    freed_blocks: Vec<(BlockId, BlockHash)>,
    /// Blocks on their way down to the tiers by background copies out of the device.
    stores: offload::StoreQueue,
}

impl EngineCore {
    /// An engine with no requests yet.
    pub fn new(
        runtime: Runtime,
        kv: KvCacheManager,
        deployment: Arc<Generation>,
        limits: EngineLimits,
        output: OutputProcessor,
        metrics: Arc<Metrics>,
        health: Arc<EngineHealth>,
    ) -> EngineCore {
        let mut core = EngineCore {
            runtime,
            deployment,
            kv,
            last_prefix_stats: Default::default(),
            limits,
            metrics,
            requests: RequestTable::default(),
            output,
            logits: Vec::new(),
            profiler: None,
            callable_times: CallableTimes::default(),
            num_steps: 0,
            health,
            masks: Default::default(),
            recovery: None,
            broken: false,
            offload: None,
            loading: Vec::new(),
            freed_blocks: Vec::new(),
            stores: Default::default(),
        };
        // A server that has served nothing yet shows its whole pool free, not an empty one.
        core.update_gauges();
        core
    }

    /// Restarts a lost device worker with `recovery` instead of failing the step.
    pub fn recover_with(&mut self, recovery: DeviceRecovery) {
        self.recovery = Some(recovery);
    }

    /// Records a span of every step from now on, written by [`EngineCore::close`].
    pub fn profile(&mut self) {
        self.profiler.get_or_insert_with(Profiler::default);
    }

    pub fn has_work(&self) -> bool {
        !self.requests.is_empty()
            || self.has_loading()
            || self.has_stores()
            || self.kv.has_cached_free()
    }

    pub fn health(&self) -> &EngineHealth {
        &self.health
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

    /// Takes a request submitted at `admitted.arrival`: it waits for its first step.
    pub fn submit(
        &mut self,
        id: RequestId,
        request: GenerationRequest,
        events: UnboundedSender<GenerationEvent>,
        admitted: Admitted,
    ) {
        let text = self.output.text_for(&request.stop.stop_strings);
        self.add(RequestState::new(id, request, events, admitted, text));
    }

    /// Queues a request, looking up its cached prefix once; fails at once a request that could
    /// never run, so it cannot wait forever.
    fn add(&mut self, state: RequestState) {
        if let Some(reason) = self.never_runs(&state) {
            tracing::warn!(
                request = state.id,
                request_id = state.request_id(),
                "refused: {reason}"
            );
            self.health.in_flight.remove(state.id);
            // Sent now, not through the output processor: the request has no earlier event to
            // follow, and no step may come to send it (the engine may have no other work).
            let _ = state
                .events
                .send(GenerationEvent::Failed { message: reason });
            return;
        }
        self.metrics
            .prompt_tokens
            .inc_by(state.prompt().len() as u64);
        if let Some(state) = self.lookup_or_load(state) {
            self.requests.queue(state);
        }
    }

    /// Records one part of the step in the metrics and, when profiling, as a trace span.
    fn record(&mut self, part: &'static str, track: Track, start: Instant, duration: Duration) {
        self.metrics
            .step_seconds
            .with_label_values(&[part])
            .observe(duration.as_secs_f64());
        if let Some(profiler) = self.profiler.as_mut() {
            profiler.span(part, track, start, duration, self.num_steps);
        }
    }

    /// Records the step's device time, and what each callable took of it when the device
    /// says: as a counter per callable and kind of step (`decode` when every sequence computed
    /// one token after its prompt, `prefill` otherwise), and as the device span's arguments in
    /// the profile.
    fn record_device_time(&mut self, start: Instant, duration: Duration, decode: bool) {
        self.metrics
            .step_seconds
            .with_label_values(&["device"])
            .observe(duration.as_secs_f64());
        if decode {
            self.metrics.decode_steps.inc();
        }
        let timed = self.callable_times.read(self.runtime.device());
        let names = self.runtime.device().callables();
        let name_of = |index: usize| names.get(index).map_or("unknown", String::as_str);
        for &(index, ns) in self.callable_times.step() {
            self.metrics
                .device_callable_seconds
                .with_label_values(&[name_of(index), if decode { "decode" } else { "prefill" }])
                .inc_by(ns as f64 * 1e-9);
        }
        // The per-callable map is built only for the profile, not on every step.
        if let Some(profiler) = self.profiler.as_mut() {
            let mut args = serde_json::Map::new();
            if timed {
                let by_callable: serde_json::Map<_, _> = self
                    .callable_times
                    .step()
                    .iter()
                    .map(|&(index, ns)| (name_of(index).to_string(), (ns as f64 * 1e-6).into()))
                    .collect();
                args.insert("callables_ms".into(), by_callable.into());
            }
            profiler.span_with(
                "device",
                Track::Device,
                (start, duration),
                self.num_steps,
                args,
            );
        }
    }

    /// One engine step. A step the device fails twice fails the requests in it; the others
    /// go on. The step's events are sent before it returns, or, when the next step is sure
    /// to launch work on a worker process's device, once that step's launches are with it.
    pub fn step(&mut self) {
        let next_step_sends = self.step_and_emit();
        if !next_step_sends {
            self.output.deliver();
        }
    }

    /// [`EngineCore::step`] but for sending the events; whether they may wait for the next
    /// step's launches.
    fn step_and_emit(&mut self) -> bool {
        self.abort_abandoned();
        if self.broken {
            // The watchdog has failed every request and the server is on its way out.
            std::thread::sleep(Duration::from_millis(50));
            return false;
        }
        // Blocks freed since the last step go down to the KV tiers before anything evicts them.
        self.store_freed_blocks();
        self.poll_loads();
        if self.requests.is_empty() {
            if self.has_loading() {
                self.wait_for_loads();
            } else if self.has_stores() {
                self.wait_for_stores();
            }
            // The last requests may just have been aborted: publish the blocks they freed.
            self.update_gauges();
            return false;
        }
        if self.requests.running().is_empty() {
            // No decode waits on the copies out: finish them, so that no block they pin looks
            // missing to the scheduler.
            self.finish_stores();
        } else {
            self.advance_stores(false);
        }
        self.num_steps += 1;
        let started = Instant::now();
        let mut plan = self.schedule();
        self.preempt(&plan.preempt);
        self.fit_scored_rows(&mut plan);
        self.store_freed_blocks();
        let scheduled = self.admit(&plan);
        self.record("schedule", Track::Host, started, started.elapsed());
        if scheduled.is_empty() {
            // A step that only preempted has freed blocks; the next one admits from the queue.
            if self.requests.running().is_empty() && plan.run.is_empty() && plan.preempt.is_empty()
            {
                self.fail_unschedulable();
            }
            self.update_gauges();
            return false;
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
                return false;
            }
        };
        self.health.liveness.progressed();
        self.finish_scored_prompts(&scheduled);
        let sample_started = Instant::now();
        let sampled = self.sample(&emitting);
        self.record(
            "sample",
            Track::Host,
            sample_started,
            sample_started.elapsed(),
        );
        let emit_started = Instant::now();
        for (&id, row) in emitting.iter().zip(sampled) {
            let (sampled, fallback, culprit) = match row {
                SampledRow::Token(sampled) => (sampled, false, false),
                SampledRow::Fallback { sampled, culprit } => (sampled, true, culprit),
                SampledRow::Rejected(rejection) => {
                    self.reject(id, rejection);
                    continue;
                }
            };
            if let Some(state) = self.requests.get_mut(id) {
                state.sampler_fallback.count(fallback, culprit);
            }
            self.emit(id, sampled);
        }
        self.record("emit", Track::Host, emit_started, emit_started.elapsed());
        self.update_gauges();
        self.runtime.device().isolation() == DeviceIsolation::Process
            && !self.requests.running().is_empty()
    }

    /// Runs the step; a device failure is retried once by recomputing the same step, which
    /// rewrites the same KV entries, so a transient fault costs only the time of one step.
    /// A lost device worker is replaced instead, and the step's requests recompute.
    fn execute_with_retry(&mut self, scheduled: &[(u64, u32)]) -> Result<Vec<u64>, RuntimeError> {
        let executed = match self.execute(scheduled) {
            Err(RuntimeError::Device(e)) if !e.is_worker_lost() => {
                tracing::warn!("device step failed, recomputing it once: {e}");
                self.metrics.device_step_retries.inc();
                self.execute(scheduled)
            }
            other => other,
        };
        match executed {
            Err(RuntimeError::Device(lost)) if lost.is_worker_lost() && self.recovery.is_some() => {
                self.replace_device(lost);
                Ok(Vec::new())
            }
            other => other,
        }
    }

    /// The device worker is gone with every buffer on it, the KV cache included: a new worker
    /// prepares the model, and every request computes its tokens again, prompt plus the
    /// output it has streamed. Recompute is deterministic, so the streams go on unchanged.
    fn replace_device(&mut self, lost: DeviceError) {
        let Some(recovery) = self.recovery.as_mut() else {
            return;
        };
        self.health.liveness.set_repreparing(true);
        let restarted = recovery.restart(lost.to_string(), &self.metrics);
        self.health.liveness.set_repreparing(false);
        match restarted {
            Ok(runtime) => {
                // The old runtime's buffers died with its worker; dropping it frees nothing.
                self.runtime = runtime;
                self.kv = KvCacheManager::new(self.kv.config());
                self.forget_stores();
                if self.offload.is_some() {
                    self.kv.record_cached_free();
                }
                for id in self.requests.running().to_vec() {
                    self.requests.preempt(id);
                    self.metrics.preemptions.inc();
                }
                for id in self.requests.ids() {
                    if let Some(state) = self.requests.get_mut(id) {
                        state.take_prefix(ComputedPrefix::default());
                    }
                }
                self.callable_times.reset();
                self.record_device_stats();
            }
            Err(fault) => {
                tracing::error!("{fault}");
                self.broken = true;
                self.health.liveness.declare(fault);
            }
        }
    }

    /// Runs the batch; returns the requests that emit a token, in logits-row order.
    fn execute(&mut self, scheduled: &[(u64, u32)]) -> Result<Vec<u64>, RuntimeError> {
        let mut batch = Vec::with_capacity(scheduled.len());
        let mut emitting = Vec::new();
        let mut scored = Vec::with_capacity(scheduled.len());
        let mut scored_chunks = Vec::new();
        let mut decode = true;
        for &(id, n) in scheduled {
            let Some(state) = self.requests.get(id) else {
                continue;
            };
            let start = state.num_computed as usize;
            let end = start + n as usize;
            decode &= n == 1 && start >= state.prompt().len();
            let emit = prompt_rows::emits(state, end);
            if emit {
                emitting.push(id);
            }
            let rows = prompt_rows::scored_rows(state, start as u32, end as u32);
            scored.push(rows);
            if rows > 0 {
                scored_chunks.push(ScoredChunk {
                    id,
                    start: start as u32,
                    rows,
                });
            }
            batch.push(StepSequence {
                id,
                tokens: &state.tokens()[start..end],
                computed_len: state.num_computed,
                block_table: self.kv.block_table(id),
                emit,
            });
        }
        let started = Instant::now();
        // A worker process's device is timed by the calls to it, which end when it hangs; an
        // in-process device call cannot be ended, so the watchdog times it.
        let watched = self.runtime.device().isolation() == DeviceIsolation::InProcess;
        if watched {
            self.health.liveness.device_step_started();
        }
        let output = &mut self.output;
        let timing = self
            .runtime
            .execute_scored(&batch, &scored, &mut self.logits, || output.deliver());
        if watched {
            self.health.liveness.device_step_finished();
        }
        let timing = timing?;
        if !scored_chunks.is_empty() {
            self.record_prompt_rows(&scored_chunks, emitting.len());
        }
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
        self.record_device_time(dispatch_start, timing.device, decode);
        self.record("read_logits", Track::Host, read_start, timing.read_logits);
        for &(id, n) in scheduled {
            if let Some(state) = self.requests.get_mut(id) {
                state.num_computed += n;
                self.kv
                    .cache_full_blocks(id, state.tokens(), state.num_computed);
            }
        }
        Ok(emitting)
    }

    /// Hands a sampled token to the output processor, and ends the request if it finished.
    fn emit(&mut self, id: u64, sampled: Sampled) {
        let Some(state) = self.requests.get_mut(id) else {
            return;
        };
        if let Some(reason) = self.output.process(state, sampled) {
            self.finish(id, reason);
        }
    }

    /// Takes `id` out of the engine: out of the request table and every queue, its KV blocks
    /// freed, off the in-flight list. The request, to send its last event.
    fn release(&mut self, id: u64) -> Option<RequestState> {
        self.health.in_flight.remove(id);
        self.kv.free(id);
        self.requests.remove(id)
    }

    fn finish(&mut self, id: u64, reason: FinishReason) {
        self.health.liveness.progressed();
        if let Some(state) = self.release(id) {
            self.output.finished(state, reason);
        }
    }

    /// Requests whose client went away release their blocks.
    fn abort_abandoned(&mut self) {
        for id in self.requests.abandoned() {
            self.finish(id, FinishReason::Abort);
        }
        self.abort_loading(false);
    }

    /// Ends every request, e.g. at shutdown.
    fn abort_all(&mut self) {
        for id in self.requests.ids() {
            self.finish(id, FinishReason::Abort);
        }
        self.abort_loading(true);
        self.update_gauges();
    }

    /// Ends `ids` with a failure carrying `message`, logged for each; the engine keeps serving
    /// the others.
    fn fail_requests(&mut self, ids: &[u64], message: &str) {
        for &id in ids {
            if let Some(state) = self.release(id) {
                tracing::error!(
                    request = id,
                    request_id = state.request_id(),
                    "request failed: {message}"
                );
                self.metrics
                    .requests_finished
                    .with_label_values(&["error"])
                    .inc();
                self.output.send(
                    &state.events,
                    GenerationEvent::Failed {
                        message: message.to_string(),
                    },
                );
            }
        }
        self.health.liveness.progressed();
    }

    /// Ends `id` with a plugin's rejection; the engine keeps serving the others.
    fn reject(&mut self, id: u64, rejection: PluginRejection) {
        if let Some(state) = self.release(id) {
            tracing::warn!(
                request = id,
                request_id = state.request_id(),
                "request rejected: {rejection}"
            );
            self.metrics
                .requests_finished
                .with_label_values(&["error"])
                .inc();
            self.output
                .send(&state.events, GenerationEvent::Rejected(rejection));
        }
        self.health.liveness.progressed();
    }

    /// Publishes the device's allocation counters.
    pub fn record_device_stats(&self) {
        if let Ok(stats) = self.runtime.device().stats() {
            self.metrics.record_device(&stats);
        }
    }

    fn update_gauges(&mut self) {
        self.record_device_stats();
        self.metrics.load.set(
            self.requests.waiting().len(),
            self.requests.running().len(),
            self.kv.usage(),
        );
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
        self.publish_tier_gauges();
    }

    /// Ends every request, writes the profile to `profile_output` if one was recorded, and
    /// closes the runtime and the device.
    pub fn close(mut self, profile_output: Option<&Path>) {
        self.abort_all();
        self.output.deliver();
        self.flush_tiers();
        if let (Some(path), Some(profiler)) = (profile_output, &self.profiler) {
            match profiler.write(path) {
                Ok(()) => {
                    tracing::info!(path = %path.display(), spans = profiler.num_spans(), "profile written")
                }
                Err(e) => tracing::error!(path = %path.display(), "cannot write the profile: {e}"),
            }
        }
        let metrics = self.metrics.clone();
        match self.runtime.into_device() {
            Ok(device) => {
                if let Ok(stats) = device.stats() {
                    metrics.record_device(&stats);
                    if stats.live_allocations > 0 {
                        tracing::warn!(
                            live = stats.live_allocations,
                            "device buffers still live after the runtime released its own"
                        );
                    }
                }
                device.close();
            }
            Err(e) => tracing::error!("closing the runtime failed: {e}"),
        }
    }
}
