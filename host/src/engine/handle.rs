//! The engine handle: how the rest of the host reaches the engine thread — submitting requests, swapping deployments, waiting for the model and hearing of faults.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::metrics::Metrics;
use crate::plugins::Generation;
use crate::plugins::generation::{LoadedSampler, UnknownSampler};

use super::health::{self, EngineHealth, Timeouts};
use super::reload::{DeploymentStatus, Deployments, ReloadError, ReloadReport, ReloadSource};
use super::request::{GenerationEvent, GenerationRequest, RequestId};
use super::start::{EngineSetup, EngineStartError, ModelSummary};
use super::thread::run_engine;

#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("the model is still loading")]
    NotReady,
    /// Why, as the layer that failed reported it; shared by every caller that asks.
    #[error("the model failed to load: {0}")]
    LoadFailed(Arc<EngineStartError>),
    #[error("the engine has stopped")]
    Stopped,
    /// The engine thread died, stalled or is stuck in a hung device; the process must restart.
    #[error("{0}")]
    Faulted(String),
    /// The request names a sampler the active deployment does not have.
    #[error(transparent)]
    UnknownSampler(#[from] UnknownSampler),
}

impl From<EngineStartError> for EngineError {
    /// What a request hears of a start that failed: that the model did not load, and why.
    fn from(error: EngineStartError) -> Self {
        EngineError::LoadFailed(Arc::new(error))
    }
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

pub(super) enum Command {
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

/// Where the model stands, shared between the handle, the engine thread and the watchdog.
#[derive(Default)]
pub(super) enum LoadState {
    #[default]
    Loading,
    Ready(Box<ModelSummary>),
    Failed(Arc<EngineStartError>),
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
                .map_err(|source| {
                    EngineError::from(EngineStartError::Spawn {
                        thread: "engine thread",
                        source,
                    })
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
                .map_err(|source| {
                    EngineError::from(EngineStartError::Spawn {
                        thread: "engine watchdog",
                        source,
                    })
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
            LoadState::Failed(error) => Err(EngineError::LoadFailed(error.clone())),
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
                LoadState::Failed(error) => return EngineError::LoadFailed(error.clone()),
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

    /// Whether a new device worker is preparing the model after the last one was lost.
    pub fn is_repreparing(&self) -> bool {
        self.health.liveness.is_repreparing()
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

pub(super) fn set_load_state(load: &(Mutex<LoadState>, Condvar), state: LoadState) {
    if let Ok(mut guard) = load.0.lock() {
        *guard = state;
    }
    load.1.notify_all();
}
