//! The process-wide wasmtime engine, its epoch ticker, and the loading of components per world.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine};

use super::PluginError;
use super::cache::ComponentCache;
use super::contract::ComponentContract;
use super::instance::{ContainedInstance, InstanceLimits, PluginState, World};
use super::records;

/// How often the epoch advances while no instance asks for a finer tick. Every tick wakes a
/// thread that takes a core from whatever runs, on a small machine the device's threads, so
/// the tick is no finer than the deadlines of the loaded plugins need.
const COARSEST_TICK: Duration = Duration::from_millis(10);

/// The finest tick an instance may ask for.
const FINEST_TICK: Duration = Duration::from_millis(1);

/// Ticks in an instance's call deadline: a deadline fires within a tenth of itself.
const TICKS_PER_DEADLINE: u32 = 10;

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
    /// The epoch's period in nanoseconds: call deadlines are whole multiples of it.
    tick_nanos: Arc<AtomicU64>,
    _ticker: EpochTicker,
}

/// Loads plugin components and makes contained instances of them.
///
/// Every runtime of a process shares one wasmtime `Engine` (and its epoch ticker) and one
/// in-memory table of compiled components, so making a runtime is cheap and a component
/// compiled once is never compiled again while the process lives.
pub struct PluginRuntime {
    shared: Arc<EngineShared>,
    cache: ComponentCache,
}

/// A compiled component and what identifies it.
#[derive(Clone)]
pub(crate) struct CompiledComponent {
    pub component: Component,
    /// Hex SHA-256 of the component file.
    pub sha256: String,
    /// The version of `plughost:plugin` the component imports, or the host's newest when it
    /// names none.
    pub wit_version: String,
    /// The contract version and world the component names.
    pub contract: ComponentContract,
}

/// The process's one engine; made on first use.
fn process_engine() -> Result<Arc<EngineShared>, PluginError> {
    static ENGINE: OnceLock<Result<Arc<EngineShared>, String>> = OnceLock::new();
    ENGINE
        .get_or_init(|| EngineShared::new().map(Arc::new).map_err(|e| e.to_string()))
        .clone()
        .map_err(PluginError::Runtime)
}

impl EngineShared {
    fn new() -> Result<Self, PluginError> {
        let mut config = Config::new();
        config.wasm_component_model(true);
        config.epoch_interruption(true);
        let engine = Engine::new(&config).map_err(|e| PluginError::Runtime(format!("{e:#}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let tick_nanos = Arc::new(AtomicU64::new(COARSEST_TICK.as_nanos() as u64));
        let thread = {
            let engine = engine.clone();
            let stop = stop.clone();
            let tick_nanos = tick_nanos.clone();
            std::thread::Builder::new()
                .name("plugin-epoch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_nanos(
                            tick_nanos.load(Ordering::Relaxed),
                        ));
                        engine.increment_epoch();
                    }
                })
                .map_err(|e| PluginError::Runtime(format!("cannot start epoch ticker: {e}")))?
        };
        let ticker = EpochTicker {
            stop,
            thread: Some(thread),
        };
        Ok(EngineShared {
            engine,
            tick_nanos,
            _ticker: ticker,
        })
    }

    /// The epoch's period now.
    pub(crate) fn tick(&self) -> Duration {
        Duration::from_nanos(self.tick_nanos.load(Ordering::Relaxed))
    }

    /// Makes the epoch advance often enough for call deadlines of `deadline`: at least
    /// [`TICKS_PER_DEADLINE`] ticks in one, within [`FINEST_TICK`] and [`COARSEST_TICK`]. The
    /// tick never grows back when that instance goes: the engine is the process's, and a
    /// finer tick only costs wake-ups.
    pub(crate) fn ask_tick_for(&self, deadline: Duration) {
        let tick = (deadline / TICKS_PER_DEADLINE).clamp(FINEST_TICK, COARSEST_TICK);
        self.tick_nanos
            .fetch_min(tick.as_nanos() as u64, Ordering::Relaxed);
    }
}

impl PluginRuntime {
    /// A runtime over the process's engine, caching compiled components in `options.cache_dir`.
    pub fn new(options: RuntimeOptions) -> Result<Self, PluginError> {
        let shared = process_engine()?;
        let cache = ComponentCache::new(&shared.engine, options.cache_dir);
        Ok(PluginRuntime { shared, cache })
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
        let compiled = self.compile(path)?;
        self.instantiate_component(path, &compiled, config, limits)
    }

    /// Compiles the component at `path`, or takes it from the process's table or the disk cache.
    pub(crate) fn compile(&self, path: &Path) -> Result<CompiledComponent, PluginError> {
        self.cache.load(&self.shared.engine, path)
    }

    pub(crate) fn instantiate_component<W: World>(
        &self,
        path: &Path,
        compiled: &CompiledComponent,
        config: &str,
        limits: InstanceLimits,
    ) -> Result<ContainedInstance<W>, PluginError> {
        // A component of another world would fail to link with a message about a missing
        // import; name the world it exports and the one the slot needs instead.
        let name = path.display().to_string();
        compiled.contract.check(&name, W::NAME)?;
        let version = compiled.contract.speaks().ok_or_else(|| {
            PluginError::Runtime(format!("{name} names no contract version this host speaks"))
        })?;
        let component = &compiled.component;
        let incompatible = |e: wasmtime::Error| PluginError::Incompatible {
            path: path.to_path_buf(),
            world: W::NAME,
            version: version.as_str(),
            message: match records::first_difference(
                &self.shared.engine,
                &component.component_type(),
                version,
            ) {
                Some(difference) => format!("{difference} ({e:#})"),
                None => format!("{e:#}"),
            },
        };
        let mut linker: Linker<PluginState> = Linker::new(&self.shared.engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .map_err(|e| PluginError::Runtime(format!("{e:#}")))?;
        W::add_to_linker(&mut linker, version)
            .map_err(|e| PluginError::Runtime(format!("{e:#}")))?;
        let pre = linker.instantiate_pre(component).map_err(incompatible)?;
        let pre = W::pre(pre, version).map_err(incompatible)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tick_follows_the_finest_deadline_within_its_bounds() {
        let shared = EngineShared::new().expect("an engine");
        assert_eq!(shared.tick(), COARSEST_TICK);
        shared.ask_tick_for(Duration::from_millis(200));
        assert_eq!(shared.tick(), COARSEST_TICK);
        shared.ask_tick_for(Duration::from_millis(50));
        assert_eq!(shared.tick(), Duration::from_millis(5));
        // A coarser deadline later leaves the finer tick in place.
        shared.ask_tick_for(Duration::from_secs(10));
        assert_eq!(shared.tick(), Duration::from_millis(5));
        shared.ask_tick_for(Duration::from_millis(1));
        assert_eq!(shared.tick(), FINEST_TICK);
    }
}
