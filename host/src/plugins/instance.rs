//! A contained plugin instance: its own Store with a memory cap, a deadline per call, re-made after a trap.

use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmtime::component::{InstancePre, Linker, ResourceTable};
use wasmtime::{Store, StoreLimits, StoreLimitsBuilder, Trap};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::PluginError;
use super::logits::LogitsBatch;
use super::runtime::{EPOCH_TICK, EngineShared};

/// Limits applied to every instance of one plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceLimits {
    /// The most linear memory the instance may hold.
    pub memory_bytes: usize,
    /// The longest one call may run before it is interrupted.
    pub call_timeout: Duration,
    /// Faults after which the plugin is no longer re-instantiated.
    pub max_faults: u32,
}

impl Default for InstanceLimits {
    fn default() -> Self {
        InstanceLimits {
            memory_bytes: 256 << 20,
            call_timeout: Duration::from_millis(500),
            max_faults: 16,
        }
    }
}

/// Counters of one plugin, across its instances.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PluginStats {
    pub calls: u64,
    pub faults: u32,
    pub instantiations: u32,
    /// Wall time spent inside calls, including the boundary crossing.
    pub busy: Duration,
}

/// What a store holds: WASI for the guest's std, the resource table, the
/// limits, and the host-owned logits of the current sampling call.
pub struct PluginState {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: StoreLimits,
    pub(crate) logits: LogitsBatch,
}

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl PluginState {
    pub(crate) fn table(&mut self) -> &mut ResourceTable {
        &mut self.table
    }
}

/// One WIT world as the host sees it: how to link, pre-instantiate, instantiate and init it.
pub(crate) trait World: Sized + 'static {
    type Pre: Clone;
    const NAME: &'static str;
    fn add_to_linker(linker: &mut Linker<PluginState>) -> wasmtime::Result<()>;
    fn pre(pre: InstancePre<PluginState>) -> wasmtime::Result<Self::Pre>;
    fn instantiate(pre: &Self::Pre, store: &mut Store<PluginState>) -> wasmtime::Result<Self>;
    fn call_init(
        &self,
        store: &mut Store<PluginState>,
        config: &str,
    ) -> wasmtime::Result<Result<(), String>>;
}

/// Implements [`World`] for a world's generated bindings; every world links, pre-instantiates,
/// instantiates and initialises the same way.
macro_rules! impl_world {
    ($bindings:ident :: $world:ident, $pre:ident, $name:literal) => {
        impl $crate::plugins::instance::World for $bindings::$world {
            type Pre = $bindings::$pre<$crate::plugins::instance::PluginState>;
            const NAME: &'static str = $name;

            fn add_to_linker(
                linker: &mut wasmtime::component::Linker<$crate::plugins::instance::PluginState>,
            ) -> wasmtime::Result<()> {
                type State = $crate::plugins::instance::PluginState;
                $bindings::$world::add_to_linker::<State, wasmtime::component::HasSelf<State>>(
                    linker,
                    |s| s,
                )
            }
            fn pre(
                pre: wasmtime::component::InstancePre<$crate::plugins::instance::PluginState>,
            ) -> wasmtime::Result<Self::Pre> {
                $bindings::$pre::new(pre)
            }
            fn instantiate(
                pre: &Self::Pre,
                store: &mut wasmtime::Store<$crate::plugins::instance::PluginState>,
            ) -> wasmtime::Result<Self> {
                pre.instantiate(&mut *store)
            }
            fn call_init(
                &self,
                store: &mut wasmtime::Store<$crate::plugins::instance::PluginState>,
                config: &str,
            ) -> wasmtime::Result<Result<(), String>> {
                self.call_init(store, config)
            }
        }
    };
}
pub(crate) use impl_world;

struct Live<W> {
    store: Store<PluginState>,
    bindings: W,
}

pub(crate) struct ContainedInstance<W: World> {
    engine: Arc<EngineShared>,
    name: String,
    pre: W::Pre,
    config: String,
    limits: InstanceLimits,
    live: Option<Live<W>>,
    stats: PluginStats,
}

impl<W: World> ContainedInstance<W> {
    pub(crate) fn new(
        engine: Arc<EngineShared>,
        name: String,
        pre: W::Pre,
        config: String,
        limits: InstanceLimits,
    ) -> Self {
        ContainedInstance {
            engine,
            name,
            pre,
            config,
            limits,
            live: None,
            stats: PluginStats::default(),
        }
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn stats(&self) -> PluginStats {
        self.stats
    }

    fn deadline_ticks(&self) -> u64 {
        let ticks = self.limits.call_timeout.as_nanos() / EPOCH_TICK.as_nanos();
        (ticks as u64).max(1)
    }

    fn new_store(&self) -> Store<PluginState> {
        let limits = StoreLimitsBuilder::new()
            .memory_size(self.limits.memory_bytes)
            .trap_on_grow_failure(true)
            .build();
        let state = PluginState {
            wasi: WasiCtx::builder().inherit_stderr().build(),
            table: ResourceTable::new(),
            limits,
            logits: LogitsBatch::default(),
        };
        let mut store = Store::new(&self.engine.engine, state);
        store.limiter(|s| &mut s.limits);
        store.epoch_deadline_trap();
        store
    }

    /// Makes a fresh instance and runs `init` if none is live.
    pub(crate) fn ensure_live(&mut self) -> Result<(), PluginError> {
        if self.live.is_some() {
            return Ok(());
        }
        if self.stats.faults >= self.limits.max_faults {
            return Err(PluginError::Disabled {
                plugin: self.name.clone(),
                faults: self.stats.faults,
            });
        }
        let mut store = self.new_store();
        store.set_epoch_deadline(self.deadline_ticks());
        let bindings =
            W::instantiate(&self.pre, &mut store).map_err(|e| PluginError::Instantiate {
                plugin: self.name.clone(),
                message: format!("{e:#}"),
            })?;
        store.set_epoch_deadline(self.deadline_ticks());
        match bindings.call_init(&mut store, &self.config) {
            Ok(Ok(())) => {}
            Ok(Err(message)) => {
                return Err(PluginError::Plugin {
                    plugin: self.name.clone(),
                    message: format!("init: {message}"),
                });
            }
            Err(e) => {
                self.stats.faults += 1;
                return Err(self.fault(e));
            }
        }
        self.stats.instantiations += 1;
        self.live = Some(Live { store, bindings });
        Ok(())
    }

    fn fault(&self, error: wasmtime::Error) -> PluginError {
        if matches!(error.downcast_ref::<Trap>(), Some(Trap::Interrupt)) {
            PluginError::Timeout {
                plugin: self.name.clone(),
                limit_ms: self.limits.call_timeout.as_millis() as u64,
            }
        } else {
            PluginError::Trap {
                plugin: self.name.clone(),
                message: format!("{error:#}"),
            }
        }
    }

    /// Runs one call under the deadline. A trap drops the instance; the next call makes a fresh one.
    pub(crate) fn call<R>(
        &mut self,
        f: impl FnOnce(&W, &mut Store<PluginState>) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        self.ensure_live()?;
        let ticks = self.deadline_ticks();
        let Some(live) = self.live.as_mut() else {
            return Err(PluginError::Runtime(
                "instance vanished after instantiation".into(),
            ));
        };
        live.store.set_epoch_deadline(ticks);
        let started = Instant::now();
        let result = f(&live.bindings, &mut live.store);
        self.stats.calls += 1;
        self.stats.busy += started.elapsed();
        match result {
            Ok(value) => Ok(value),
            Err(e) => {
                self.live = None;
                self.stats.faults += 1;
                tracing::warn!(plugin = %self.name, faults = self.stats.faults, "plugin fault: {e:#}");
                Err(self.fault(e))
            }
        }
    }
}
