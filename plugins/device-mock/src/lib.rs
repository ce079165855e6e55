//! The deterministic mock device: every callable, counters and fault injection, exported through the plughost device C ABI.
//!
//! Config (the `open` string): comma-separated `key=value` options, see [`config`].
//! `fail_launch=N` makes the Nth launch fail with LAUNCH_FAILED (and, with `fail_launch_count=K`,
//! the K launches from the Nth on: K=1 is a transient fault a retry gets past, K≥2 a persistent
//! one); `hang_launch=N` makes it sleep `hang_ms` (default a day) before running;
//! `crash_launch=N` aborts the process at the Nth launch (run it in a device worker);
//! `memory_bytes=N` caps live allocations; `launch_ms=N` makes every launch take N ms at least
//! (a slow device). Copies out in the background (ABI revision 1.2): `copy_ms=N` makes each
//! wait N ms on the copy thread before it copies, so it spans engine steps; `crash_copy=N`
//! aborts the process during the Nth copy (run it in a device worker). With the environment
//! variable [`TABLE_REVISION_ENV`] set to `1.1` the library exports a revision 1.1 table,
//! without the copy-out entries: a device the host must copy from synchronously. Launches are counted from 1 across all callables,
//! counting every launch that passed the argument checks (a refused launch never reaches the
//! device), so each fault fires once in the life of a device. In a device worker process the
//! faults fire only in a server's first worker, so a restarted worker recovers; with
//! `faults_every_worker=1` they fire in every worker.

pub mod config;
pub mod kernels;
pub mod step_inputs;

use std::thread;

use plughost_device_abi::PlughostDeviceV1;
use plughost_device_abi::export::{CopyOutFault, DeviceBackend, DeviceFailure, Launch};

use crate::config::MockConfig;

/// Set to `1.1` in the environment of the process that loads the mock device, makes it export a
/// revision 1.1 function table (without `copy_out_start` and `copy_out_poll`).
pub const TABLE_REVISION_ENV: &str = "PLUGHOST_MOCK_DEVICE_TABLE_REVISION";

pub struct MockDevice {
    config: MockConfig,
    launches_started: u64,
    copies_started: u64,
}

impl DeviceBackend for MockDevice {
    fn open(config: &str) -> Result<MockDevice, DeviceFailure> {
        let mut config = MockConfig::parse(config)
            .map_err(|error| DeviceFailure::invalid_argument(error.to_string()))?;
        if !config.faults_every_worker && is_restarted_worker() {
            config.fail_launch = None;
            config.hang_launch = None;
            config.crash_launch = None;
            config.crash_copy = None;
        }
        Ok(MockDevice {
            config,
            launches_started: 0,
            copies_started: 0,
        })
    }

    fn memory_capacity(&self) -> u64 {
        self.config.memory_bytes.unwrap_or(u64::MAX)
    }

    fn copy_out_fault(&mut self) -> CopyOutFault {
        self.copies_started += 1;
        CopyOutFault {
            delay: self.config.copy_time,
            abort: self.config.crash_copy == Some(self.copies_started),
        }
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
        thread::sleep(self.config.launch_time);
        if self.config.crash_launch == Some(number) {
            eprintln!("mock device: injected crash at launch {number} (crash_launch={number})");
            std::process::abort();
        }
        kernels::run(launch)
    }
}

/// Whether this process is a device worker that replaced an earlier one of the same server.
fn is_restarted_worker() -> bool {
    std::env::var(plughost_device_abi::WORKER_RESTARTS_ENV)
        .ok()
        .and_then(|restarts| restarts.parse::<u64>().ok())
        .is_some_and(|restarts| restarts > 0)
}

/// The device entry point: the function table of this library, of revision 1.1 when
/// [`TABLE_REVISION_ENV`] asks for it.
#[unsafe(no_mangle)]
pub extern "C" fn plughost_device_v1() -> *const PlughostDeviceV1 {
    static TABLE: PlughostDeviceV1 = plughost_device_abi::export::device_table::<MockDevice>();
    static REVISION_1_1: PlughostDeviceV1 = PlughostDeviceV1 {
        struct_size: PlughostDeviceV1::SIZE_1_1,
        copy_out_start: None,
        copy_out_poll: None,
        ..plughost_device_abi::export::device_table::<MockDevice>()
    };
    if std::env::var(TABLE_REVISION_ENV).is_ok_and(|revision| revision == "1.1") {
        &REVISION_1_1
    } else {
        &TABLE
    }
}
