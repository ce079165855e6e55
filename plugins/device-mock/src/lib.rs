//! The deterministic mock device: every callable, counters and fault injection, exported through the plughost device C ABI.
//!
//! Config (the `open` string): comma-separated `key=value` options, see [`config`].
//! `fail_launch=N` makes the Nth launch fail with LAUNCH_FAILED (and, with `fail_launch_count=K`,
//! the K launches from the Nth on: K=1 is a transient fault a retry gets past, K≥2 a persistent
//! one); `hang_launch=N` makes it sleep `hang_ms` (default a day) before running;
//! `memory_bytes=N` caps live allocations. Launches are counted from 1 across all callables,
//! counting every launch that passed the argument checks (a refused launch never reaches the
//! device), so each fault fires once in the life of a device.

pub mod config;
pub mod kernels;
pub mod step_inputs;

use std::thread;

use plughost_device_abi::export::{DeviceBackend, DeviceFailure, Launch};

use crate::config::MockConfig;

pub struct MockDevice {
    config: MockConfig,
    launches_started: u64,
}

impl DeviceBackend for MockDevice {
    fn open(config: &str) -> Result<MockDevice, DeviceFailure> {
        let config = MockConfig::parse(config)
            .map_err(|error| DeviceFailure::invalid_argument(error.to_string()))?;
        Ok(MockDevice {
            config,
            launches_started: 0,
        })
    }

    fn memory_capacity(&self) -> u64 {
        self.config.memory_bytes.unwrap_or(u64::MAX)
    }

    fn launch(&mut self, launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
        self.launches_started += 1;
        let number = self.launches_started;
        if let Some(first) = self.config.fail_launch
            && (first..first.saturating_add(self.config.fail_launch_count)).contains(&number)
        {
            return Err(DeviceFailure::launch_failed(format!(
                "injected failure of launch {number} (fail_launch={first})"
            )));
        }
        if self.config.hang_launch == Some(number) {
            thread::sleep(self.config.hang);
        }
        kernels::run(launch)
    }
}

plughost_device_abi::export_device!(MockDevice);
