//! Reloading the deployment while serving: re-read the `--config` file, build the next generation off the engine thread, hand it to the engine loop.
//!
//! The engine swaps generations between two steps. A request keeps the generation it started
//! with (and so its sampler instance) until it finishes; the new scheduler plans the very next
//! step, for every request. A generation is dropped when the engine and the last request
//! holding it let go. A reload that fails at any point changes nothing.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::metrics::Metrics;
use crate::plugins::generation::{ComponentHealth, unix_seconds};
use crate::plugins::{
    ComponentState, ComponentStatus, Deployment, DeploymentError, Generation, GenerationError,
    PluginError, PluginRuntime, PluginSpec, RuntimeOptions,
};

use super::fingerprint::ModelIdentity;
use super::handle::EngineError;
use crate::kv::tier::NumericFingerprint;

/// The built-in components a deployment file that omits a section gets.
pub const DEFAULT_SCHEDULER: &str = "plughost_scheduler_fcfs.wasm";
pub const DEFAULT_SAMPLER: &str = "plughost_sampler_standard.wasm";

/// Where a reload reads the deployment from: what `serve` was started with.
#[derive(Debug, Clone)]
pub struct ReloadSource {
    /// The `--config` file; `None`: there is nothing to reload.
    pub config: Option<PathBuf>,
    /// Where the default scheduler and sampler are, for a file that omits them.
    pub plugins_dir: PathBuf,
    /// Reload whenever the config file's content changes (`--watch-config`).
    pub watch: bool,
}

/// Why a reload did not happen. The deployment that served before still serves.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(
        "there is nothing to reload: the server was started without --config; start it with \
         --config FILE (a deployment TOML) to reload that file"
    )]
    NotConfigured,
    #[error("cannot reload while the engine is not serving: {0}")]
    Engine(#[from] EngineError),
    #[error(transparent)]
    File(#[from] DeploymentError),
    #[error(transparent)]
    Component(#[from] GenerationError),
    #[error(
        "the deployment changes the model glue ({detail}); the glue belongs to the prepared \
         model, so changing it needs a restart"
    )]
    GlueChanged { detail: String },
    #[error("the engine stopped before it took the new deployment")]
    NotInstalled,
    #[error("the plugin runtime is unavailable: {0}")]
    PluginRuntime(#[source] PluginError),
}

impl ReloadError {
    /// The deployment slot at fault, when one is.
    pub fn slot(&self) -> Option<&'static str> {
        match self {
            ReloadError::Component(e) => Some(e.slot().as_str()),
            ReloadError::GlueChanged { .. } => Some("glue"),
            _ => None,
        }
    }
}

/// What a successful reload installed.
#[derive(Debug, Clone, Serialize)]
pub struct ReloadReport {
    pub generation: u64,
    /// Unix seconds.
    pub loaded_at: u64,
    /// Milliseconds from reading the file to the engine taking the new generation.
    pub reload_ms: f64,
    /// Milliseconds the build took (compile, instantiate, init, dry run), off the engine thread.
    pub build_ms: f64,
    /// Milliseconds from handing the generation to the engine until it had swapped it in: the
    /// rest of the step under way, then the swap itself.
    pub swap_ms: f64,
    pub components: Vec<ComponentStatus>,
}

/// The active deployment as `/admin/deployment` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct DeploymentStatus {
    pub generation: u64,
    pub loaded_at: u64,
    /// The file reloads read; `None` when the server runs without one.
    pub config: Option<String>,
    /// The `system_fingerprint` of requests that start now.
    pub system_fingerprint: String,
    /// The prepared model's glue, which reloads never change.
    pub glue: Option<GlueStatus>,
    pub components: Vec<ComponentStatus>,
    /// The names requests may send as `"sampler"`, `default` first.
    pub samplers: Vec<String>,
    /// The sampler requests that name none get.
    pub default_sampler: String,
    /// Earlier generations that requests started under still hold, oldest first.
    pub draining: Vec<DrainingGeneration>,
}

/// An earlier generation kept alive by the requests that started under it.
#[derive(Debug, Clone, Serialize)]
pub struct DrainingGeneration {
    pub generation: u64,
    pub components: Vec<ComponentStatus>,
}

/// The model glue as `/admin/deployment` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct GlueStatus {
    pub file: String,
    pub sha256: String,
    /// The `plughost:plugin` version it was built for.
    pub wit_version: String,
}

/// The prepared model's glue, which no reload may change.
#[derive(Debug, Clone)]
struct GlueIdentity {
    path: PathBuf,
    sha256: String,
    wit_version: String,
    config_json: String,
}

/// The engine's deployments: the active generation, where reloads read from, and the
/// serialising of reloads. Shared by the engine handle and the engine thread.
pub(crate) struct Deployments {
    current: Mutex<Option<Arc<Generation>>>,
    /// Generations replaced by a reload; alive while requests that started under them run.
    replaced: Mutex<Vec<Weak<Generation>>>,
    source: Mutex<Option<ReloadSource>>,
    glue: Mutex<Option<GlueIdentity>>,
    /// What the fingerprint covers besides the components, once the model is loaded.
    identity: Mutex<Option<ModelIdentity>>,
    /// Held for a whole reload, so two never build at once.
    reloading: Mutex<()>,
    runtime_options: RuntimeOptions,
    metrics: Arc<Metrics>,
}

impl Deployments {
    pub(crate) fn new(component_cache: Option<PathBuf>, metrics: Arc<Metrics>) -> Self {
        Deployments {
            current: Mutex::new(None),
            replaced: Mutex::new(Vec::new()),
            source: Mutex::new(None),
            glue: Mutex::new(None),
            identity: Mutex::new(None),
            reloading: Mutex::new(()),
            runtime_options: RuntimeOptions {
                cache_dir: component_cache,
            },
            metrics,
        }
    }

    pub(crate) fn runtime(&self) -> Result<PluginRuntime, PluginError> {
        PluginRuntime::new(self.runtime_options.clone())
    }

    pub(crate) fn set_source(&self, source: ReloadSource) {
        *lock(&self.source) = Some(source);
    }

    pub(crate) fn source(&self) -> Option<ReloadSource> {
        lock(&self.source).clone()
    }

    /// Records the prepared model's glue, which reloads compare against.
    pub(crate) fn set_glue(&self, runtime: &PluginRuntime, spec: &PluginSpec) {
        match runtime.compile(&spec.component) {
            Ok(compiled) => {
                tracing::info!(
                    slot = "glue",
                    component = %spec.component.display(),
                    sha256 = %compiled.sha256,
                    wit_version = %compiled.wit_version,
                    "loaded plugin component"
                );
                *lock(&self.glue) = Some(GlueIdentity {
                    path: spec.component.clone(),
                    sha256: compiled.sha256,
                    wit_version: compiled.wit_version,
                    config_json: spec.config_json(),
                });
            }
            Err(e) => tracing::warn!("cannot identify the model glue: {e}"),
        }
    }

    /// Records what the loaded model contributes to the fingerprint.
    pub(crate) fn set_identity(&self, identity: ModelIdentity) {
        *lock(&self.identity) = Some(identity);
    }

    /// Gives `generation` its fingerprint: the model's identity, its glue and its components.
    /// Returns the fingerprint's numeric part, which the KV tiers key blocks by.
    pub(crate) fn stamp(&self, generation: &mut Generation) -> Option<NumericFingerprint> {
        let glue = lock(&self.glue)
            .as_ref()
            .map(|g| format!("{} {}", g.sha256, g.wit_version))
            .unwrap_or_default();
        let identity = lock(&self.identity);
        let (fingerprint, numeric) = identity
            .as_ref()?
            .fingerprint_parts(&glue, &generation.components());
        generation.set_fingerprint(fingerprint);
        Some(numeric)
    }

    pub(crate) fn current(&self) -> Option<Arc<Generation>> {
        lock(&self.current).clone()
    }

    /// Makes `generation` the active one, for the listing and the metrics.
    pub(crate) fn activate(&self, generation: Arc<Generation>) {
        for c in generation.components() {
            let verb = if c.generation == generation.number() {
                "loaded"
            } else {
                "kept"
            };
            tracing::info!(
                generation = generation.number(),
                slot = %c.slot,
                sampler = c.name.as_deref(),
                component = %c.file,
                sha256 = %c.sha256,
                wit_version = %c.wit_version,
                "{verb} plugin component"
            );
        }
        self.publish(&generation);
        let previous = lock(&self.current).replace(generation);
        let mut replaced = lock(&self.replaced);
        replaced.retain(|g| g.strong_count() > 0);
        if let Some(previous) = previous {
            replaced.push(Arc::downgrade(&previous));
        }
    }

    fn publish(&self, generation: &Generation) {
        let m = &self.metrics;
        m.deployment_generation.set(generation.number() as i64);
        m.plugin_info.reset();
        for c in generation.components() {
            m.plugin_info
                .with_label_values(&[c.slot.as_str(), &c.file, &c.sha256, &c.wit_version])
                .set(1);
        }
    }

    /// Each active component's failure-policy state, as of now; never waits for a plugin call.
    pub(crate) fn plugin_health(&self) -> Vec<ComponentHealth> {
        self.current()
            .map(|g| g.component_health())
            .unwrap_or_default()
    }

    /// Sets the plugin state and fault gauges from the active components, as of now.
    pub(crate) fn publish_plugin_state(&self) {
        let m = &self.metrics;
        m.plugin_state.reset();
        m.plugin_faults.reset();
        for c in self.plugin_health() {
            let slot = c.slot.as_str();
            for state in ComponentState::NAMES {
                m.plugin_state
                    .with_label_values(&[slot, &c.component, state])
                    .set(i64::from(state == c.state));
            }
            m.plugin_faults
                .with_label_values(&[slot, &c.component])
                .set(i64::try_from(c.faults).unwrap_or(i64::MAX));
        }
    }

    pub(crate) fn status(&self) -> Option<DeploymentStatus> {
        let generation = self.current()?;
        Some(DeploymentStatus {
            generation: generation.number(),
            loaded_at: unix_seconds(generation.loaded_at()),
            system_fingerprint: generation.fingerprint().to_string(),
            glue: lock(&self.glue).as_ref().map(|g| GlueStatus {
                file: g.path.display().to_string(),
                sha256: g.sha256.clone(),
                wit_version: g.wit_version.clone(),
            }),
            config: self
                .source()
                .and_then(|s| s.config)
                .map(|p| p.display().to_string()),
            components: generation.components(),
            samplers: generation.sampler_names().map(str::to_string).collect(),
            default_sampler: generation.default_sampler_name().to_string(),
            draining: lock(&self.replaced)
                .iter()
                .filter_map(Weak::upgrade)
                .map(|g| DrainingGeneration {
                    generation: g.number(),
                    components: g.components(),
                })
                .collect(),
        })
    }

    /// Builds the next generation from the config file and has `install` hand it to the
    /// engine; counts and logs the outcome.
    pub(crate) fn reload(
        &self,
        install: impl FnOnce(Arc<Generation>) -> Result<(), ReloadError>,
    ) -> Result<ReloadReport, ReloadError> {
        let _one_at_a_time = lock(&self.reloading);
        let started = Instant::now();
        let result = self.build_next().and_then(|(generation, build)| {
            let handed = Instant::now();
            install(generation.clone())?;
            let swap = handed.elapsed();
            self.activate(generation.clone());
            Ok(ReloadReport {
                generation: generation.number(),
                loaded_at: unix_seconds(generation.loaded_at()),
                reload_ms: millis(started.elapsed()),
                build_ms: millis(build),
                swap_ms: millis(swap),
                components: generation.components(),
            })
        });
        let outcome = if result.is_ok() { "ok" } else { "error" };
        self.metrics
            .deployment_reloads
            .with_label_values(&[outcome])
            .inc();
        match &result {
            Ok(report) => tracing::info!(
                generation = report.generation,
                reload_ms = report.reload_ms,
                build_ms = report.build_ms,
                swap_ms = report.swap_ms,
                "deployment reloaded"
            ),
            Err(e) => {
                tracing::error!("deployment reload failed, the running deployment stays: {e}")
            }
        }
        result
    }

    fn build_next(&self) -> Result<(Arc<Generation>, Duration), ReloadError> {
        let source = self.source().ok_or(ReloadError::NotConfigured)?;
        let config = source.config.as_deref().ok_or(ReloadError::NotConfigured)?;
        let previous = self.current().ok_or(EngineError::NotReady)?;
        let deployment = Deployment::from_file(config)?;
        let runtime = self.runtime().map_err(ReloadError::PluginRuntime)?;
        self.check_glue(&runtime, config, deployment.glue.as_ref())?;
        let named_samplers = deployment.named_samplers();
        let scheduler = deployment
            .scheduler
            .unwrap_or_else(|| default_spec(&source.plugins_dir, DEFAULT_SCHEDULER));
        let sampler = deployment
            .sampler
            .unwrap_or_else(|| default_spec(&source.plugins_dir, DEFAULT_SAMPLER));
        let started = Instant::now();
        let mut generation = Generation::build(
            &runtime,
            previous.number() + 1,
            Some(&scheduler),
            Some(&sampler),
            &named_samplers,
            Some(&previous),
        )?;
        self.stamp(&mut generation);
        Ok((Arc::new(generation), started.elapsed()))
    }

    /// A file that names a glue must name the one the model was prepared with; a file that
    /// names none keeps the glue found for the model.
    fn check_glue(
        &self,
        runtime: &PluginRuntime,
        file: &Path,
        spec: Option<&PluginSpec>,
    ) -> Result<(), ReloadError> {
        let Some(spec) = spec else {
            return Ok(());
        };
        let Some(current) = lock(&self.glue).clone() else {
            return Ok(());
        };
        let compiled = runtime
            .compile(&spec.component)
            .map_err(|e| ReloadError::GlueChanged {
                detail: format!("{}: {e}", spec.component.display()),
            })?;
        let detail = if compiled.sha256 != current.sha256 {
            format!(
                "{} names {} (sha256 {}), the model runs {} (sha256 {})",
                file.display(),
                spec.component.display(),
                compiled.sha256,
                current.path.display(),
                current.sha256
            )
        } else if spec.config_json() != current.config_json {
            format!(
                "{} gives the glue the config {}, the model was prepared with {}",
                file.display(),
                spec.config_json(),
                current.config_json
            )
        } else {
            return Ok(());
        };
        Err(ReloadError::GlueChanged { detail })
    }
}

fn default_spec(plugins_dir: &Path, file: &str) -> PluginSpec {
    PluginSpec {
        component: plugins_dir.join(file),
        config: Default::default(),
        memory_mib: None,
        call_timeout_ms: None,
        failure: Default::default(),
    }
}

fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
