//! The engine's liveness: what the engine thread reports as it works, the watchdog that judges it, and the requests to tell when it has failed.
//!
//! The engine thread stamps the start and end of every device step and every step that
//! made progress. A watchdog thread reads those stamps: a device step longer than the
//! device timeout is a hung device, work pending with no progress for the stall timeout is
//! a stalled engine. Either is fatal, as is a panic of the engine thread: the device call
//! on the engine thread cannot be cancelled, so the only way out is a new process. The
//! watchdog then fails every request in flight, so no client waits on a dead engine.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;

use super::request::{GenerationEvent, RequestId};
use crate::plugins::generation::ComponentHealth;

/// The body of a 200 `/health`: the engine serves. A plugin backed off or disabled is reported
/// here but keeps the status 200: the host's built-in policy or the plugin's `reject` policy
/// still answers every request, so restarting the process would not help.
#[derive(Debug, Clone, Serialize)]
pub struct HealthReport {
    /// `ok`, or `degraded` while a plugin component is backed off or disabled.
    pub status: &'static str,
    pub plugins: Vec<ComponentHealth>,
}

impl HealthReport {
    pub fn new(plugins: Vec<ComponentHealth>) -> HealthReport {
        let degraded = plugins.iter().any(|p| p.state != "active");
        HealthReport {
            status: if degraded { "degraded" } else { "ok" },
            plugins,
        }
    }
}

/// Why the engine can no longer serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineFault {
    #[error("the engine thread panicked: {0}")]
    Panicked(String),
    #[error(
        "the engine stalled: work was pending and no step finished for {seconds} s (--engine-stall-timeout)"
    )]
    Stalled { seconds: u64 },
    #[error(
        "the device hung: a step's launch or synchronize ran past {seconds} s (--device-timeout)"
    )]
    DeviceHung { seconds: u64 },
    #[error(
        "the device is broken: its worker process was lost {restarts} times within {window_seconds} s \
         (--device-restart-limit, --device-restart-window); the last time: {cause}"
    )]
    DeviceBroken {
        restarts: u32,
        window_seconds: u64,
        cause: String,
    },
}

impl EngineFault {
    /// Whether clients should hear 503 (try another replica) rather than a server error.
    fn is_unavailable(&self) -> bool {
        matches!(self, EngineFault::DeviceBroken { .. })
    }
}

/// How long the engine may take before the watchdog declares it failed.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Work pending and no step finished for this long is a stall.
    pub stall: Duration,
    /// One device step (launches and synchronize) longer than this is a hung device.
    pub device: Duration,
}

/// No stamp: `0` in the atomics below.
const NEVER: u64 = 0;

/// The stamps the engine thread writes and the watchdog reads.
pub struct Liveness {
    epoch: Instant,
    /// When the running device step started or last completed a launch (µs since `epoch`,
    /// plus one), or `NEVER`.
    device_step_started: AtomicU64,
    /// When the engine last made progress (µs since `epoch`, plus one).
    last_progress: AtomicU64,
    has_work: AtomicBool,
    /// A new device worker is preparing the model: no step can finish, and that is no stall.
    repreparing: AtomicBool,
    /// A fault the engine thread found itself, for the watchdog to act on.
    declared: Mutex<Option<EngineFault>>,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            epoch: Instant::now(),
            device_step_started: AtomicU64::new(NEVER),
            last_progress: AtomicU64::new(1),
            has_work: AtomicBool::new(false),
            repreparing: AtomicBool::new(false),
            declared: Mutex::new(None),
        }
    }
}

impl Liveness {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64 + 1
    }

    fn since(&self, stamp: u64) -> Duration {
        Duration::from_micros(self.now().saturating_sub(stamp))
    }

    pub fn device_step_started(&self) {
        self.device_step_started
            .store(self.now(), Ordering::Release);
    }

    /// An in-process device completed a launch: the device timeout starts again, so it
    /// bounds one launch rather than a whole step.
    pub fn device_launch_completed(&self) {
        if self.device_step_started.load(Ordering::Acquire) != NEVER {
            self.device_step_started
                .store(self.now(), Ordering::Release);
        }
    }

    pub fn device_step_finished(&self) {
        self.device_step_started.store(NEVER, Ordering::Release);
    }

    /// A step computed tokens, or requests finished or failed.
    pub fn progressed(&self) {
        self.last_progress.store(self.now(), Ordering::Release);
    }

    /// Whether requests are queued or running; the stall clock starts when work arrives.
    pub fn set_has_work(&self, has_work: bool) {
        if has_work && !self.has_work.load(Ordering::Acquire) {
            self.progressed();
        }
        self.has_work.store(has_work, Ordering::Release);
    }

    /// A device worker starts preparing the model again (`true`), or is done (`false`).
    pub fn set_repreparing(&self, repreparing: bool) {
        self.repreparing.store(repreparing, Ordering::Release);
        self.progressed();
    }

    pub fn is_repreparing(&self) -> bool {
        self.repreparing.load(Ordering::Acquire)
    }

    /// The engine thread found a fault it cannot recover from; the watchdog acts on it.
    pub fn declare(&self, fault: EngineFault) {
        if let Ok(mut declared) = self.declared.lock() {
            declared.get_or_insert(fault);
        }
    }

    /// The fault the stamps show under `timeouts`, if any.
    pub fn fault(&self, timeouts: &Timeouts) -> Option<EngineFault> {
        if let Some(fault) = self.declared.lock().ok().and_then(|d| d.clone()) {
            return Some(fault);
        }
        let device_started = self.device_step_started.load(Ordering::Acquire);
        if device_started != NEVER && self.since(device_started) > timeouts.device {
            return Some(EngineFault::DeviceHung {
                seconds: timeouts.device.as_secs(),
            });
        }
        let last_progress = self.last_progress.load(Ordering::Acquire);
        if self.has_work.load(Ordering::Acquire)
            && !self.is_repreparing()
            && self.since(last_progress) > timeouts.stall
        {
            return Some(EngineFault::Stalled {
                seconds: timeouts.stall.as_secs(),
            });
        }
        None
    }
}

/// The event channels of every request the engine holds, so a failure the engine thread
/// cannot report itself (it is stuck or gone) still reaches each client.
#[derive(Default)]
pub struct InFlight {
    senders: Mutex<HashMap<RequestId, InFlightRequest>>,
}

/// A request in flight as the watchdog sees it: where its events go, and the API request's
/// id for the log line that reports its failure.
struct InFlightRequest {
    events: UnboundedSender<GenerationEvent>,
    request_id: Option<Arc<str>>,
}

impl InFlight {
    pub fn insert(
        &self,
        id: RequestId,
        request_id: Option<Arc<str>>,
        events: UnboundedSender<GenerationEvent>,
    ) {
        if let Ok(mut senders) = self.senders.lock() {
            senders.insert(id, InFlightRequest { events, request_id });
        }
    }

    /// The request has sent its last event.
    pub fn remove(&self, id: RequestId) {
        if let Ok(mut senders) = self.senders.lock() {
            senders.remove(&id);
        }
    }

    /// Sends every request in flight a failure carrying `message`, and forgets them;
    /// `unavailable` failures tell the client to try another replica.
    pub fn fail_all(&self, message: &str, unavailable: bool) -> usize {
        let senders = match self.senders.lock() {
            Ok(mut senders) => std::mem::take(&mut *senders),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        for (id, request) in &senders {
            tracing::error!(
                request = id,
                request_id = request.request_id.as_deref(),
                "request failed: {message}"
            );
            let message = message.to_string();
            let _ = request.events.send(if unavailable {
                GenerationEvent::Unavailable { message }
            } else {
                GenerationEvent::Failed { message }
            });
        }
        senders.len()
    }
}

/// What the engine thread and the watchdog share.
#[derive(Default)]
pub struct EngineHealth {
    pub liveness: Liveness,
    pub in_flight: InFlight,
}

/// How often the watchdog looks; small against any timeout, so exits come close to them.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(100);

/// Watches `health` until `stopping` is set or a fault is found; on a fault, fails every
/// request in flight and calls `on_fault` once.
pub fn watch(
    health: Arc<EngineHealth>,
    timeouts: Timeouts,
    stopping: Arc<AtomicBool>,
    on_fault: impl FnOnce(EngineFault),
) {
    while !stopping.load(Ordering::Acquire) {
        if let Some(fault) = health.liveness.fault(&timeouts) {
            tracing::error!("{fault}");
            let failed = health
                .in_flight
                .fail_all(&fault.to_string(), fault.is_unavailable());
            tracing::error!(requests = failed, "failed every request in flight");
            on_fault(fault);
            return;
        }
        std::thread::sleep(WATCH_INTERVAL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past after `SLEEP`; and far more than two adjacent lines take, however busy the machine.
    const HALF: Timeouts = Timeouts {
        stall: Duration::from_millis(500),
        device: Duration::from_millis(500),
    };
    const SLEEP: Duration = Duration::from_millis(1000);

    #[test]
    fn an_idle_engine_never_stalls_and_work_starts_the_clock_afresh() {
        let liveness = Liveness::default();
        std::thread::sleep(SLEEP);
        assert_eq!(liveness.fault(&HALF), None);
        liveness.set_has_work(true);
        assert_eq!(liveness.fault(&HALF), None);
    }

    #[test]
    fn work_with_no_progress_is_a_stall_and_progress_clears_it() {
        let liveness = Liveness::default();
        liveness.set_has_work(true);
        std::thread::sleep(SLEEP);
        assert!(matches!(
            liveness.fault(&HALF),
            Some(EngineFault::Stalled { .. })
        ));
        liveness.progressed();
        assert_eq!(liveness.fault(&HALF), None);
    }

    #[test]
    fn a_device_step_past_the_timeout_is_a_hung_device() {
        let liveness = Liveness::default();
        liveness.device_step_started();
        std::thread::sleep(SLEEP);
        assert!(matches!(
            liveness.fault(&HALF),
            Some(EngineFault::DeviceHung { .. })
        ));
        liveness.device_step_finished();
        assert_eq!(liveness.fault(&HALF), None);
    }

    #[test]
    fn failing_all_reaches_every_request_once() {
        let in_flight = InFlight::default();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        in_flight.insert(1, None, tx.clone());
        in_flight.insert(2, None, tx);
        in_flight.remove(2);
        assert_eq!(in_flight.fail_all("gone", false), 1);
        assert_eq!(
            rx.try_recv(),
            Ok(GenerationEvent::Failed {
                message: "gone".into()
            })
        );
        assert!(rx.try_recv().is_err());
        assert_eq!(in_flight.fail_all("again", false), 0);
    }
}
