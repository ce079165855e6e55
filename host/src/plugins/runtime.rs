//! The process-wide wasmtime engine, its epoch ticker, and the loading of components per world.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine};

use super::PluginError;
use super::cache::ComponentCache;
use super::instance::{ContainedInstance, InstanceLimits, PluginState, World};

/// How often the epoch advances; call deadlines are whole multiples of it.
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(2);

/// Options of the plugin runtime.
#[derive(Debug, Clone, Default)]
pub struct RuntimeOptions {
    /// Where compiled components are cached; `None` compiles on every load.
    pub cache_dir: Option<PathBuf>,
}

/// Stops the epoch ticker when the last holder of the engine goes away.
struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Shared by the runtime and every instance: an instance's deadline only
/// fires while the ticker runs, so instances keep it alive.
pub(crate) struct EngineShared {
    pub engine: Engine,
    _ticker: EpochTicker,
}

/// Loads plugin components and makes contained instances of them.
pub struct PluginRuntime {
    shared: Arc<EngineShared>,
    cache: ComponentCache,
}

impl PluginRuntime {
    pub fn new(options: RuntimeOptions) -> Result<Self, PluginError> {
        let mut config = Config::new();
        config.wasm_component_model(true);
        config.epoch_interruption(true);
        let engine = Engine::new(&config).map_err(|e| PluginError::Runtime(format!("{e:#}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let engine = engine.clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("plugin-epoch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(EPOCH_TICK);
                        engine.increment_epoch();
                    }
                })
                .map_err(|e| PluginError::Runtime(format!("cannot start epoch ticker: {e}")))?
        };
        let cache = ComponentCache::new(&engine, options.cache_dir);
        let ticker = EpochTicker {
            stop,
            thread: Some(thread),
        };
        Ok(PluginRuntime {
            shared: Arc::new(EngineShared {
                engine,
                _ticker: ticker,
            }),
            cache,
        })
    }

    pub fn engine(&self) -> &Engine {
        &self.shared.engine
    }

    /// Compiles (or loads from cache) the component at `path` and makes an
    /// instance of world `W`, initialised with `config`.
    pub(crate) fn instantiate<W: World>(
        &self,
        path: &Path,
        config: &str,
        limits: InstanceLimits,
    ) -> Result<ContainedInstance<W>, PluginError> {
        let component = self.cache.load(&self.shared.engine, path)?;
        self.instantiate_component(path, &component, config, limits)
    }

    fn instantiate_component<W: World>(
        &self,
        path: &Path,
        component: &Component,
        config: &str,
        limits: InstanceLimits,
    ) -> Result<ContainedInstance<W>, PluginError> {
        let incompatible = |e: wasmtime::Error| PluginError::Incompatible {
            path: path.to_path_buf(),
            world: W::NAME,
            version: crate::plugins::instance::CONTRACT_VERSION,
            message: format!("{e:#}"),
        };
        let mut linker: Linker<PluginState> = Linker::new(&self.shared.engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .map_err(|e| PluginError::Runtime(format!("{e:#}")))?;
        W::add_to_linker(&mut linker).map_err(|e| PluginError::Runtime(format!("{e:#}")))?;
        let pre = linker.instantiate_pre(component).map_err(incompatible)?;
        let pre = W::pre(pre).map_err(incompatible)?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        let mut instance =
            ContainedInstance::new(self.shared.clone(), name, pre, config.to_string(), limits);
        // Instantiate now so a bad config or a broken component fails the load, not the first step.
        instance.ensure_live()?;
        Ok(instance)
    }
}
