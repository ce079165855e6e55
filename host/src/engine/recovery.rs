//! Recovering from a lost device worker: a new worker, the model prepared on it again, within a restart budget.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::device::DeviceSource;
use crate::metrics::Metrics;
use crate::runtime::{ModelRecipe, Runtime};

use super::health::EngineFault;

/// How many device worker restarts within a window a deployment tolerates; one more means
/// the device is broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartBudget {
    pub limit: u32,
    pub window: Duration,
}

impl Default for RestartBudget {
    fn default() -> Self {
        RestartBudget {
            limit: 5,
            window: Duration::from_secs(600),
        }
    }
}

/// What the engine keeps to start a device worker again and prepare the model on it.
pub struct DeviceRecovery {
    source: DeviceSource,
    recipe: ModelRecipe,
    budget: RestartBudget,
    /// Workers started after the first, over the server's life.
    restarts: u32,
    /// When the restarts within the window happened.
    recent: VecDeque<Instant>,
}

impl DeviceRecovery {
    pub fn new(source: DeviceSource, recipe: ModelRecipe, budget: RestartBudget) -> DeviceRecovery {
        DeviceRecovery {
            source,
            recipe,
            budget,
            restarts: 0,
            recent: VecDeque::new(),
        }
    }

    /// Starts a new worker and prepares the model on it, retrying a worker that fails to come
    /// up, until the budget is spent: then the device is broken.
    pub fn restart(&mut self, cause: String, metrics: &Metrics) -> Result<Runtime, EngineFault> {
        let mut cause = cause;
        loop {
            let now = Instant::now();
            while self
                .recent
                .front()
                .is_some_and(|&at| now.duration_since(at) > self.budget.window)
            {
                self.recent.pop_front();
            }
            if self.recent.len() >= self.budget.limit as usize {
                return Err(EngineFault::DeviceBroken {
                    restarts: self.recent.len() as u32 + 1,
                    window_seconds: self.budget.window.as_secs(),
                    cause,
                });
            }
            self.recent.push_back(now);
            self.restarts += 1;
            metrics.device_restarts.inc();
            tracing::warn!(
                restart = self.restarts,
                "starting a new device worker and preparing the model again: {cause}"
            );
            let prepared = self
                .source
                .open(self.restarts)
                .map_err(|e| e.to_string())
                .and_then(|device| self.recipe.prepare(device).map_err(|e| e.to_string()));
            match prepared {
                Ok(runtime) => {
                    tracing::info!(
                        restart = self.restarts,
                        seconds = now.elapsed().as_secs_f64(),
                        "the new device worker is ready"
                    );
                    return Ok(runtime);
                }
                Err(e) => {
                    tracing::error!(restart = self.restarts, "the new device worker failed: {e}");
                    cause = e;
                }
            }
        }
    }
}
