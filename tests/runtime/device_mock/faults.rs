//! Fault injection: `fail_launch` fails exactly the launch it names, and `hang_launch` delays only that launch and counts as device time.

use std::time::{Duration, Instant};

use plughost::device::{ArgTag, BufferId, DType, Device, DeviceError, status};

use super::{arg, download_f32, expect_call_error, open_mock, upload_f32};

/// `add` on a fresh pair of buffers; returns the launch result.
fn add_once(device: &mut Device, x: BufferId, y: BufferId) -> Result<(), DeviceError> {
    let add = device.callable_index("add").unwrap();
    device.launch(
        add,
        &[
            arg(x, DType::F32, &[1, 2], ArgTag::Inout),
            arg(y, DType::F32, &[1, 2], ArgTag::Input),
        ],
        &[],
    )
}

#[test]
fn fail_launch_fails_exactly_that_launch() {
    let mut device = open_mock("fail_launch=2");
    let x = upload_f32(&mut device, &[0.0, 0.0]);
    let y = upload_f32(&mut device, &[1.0, 2.0]);

    add_once(&mut device, x, y).unwrap();
    let (code, message) = expect_call_error(add_once(&mut device, x, y));
    assert_eq!(code, status::LAUNCH_FAILED);
    assert_eq!(
        message,
        "launch `add`: injected failure of launch 2 (fail_launch=2)"
    );
    add_once(&mut device, x, y).unwrap();
    add_once(&mut device, x, y).unwrap();

    // The failed launch wrote nothing.
    assert_eq!(download_f32(&mut device, x, 2), [3.0, 6.0]);
    assert_eq!(device.stats().unwrap().launches, 3);
}

#[test]
fn hang_launch_delays_that_launch_and_counts_as_device_time() {
    let mut device = open_mock("hang_launch=1,hang_ms=1000");
    let x = upload_f32(&mut device, &[0.0, 0.0]);
    let y = upload_f32(&mut device, &[1.0, 2.0]);

    // Lower bounds: a sleep of a second lasts at least that long, however busy the machine.
    let started = Instant::now();
    add_once(&mut device, x, y).unwrap();
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert!(device.synchronize().unwrap() >= Duration::from_secs(1));
    // Device time is reported once, then starts again from zero.
    assert_eq!(device.synchronize().unwrap(), Duration::ZERO);

    // Only the first launch hangs. A liveness bound: the second is a two-element add, some
    // microseconds, where another hang would take a second at least.
    add_once(&mut device, x, y).unwrap();
    assert!(device.synchronize().unwrap() < Duration::from_secs(1));
    assert_eq!(download_f32(&mut device, x, 2), [2.0, 4.0]);
}
