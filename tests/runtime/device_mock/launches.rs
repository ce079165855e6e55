//! Launch checks: callables in ABI order, invalid launches named and refused before the device runs, and data errors found inside a launch.

use plughost::device::{ArgTag, DType, TensorArg, status, tensor_arg};
use plughost_device_abi::callables;

use super::{arg, download_f32, expect_call_error, open_mock, upload_f32, upload_i32};

#[test]
fn callables_are_listed_in_abi_order() {
    let device = open_mock("");
    let expected: Vec<&str> = callables::ALL.iter().map(|spec| spec.name).collect();
    assert_eq!(device.callables(), expected.as_slice());
    let index = device.callable_index("paged_attention").unwrap();
    assert_eq!(device.callable_name(index), Some("paged_attention"));
    let error = device.callable_index("flash_attention").unwrap_err();
    assert_eq!(
        error.to_string(),
        "the device has no callable `flash_attention`"
    );
}

#[test]
fn invalid_launches_name_the_problem_and_leave_the_device_working() {
    let mut device = open_mock("");
    // linear: x [T=2, K=3], w [N=4, K=3], out [T=2, N=4]
    let x = upload_f32(&mut device, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let w = upload_f32(&mut device, &[0.5; 12]);
    let out = device.alloc(2 * 4 * 4).unwrap();
    let valid = [
        arg(x, DType::F32, &[2, 3], ArgTag::Input),
        arg(w, DType::F32, &[4, 3], ArgTag::Input),
        arg(out, DType::F32, &[2, 4], ArgTag::Output),
    ];
    let linear = device.callable_index("linear").unwrap();

    struct Case {
        problem: &'static str,
        args: Vec<TensorArg>,
        params: Vec<i64>,
        status: i32,
        expected: &'static str,
    }
    let with_arg = |index: usize, replacement: TensorArg| {
        let mut args = valid.to_vec();
        args[index] = replacement;
        args
    };
    let cases = [
        Case {
            problem: "argument count",
            args: valid[..2].to_vec(),
            params: vec![],
            status: status::INVALID_ARGUMENT,
            expected: "launch `linear`: takes 3 tensor arguments (x, w, out), got 2",
        },
        Case {
            problem: "dtype",
            args: with_arg(1, arg(w, DType::I32, &[4, 3], ArgTag::Input)),
            params: vec![],
            status: status::INVALID_ARGUMENT,
            expected: "argument `w` (#1): dtype i32 is not allowed, expected one of f32, f16, bf16",
        },
        Case {
            problem: "shape",
            args: with_arg(2, arg(out, DType::F32, &[2, 5], ArgTag::Output)),
            params: vec![],
            status: status::INVALID_ARGUMENT,
            expected: "argument `out` (#2) dimension 1 is 5, but N = 4",
        },
        Case {
            problem: "rank",
            args: with_arg(0, arg(x, DType::F32, &[2, 3, 1], ArgTag::Input)),
            params: vec![],
            status: status::INVALID_ARGUMENT,
            expected: "argument `x` (#0): rank 3, expected 2 ([T, K])",
        },
        Case {
            problem: "tag",
            args: with_arg(2, arg(out, DType::F32, &[2, 4], ArgTag::Input)),
            params: vec![],
            status: status::INVALID_ARGUMENT,
            expected: "argument `out` (#2): tag INPUT does not match how the callable uses it",
        },
        Case {
            problem: "param count",
            args: valid.to_vec(),
            params: vec![7],
            status: status::INVALID_ARGUMENT,
            expected: "takes 0 integer params (none), got 1",
        },
        Case {
            problem: "range past the buffer end",
            args: with_arg(
                2,
                tensor_arg(out, 8, DType::F32, &[2, 4], ArgTag::Output).unwrap(),
            ),
            params: vec![],
            status: status::OUT_OF_BOUNDS,
            expected: "argument `out` (#2): bytes 8..40 do not fit in buffer",
        },
        Case {
            problem: "unknown buffer",
            args: with_arg(
                0,
                TensorArg {
                    buffer: 999,
                    ..valid[0]
                },
            ),
            params: vec![],
            status: status::UNKNOWN_BUFFER,
            expected: "argument `x` (#0): unknown buffer 999",
        },
    ];

    let mut successful_launches = 0;
    for case in &cases {
        let (code, message) = expect_call_error(device.launch(linear, &case.args, &case.params));
        assert_eq!(code, case.status, "{}: {message}", case.problem);
        assert!(
            message.contains(case.expected),
            "{}: `{message}` lacks `{}`",
            case.problem,
            case.expected
        );

        device.launch(linear, &valid, &[]).unwrap();
        successful_launches += 1;
    }
    assert_eq!(device.callable_launches(linear), successful_launches);
    assert_eq!(device.stats().unwrap().launches, successful_launches);

    // The documented stand-in: out[t,n] = x[t, n % K] * w[n, n % K] + mean(x[t,:]) + mean(w[n,:]).
    let expected = [
        1.0 * 0.5 + 2.0 + 0.5,
        2.0 * 0.5 + 2.0 + 0.5,
        3.0 * 0.5 + 2.0 + 0.5,
        1.0 * 0.5 + 2.0 + 0.5,
        4.0 * 0.5 + 5.0 + 0.5,
        5.0 * 0.5 + 5.0 + 0.5,
        6.0 * 0.5 + 5.0 + 0.5,
        4.0 * 0.5 + 5.0 + 0.5,
    ];
    assert_eq!(download_f32(&mut device, out, 8), expected);
}

#[test]
fn data_errors_inside_a_launch_are_reported() {
    let mut device = open_mock("");
    let ids = upload_i32(&mut device, &[1, 10]);
    let table = upload_f32(&mut device, &[0.0; 10 * 2]);
    let out = device.alloc(2 * 2 * 4).unwrap();
    let callable = device.callable_index("embedding_gather").unwrap();
    let (code, message) = expect_call_error(device.launch(
        callable,
        &[
            arg(ids, DType::I32, &[2], ArgTag::Input),
            arg(table, DType::F32, &[10, 2], ArgTag::Input),
            arg(out, DType::F32, &[2, 2], ArgTag::Output),
        ],
        &[],
    ));
    assert_eq!(code, status::LAUNCH_FAILED);
    assert_eq!(
        message,
        "launch `embedding_gather`: ids[1] = 10 is outside 0..10"
    );
}
