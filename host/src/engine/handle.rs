//! Starting the engine on its own thread, and the handle the rest of the host uses to reach it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::fingerprint::ModelIdentity;
use crate::device::{Device, DeviceLibrary};
use crate::grammar::GrammarCompiler;
use crate::kv::{KvCacheConfig, KvCacheManager};
use crate::load_metrics::CacheConfig;
use crate::metrics::Metrics;
use crate::model::{ChatTemplate, GenerationDefaults, ModelConfig, Tokenizer};
use crate::plugins::generation::{LoadedSampler, UnknownSampler};
use crate::plugins::glue::GluePlugin;
use crate::plugins::{Generation, NamedSamplers, PluginSpec};
use crate::profile::Profiler;
use crate::runtime::{KvCacheDtype, RuntimeConfig, load_described};
use crate::sched::Phase;

use super::core::{EngineCore, EngineLimits};
use super::health::{self, EngineHealth, Timeouts};
use super::reload::{DeploymentStatus, Deployments, ReloadError, ReloadReport, ReloadSource};
use super::request::{GenerationEvent, GenerationRequest, RequestId};
use super::state::{DormantGrammar, RequestState};
use super::stop::StopMatcher;

#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("the model is still loading")]
    NotReady,
    #[error("the model failed to load: {0}")]
    LoadFailed(String),
    #[error("the engine has stopped")]
    Stopped,
    /// The engine thread died, stalled or is stuck in a hung device; the process must restart.
    #[error("{0}")]
    Faulted(String),
    /// The request names a sampler the active deployment does not have.
    #[error(transparent)]
    UnknownSampler(#[from] UnknownSampler),
}

/// Scheduling and memory limits of a deployment.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub block_size: u32,
    /// KV blocks in the pool; when `None`, derived from `kv_cache_memory`.
    pub num_kv_blocks: Option<u32>,
    /// Bytes for the KV cache when `num_kv_blocks` is not given.
    pub kv_cache_memory: u64,
    /// The element type of the KV cache.
    pub kv_cache_dtype: KvCacheDtype,
    pub enable_prefix_caching: bool,
    /// Longest prompt plus output; defaults to the model's maximum position, lowered to what
    /// the KV cache holds. Set, it must fit the cache.
    pub max_model_len: Option<u32>,
    /// Work pending and no step finished for this long is a stalled engine.
    pub engine_stall_timeout: Duration,
    /// A device step (launches and synchronize) running longer than this is a hung device.
    pub device_timeout: Duration,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            block_size: 16,
            num_kv_blocks: None,
            kv_cache_memory: 512 << 20,
            kv_cache_dtype: KvCacheDtype::Auto,
            enable_prefix_caching: true,
            max_model_len: None,
            engine_stall_timeout: Duration::from_secs(60),
            device_timeout: Duration::from_secs(60),
        }
    }
}

/// Everything the engine loads at start.
#[derive(Debug, Clone)]
pub struct EngineSetup {
    pub model_dir: PathBuf,
    /// The name clients use for the model.
    pub model_name: String,
    pub device_library: PathBuf,
    pub device_config: String,
    pub glue: PluginSpec,
    /// `None`: the built-in FCFS schedules every step.
    pub scheduler: Option<PluginSpec>,
    /// The sampler named `default`; `None`: the built-in standard sampler runs natively.
    pub sampler: Option<PluginSpec>,
    /// The deployment's `[samplers.NAME]`, which requests choose by name.
    pub named_samplers: NamedSamplers,
    pub component_cache: Option<PathBuf>,
    pub options: EngineOptions,
    /// Write a Chrome trace of every step here at shutdown.
    pub profile_output: Option<PathBuf>,
}

/// A deployment generation requests can be submitted under; holding it keeps it alive.
#[derive(Clone)]
pub struct PinnedDeployment(Arc<Generation>);

impl PinnedDeployment {
    /// The `system_fingerprint` of the requests submitted under it.
    pub fn fingerprint(&self) -> &str {
        self.0.fingerprint()
    }
}

/// What the rest of the host needs to know about the loaded model.
#[derive(Debug, Clone)]
pub struct ModelSummary {
    pub name: String,
    /// The model folder, as `/v1/models` shows it.
    pub root: String,
    /// `generation_config.json`'s defaults, for requests silent on them.
    pub generation_defaults: GenerationDefaults,
    pub max_model_len: u32,
    pub vocab_size: u32,
    pub eos_token_ids: Vec<u32>,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// Compiles the request's output constraints against this model's vocabulary.
    pub grammars: Arc<GrammarCompiler>,
}

enum Command {
    Submit {
        id: RequestId,
        request: Box<GenerationRequest>,
        events: UnboundedSender<GenerationEvent>,
        arrival: Instant,
        /// The deployment active at submission, and the sampler the request chose from it.
        deployment: Arc<Generation>,
        sampler: Option<Arc<LoadedSampler>>,
    },
    /// Swap in a new deployment generation between two steps; `done` hears when it has.
    Install {
        generation: Arc<Generation>,
        done: Sender<()>,
    },
    Shutdown,
}

#[derive(Default)]
enum LoadState {
    #[default]
    Loading,
    Ready(Box<ModelSummary>),
    Failed(String),
    /// Loaded once, then died, stalled or hung: fatal for the process.
    Faulted(String),
}

/// The engine, from anywhere in the host. Cheap to share behind an `Arc`.
pub struct EngineHandle {
    commands: Mutex<Sender<Command>>,
    load: Arc<(Mutex<LoadState>, Condvar)>,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    metrics: Arc<Metrics>,
    health: Arc<EngineHealth>,
    /// Set once the engine thread has ended, so the watchdog stops.
    stopping: Arc<AtomicBool>,
    /// The active deployment generation and the reloading of the next.
    deployments: Arc<Deployments>,
}

impl EngineHandle {
    /// Starts the engine thread; the model loads there, so this returns at once.
    pub fn start(setup: EngineSetup, metrics: Arc<Metrics>) -> Result<EngineHandle, EngineError> {
        let (tx, rx) = mpsc::channel();
        let load = Arc::new((Mutex::new(LoadState::Loading), Condvar::new()));
        let health = Arc::new(EngineHealth::default());
        let stopping = Arc::new(AtomicBool::new(false));
        let timeouts = Timeouts {
            stall: setup.options.engine_stall_timeout,
            device: setup.options.device_timeout,
        };
        let deployments = Arc::new(Deployments::new(
            setup.component_cache.clone(),
            metrics.clone(),
        ));
        let thread = {
            let (load, metrics, health) = (load.clone(), metrics.clone(), health.clone());
            let deployments = deployments.clone();
            std::thread::Builder::new()
                .name("engine".into())
                .spawn(move || run_engine(setup, rx, load, metrics, health, deployments))
                .map_err(|e| {
                    EngineError::LoadFailed(format!("cannot start the engine thread: {e}"))
                })?
        };
        {
            let (load, health, stopping) = (load.clone(), health.clone(), stopping.clone());
            // Detached: it ends at shutdown or at the first fault.
            std::thread::Builder::new()
                .name("engine-watchdog".into())
                .spawn(move || {
                    health::watch(health, timeouts, stopping, |fault| {
                        set_load_state(&load, LoadState::Faulted(fault.to_string()))
                    })
                })
                .map_err(|e| {
                    EngineError::LoadFailed(format!("cannot start the engine watchdog: {e}"))
                })?;
        }
        Ok(EngineHandle {
            commands: Mutex::new(tx),
            load,
            next_id: AtomicU64::new(1),
            thread: Mutex::new(Some(thread)),
            metrics,
            health,
            stopping,
            deployments,
        })
    }

    /// Where reloads read the deployment from; until this is called, a reload answers
    /// [`ReloadError::NotConfigured`].
    pub fn set_reload_source(&self, source: ReloadSource) {
        self.deployments.set_source(source);
    }

    pub fn reload_source(&self) -> Option<ReloadSource> {
        self.deployments.source()
    }

    /// The active deployment, once the model is loaded.
    pub fn deployment(&self) -> Option<DeploymentStatus> {
        self.deployments.status()
    }

    /// Re-reads the deployment file, builds the next generation on this thread (it blocks
    /// for the compile, instantiate, init and dry run of each changed component), then has the
    /// engine swap it in between two steps. On any error the running deployment stays.
    pub fn reload(&self) -> Result<ReloadReport, ReloadError> {
        self.deployments.reload(|generation| {
            self.summary()?;
            let (done, installed) = mpsc::channel();
            let command = Command::Install { generation, done };
            self.commands
                .lock()
                .map_err(|_| EngineError::Stopped)?
                .send(command)
                .map_err(|_| EngineError::Stopped)?;
            // The engine takes it after the step under way; a fault ends the wait.
            loop {
                match installed.recv_timeout(Duration::from_millis(100)) {
                    Ok(()) => return Ok(()),
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        return Err(ReloadError::NotInstalled);
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        if let Err(e @ EngineError::Faulted(_)) = self.summary() {
                            return Err(e.into());
                        }
                    }
                }
            }
        })
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The metrics in the Prometheus text format, with the plugin state gauges as of now.
    pub fn render_metrics(&self) -> String {
        self.deployments.publish_plugin_state();
        self.metrics.render()
    }

    /// What `/health` reports besides its status: each plugin component's failure-policy state.
    pub fn health_report(&self) -> health::HealthReport {
        health::HealthReport::new(self.deployments.plugin_health())
    }

    /// The model, once loaded.
    pub fn summary(&self) -> Result<ModelSummary, EngineError> {
        let state = self.load.0.lock().map_err(|_| EngineError::Stopped)?;
        match &*state {
            LoadState::Loading => Err(EngineError::NotReady),
            LoadState::Ready(summary) => Ok((**summary).clone()),
            LoadState::Failed(message) => Err(EngineError::LoadFailed(message.clone())),
            LoadState::Faulted(message) => Err(EngineError::Faulted(message.clone())),
        }
    }

    /// Blocks until the engine can no longer serve: its model failed to load, or it died,
    /// stalled or hung after loading. Returns that error; never returns for a healthy engine.
    pub fn wait_fault(&self) -> EngineError {
        let (lock, changed) = &*self.load;
        let Ok(mut state) = lock.lock() else {
            return EngineError::Stopped;
        };
        loop {
            match &*state {
                LoadState::Failed(message) => return EngineError::LoadFailed(message.clone()),
                LoadState::Faulted(message) => return EngineError::Faulted(message.clone()),
                LoadState::Loading | LoadState::Ready(_) => match changed.wait(state) {
                    Ok(next) => state = next,
                    Err(_) => return EngineError::Stopped,
                },
            }
        }
    }

    /// Blocks until the model is loaded or failed to load.
    pub fn wait_ready(&self) -> Result<ModelSummary, EngineError> {
        let (lock, ready) = &*self.load;
        let mut state = lock.lock().map_err(|_| EngineError::Stopped)?;
        while matches!(*state, LoadState::Loading) {
            state = ready.wait(state).map_err(|_| EngineError::Stopped)?;
        }
        drop(state);
        self.summary()
    }

    /// Queues a validated request. Dropping the receiver aborts it and frees its KV blocks.
    pub fn submit(
        &self,
        request: GenerationRequest,
    ) -> Result<(RequestId, UnboundedReceiver<GenerationEvent>), EngineError> {
        let pinned = self.pin()?;
        self.submit_pinned(&pinned, request)
    }

    /// The active deployment, for requests that must all start under the same one (the
    /// choices of one API request) and report its fingerprint.
    pub fn pin(&self) -> Result<PinnedDeployment, EngineError> {
        self.summary()?;
        let deployment = self.deployments.current().ok_or(EngineError::NotReady)?;
        Ok(PinnedDeployment(deployment))
    }

    /// [`EngineHandle::submit`] under a deployment [`EngineHandle::pin`] returned.
    pub fn submit_pinned(
        &self,
        pinned: &PinnedDeployment,
        request: GenerationRequest,
    ) -> Result<(RequestId, UnboundedReceiver<GenerationEvent>), EngineError> {
        let deployment = pinned.0.clone();
        let sampler = deployment.sampler_for(request.sampler.as_deref())?.cloned();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, receiver) = unbounded_channel();
        self.health
            .in_flight
            .insert(id, request.request_id.clone(), events.clone());
        let command = Command::Submit {
            id,
            request: Box::new(request),
            events,
            arrival: Instant::now(),
            deployment,
            sampler,
        };
        let sent = self
            .commands
            .lock()
            .map_err(|_| EngineError::Stopped)
            .and_then(|commands| commands.send(command).map_err(|_| EngineError::Stopped));
        if let Err(e) = sent {
            self.health.in_flight.remove(id);
            return Err(e);
        }
        Ok((id, receiver))
    }

    /// Aborts what is running, closes the runtime and the device, and joins the engine thread.
    /// The watchdog keeps watching meanwhile: a device that hangs now is still found within
    /// the device timeout, and then the thread, stuck in the device for good, is left behind.
    pub fn shutdown(&self) {
        if let Ok(commands) = self.commands.lock() {
            let _ = commands.send(Command::Shutdown);
        }
        let Some(thread) = self.thread.lock().ok().and_then(|mut t| t.take()) else {
            return;
        };
        while !thread.is_finished() {
            if matches!(self.summary(), Err(EngineError::Faulted(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.stopping.store(true, Ordering::Release);
        let _ = thread.join();
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn set_load_state(load: &(Mutex<LoadState>, Condvar), state: LoadState) {
    if let Ok(mut guard) = load.0.lock() {
        *guard = state;
    }
    load.1.notify_all();
}

fn run_engine(
    setup: EngineSetup,
    commands: Receiver<Command>,
    load: Arc<(Mutex<LoadState>, Condvar)>,
    metrics: Arc<Metrics>,
    health: Arc<EngineHealth>,
    deployments: Arc<Deployments>,
) {
    let started = Instant::now();
    let mut core = match load_engine(&setup, metrics, health.clone(), &deployments) {
        Ok((core, summary)) => {
            tracing::info!(model = %setup.model_dir.display(), seconds = started.elapsed().as_secs_f64(), "model ready");
            if let Ok(stats) = core.runtime.device().stats() {
                core.metrics.record_device(&stats);
            }
            set_load_state(&load, LoadState::Ready(Box::new(summary)));
            core
        }
        Err(message) => {
            tracing::error!("model failed to load: {message}");
            set_load_state(&load, LoadState::Failed(message));
            return;
        }
    };
    let served = guard_panics(&health, &load, || {
        serve_commands(&mut core, &commands, started)
    });
    if served {
        close_engine(core, &setup);
    }
}

/// Runs `body`; a panic in it must not leave clients waiting and /health green, so it is a
/// fault like a hang: every request in flight fails and the engine reports the fault.
/// Whether `body` returned.
fn guard_panics(
    health: &EngineHealth,
    load: &(Mutex<LoadState>, Condvar),
    body: impl FnOnce(),
) -> bool {
    let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) else {
        return true;
    };
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into());
    let fault = health::EngineFault::Panicked(message);
    tracing::error!("{fault}");
    health.in_flight.fail_all(&fault.to_string());
    set_load_state(load, LoadState::Faulted(fault.to_string()));
    false
}

/// The engine loop: takes commands, steps while there is work, until shutdown.
fn serve_commands(core: &mut EngineCore, commands: &Receiver<Command>, started: Instant) {
    loop {
        core.health.liveness.set_has_work(core.has_work());
        let command = if core.has_work() {
            match commands.try_recv() {
                Ok(c) => Some(c),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => Some(Command::Shutdown),
            }
        } else {
            Some(commands.recv().unwrap_or(Command::Shutdown))
        };
        match command {
            Some(Command::Shutdown) => break,
            Some(Command::Install { generation, done }) => {
                core.install(generation);
                let _ = done.send(());
                continue;
            }
            Some(Command::Submit {
                id,
                request,
                events,
                arrival,
                deployment,
                sampler,
            }) => {
                let admitted = Admitted {
                    arrival,
                    deployment,
                    sampler,
                };
                let state = new_request_state(core, id, *request, events, admitted, started);
                core.add(state);
                continue;
            }
            None => {}
        }
        core.step();
    }
}

/// Ends every request, writes the profile and closes the runtime and the device.
fn close_engine(mut core: EngineCore, setup: &EngineSetup) {
    core.abort_all();
    if let (Some(path), Some(profiler)) = (&setup.profile_output, &core.profiler) {
        match profiler.write(path) {
            Ok(()) => {
                tracing::info!(path = %path.display(), spans = profiler.num_spans(), "profile written")
            }
            Err(e) => tracing::error!(path = %path.display(), "cannot write the profile: {e}"),
        }
    }
    let metrics = core.metrics.clone();
    match core.runtime.into_device() {
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

/// When a request arrived, and the deployment and sampler it was given then.
struct Admitted {
    arrival: Instant,
    deployment: Arc<Generation>,
    sampler: Option<Arc<LoadedSampler>>,
}

fn new_request_state(
    core: &EngineCore,
    id: RequestId,
    request: GenerationRequest,
    events: UnboundedSender<GenerationEvent>,
    admitted: Admitted,
    engine_started: Instant,
) -> RequestState {
    let Admitted {
        arrival,
        deployment,
        sampler,
    } = admitted;
    let prompt: Arc<[u32]> = Arc::from(request.prompt_tokens.clone());
    RequestState {
        id,
        tokens: request.prompt_tokens.clone(),
        prompt,
        output: Vec::new(),
        phase: Phase::Waiting,
        num_computed: 0,
        num_cached_prefix: 0,
        pending_prefix: None,
        arrival,
        arrival_us: arrival
            .saturating_duration_since(engine_started)
            .as_micros() as u64,
        first_scheduled: None,
        last_token: None,
        detokenizer: core.tokenizer.decode_stream(true),
        stop: StopMatcher::new(&request.stop.stop_strings),
        events,
        grammar: request
            .constraint
            .as_ref()
            .filter(|grammar| grammar.starts_after().is_none())
            .map(|grammar| Box::new(grammar.matcher())),
        dormant_grammar: request.constraint.as_ref().and_then(|grammar| {
            let block = grammar.starts_after()?.clone();
            Some(DormantGrammar::new(Box::new(grammar.matcher()), block))
        }),
        request,
        _deployment: deployment,
        sampler,
        sampler_fallback: Default::default(),
    }
}

fn load_engine(
    setup: &EngineSetup,
    metrics: Arc<Metrics>,
    health: Arc<EngineHealth>,
    deployments: &Deployments,
) -> Result<(EngineCore, ModelSummary), String> {
    // Checked before anything loads: with either at 0 no request could ever be scheduled.
    if setup.options.max_num_seqs == 0 {
        return Err("--max-num-seqs must be at least 1".into());
    }
    if setup.options.block_size == 0 {
        return Err("--block-size must be at least 1".into());
    }
    let tokenizer = Tokenizer::from_dir(&setup.model_dir).map_err(|e| e.to_string())?;
    let generation_defaults =
        GenerationDefaults::from_dir(&setup.model_dir).map_err(|e| e.to_string())?;
    let chat_template = ChatTemplate::from_dir(&setup.model_dir).ok().map(Arc::new);
    let plugins = deployments.runtime().map_err(|e| e.to_string())?;
    let mut glue = GluePlugin::load(
        &plugins,
        &setup.glue.component,
        &setup.glue.config_json(),
        setup.glue.glue_limits(),
    )
    .map_err(|e| format!("[glue] {}: {e}", setup.glue.component.display()))?;
    deployments.set_glue(&plugins, &setup.glue);
    let mut deployment = Generation::build(
        &plugins,
        1,
        setup.scheduler.as_ref(),
        setup.sampler.as_ref(),
        &setup.named_samplers,
        None,
    )
    .map_err(|e| e.to_string())?;
    let config_path = setup.model_dir.join("config.json");
    let config_json = std::fs::read_to_string(&config_path)
        .map_err(|e| format!("cannot read {}: {e}", config_path.display()))?;
    let info = glue.describe(&config_json).map_err(|e| e.to_string())?;
    let model_config = ModelConfig::parse(&config_json, &config_path).map_err(|e| e.to_string())?;
    let options = &setup.options;
    let mut max_model_len = options
        .max_model_len
        .unwrap_or(info.max_position)
        .min(info.max_position.max(1));
    let kv_cache_dtype = options
        .kv_cache_dtype
        .resolve(model_config.torch_dtype.as_deref());
    let bytes_per_block = 2u64
        * info.kv.num_layers as u64
        * options.block_size as u64
        * info.kv.num_kv_heads as u64
        * info.kv.head_dim as u64
        * kv_cache_dtype.size_bytes();
    let num_kv_blocks = match options.num_kv_blocks {
        Some(n) => n,
        None => {
            // No more than every sequence at full length could use.
            let useful = (max_model_len as u64).div_ceil(options.block_size as u64)
                * options.max_num_seqs as u64;
            (options.kv_cache_memory / bytes_per_block.max(1)).min(useful) as u32
        }
    };
    tracing::info!(
        blocks = num_kv_blocks,
        dtype = %kv_cache_dtype,
        mib = (num_kv_blocks as u64 * bytes_per_block) as f64 / (1u64 << 20) as f64,
        "KV cache"
    );
    max_model_len = fit_max_model_len(
        max_model_len,
        options.max_model_len.is_some(),
        num_kv_blocks,
        options.block_size,
    )?;
    let library = DeviceLibrary::load(&setup.device_library).map_err(|e| e.to_string())?;
    let device = Device::open(&library, &setup.device_config).map_err(|e| e.to_string())?;
    let runtime_config = RuntimeConfig {
        max_num_seqs: options.max_num_seqs,
        max_num_batched_tokens: options.max_num_batched_tokens,
        block_size: options.block_size,
        num_kv_blocks,
        max_model_len,
        kv_cache_dtype,
    };
    let vocab_size = info.vocab_size;
    // generation_config.json may name more end tokens than config.json (Qwen3 adds
    // `<|im_end|>`); a sequence ends at any of them.
    let mut eos_token_ids = info.eos_token_ids.clone();
    for &id in &generation_defaults.eos_token_ids {
        if !eos_token_ids.contains(&id) && id < info.vocab_size {
            eos_token_ids.push(id);
        }
    }
    let runtime = load_described(device, &mut glue, info, &setup.model_dir, runtime_config)
        .map_err(|e| e.to_string())?;
    let hashing = Instant::now();
    deployments.set_identity(ModelIdentity::new(
        &setup.model_dir,
        &kv_cache_dtype.to_string(),
        options.block_size,
        &setup.device_library,
        &setup.device_config,
        setup.component_cache.as_deref(),
    ));
    deployments.stamp(&mut deployment);
    let deployment = Arc::new(deployment);
    tracing::info!(
        system_fingerprint = deployment.fingerprint(),
        seconds = hashing.elapsed().as_secs_f64(),
        "deployment fingerprint"
    );
    metrics.load.describe_model(
        &setup.model_name,
        &CacheConfig {
            block_size: options.block_size,
            num_blocks: num_kv_blocks,
            dtype: kv_cache_dtype.to_string(),
        },
    );
    let kv = KvCacheManager::new(KvCacheConfig {
        num_blocks: num_kv_blocks,
        block_size: options.block_size,
        enable_prefix_caching: options.enable_prefix_caching,
    });
    let grammars = Arc::new(GrammarCompiler::new(
        tokenizer.clone(),
        vocab_size,
        eos_token_ids.clone(),
    ));
    prepare_grammars_in_background(&grammars);
    let summary = ModelSummary {
        name: setup.model_name.clone(),
        root: setup.model_dir.display().to_string(),
        generation_defaults,
        max_model_len,
        vocab_size,
        eos_token_ids: eos_token_ids.clone(),
        tokenizer: tokenizer.clone(),
        chat_template,
        grammars,
    };
    deployments.activate(deployment.clone());
    let core = EngineCore {
        runtime,
        deployment,
        kv,
        tokenizer,
        eos_token_ids,
        limits: EngineLimits {
            max_num_seqs: options.max_num_seqs,
            max_num_batched_tokens: options.max_num_batched_tokens,
            max_model_len,
        },
        metrics,
        requests: Default::default(),
        running: Vec::new(),
        waiting: Vec::new(),
        logits: Vec::new(),
        last_prefix_stats: Default::default(),
        profiler: setup.profile_output.as_ref().map(|_| Profiler::default()),
        num_steps: 0,
        health,
        masks: Default::default(),
    };
    Ok((core, summary))
}

/// Builds the token environment of constrained decoding off the start path: tens of
/// milliseconds for a large vocabulary that only constrained requests need. A request that
/// comes first waits for it; a tokenizer llguidance cannot read is reported to those requests.
fn prepare_grammars_in_background(grammars: &Arc<GrammarCompiler>) {
    let grammars = grammars.clone();
    let spawned = std::thread::Builder::new()
        .name("grammar-prepare".into())
        .spawn(move || {
            if let Err(e) = grammars.prepare() {
                tracing::warn!("{e}");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the thread that prepares constrained decoding: {e}");
    }
}

/// The longest sequence the engine accepts: one sequence of that length must fit the KV cache,
/// or a request that long would be preempted and never admitted again. A length taken from the
/// model is lowered to fit; one the user set must fit as it is.
fn fit_max_model_len(
    max_model_len: u32,
    user_set: bool,
    num_kv_blocks: u32,
    block_size: u32,
) -> Result<u32, String> {
    let capacity = u64::from(num_kv_blocks) * u64::from(block_size);
    if u64::from(max_model_len) <= capacity {
        return Ok(max_model_len);
    }
    if capacity == 0 {
        return Err(format!(
            "the KV cache has no room: {num_kv_blocks} blocks of {block_size} tokens; \
             give it more with --num-kv-blocks or --kv-cache-memory"
        ));
    }
    if user_set {
        return Err(format!(
            "--max-model-len {max_model_len} does not fit the KV cache, which holds {capacity} \
             tokens ({num_kv_blocks} blocks of {block_size}); lower --max-model-len to at most \
             {capacity} or give the cache more blocks"
        ));
    }
    // Fits in u32: less than `max_model_len`.
    let fitted = capacity as u32;
    tracing::warn!(
        from = max_model_len,
        to = fitted,
        num_kv_blocks,
        block_size,
        "lowering max_model_len so one sequence fits the KV cache"
    );
    Ok(fitted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_of_the_engine_loop_fails_every_request_and_is_a_fault() {
        let health = EngineHealth::default();
        let load = (Mutex::new(LoadState::Loading), Condvar::new());
        let (events, mut receiver) = unbounded_channel();
        health.in_flight.insert(7, None, events);
        assert!(guard_panics(&health, &load, || {}));
        assert!(matches!(*load.0.lock().unwrap(), LoadState::Loading));
        let returned = guard_panics(&health, &load, || panic!("step {} went wrong", 3));
        assert!(!returned);
        let expected = "the engine thread panicked: step 3 went wrong";
        assert_eq!(
            receiver.try_recv(),
            Ok(GenerationEvent::Failed {
                message: expected.into()
            })
        );
        assert!(matches!(&*load.0.lock().unwrap(), LoadState::Faulted(m) if m == expected));
    }

    #[test]
    fn max_model_len_fits_the_kv_cache_or_the_start_fails() {
        assert_eq!(fit_max_model_len(256, true, 16, 16), Ok(256));
        assert_eq!(fit_max_model_len(4096, false, 16, 16), Ok(256));
        let error = fit_max_model_len(4096, true, 16, 16).unwrap_err();
        assert!(
            error.contains("--max-model-len 4096") && error.contains("holds 256 tokens"),
            "{error}"
        );
        assert!(fit_max_model_len(4096, false, 0, 16).is_err());
    }
}
