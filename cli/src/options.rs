//! The `serve` and `generate` options: where the model, plugins and device come from, the
//! engine's and the connections' limits, and turning them into an engine setup.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use plughost::api::ConnectionLimits;
use plughost::cli::{parse_bytes, parse_seconds};
use plughost::device::DeviceIsolation;
use plughost::engine::reload::{DEFAULT_SAMPLER, DEFAULT_SCHEDULER, ReloadSource};
use plughost::engine::{EngineOptions, EngineSetup, RestartBudget};
use plughost::kv::offload::KvOffloadOptions;
use plughost::model::GenerationConfigSource;
use plughost::model::WeightQuantization;
use plughost::plugins::glue::GluePlugin;
use plughost::plugins::{Deployment, InstanceLimits, PluginRuntime, PluginSpec, RuntimeOptions};
use plughost::runtime::KvCacheDtype;

use crate::error::CliError;

fn parse_generation_config(value: &str) -> Result<GenerationConfigSource, String> {
    if value.is_empty() {
        return Err("expected auto, vllm or a folder".into());
    }
    Ok(GenerationConfigSource::parse(value))
}

/// Where the model, the plugins and the device come from, and the engine's limits.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// The model folder (config.json, safetensors, tokenizer.json, tokenizer_config.json), or a
    /// GGUF file (Llama architecture), served with its weights in their stored types.
    #[arg(long)]
    pub model: PathBuf,
    /// A deployment file naming the scheduler, sampler and glue components (optional).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// `serve`: reload the deployment whenever the --config file changes (a write, a replaced
    /// file, or Kubernetes' `..data` symlink swap of a mounted ConfigMap).
    #[arg(long, requires = "config")]
    pub watch_config: bool,
    /// The folder of built plugins (default: `$PLUGHOST_PLUGINS_DIR`, else `plugins/` next to the binary's folder).
    #[arg(long, env = "PLUGHOST_PLUGINS_DIR")]
    pub plugins_dir: Option<PathBuf>,
    /// The device library (default: the CPU device in the plugins folder).
    #[arg(long)]
    pub device: Option<PathBuf>,
    /// The device's open config string, comma-separated `key=value` (for the CPU device:
    /// `threads=N`, `isa=LEVEL`, `bf16_products=bf16|f32`, `activation_digits=2|1`; see the
    /// README).
    #[arg(long, default_value = "")]
    pub device_config: String,
    /// The name clients use for the model (default: the model folder's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: u32,
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: u32,
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV blocks in the pool (default: from --kv-cache-memory).
    #[arg(long, conflicts_with = "kv_cache_memory")]
    pub num_kv_blocks: Option<u32>,
    /// Memory for the KV cache, e.g. `512MiB`, `2GiB` or a number of bytes.
    #[arg(long, value_parser = parse_bytes, default_value = "512MiB")]
    pub kv_cache_memory: u64,
    /// The KV cache's element type; `auto` takes the checkpoint's (bf16 for a bf16 model).
    #[arg(long, value_enum, default_value_t = KvCacheDtype::Auto)]
    pub kv_cache_dtype: KvCacheDtype,
    /// Reuse KV blocks of shared prompt prefixes (on by default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Longest prompt plus output (default: the model's maximum position).
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// Where requests' defaults come from: `auto` (the model folder's generation_config.json),
    /// `vllm` (OpenAI's defaults; the file's end tokens still apply) or a folder holding a
    /// generation_config.json.
    #[arg(long, default_value = "auto", value_parser = parse_generation_config)]
    pub generation_config: GenerationConfigSource,
    /// Quantize the attention and MLP projections of f32/f16/bf16 safetensors at load: `q8_0`,
    /// or `q4_k` (a row that does not split into 256-value blocks becomes q8_0). A GGUF file
    /// is served in its stored types and refuses this option.
    #[arg(long, value_enum)]
    pub quantize: Option<WeightQuantization>,
    /// Host memory for KV blocks below the device, e.g. `4GiB`: a full prefix block is copied
    /// there when its last user finishes, and comes back on a prefix hit instead of being
    /// recomputed. Allocated and mapped at start; more than the host has available is refused.
    /// Off by default.
    #[arg(long, value_parser = parse_bytes)]
    pub kv_offload_memory: Option<u64>,
    /// A directory for KV blocks on disk, one file per block; they survive restarts of the
    /// same deployment. Needs --kv-offload-disk.
    #[arg(long, requires = "kv_offload_disk")]
    pub kv_offload_dir: Option<PathBuf>,
    /// Bytes of --kv-offload-dir the block files may take, e.g. `20GiB`.
    #[arg(long, value_parser = parse_bytes, requires = "kv_offload_dir")]
    pub kv_offload_disk: Option<u64>,
    /// Where compiled components are cached.
    #[arg(long, env = "PLUGHOST_CACHE_DIR")]
    pub component_cache: Option<PathBuf>,
    /// Write a Chrome trace (open it in Perfetto) of every engine step here at shutdown.
    #[arg(long)]
    pub profile_output: Option<PathBuf>,
    /// Seconds with work pending and no engine step finished before the engine counts as
    /// stalled: /health answers 503 and `serve` exits non-zero.
    #[arg(long, default_value_t = 60.0, value_parser = parse_seconds)]
    pub engine_stall_timeout: f64,
    /// Seconds a device launch or synchronize may take before the device counts as hung:
    /// in-flight requests fail, /health answers 503 and `serve` exits non-zero.
    #[arg(long, default_value_t = 60.0, value_parser = parse_seconds)]
    pub device_timeout: f64,
    /// Where the device library runs. `process` (the default): in a worker process the
    /// server supervises; when it crashes or misses --device-timeout, a new worker prepares
    /// the model again and requests in flight resume where they were (clients see a pause).
    /// `in-process`: a device crash ends the server, and a hang is fatal as --device-timeout
    /// says.
    #[arg(long, value_enum, default_value_t = DeviceIsolation::Process)]
    pub device_isolation: DeviceIsolation,
    /// Device worker restarts tolerated within --device-restart-window; one more means the
    /// device is broken: requests fail with 503, /health answers 503, `serve` exits non-zero.
    /// Only with `--device-isolation process`. [default: 5]
    #[arg(long)]
    pub device_restart_limit: Option<u32>,
    /// Seconds over which --device-restart-limit counts restarts.
    /// Only with `--device-isolation process`. [default: 600]
    #[arg(long, value_parser = parse_seconds)]
    pub device_restart_window: Option<f64>,
}

fn default_plugins_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| {
            exe.parent()
                .and_then(Path::parent)
                .map(|dir| dir.join("plugins"))
        })
        .unwrap_or_else(|| PathBuf::from("target/plugins"))
}

fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("plughost").join("components"))
}

fn spec(component: PathBuf) -> PluginSpec {
    PluginSpec {
        component,
        config: Default::default(),
        memory_mib: None,
        call_timeout_ms: None,
        failure: Default::default(),
    }
}

fn existing(path: PathBuf) -> Result<PathBuf, CliError> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(CliError::MissingPlugin(path))
    }
}

impl ModelArgs {
    /// The restart budget of a device worker; the flags that set it mean nothing in-process,
    /// so they are refused there rather than ignored.
    fn restart_budget(&self) -> Result<RestartBudget, CliError> {
        let default = RestartBudget::default();
        if self.device_isolation == DeviceIsolation::InProcess {
            let given = [
                (
                    "--device-restart-limit",
                    self.device_restart_limit.is_some(),
                ),
                (
                    "--device-restart-window",
                    self.device_restart_window.is_some(),
                ),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, set)| *set) {
                return Err(CliError::NeedsWorker { flag });
            }
        }
        Ok(RestartBudget {
            limit: self.device_restart_limit.unwrap_or(default.limit),
            window: self
                .device_restart_window
                .map_or(default.window, Duration::from_secs_f64),
        })
    }
}

/// The folder the host reads `model` from: `model` itself, or for a GGUF file the folder its
/// metadata is written to (under the component cache, else the temporary folder).
fn model_folder(model: &Path, cache: Option<&Path>) -> Result<PathBuf, CliError> {
    use plughost::model::gguf::folder;
    if !folder::is_gguf_file(model) {
        return Ok(model.to_path_buf());
    }
    let root = cache.map_or_else(|| std::env::temp_dir().join("plughost"), Path::to_path_buf);
    folder::prepare(model, &root).map_err(|source| {
        CliError::Model(plughost::model::ModelError::Gguf {
            path: model.to_path_buf(),
            source,
        })
    })
}

/// The first glue component in `dir` whose `describe` accepts the model's config.json.
fn find_glue(
    dir: &Path,
    model_dir: &Path,
    runtime: &PluginRuntime,
) -> Result<PluginSpec, CliError> {
    let config_path = model_dir.join("config.json");
    let config_json = std::fs::read_to_string(&config_path).map_err(|source| CliError::Read {
        path: config_path.clone(),
        source,
    })?;
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| CliError::PluginsFolder {
            path: dir.to_path_buf(),
            source,
        })?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("plughost_model_"))
                && p.extension().is_some_and(|e| e == "wasm")
        })
        .collect();
    candidates.sort();
    let mut refusals = Vec::new();
    for path in candidates {
        match GluePlugin::load(runtime, &path, "", InstanceLimits::for_prepare())
            .and_then(|mut g| g.describe(&config_json))
        {
            Ok(_) => return Ok(spec(path)),
            Err(e) => refusals.push(format!("  {}: {e}", path.display())),
        }
    }
    Err(CliError::NoGlue {
        dir: dir.to_path_buf(),
        config: config_path,
        refusals,
    })
}

impl ModelArgs {
    /// Where reloads (SIGHUP, `POST /admin/reload`, `--watch-config`) read the deployment from.
    pub fn reload_source(&self) -> ReloadSource {
        ReloadSource {
            config: self.config.clone(),
            plugins_dir: self.plugins_dir.clone().unwrap_or_else(default_plugins_dir),
            watch: self.watch_config,
        }
    }

    /// Resolves defaults (plugins folder, device, glue by architecture) into an engine setup.
    pub fn setup(&self) -> Result<EngineSetup, CliError> {
        let plugins_dir = self.plugins_dir.clone().unwrap_or_else(default_plugins_dir);
        let deployment = match &self.config {
            Some(path) => Deployment::from_file(path)?,
            None => Deployment::default(),
        };
        let component_cache = self.component_cache.clone().or_else(default_cache_dir);
        if let Some(target) = self.quantize
            && plughost::model::gguf::folder::is_gguf_file(&self.model)
        {
            return Err(CliError::QuantizeGguf {
                path: self.model.clone(),
                target: target.name(),
            });
        }
        let model = model_folder(&self.model, component_cache.as_deref())?;
        let named_samplers = deployment.named_samplers();
        let scheduler = match deployment.scheduler {
            Some(s) => s,
            None => spec(existing(plugins_dir.join(DEFAULT_SCHEDULER))?),
        };
        let sampler = match deployment.sampler {
            Some(s) => s,
            None => spec(existing(plugins_dir.join(DEFAULT_SAMPLER))?),
        };
        let glue = match deployment.glue {
            Some(g) => g,
            None => {
                let runtime = PluginRuntime::new(RuntimeOptions {
                    cache_dir: component_cache.clone(),
                })?;
                find_glue(&plugins_dir, &model, &runtime)?
            }
        };
        let device_library = match &self.device {
            Some(path) => path.clone(),
            None => existing(plugins_dir.join(format!(
                "{}plughost_device_cpu{}",
                std::env::consts::DLL_PREFIX,
                std::env::consts::DLL_SUFFIX
            )))?,
        };
        let model_name = self.served_model_name.clone().unwrap_or_else(|| {
            model
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        });
        Ok(EngineSetup {
            model_dir: model.clone(),
            model_name,
            device_library,
            device_config: self.device_config.clone(),
            glue,
            scheduler: Some(scheduler),
            sampler: Some(sampler),
            named_samplers,
            component_cache,
            options: EngineOptions {
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                block_size: self.block_size,
                num_kv_blocks: self.num_kv_blocks,
                kv_cache_memory: self.kv_cache_memory,
                kv_cache_dtype: self.kv_cache_dtype,
                enable_prefix_caching: !self.no_enable_prefix_caching,
                max_model_len: self.max_model_len,
                engine_stall_timeout: Duration::from_secs_f64(self.engine_stall_timeout),
                device_timeout: Duration::from_secs_f64(self.device_timeout),
                device_isolation: self.device_isolation,
                device_restarts: self.restart_budget()?,
                device_worker: None,
                generation_config: self.generation_config.clone(),
                quantize: self.quantize,
                kv_offload: KvOffloadOptions {
                    memory_bytes: self.kv_offload_memory,
                    disk: self.kv_offload_dir.clone().zip(self.kv_offload_disk),
                },
            },
            profile_output: self.profile_output.clone(),
        })
    }
}

/// How long connections may take and how many may be open (`serve`).
#[derive(Debug, Clone, Args)]
pub struct ConnectionArgs {
    /// Seconds a client has to send a request's headers, from connecting or from the first byte of a later request.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_read_timeout: u64,
    /// Seconds a client has to send a whole request body, from the end of its headers (408 after).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub body_read_timeout: u64,
    /// Seconds a keep-alive connection may idle between requests.
    #[arg(long, default_value_t = 75, value_parser = clap::value_parser!(u64).range(1..))]
    pub keep_alive_timeout: u64,
    /// Open connections; at the limit the oldest idle one is closed (default: 10000, or fewer to fit the open-file limit).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: Option<u64>,
    /// Seconds requests in flight may run after SIGTERM or SIGINT before they are ended.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
}

/// File descriptors kept for everything but client connections: the listener, model and
/// plugin files, the device, logs, the blocking pool.
const RESERVED_FDS: u64 = 256;

impl ConnectionArgs {
    /// The limits, with `--max-connections` defaulting to what `open_files` (the soft limit
    /// of open files, once raised) leaves room for.
    pub fn limits(&self, open_files: u64) -> ConnectionLimits {
        let defaults = ConnectionLimits::default();
        let room = open_files.saturating_sub(RESERVED_FDS).max(1);
        let max_connections = match self.max_connections {
            Some(n) => {
                if n > room {
                    tracing::warn!(
                        "--max-connections {n} exceeds the {room} connections the open-file limit of {open_files} leaves room for; at that limit the oldest idle connection is closed"
                    );
                }
                n
            }
            None => (defaults.max_connections as u64).min(room),
        };
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(self.header_read_timeout),
            body_read_timeout: Duration::from_secs(self.body_read_timeout),
            keep_alive_timeout: Duration::from_secs(self.keep_alive_timeout),
            max_connections: usize::try_from(max_connections).unwrap_or(usize::MAX),
            shutdown_timeout: Duration::from_secs(self.shutdown_timeout),
        }
    }
}
