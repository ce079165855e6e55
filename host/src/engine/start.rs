//! Starting the engine: what it loads (the setup and its options), building the engine core from them, and the typed errors of a start that fails.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::device::worker::WorkerCommand;
use crate::device::{DeviceError, DeviceIsolation, DeviceSource};
use crate::grammar::GrammarCompiler;
use crate::kv::offload::{KvOffload, KvOffloadOptions};
use crate::kv::tier::disk::BlockFormat;
use crate::kv::tier::{NumericFingerprint, TierError};
use crate::kv::{KvCacheConfig, KvCacheManager};
use crate::load_metrics::CacheConfig;
use crate::metrics::Metrics;
use crate::model::{
    ChatTemplate, GenerationConfigSource, GenerationDefaults, ModelConfig, ModelError, Tokenizer,
    WeightQuantization,
};
use crate::plugins::glue::GluePlugin;
use crate::plugins::{Generation, GenerationError, NamedSamplers, PluginError, PluginSpec};
use crate::runtime::{KvCacheDtype, LoadError, RuntimeConfig, load_with_recipe};

use super::core::{EngineCore, EngineLimits};
use super::fingerprint::ModelIdentity;
use super::health::EngineHealth;
use super::output::OutputProcessor;
use super::recovery::{DeviceRecovery, RestartBudget};
use super::reload::Deployments;

/// Why the engine could not start: each layer's own error, as that layer reported it.
#[derive(Debug, thiserror::Error)]
pub enum EngineStartError {
    #[error("--max-num-seqs must be at least 1")]
    NoSequences,
    #[error("--block-size must be at least 1")]
    NoBlockSize,
    /// The model folder: tokenizer, `generation_config.json`, `config.json`.
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("cannot read {}: {source}", path.display())]
    ReadConfig {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The plugin runtime, or the glue describing the model.
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error("[glue] {}: {source}", path.display())]
    Glue { path: PathBuf, source: PluginError },
    /// The scheduler and samplers of the deployment.
    #[error(transparent)]
    Deployment(#[from] GenerationError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// Loading the weights onto the device.
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(
        "the KV cache has no room: {num_kv_blocks} blocks of {block_size} tokens; give it more \
         with --num-kv-blocks or --kv-cache-memory"
    )]
    NoKvCache { num_kv_blocks: u32, block_size: u32 },
    #[error(
        "--max-model-len {max_model_len} does not fit the KV cache, which holds {capacity} \
         tokens ({num_kv_blocks} blocks of {block_size}); lower --max-model-len to at most \
         {capacity} or give the cache more blocks"
    )]
    MaxModelLenTooLong {
        max_model_len: u32,
        capacity: u64,
        num_kv_blocks: u32,
        block_size: u32,
    },
    /// Positions past what the model computes exactly: past `max_position_embeddings`
    /// without a rope scaling that covers them, or past a sliding window.
    #[error(
        "--max-model-len {max_model_len} is above the {max_position} positions the model \
         covers (config.json's max_position_embeddings, as far as its rope scaling stretches \
         it, or its sliding window if shorter); lower --max-model-len to at most {max_position} \
         or serve a config whose rope scaling covers {max_model_len}"
    )]
    MaxModelLenAboveModel {
        max_model_len: u32,
        max_position: u32,
    },
    /// A KV tier below the device could not open (its directory cannot be written, ...).
    #[error(transparent)]
    KvOffload(#[from] TierError),
    #[error(
        "--kv-offload-memory and --kv-offload-dir keep prefix-cache blocks; they need prefix \
         caching, which --no-enable-prefix-caching turns off"
    )]
    KvOffloadWithoutPrefixCaching,
    #[error("cannot start the {thread}: {source}")]
    Spawn {
        thread: &'static str,
        source: std::io::Error,
    },
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
    /// Where the device library runs: in this process, or in a supervised worker process.
    pub device_isolation: DeviceIsolation,
    /// The worker restarts tolerated within a window before the device counts as broken.
    pub device_restarts: RestartBudget,
    /// The program that runs a device worker; by default this executable's `device-worker`.
    pub device_worker: Option<WorkerCommand>,
    /// Where requests' sampling defaults and extra end tokens come from.
    pub generation_config: GenerationConfigSource,
    /// Quantize the linear projections of f32/f16/bf16 weights to this block type at load.
    pub quantize: Option<WeightQuantization>,
    /// KV tiers below the device: host memory, disk. Neither by default.
    pub kv_offload: KvOffloadOptions,
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
            device_isolation: DeviceIsolation::InProcess,
            device_restarts: RestartBudget::default(),
            device_worker: None,
            generation_config: GenerationConfigSource::Model,
            quantize: None,
            kv_offload: KvOffloadOptions::default(),
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

/// Loads the model, the glue, the deployment and the device for `setup`, on the engine
/// thread, and builds the engine core that will serve it.
pub(super) fn build_core(
    setup: &EngineSetup,
    metrics: Arc<Metrics>,
    health: Arc<EngineHealth>,
    deployments: &Deployments,
) -> Result<(EngineCore, ModelSummary), EngineStartError> {
    // Checked before anything loads: with either at 0 no request could ever be scheduled.
    if setup.options.max_num_seqs == 0 {
        return Err(EngineStartError::NoSequences);
    }
    if setup.options.block_size == 0 {
        return Err(EngineStartError::NoBlockSize);
    }
    if setup.options.kv_offload.is_enabled() && !setup.options.enable_prefix_caching {
        return Err(EngineStartError::KvOffloadWithoutPrefixCaching);
    }
    let tokenizer = Tokenizer::from_dir(&setup.model_dir)?;
    let generation_defaults = setup.options.generation_config.load(&setup.model_dir)?;
    let chat_template = ChatTemplate::from_dir(&setup.model_dir).ok().map(Arc::new);
    let plugins = deployments.runtime()?;
    let mut glue = GluePlugin::load(
        &plugins,
        &setup.glue.component,
        &setup.glue.config_json(),
        setup.glue.glue_limits(),
    )
    .map_err(|source| EngineStartError::Glue {
        path: setup.glue.component.clone(),
        source,
    })?;
    deployments.set_glue(&plugins, &setup.glue);
    let mut deployment = Generation::build(
        &plugins,
        1,
        setup.scheduler.as_ref(),
        setup.sampler.as_ref(),
        &setup.named_samplers,
        None,
    )?;
    let config_path = setup.model_dir.join("config.json");
    let config_json =
        std::fs::read_to_string(&config_path).map_err(|source| EngineStartError::ReadConfig {
            path: config_path.clone(),
            source,
        })?;
    let info = glue.describe(&config_json)?;
    let model_config = ModelConfig::parse(&config_json, &config_path)?;
    let options = &setup.options;
    let max_position = info.max_position.max(1);
    let mut max_model_len = match options.max_model_len {
        Some(asked) if asked > max_position => {
            return Err(EngineStartError::MaxModelLenAboveModel {
                max_model_len: asked,
                max_position,
            });
        }
        Some(asked) => asked,
        None => max_position,
    };
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
    let mut device_source =
        DeviceSource::in_process(&setup.device_library, setup.device_config.clone());
    if options.device_isolation == DeviceIsolation::Process {
        device_source =
            device_source.in_worker(options.device_worker.clone(), options.device_timeout);
    }
    let mut device = device_source.open(0)?;
    if options.device_isolation == DeviceIsolation::InProcess {
        let health = health.clone();
        device.on_launch_completed(Arc::new(move || health.liveness.device_launch_completed()));
    }
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
    let (runtime, recipe) = load_with_recipe(
        device,
        &mut glue,
        info,
        &setup.model_dir,
        runtime_config,
        options.quantize,
    )?;
    let recovery = (options.device_isolation == DeviceIsolation::Process)
        .then(|| DeviceRecovery::new(device_source, recipe, options.device_restarts));
    let hashing = Instant::now();
    deployments.set_identity(
        ModelIdentity::new(
            &setup.model_dir,
            &kv_cache_dtype.to_string(),
            options.block_size,
            &setup.device_library,
            &setup.device_config,
            setup.component_cache.as_deref(),
        )
        .with_generation_defaults(&generation_defaults)
        .with_quantization(options.quantize.map(WeightQuantization::name)),
    );
    let numeric_fingerprint = deployments.stamp(&mut deployment);
    let offload = open_kv_offload(
        &options.kv_offload,
        numeric_fingerprint,
        kv_cache_dtype.code(),
        options.block_size,
        runtime.kv_block_bytes(),
    )?;
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
    let limits = EngineLimits {
        max_num_seqs: options.max_num_seqs,
        max_num_batched_tokens: options.max_num_batched_tokens,
        max_model_len,
    };
    let output = OutputProcessor::new(tokenizer, eos_token_ids, max_model_len, metrics.clone());
    let mut core = EngineCore::new(runtime, kv, deployment, limits, output, metrics, health);
    if let Some(recovery) = recovery {
        core.recover_with(recovery);
    }
    if let Some(offload) = offload {
        core.offload_to(offload);
    }
    if setup.profile_output.is_some() {
        core.profile();
    }
    Ok((core, summary))
}

/// The KV tiers `options` ask for, keyed by the deployment's numeric fingerprint.
fn open_kv_offload(
    options: &KvOffloadOptions,
    model: Option<NumericFingerprint>,
    dtype: u32,
    block_size: u32,
    block_bytes: u64,
) -> Result<Option<KvOffload>, EngineStartError> {
    if !options.is_enabled() {
        return Ok(None);
    }
    let Some(model) = model else {
        tracing::warn!(
            "the deployment has no fingerprint, so its KV blocks cannot be named: no KV offload"
        );
        return Ok(None);
    };
    let format = BlockFormat {
        model,
        dtype,
        block_size,
        block_bytes,
    };
    let offload = KvOffload::open(options, format)?;
    tracing::info!(
        memory_bytes = options.memory_bytes,
        disk = ?options.disk,
        block_bytes,
        "KV offload below the device"
    );
    Ok(offload)
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
) -> Result<u32, EngineStartError> {
    let capacity = u64::from(num_kv_blocks) * u64::from(block_size);
    if u64::from(max_model_len) <= capacity {
        return Ok(max_model_len);
    }
    if capacity == 0 {
        return Err(EngineStartError::NoKvCache {
            num_kv_blocks,
            block_size,
        });
    }
    if user_set {
        return Err(EngineStartError::MaxModelLenTooLong {
            max_model_len,
            capacity,
            num_kv_blocks,
            block_size,
        });
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
    fn max_model_len_fits_the_kv_cache_or_the_start_fails() {
        assert_eq!(fit_max_model_len(256, true, 16, 16).ok(), Some(256));
        assert_eq!(fit_max_model_len(4096, false, 16, 16).ok(), Some(256));
        let error = fit_max_model_len(4096, true, 16, 16).unwrap_err();
        assert!(
            matches!(
                error,
                EngineStartError::MaxModelLenTooLong { capacity: 256, .. }
            ),
            "{error}"
        );
        let error = error.to_string();
        assert!(
            error.contains("--max-model-len 4096") && error.contains("holds 256 tokens"),
            "{error}"
        );
        assert!(matches!(
            fit_max_model_len(4096, false, 0, 16),
            Err(EngineStartError::NoKvCache { .. })
        ));
    }
}
