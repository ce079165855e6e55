//! Failures through the C ABI: a config the device refuses, and launches refused or failed before they write anything.

use plughost_device_abi::{DType, status};

use super::device::{Device, IN, INOUT, OUT};
use super::step::THETA;

#[test]
fn failures_come_back_as_codes_and_messages() {
    let (code, message) = Device::open("threads=0").err().unwrap();
    assert_eq!(code, status::INVALID_ARGUMENT);
    assert_eq!(
        message,
        "open: cpu device option `threads` must be a positive integer, got `0`"
    );

    let device = Device::open("").unwrap();
    let ids = device.i32s(&[2], &[1, 7]);
    let table = device.f32s(&[3, 2], &[0.0; 6]);
    let out = device.f32s(&[2, 2], &[9.0; 4]);
    let (code, message) = device
        .launch(
            "embedding_gather",
            &[ids.arg(IN), table.arg(IN), out.arg(OUT)],
            &[],
        )
        .unwrap_err();
    assert_eq!(code, status::LAUNCH_FAILED);
    assert_eq!(
        message,
        "launch `embedding_gather`: ids[1] = 7 is outside 0..3"
    );
    assert_eq!(
        device.read_f32(&out),
        [9.0; 4],
        "a failed launch writes nothing"
    );
    assert_eq!(device.stats().launches, 0);

    // Written arguments that overlap are refused rather than computed in some order.
    let qk = device.f32s(&[1, 8], &[0.0; 8]);
    let positions = device.i32s(&[1], &[0]);
    let (code, message) = device
        .launch(
            "rotary",
            &[qk.arg(INOUT), qk.arg(INOUT), positions.arg(IN)],
            &crate::test_support::rotary_params(8, THETA),
        )
        .unwrap_err();
    assert_eq!(code, status::INVALID_ARGUMENT);
    assert!(
        message.contains("arguments `q` and `k` overlap"),
        "{message}"
    );

    // A layer's key and value caches share one dtype; the ABI refuses a launch that mixes them
    // before the kernel sees it.
    let rows = device.f32s(&[1, 4], &[1.0; 4]);
    let cache_shape = [2, 1, 1, 4];
    let key_cache = device.zeros_of(DType::F32, &cache_shape);
    let value_cache = device.zeros_of(DType::BF16, &cache_shape);
    let slots = device.i32s(&[1], &[0]);
    let (code, message) = device
        .launch(
            "kv_write",
            &[
                rows.arg(IN),
                rows.arg(IN),
                key_cache.arg(OUT),
                value_cache.arg(OUT),
                slots.arg(IN),
            ],
            &[],
        )
        .unwrap_err();
    assert_eq!(code, status::INVALID_ARGUMENT);
    assert!(
        message.contains(
            "arguments `key_cache` (f32) and `value_cache` (bf16) must have the same dtype"
        ),
        "{message}"
    );
    assert_eq!(device.read_widened_bits(&key_cache), [0; 8]);
    assert_eq!(device.stats().launches, 0);
}
