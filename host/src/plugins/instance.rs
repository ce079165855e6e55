//! A contained plugin instance: its own Store with a memory cap, a deadline per call, re-made after a trap, under its component's failure policy.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cpu_time::ThreadTime;
use wasmtime::component::{InstancePre, Linker, ResourceTable};
use wasmtime::{ResourceLimiter, Store, Trap, UpdateDeadline};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::PluginError;
use super::contract::ContractVersion;
use super::generation::Slot;
use super::logits::LogitsBatch;
use super::policy::{FaultPolicy, FaultTracker, Unavailable};
use super::runtime::EngineShared;
use super::sandbox::{CallRandom, deterministic_wasi};

/// Limits applied to every instance of one plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceLimits {
    /// The most linear memory the instance may hold, all its memories together.
    pub memory_bytes: usize,
    /// The longest one call may run before it is interrupted.
    pub call_timeout: Duration,
}

/// The default deadline of one call: a step of a small model takes tens of milliseconds, and a
/// plugin that runs longer holds up every sequence of the batch. It is a wall-clock bound on
/// the plugin's own time, so it leaves room for the plugin's thread being descheduled on a
/// busy machine: a spurious timeout fails requests under the sampler's `reject` default.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_millis(200);

/// The default deadline of a call made once at prepare time (the model glue's), never on a
/// step: it may compute for a while.
pub const PREPARE_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The least deadline of instantiating an instance and running its `init`, which happen at
/// load and after a fault, not on every step.
pub const INIT_TIMEOUT: Duration = Duration::from_secs(1);

/// The deadline bounds the plugin's own time: the CPU time of the calling thread, so time the
/// thread spends descheduled on a busy machine is not charged. Time in the host's native fast
/// paths (argmax, top-k, log-softmax over a whole row) is the host's work, which a native
/// sampler would pay too, so it is not charged either; but a call never takes more than this
/// many deadlines of CPU time in all, so a plugin cannot loop forever on host calls.
pub const CPU_DEADLINES: u32 = 10;

/// The last resort, in wall-clock time: a call is interrupted after this many deadlines
/// whatever its CPU time says.
pub const WALL_DEADLINES: u32 = 100;

/// The most linear memory an instance keeps between calls. An instance that grew past it is
/// dropped after the call (its memory unmapped) and re-made for the next, so a burst inside
/// one call never stays resident in the host.
pub const KEPT_MEMORY_BYTES: usize = 64 << 20;

impl Default for InstanceLimits {
    fn default() -> Self {
        InstanceLimits {
            memory_bytes: 256 << 20,
            call_timeout: DEFAULT_CALL_TIMEOUT,
        }
    }
}

impl InstanceLimits {
    /// The defaults of a plugin called only at prepare time (the model glue).
    pub fn for_prepare() -> Self {
        InstanceLimits {
            call_timeout: PREPARE_CALL_TIMEOUT,
            ..InstanceLimits::default()
        }
    }

    fn init_timeout(&self) -> Duration {
        self.call_timeout.max(INIT_TIMEOUT)
    }
}

/// Counters of one plugin, across its instances.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PluginStats {
    pub calls: u64,
    pub faults: u32,
    pub instantiations: u32,
    /// Instances dropped after a call because they held more than [`KEPT_MEMORY_BYTES`].
    pub memory_resets: u32,
    /// Wall time spent inside calls, including the boundary crossing.
    pub busy: Duration,
}

/// Caps the instance's linear memory, all memories together, and knows how much it holds.
struct MemoryMeter {
    cap: usize,
    held: usize,
}

impl ResourceLimiter for MemoryMeter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let total = self.held - current.min(self.held) + desired;
        if total > self.cap || maximum.is_some_and(|max| desired > max) {
            // A trap rather than a failed grow: a guest that cannot allocate would abort anyway,
            // and the trap names the cause.
            wasmtime::bail!(
                "the plugin's linear memory would grow to {total} bytes, past its cap of {} \
                 bytes (memory_mib)",
                self.cap
            );
        }
        self.held = total;
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(maximum.is_none_or(|max| desired <= max))
    }
}

/// What a store holds: WASI for the guest's std, the resource table, the
/// memory limiter, and the host-owned logits of the current sampling call.
pub struct PluginState {
    wasi: WasiCtx,
    /// Restarted at every call: a plugin's `wasi:random` depends only on the call.
    random: CallRandom,
    table: ResourceTable,
    memory: MemoryMeter,
    pub(crate) logits: LogitsBatch,
    /// What the current call's penalties overwrote, `(row, token, value)`, so a failed call
    /// can give the rows back as they came.
    pub(crate) undo: Vec<(u32, u32, f32)>,
    clock: CallClock,
}

/// The time of the call under way: wall and CPU time, the CPU time split between the guest and
/// the host's fast paths.
struct CallClock {
    started: Instant,
    /// The calling thread's CPU time when the call started.
    cpu_started: Duration,
    cpu_in_host: Duration,
    deadline: Duration,
    /// The epoch's period when the call started.
    tick: Duration,
}

impl CallClock {
    fn new() -> CallClock {
        CallClock {
            started: Instant::now(),
            cpu_started: thread_cpu_time(),
            cpu_in_host: Duration::ZERO,
            deadline: DEFAULT_CALL_TIMEOUT,
            tick: Duration::from_millis(1),
        }
    }

    /// What the epoch check does when a tick passes the deadline (it runs on the calling
    /// thread): go on while the guest's own CPU time is within it (extending to when it could
    /// run out), trap once it is not.
    fn check(&self) -> UpdateDeadline {
        let cpu = thread_cpu_time().saturating_sub(self.cpu_started);
        let guest = cpu.saturating_sub(self.cpu_in_host);
        if guest >= self.deadline
            || cpu >= self.deadline * CPU_DEADLINES
            || self.started.elapsed() >= self.deadline * WALL_DEADLINES
        {
            return UpdateDeadline::Interrupt;
        }
        UpdateDeadline::Continue(ticks(self.deadline - guest, self.tick))
    }
}

/// The CPU time the calling thread has used.
fn thread_cpu_time() -> Duration {
    ThreadTime::now().as_duration()
}

/// Starts a call of `deadline` on `store`, the epoch advancing every `tick`: its clock and its
/// epoch deadline.
fn start_call(store: &mut Store<PluginState>, deadline: Duration, tick: Duration) {
    store.data_mut().start_call(deadline, tick);
    store.set_epoch_deadline(ticks(deadline, tick));
}

/// Whole ticks of `tick` in `time`, at least one.
fn ticks(time: Duration, tick: Duration) -> u64 {
    ((time.as_nanos() / tick.as_nanos().max(1)) as u64).max(1)
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

    /// Runs one of the host's fast paths, keeping its time off the plugin's deadline.
    pub(crate) fn host_work<R>(&mut self, work: impl FnOnce(&mut Self) -> R) -> R {
        let started = thread_cpu_time();
        let result = work(self);
        self.clock.cpu_in_host += thread_cpu_time().saturating_sub(started);
        result
    }

    fn start_call(&mut self, deadline: Duration, tick: Duration) {
        self.random.restart();
        self.clock = CallClock {
            deadline,
            tick,
            ..CallClock::new()
        };
    }
}

/// One WIT world as the host sees it, in whichever contract version a component names: how
/// to link, pre-instantiate, instantiate and init it.
pub(crate) trait World: Sized + 'static {
    type Pre: Clone;
    const NAME: &'static str;
    fn add_to_linker(
        linker: &mut Linker<PluginState>,
        version: ContractVersion,
    ) -> wasmtime::Result<()>;
    fn pre(pre: InstancePre<PluginState>, version: ContractVersion) -> wasmtime::Result<Self::Pre>;
    fn instantiate(pre: &Self::Pre, store: &mut Store<PluginState>) -> wasmtime::Result<Self>;
    fn call_init(
        &self,
        store: &mut Store<PluginState>,
        config: &str,
    ) -> wasmtime::Result<Result<(), String>>;
}

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
    faults: Arc<FaultTracker>,
}

impl<W: World> ContainedInstance<W> {
    pub(crate) fn new(
        engine: Arc<EngineShared>,
        name: String,
        pre: W::Pre,
        config: String,
        limits: InstanceLimits,
    ) -> Self {
        engine.ask_tick_for(limits.call_timeout);
        ContainedInstance {
            engine,
            pre,
            config,
            limits,
            live: None,
            stats: PluginStats::default(),
            faults: Arc::new(FaultTracker::new(
                name.clone(),
                Slot::Scheduler,
                FaultPolicy::default_for(Slot::Scheduler),
            )),
            name,
        }
    }

    /// Puts the instance under `policy` as the component of `slot`, with fresh counts.
    pub(crate) fn set_fault_policy(&mut self, slot: Slot, policy: FaultPolicy) {
        self.faults = Arc::new(FaultTracker::new(self.name.clone(), slot, policy));
    }

    /// The component's fault counts and state, shared with status readers.
    pub(crate) fn fault_tracker(&self) -> &Arc<FaultTracker> {
        &self.faults
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn stats(&self) -> PluginStats {
        PluginStats {
            faults: u32::try_from(self.faults.faults()).unwrap_or(u32::MAX),
            ..self.stats
        }
    }

    /// Counts a fault the host found in what a call returned (an invalid plan, a bad token);
    /// the instance itself is still sound.
    pub(crate) fn record_fault(&self, cause: &dyn std::fmt::Display) {
        self.faults.record_fault(cause);
    }

    /// Drops the live instance, so the next call runs on a fresh one.
    pub(crate) fn reset(&mut self) {
        self.live = None;
    }

    /// Why no call may reach the component now, if so.
    pub(crate) fn unavailable(&self) -> Option<Unavailable> {
        self.faults.admit().err()
    }

    fn unavailable_error(&self, unavailable: Unavailable) -> PluginError {
        match unavailable {
            Unavailable::BackingOff { remaining } => PluginError::BackingOff {
                plugin: self.name.clone(),
                remaining_ms: remaining.as_millis() as u64,
            },
            Unavailable::Disabled { backoffs } => PluginError::Disabled {
                plugin: self.name.clone(),
                backoffs,
            },
        }
    }

    fn new_store(&self) -> Store<PluginState> {
        let (wasi, random) = deterministic_wasi();
        let state = PluginState {
            wasi,
            random,
            table: ResourceTable::new(),
            memory: MemoryMeter {
                cap: self.limits.memory_bytes,
                held: 0,
            },
            logits: LogitsBatch::default(),
            undo: Vec::new(),
            clock: CallClock {
                deadline: self.limits.call_timeout,
                ..CallClock::new()
            },
        };
        let mut store = Store::new(&self.engine.engine, state);
        store.limiter(|s| &mut s.memory);
        store.epoch_deadline_callback(|store| Ok(store.data().clock.check()));
        store
    }

    /// Makes a fresh instance and runs `init` if none is live.
    pub(crate) fn ensure_live(&mut self) -> Result<(), PluginError> {
        if self.live.is_some() {
            return Ok(());
        }
        let mut store = self.new_store();
        let init_timeout = self.limits.init_timeout();
        start_call(&mut store, init_timeout, self.engine.tick());
        let bindings =
            W::instantiate(&self.pre, &mut store).map_err(|e| PluginError::Instantiate {
                plugin: self.name.clone(),
                message: format!("{e:#}"),
            })?;
        start_call(&mut store, init_timeout, self.engine.tick());
        match bindings.call_init(&mut store, &self.config) {
            Ok(Ok(())) => {}
            Ok(Err(message)) => {
                return Err(PluginError::Plugin {
                    plugin: self.name.clone(),
                    message: format!("init: {message}"),
                });
            }
            Err(e) => return Err(self.fault(e)),
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
            // The trap code or the host's own reason, without the wasm backtrace, which goes
            // to the debug log: the message reaches clients and the admin listing.
            tracing::debug!(plugin = %self.name, "plugin trapped: {error:?}");
            let message = match error.downcast_ref::<Trap>() {
                Some(trap) => trap.to_string(),
                None => error.root_cause().to_string(),
            };
            PluginError::Trap {
                plugin: self.name.clone(),
                message,
            }
        }
    }

    /// Runs one call under the deadline, if the failure policy lets calls through. A trap
    /// drops the instance, counts a fault, and the next call makes a fresh instance.
    pub(crate) fn call<R>(
        &mut self,
        f: impl FnOnce(&W, &mut Store<PluginState>) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        self.call_counting(f, true)
    }

    /// A call whose failure is not counted as a fault: a re-run of input that already counted one.
    pub(crate) fn call_uncounted<R>(
        &mut self,
        f: impl FnOnce(&W, &mut Store<PluginState>) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        self.call_counting(f, false)
    }

    fn call_counting<R>(
        &mut self,
        f: impl FnOnce(&W, &mut Store<PluginState>) -> wasmtime::Result<R>,
        count: bool,
    ) -> Result<R, PluginError> {
        if let Some(unavailable) = self.unavailable() {
            return Err(self.unavailable_error(unavailable));
        }
        if let Err(e) = self.ensure_live() {
            if count {
                self.faults.record_fault(&e);
            }
            return Err(e);
        }
        let tick = self.engine.tick();
        let Some(live) = self.live.as_mut() else {
            return Err(PluginError::Runtime(
                "instance vanished after instantiation".into(),
            ));
        };
        start_call(&mut live.store, self.limits.call_timeout, tick);
        let started = Instant::now();
        let result = f(&live.bindings, &mut live.store);
        self.stats.calls += 1;
        self.stats.busy += started.elapsed();
        match result {
            Ok(value) => {
                if live.store.data().memory.held > KEPT_MEMORY_BYTES {
                    tracing::debug!(
                        plugin = %self.name,
                        bytes = live.store.data().memory.held,
                        "dropping an instance that grew past the memory kept between calls"
                    );
                    self.live = None;
                    self.stats.memory_resets += 1;
                }
                Ok(value)
            }
            Err(e) => {
                self.live = None;
                let error = self.fault(e);
                if count {
                    self.faults.record_fault(&error);
                } else {
                    tracing::debug!(plugin = %self.name, "re-run failed: {error}");
                }
                Err(error)
            }
        }
    }
}
