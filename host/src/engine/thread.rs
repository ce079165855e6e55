//! The engine thread: loads the model, then runs the engine loop (commands in, steps while there is work) until shutdown, turning a panic into a fault.

use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crate::metrics::Metrics;

use super::core::EngineCore;
use super::handle::{Command, LoadState, set_load_state};
use super::health::{self, EngineHealth};
use super::reload::Deployments;
use super::start::{EngineSetup, build_core};
use super::state::Admitted;

pub(super) fn run_engine(
    setup: EngineSetup,
    commands: Receiver<Command>,
    load: Arc<(Mutex<LoadState>, Condvar)>,
    metrics: Arc<Metrics>,
    health: Arc<EngineHealth>,
    deployments: Arc<Deployments>,
) {
    let started = Instant::now();
    let mut core = match build_core(&setup, metrics, health.clone(), &deployments) {
        Ok((core, summary)) => {
            tracing::info!(model = %setup.model_dir.display(), seconds = started.elapsed().as_secs_f64(), "model ready");
            core.record_device_stats();
            set_load_state(&load, LoadState::Ready(Box::new(summary)));
            core
        }
        Err(error) => {
            tracing::error!("model failed to load: {error}");
            set_load_state(&load, LoadState::Failed(Arc::new(error)));
            return;
        }
    };
    let served = guard_panics(&health, &load, || {
        serve_commands(&mut core, &commands, started)
    });
    if served {
        core.close(setup.profile_output.as_deref());
    }
}

/// Runs `body`; a panic in it must not leave clients waiting and /health green, so it is a
/// fault like a hang: every request in flight fails and the engine reports the fault.
/// Whether `body` returned.
fn guard_panics(
    health: &EngineHealth,
    load: &(Mutex<LoadState>, Condvar),
    body: impl FnOnce(),
) -> bool {
    let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) else {
        return true;
    };
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into());
    let fault = health::EngineFault::Panicked(message);
    tracing::error!("{fault}");
    health.in_flight.fail_all(&fault.to_string(), false);
    set_load_state(load, LoadState::Faulted(fault.to_string()));
    false
}

/// The engine loop: takes commands, steps while there is work, until shutdown.
fn serve_commands(core: &mut EngineCore, commands: &Receiver<Command>, started: Instant) {
    loop {
        core.health().liveness.set_has_work(core.has_work());
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
            Some(Command::Install { generation, done }) => {
                core.install(generation);
                let _ = done.send(());
                continue;
            }
            Some(Command::Submit {
                id,
                request,
                events,
                arrival,
                deployment,
                sampler,
            }) => {
                let admitted = Admitted {
                    arrival,
                    arrival_us: arrival.saturating_duration_since(started).as_micros() as u64,
                    deployment,
                    sampler,
                };
                core.submit(id, *request, events, admitted);
                continue;
            }
            None => {}
        }
        core.step();
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc::unbounded_channel;

    use super::super::request::GenerationEvent;
    use super::*;

    #[test]
    fn a_panic_of_the_engine_loop_fails_every_request_and_is_a_fault() {
        let health = EngineHealth::default();
        let load = (Mutex::new(LoadState::Loading), Condvar::new());
        let (events, mut receiver) = unbounded_channel();
        health.in_flight.insert(7, None, events);
        assert!(guard_panics(&health, &load, || {}));
        assert!(matches!(*load.0.lock().unwrap(), LoadState::Loading));
        let returned = guard_panics(&health, &load, || panic!("step {} went wrong", 3));
        assert!(!returned);
        let expected = "the engine thread panicked: step 3 went wrong";
        assert_eq!(
            receiver.try_recv(),
            Ok(GenerationEvent::Failed {
                message: expected.into()
            })
        );
        assert!(matches!(&*load.0.lock().unwrap(), LoadState::Faulted(m) if m == expected));
    }
}
