//! The device's counters: allocations, copies and launches per callable, exactly as the caller made them.

use plughost::device::{ArgTag, DType, DeviceStats};

use super::{arg, download_f32, expect_call_error, f32_bytes, launch, open_mock};

#[test]
fn counters_match_what_the_caller_did() {
    let mut device = open_mock("");
    let x = device.alloc(24).unwrap();
    let y = device.alloc(24).unwrap();
    let out = device.alloc(24).unwrap();
    let scratch = device.alloc(10).unwrap();
    device.free(scratch).unwrap();
    let x_values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let y_values = [0.5, -1.0, 2.0, 0.0, 1.0, -3.0];
    device.write(x, 0, &f32_bytes(&x_values)).unwrap();
    device.write(y, 0, &f32_bytes(&y_values)).unwrap();

    let shape = [2, 3];
    let add_args = [
        arg(x, DType::F32, &shape, ArgTag::Inout),
        arg(y, DType::F32, &shape, ArgTag::Input),
    ];
    launch(&mut device, "add", &add_args, &[]);
    launch(&mut device, "add", &add_args, &[]);
    let silu_args = [
        arg(x, DType::F32, &shape, ArgTag::Input),
        arg(y, DType::F32, &shape, ArgTag::Input),
        arg(out, DType::F32, &shape, ArgTag::Output),
    ];
    launch(&mut device, "silu_mul", &silu_args, &[]);
    // A refused launch counts nowhere.
    let add = device.callable_index("add").unwrap();
    expect_call_error(device.launch(add, &add_args[..1], &[]));

    let x_after = download_f32(&mut device, x, 6);
    let mut first_two = [0; 8];
    device.read(out, 0, &mut first_two).unwrap();

    let expected_x: Vec<f32> = x_values
        .iter()
        .zip(&y_values)
        .map(|(x, y)| x + 2.0 * y)
        .collect();
    assert_eq!(x_after, expected_x);
    assert_eq!(
        device.stats().unwrap(),
        DeviceStats {
            allocations: 4,
            frees: 1,
            live_allocations: 3,
            live_bytes: 72,
            h2d_bytes: 48,
            h2d_calls: 2,
            d2h_bytes: 32,
            d2h_calls: 2,
            launches: 3,
        }
    );
    for name in device.callables().to_vec() {
        let expected = match name.as_str() {
            "add" => 2,
            "silu_mul" => 1,
            _ => 0,
        };
        let index = device.callable_index(&name).unwrap();
        assert_eq!(device.callable_launches(index), expected, "{name}");
    }
    device.close();
}
