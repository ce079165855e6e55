//! Starting the engine on its own thread, and the handle the rest of the host uses to reach it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::device::{Device, DeviceLibrary};
use crate::kv::{KvCacheConfig, KvCacheManager};
use crate::metrics::Metrics;
use crate::model::{ChatTemplate, ModelConfig, Tokenizer};
use crate::plugins::glue::GluePlugin;
use crate::plugins::sampler::SamplerPlugin;
use crate::plugins::scheduler::SchedulerPlugin;
use crate::plugins::{PluginRuntime, PluginSpec, RuntimeOptions};
use crate::profile::Profiler;
use crate::runtime::{KvCacheDtype, RuntimeConfig, load_model};
use crate::sched::Phase;

use super::core::{EngineCore, EngineLimits};
use super::request::{GenerationEvent, GenerationRequest, RequestId};
use super::state::RequestState;
use super::stop::StopMatcher;

#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("the model is still loading")]
    NotReady,
    #[error("the model failed to load: {0}")]
    LoadFailed(String),
    #[error("the engine has stopped")]
    Stopped,
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
    /// Longest prompt plus output; defaults to the model's maximum position.
    pub max_model_len: Option<u32>,
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
    /// `None`: the built-in standard sampler runs natively.
    pub sampler: Option<PluginSpec>,
    pub component_cache: Option<PathBuf>,
    pub options: EngineOptions,
    /// Write a Chrome trace of every step here at shutdown.
    pub profile_output: Option<PathBuf>,
}

/// What the rest of the host needs to know about the loaded model.
#[derive(Debug, Clone)]
pub struct ModelSummary {
    pub name: String,
    pub max_model_len: u32,
    pub vocab_size: u32,
    pub eos_token_ids: Vec<u32>,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<Arc<ChatTemplate>>,
}

enum Command {
    Submit {
        id: RequestId,
        request: Box<GenerationRequest>,
        events: UnboundedSender<GenerationEvent>,
        arrival: Instant,
    },
    Shutdown,
}

#[derive(Default)]
enum LoadState {
    #[default]
    Loading,
    Ready(Box<ModelSummary>),
    Failed(String),
}

/// The engine, from anywhere in the host. Cheap to share behind an `Arc`.
pub struct EngineHandle {
    commands: Mutex<Sender<Command>>,
    load: Arc<(Mutex<LoadState>, Condvar)>,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    metrics: Arc<Metrics>,
}

impl EngineHandle {
    /// Starts the engine thread; the model loads there, so this returns at once.
    pub fn start(setup: EngineSetup, metrics: Arc<Metrics>) -> Result<EngineHandle, EngineError> {
        let (tx, rx) = mpsc::channel();
        let load = Arc::new((Mutex::new(LoadState::Loading), Condvar::new()));
        let thread = {
            let load = load.clone();
            let metrics = metrics.clone();
            std::thread::Builder::new()
                .name("engine".into())
                .spawn(move || run_engine(setup, rx, load, metrics))
                .map_err(|e| {
                    EngineError::LoadFailed(format!("cannot start the engine thread: {e}"))
                })?
        };
        Ok(EngineHandle {
            commands: Mutex::new(tx),
            load,
            next_id: AtomicU64::new(1),
            thread: Mutex::new(Some(thread)),
            metrics,
        })
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The model, once loaded.
    pub fn summary(&self) -> Result<ModelSummary, EngineError> {
        let state = self.load.0.lock().map_err(|_| EngineError::Stopped)?;
        match &*state {
            LoadState::Loading => Err(EngineError::NotReady),
            LoadState::Ready(summary) => Ok((**summary).clone()),
            LoadState::Failed(message) => Err(EngineError::LoadFailed(message.clone())),
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
        self.summary()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, receiver) = unbounded_channel();
        let command = Command::Submit {
            id,
            request: Box::new(request),
            events,
            arrival: Instant::now(),
        };
        let commands = self.commands.lock().map_err(|_| EngineError::Stopped)?;
        commands.send(command).map_err(|_| EngineError::Stopped)?;
        Ok((id, receiver))
    }

    /// Aborts what is running, closes the runtime and the device, and joins the engine thread.
    pub fn shutdown(&self) {
        if let Ok(commands) = self.commands.lock() {
            let _ = commands.send(Command::Shutdown);
        }
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(thread) = thread {
            let _ = thread.join();
        }
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
) {
    let started = Instant::now();
    let mut core = match load_engine(&setup, metrics) {
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
    loop {
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
            Some(Command::Submit {
                id,
                request,
                events,
                arrival,
            }) => {
                let state = new_request_state(&core, id, *request, events, arrival, started);
                core.add(state);
                continue;
            }
            None => {}
        }
        if let Err(e) = core.step() {
            tracing::error!("engine step failed: {e}");
            core.fail_all(&format!("engine step failed: {e}"));
        }
    }
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

fn new_request_state(
    core: &EngineCore,
    id: RequestId,
    request: GenerationRequest,
    events: UnboundedSender<GenerationEvent>,
    arrival: Instant,
    engine_started: Instant,
) -> RequestState {
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
        request,
    }
}

fn load_engine(
    setup: &EngineSetup,
    metrics: Arc<Metrics>,
) -> Result<(EngineCore, ModelSummary), String> {
    let tokenizer = Tokenizer::from_dir(&setup.model_dir).map_err(|e| e.to_string())?;
    let chat_template = ChatTemplate::from_dir(&setup.model_dir).ok().map(Arc::new);
    let plugins = PluginRuntime::new(RuntimeOptions {
        cache_dir: setup.component_cache.clone(),
    })
    .map_err(|e| e.to_string())?;
    let mut glue = GluePlugin::load(
        &plugins,
        &setup.glue.component,
        &setup.glue.config_json(),
        setup.glue.limits(),
    )
    .map_err(|e| e.to_string())?;
    let scheduler = match &setup.scheduler {
        Some(spec) => Some(
            SchedulerPlugin::load(
                &plugins,
                &spec.component,
                &spec.config_json(),
                spec.limits(),
            )
            .map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    let sampler = match &setup.sampler {
        Some(spec) => Some(
            SamplerPlugin::load(
                &plugins,
                &spec.component,
                &spec.config_json(),
                spec.limits(),
            )
            .map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    let config_path = setup.model_dir.join("config.json");
    let config_json = std::fs::read_to_string(&config_path)
        .map_err(|e| format!("cannot read {}: {e}", config_path.display()))?;
    let info = glue.describe(&config_json).map_err(|e| e.to_string())?;
    let model_config = ModelConfig::parse(&config_json, &config_path).map_err(|e| e.to_string())?;
    let options = &setup.options;
    let max_model_len = options
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
    if (num_kv_blocks as u64) * (options.block_size as u64)
        < max_model_len.min(options.max_num_batched_tokens) as u64
    {
        tracing::warn!(
            num_kv_blocks,
            "the KV cache holds fewer tokens than one full-length request needs"
        );
    }
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
    let runtime = load_model(device, &mut glue, &setup.model_dir, runtime_config)
        .map_err(|e| e.to_string())?;
    let kv = KvCacheManager::new(KvCacheConfig {
        num_blocks: num_kv_blocks,
        block_size: options.block_size,
        enable_prefix_caching: options.enable_prefix_caching,
    });
    let summary = ModelSummary {
        name: setup.model_name.clone(),
        max_model_len,
        vocab_size: info.vocab_size,
        eos_token_ids: info.eos_token_ids.clone(),
        tokenizer: tokenizer.clone(),
        chat_template,
    };
    let core = EngineCore {
        runtime,
        scheduler,
        sampler,
        kv,
        tokenizer,
        eos_token_ids: info.eos_token_ids,
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
    };
    Ok((core, summary))
}
