//! End-to-end tests of the device C ABI: the host's loader and `Device` wrapper driving the mock device library.
//!
//! Needs `libplughost_device_mock.so` and `libplughost_device_wrong_abi.so` in the plugins
//! folder (`cargo xtask build-plugins`).

use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
use std::path::Path;
use std::time::{Duration, Instant};

use plughost::device::{
    ArgTag, BufferId, DType, Device, DeviceError, DeviceLibrary, DeviceStats, TensorArg, status,
    tensor_arg,
};
use plughost_device_abi::callables;

use crate::common;

fn library_file(crate_name: &str) -> String {
    format!("{DLL_PREFIX}{}{DLL_SUFFIX}", crate_name.replace('-', "_"))
}

fn mock_library() -> DeviceLibrary {
    let path = common::plugin_path(&library_file("plughost-device-mock"));
    DeviceLibrary::load(&path).unwrap_or_else(|error| panic!("{error}"))
}

fn open_mock(config: &str) -> Device {
    Device::open(&mock_library(), config).unwrap_or_else(|error| panic!("{error}"))
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

fn i32_bytes(values: &[i32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

fn upload(device: &mut Device, bytes: &[u8]) -> BufferId {
    let buffer = device.alloc(bytes.len() as u64).unwrap();
    device.write(buffer, 0, bytes).unwrap();
    buffer
}

fn upload_f32(device: &mut Device, values: &[f32]) -> BufferId {
    upload(device, &f32_bytes(values))
}

fn upload_i32(device: &mut Device, values: &[i32]) -> BufferId {
    upload(device, &i32_bytes(values))
}

fn download_f32(device: &mut Device, buffer: BufferId, count: usize) -> Vec<f32> {
    let mut bytes = vec![0; count * 4];
    device.read(buffer, 0, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|chunk| f32::from_le_bytes(chunk.try_into().unwrap()))
        .collect()
}

fn download_i32(device: &mut Device, buffer: BufferId, count: usize) -> Vec<i32> {
    let mut bytes = vec![0; count * 4];
    device.read(buffer, 0, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|chunk| i32::from_le_bytes(chunk.try_into().unwrap()))
        .collect()
}

fn arg(buffer: BufferId, dtype: DType, shape: &[u64], tag: ArgTag) -> TensorArg {
    tensor_arg(buffer, 0, dtype, shape, tag).unwrap()
}

fn launch(device: &mut Device, name: &str, args: &[TensorArg], params: &[i64]) {
    let callable = device.callable_index(name).unwrap();
    device
        .launch(callable, args, params)
        .unwrap_or_else(|error| panic!("{name}: {error}"));
}

/// The status and message of a device call that must fail.
fn expect_call_error(result: Result<(), DeviceError>) -> (i32, String) {
    match result {
        Err(DeviceError::Call {
            status, message, ..
        }) => (status, message),
        Err(other) => panic!("expected a device call error, got {other}"),
        Ok(()) => panic!("expected a device call error, got success"),
    }
}

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
fn write_then_read_returns_the_same_bytes() {
    struct Case {
        buffer_bytes: u64,
        offset: u64,
        payload: Vec<u8>,
    }
    let cases = [
        Case {
            buffer_bytes: 16,
            offset: 0,
            payload: (1..=16).collect(),
        },
        Case {
            buffer_bytes: 16,
            offset: 5,
            payload: vec![9, 8, 7],
        },
        Case {
            buffer_bytes: 1,
            offset: 0,
            payload: vec![42],
        },
        Case {
            buffer_bytes: 4096,
            offset: 4000,
            payload: (0..96).collect(),
        },
    ];
    let mut device = open_mock("");
    for case in cases {
        let buffer = device.alloc(case.buffer_bytes).unwrap();
        device.write(buffer, case.offset, &case.payload).unwrap();

        let mut same_range = vec![0; case.payload.len()];
        device.read(buffer, case.offset, &mut same_range).unwrap();
        assert_eq!(same_range, case.payload);

        // Everything outside the written range is still zero from alloc.
        let mut whole = vec![0xff; case.buffer_bytes as usize];
        device.read(buffer, 0, &mut whole).unwrap();
        let mut expected = vec![0; case.buffer_bytes as usize];
        let start = case.offset as usize;
        expected[start..start + case.payload.len()].copy_from_slice(&case.payload);
        assert_eq!(whole, expected);
    }
}

#[test]
fn out_of_range_copies_and_unknown_buffers_are_refused() {
    let mut device = open_mock("");
    let buffer = device.alloc(8).unwrap();
    let (code, message) = expect_call_error(device.write(buffer, 4, &[0; 5]));
    assert_eq!(code, status::OUT_OF_BOUNDS);
    assert!(
        message.contains("bytes 4..9 do not fit in buffer"),
        "{message}"
    );

    let (code, message) = expect_call_error(device.read(buffer, u64::MAX, &mut [0; 2]));
    assert_eq!(code, status::OUT_OF_BOUNDS, "{message}");

    device.free(buffer).unwrap();
    let (code, message) = expect_call_error(device.free(buffer));
    assert_eq!(code, status::UNKNOWN_BUFFER);
    assert!(
        message.contains(&format!("unknown buffer {}", buffer.raw())),
        "{message}"
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

#[test]
fn memory_limit_gives_out_of_memory() {
    let mut device = open_mock("memory_bytes=64");
    let first = device.alloc(48).unwrap();
    let error = device.alloc(32).unwrap_err();
    assert_eq!(error.status(), Some(status::OUT_OF_MEMORY));
    assert!(
        error.to_string().contains("only 16 of 64 bytes are free"),
        "{error}"
    );
    device.free(first).unwrap();
    device.alloc(32).unwrap();
}

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
    let mut device = open_mock("hang_launch=1,hang_ms=150");
    let x = upload_f32(&mut device, &[0.0, 0.0]);
    let y = upload_f32(&mut device, &[1.0, 2.0]);

    let started = Instant::now();
    add_once(&mut device, x, y).unwrap();
    assert!(started.elapsed() >= Duration::from_millis(150));
    assert!(device.synchronize().unwrap() >= Duration::from_millis(150));

    add_once(&mut device, x, y).unwrap();
    // Device time is reported once, then starts again from zero.
    assert!(device.synchronize().unwrap() < Duration::from_millis(150));
    assert_eq!(download_f32(&mut device, x, 2), [2.0, 4.0]);
}

#[test]
fn device_maintained_step_inputs_have_the_real_values() {
    struct Case {
        description: &'static str,
        seq_lens_before: Vec<i32>,
        query_start: Vec<i32>,
        num_tokens: usize,
        block_table: Vec<i32>,
        blocks_per_seq: usize,
        block_size: i64,
        seq_lens_after: Vec<i32>,
        positions: Vec<i32>,
        slot_mapping: Vec<i32>,
    }
    let cases = [
        Case {
            description: "a 2-token prefill chunk, a decode and a padding row",
            seq_lens_before: vec![3, 5],
            query_start: vec![0, 2, 3],
            num_tokens: 4,
            block_table: vec![7, 2, 1, 9],
            blocks_per_seq: 2,
            block_size: 4,
            seq_lens_after: vec![5, 6],
            positions: vec![3, 4, 5, 0],
            slot_mapping: vec![7 * 4 + 3, 2 * 4, 9 * 4 + 1, -1],
        },
        Case {
            description: "two decodes, one crossing into a new block",
            seq_lens_before: vec![1, 8],
            query_start: vec![0, 1, 2],
            num_tokens: 2,
            block_table: vec![0, 3, 0, 5, 6, 4],
            blocks_per_seq: 3,
            block_size: 4,
            seq_lens_after: vec![2, 9],
            positions: vec![1, 8],
            slot_mapping: vec![1, 4 * 4],
        },
    ];
    for case in cases {
        let mut device = open_mock("");
        let num_seqs = case.seq_lens_before.len() as u64;
        let num_tokens = case.num_tokens as u64;
        let seq_lens = upload_i32(&mut device, &case.seq_lens_before);
        let query_start = upload_i32(&mut device, &case.query_start);
        let block_table = upload_i32(&mut device, &case.block_table);
        let positions = device.alloc(num_tokens * 4).unwrap();
        let slot_mapping = device.alloc(num_tokens * 4).unwrap();
        let query_start_arg = arg(query_start, DType::I32, &[num_seqs + 1], ArgTag::Input);
        let block_table_arg = arg(
            block_table,
            DType::I32,
            &[num_seqs, case.blocks_per_seq as u64],
            ArgTag::Input,
        );

        launch(
            &mut device,
            "advance_seq_lens",
            &[
                arg(seq_lens, DType::I32, &[num_seqs], ArgTag::Inout),
                query_start_arg,
            ],
            &[],
        );
        let seq_lens_arg = arg(seq_lens, DType::I32, &[num_seqs], ArgTag::Input);
        launch(
            &mut device,
            "derive_positions",
            &[
                seq_lens_arg,
                query_start_arg,
                arg(positions, DType::I32, &[num_tokens], ArgTag::Output),
            ],
            &[],
        );
        launch(
            &mut device,
            "derive_slot_mapping",
            &[
                block_table_arg,
                seq_lens_arg,
                query_start_arg,
                arg(slot_mapping, DType::I32, &[num_tokens], ArgTag::Output),
            ],
            &[case.block_size],
        );

        let description = case.description;
        let seqs = num_seqs as usize;
        assert_eq!(
            download_i32(&mut device, seq_lens, seqs),
            case.seq_lens_after,
            "{description}"
        );
        assert_eq!(
            download_i32(&mut device, positions, case.num_tokens),
            case.positions,
            "{description}"
        );
        assert_eq!(
            download_i32(&mut device, slot_mapping, case.num_tokens),
            case.slot_mapping,
            "{description}"
        );
    }
}

#[test]
fn kv_write_rounds_into_a_bf16_cache_and_mixed_caches_are_refused() {
    use ArgTag::{Input, Output, OutputExisting};
    let mut device = open_mock("");
    // Two blocks of one KV head of 2 slots of width 4; the row goes to slot 3.
    let row = [1.0f32, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.5];
    let k = upload_f32(&mut device, &row);
    let v = upload_f32(&mut device, &row.map(|x| -x));
    let cache_bytes = 2 * 2 * 4 * 2;
    let key_cache = upload(&mut device, &vec![0; cache_bytes]);
    let value_cache = upload(&mut device, &vec![0; cache_bytes]);
    let slots = upload_i32(&mut device, &[3]);
    let cache_shape = [2, 1, 2, 4];
    // The launch's arguments with `value_cache` as given.
    let kv_write_args = |value_cache: TensorArg| {
        [
            arg(k, DType::F32, &[1, 4], Input),
            arg(v, DType::F32, &[1, 4], Input),
            arg(key_cache, DType::BF16, &cache_shape, OutputExisting),
            value_cache,
            arg(slots, DType::I32, &[1], Input),
        ]
    };
    let bf16_values = arg(value_cache, DType::BF16, &cache_shape, OutputExisting);
    launch(&mut device, "kv_write", &kv_write_args(bf16_values), &[]);
    let mut bytes = vec![0; cache_bytes];
    device.read(key_cache, 0, &mut bytes).unwrap();
    let bits: Vec<u16> = bytes
        .chunks_exact(2)
        .map(|pair| u16::from_le_bytes([pair[0], pair[1]]))
        .collect();
    // 1 + 2^-8 and 1 + 3 * 2^-8 lie halfway between bf16 values: ties go to the even one.
    assert_eq!(&bits[12..], &[0x3f80, 0x3f80, 0x3f82, 0xc020]);
    assert!(bits[..12].iter().all(|&b| b == 0), "{bits:?}");
    // A mixed pair of caches is refused before the device runs anything.
    let f32_cache = upload(&mut device, &vec![0; 2 * cache_bytes]);
    let callable = device.callable_index("kv_write").unwrap();
    let f32_values = arg(f32_cache, DType::F32, &cache_shape, Output);
    let (_, message) = expect_call_error(device.launch(callable, &kv_write_args(f32_values), &[]));
    assert!(message.contains("must have the same dtype"), "{message}");
}

#[test]
fn a_short_block_table_fails_the_slot_mapping() {
    let mut device = open_mock("");
    let seq_lens = upload_i32(&mut device, &[9]);
    let query_start = upload_i32(&mut device, &[0, 1]);
    let block_table = upload_i32(&mut device, &[3, 4]);
    let slot_mapping = device.alloc(4).unwrap();
    let callable = device.callable_index("derive_slot_mapping").unwrap();
    let (code, message) = expect_call_error(device.launch(
        callable,
        &[
            arg(block_table, DType::I32, &[1, 2], ArgTag::Input),
            arg(seq_lens, DType::I32, &[1], ArgTag::Input),
            arg(query_start, DType::I32, &[2], ArgTag::Input),
            arg(slot_mapping, DType::I32, &[1], ArgTag::Output),
        ],
        &[4],
    ));
    assert_eq!(code, status::LAUNCH_FAILED);
    assert_eq!(
        message,
        "launch `derive_slot_mapping`: sequence 0: position 8 needs block 2, \
         but the block table has 2 columns"
    );
}

/// The buffers of one tiny decoder step: T=3 tokens in S=2 sequences, hidden 8, vocab 10,
/// 2 query heads and 1 KV head of dim 4, 4 blocks of 4 slots, MLP width 6.
fn run_decoder_step(device: &mut Device) -> Vec<u8> {
    const T: u64 = 3;
    const S: u64 = 2;
    const H: u64 = 8;
    const V: u64 = 10;
    const HQ: u64 = 2;
    const HK: u64 = 1;
    const D: u64 = 4;
    const B: u64 = 4;
    const BS: u64 = 4;
    const M: u64 = 2;
    const I: u64 = 6;
    const E: u64 = 2;
    let eps = i64::from(1e-6f32.to_bits());
    let theta = i64::from(10000f32.to_bits());
    let scale = i64::from(0.5f32.to_bits());

    let ramp = |count: u64, step: f32| -> Vec<f32> {
        (0..count).map(|i| (i as f32 * step).sin()).collect()
    };
    // Weights in every precision a weight may have: bf16 embedding, f16 norm, f32 projections.
    let bf16_of = |values: &[f32]| -> Vec<u8> {
        values
            .iter()
            .flat_map(|value| ((value.to_bits() >> 16) as u16).to_le_bytes())
            .collect()
    };
    let f16_one = 0x3c00u16.to_le_bytes();

    let embedding = upload(device, &bf16_of(&ramp(V * H, 0.3)));
    let norm_weight = upload(device, &f16_one.repeat(H as usize));
    let head_norm_weight = upload_f32(device, &[1.0; D as usize]);
    let wq = upload_f32(device, &ramp(HQ * D * H, 0.7));
    let wk = upload_f32(device, &ramp(HK * D * H, 1.1));
    let wv = upload_f32(device, &ramp(HK * D * H, 1.3));
    let wo = upload_f32(device, &ramp(H * HQ * D, 0.9));
    let w_gate = upload_f32(device, &ramp(I * H, 0.5));
    let w_up = upload_f32(device, &ramp(I * H, 0.6));
    let w_down = upload_f32(device, &ramp(H * I, 0.4));

    let ids = upload_i32(device, &[4, 7, 2]);
    let seq_lens = upload_i32(device, &[3, 5]);
    let query_start = upload_i32(device, &[0, 2, 3]);
    let block_table = upload_i32(device, &[0, 1, 2, 3]);
    let emitting_rows = upload_i32(device, &[1, 2]);
    let positions = device.alloc(T * 4).unwrap();
    let slot_mapping = device.alloc(T * 4).unwrap();

    let mut scratch = |elements: u64| device.alloc(elements * 4).unwrap();
    let hidden = scratch(T * H);
    let normed = scratch(T * H);
    let q = scratch(T * HQ * D);
    let k = scratch(T * HK * D);
    let v = scratch(T * HK * D);
    let key_cache = scratch(B * BS * HK * D);
    let value_cache = scratch(B * BS * HK * D);
    let attention = scratch(T * HQ * D);
    let projected = scratch(T * H);
    let gate = scratch(T * I);
    let up = scratch(T * I);
    let activated = scratch(T * I);
    let emitted = scratch(E * H);
    let logits = scratch(E * V);

    use ArgTag::{Inout, Input, Output, OutputExisting};
    use DType::{BF16, F16, F32, I32};
    let cache_shape = [B, HK, BS, D];
    let step_layout = [
        arg(block_table, I32, &[S, M], Input),
        arg(seq_lens, I32, &[S], Input),
        arg(query_start, I32, &[S + 1], Input),
    ];
    let program: Vec<(&str, Vec<TensorArg>, Vec<i64>)> = vec![
        (
            "advance_seq_lens",
            vec![
                arg(seq_lens, I32, &[S], Inout),
                arg(query_start, I32, &[S + 1], Input),
            ],
            vec![],
        ),
        (
            "derive_positions",
            vec![
                step_layout[1],
                step_layout[2],
                arg(positions, I32, &[T], Output),
            ],
            vec![],
        ),
        (
            "derive_slot_mapping",
            vec![
                step_layout[0],
                step_layout[1],
                step_layout[2],
                arg(slot_mapping, I32, &[T], Output),
            ],
            vec![BS as i64],
        ),
        (
            "embedding_gather",
            vec![
                arg(ids, I32, &[T], Input),
                arg(embedding, BF16, &[V, H], Input),
                arg(hidden, F32, &[T, H], Output),
            ],
            vec![],
        ),
        (
            "rms_norm",
            vec![
                arg(hidden, F32, &[T, H], Input),
                arg(norm_weight, F16, &[H], Input),
                arg(normed, F32, &[T, H], Output),
            ],
            vec![eps],
        ),
        (
            "linear",
            vec![
                arg(normed, F32, &[T, H], Input),
                arg(wq, F32, &[HQ * D, H], Input),
                arg(q, F32, &[T, HQ * D], Output),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(normed, F32, &[T, H], Input),
                arg(wk, F32, &[HK * D, H], Input),
                arg(k, F32, &[T, HK * D], Output),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(normed, F32, &[T, H], Input),
                arg(wv, F32, &[HK * D, H], Input),
                arg(v, F32, &[T, HK * D], Output),
            ],
            vec![],
        ),
        (
            "rms_norm_heads",
            vec![
                arg(q, F32, &[T, HQ * D], Inout),
                arg(head_norm_weight, F32, &[D], Input),
            ],
            vec![eps, D as i64],
        ),
        (
            "rotary",
            vec![
                arg(q, F32, &[T, HQ * D], Inout),
                arg(k, F32, &[T, HK * D], Inout),
                arg(positions, I32, &[T], Input),
            ],
            vec![D as i64, theta],
        ),
        (
            "kv_write",
            vec![
                arg(k, F32, &[T, HK * D], Input),
                arg(v, F32, &[T, HK * D], Input),
                arg(key_cache, F32, &cache_shape, OutputExisting),
                arg(value_cache, F32, &cache_shape, OutputExisting),
                arg(slot_mapping, I32, &[T], Input),
            ],
            vec![],
        ),
        (
            "paged_attention",
            vec![
                arg(q, F32, &[T, HQ * D], Input),
                arg(key_cache, F32, &cache_shape, Input),
                arg(value_cache, F32, &cache_shape, Input),
                step_layout[0],
                step_layout[1],
                step_layout[2],
                arg(attention, F32, &[T, HQ * D], Output),
            ],
            vec![HQ as i64, HK as i64, D as i64, BS as i64, scale],
        ),
        (
            "linear",
            vec![
                arg(attention, F32, &[T, HQ * D], Input),
                arg(wo, F32, &[H, HQ * D], Input),
                arg(projected, F32, &[T, H], Output),
            ],
            vec![],
        ),
        (
            "add",
            vec![
                arg(hidden, F32, &[T, H], Inout),
                arg(projected, F32, &[T, H], Input),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(hidden, F32, &[T, H], Input),
                arg(w_gate, F32, &[I, H], Input),
                arg(gate, F32, &[T, I], Output),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(hidden, F32, &[T, H], Input),
                arg(w_up, F32, &[I, H], Input),
                arg(up, F32, &[T, I], Output),
            ],
            vec![],
        ),
        (
            "silu_mul",
            vec![
                arg(gate, F32, &[T, I], Input),
                arg(up, F32, &[T, I], Input),
                arg(activated, F32, &[T, I], Output),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(activated, F32, &[T, I], Input),
                arg(w_down, F32, &[H, I], Input),
                arg(projected, F32, &[T, H], Output),
            ],
            vec![],
        ),
        (
            "add",
            vec![
                arg(hidden, F32, &[T, H], Inout),
                arg(projected, F32, &[T, H], Input),
            ],
            vec![],
        ),
        (
            "gather_rows",
            vec![
                arg(hidden, F32, &[T, H], Input),
                arg(emitting_rows, I32, &[E], Input),
                arg(emitted, F32, &[E, H], Output),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(emitted, F32, &[E, H], Input),
                arg(embedding, BF16, &[V, H], Input),
                arg(logits, F32, &[E, V], Output),
            ],
            vec![],
        ),
    ];
    for (name, args, params) in &program {
        launch(device, name, args, params);
    }
    device.synchronize().unwrap();

    let mut logits_bytes = vec![0; (E * V * 4) as usize];
    device.read(logits, 0, &mut logits_bytes).unwrap();
    logits_bytes
}

/// Runs each fused callable and the sequence of callables it replaces on the same inputs;
/// returns (fused, sequence) outputs: q, k, v, the gated activation, the residual and the norm.
fn run_fused_and_sequences(device: &mut Device) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    use ArgTag::{Inout, Input, Output};
    use DType::{BF16, F32};
    const T: u64 = 3;
    const K: u64 = 8;
    const Q: u64 = 6;
    const R: u64 = 4;
    const I: u64 = 5;
    let ramp = |count: u64, step: f32| -> Vec<f32> {
        (0..count).map(|i| (i as f32 * step).cos()).collect()
    };
    let bf16_of = |values: &[f32]| -> Vec<u8> {
        values
            .iter()
            .flat_map(|value| ((value.to_bits() >> 16) as u16).to_le_bytes())
            .collect()
    };
    let x = upload_f32(device, &ramp(T * K, 0.3));
    let [wq, wk, wv, w_gate, w_up] = [(Q, 0.7), (R, 1.1), (R, 1.3), (I, 0.5), (I, 0.6)]
        .map(|(rows, step)| upload(device, &bf16_of(&ramp(rows * K, step))));
    let norm_weight = upload_f32(device, &ramp(K, 0.2));
    let eps = i64::from(1e-6f32.to_bits());
    let mut scratch = |elements: u64| device.alloc(elements * 4).unwrap();
    let [q1, q2] = [scratch(T * Q), scratch(T * Q)];
    let [k1, k2, v1, v2] = [0; 4].map(|_| scratch(T * R));
    let [act1, act2, gate, up] = [0; 4].map(|_| scratch(T * I));
    let [out1, out2] = [scratch(T * K), scratch(T * K)];
    let residual = ramp(T * K, 0.9);
    let [res1, res2] = [0; 2].map(|_| upload_f32(device, &residual));

    launch(
        device,
        "qkv_linear",
        &[
            arg(x, F32, &[T, K], Input),
            arg(wq, BF16, &[Q, K], Input),
            arg(wk, BF16, &[R, K], Input),
            arg(wv, BF16, &[R, K], Input),
            arg(q1, F32, &[T, Q], Output),
            arg(k1, F32, &[T, R], Output),
            arg(v1, F32, &[T, R], Output),
        ],
        &[],
    );
    for (w, out, n) in [(wq, q2, Q), (wk, k2, R), (wv, v2, R)] {
        let args = [
            arg(x, F32, &[T, K], Input),
            arg(w, BF16, &[n, K], Input),
            arg(out, F32, &[T, n], Output),
        ];
        launch(device, "linear", &args, &[]);
    }
    launch(
        device,
        "silu_gate_linear",
        &[
            arg(x, F32, &[T, K], Input),
            arg(w_gate, BF16, &[I, K], Input),
            arg(w_up, BF16, &[I, K], Input),
            arg(act1, F32, &[T, I], Output),
        ],
        &[],
    );
    for (w, out) in [(w_gate, gate), (w_up, up)] {
        let args = [
            arg(x, F32, &[T, K], Input),
            arg(w, BF16, &[I, K], Input),
            arg(out, F32, &[T, I], Output),
        ];
        launch(device, "linear", &args, &[]);
    }
    let silu_args = [
        arg(gate, F32, &[T, I], Input),
        arg(up, F32, &[T, I], Input),
        arg(act2, F32, &[T, I], Output),
    ];
    launch(device, "silu_mul", &silu_args, &[]);
    launch(
        device,
        "add_rms_norm",
        &[
            arg(res1, F32, &[T, K], Inout),
            arg(x, F32, &[T, K], Input),
            arg(norm_weight, F32, &[K], Input),
            arg(out1, F32, &[T, K], Output),
        ],
        &[eps],
    );
    let add_args = [arg(res2, F32, &[T, K], Inout), arg(x, F32, &[T, K], Input)];
    launch(device, "add", &add_args, &[]);
    let norm_args = [
        arg(res2, F32, &[T, K], Input),
        arg(norm_weight, F32, &[K], Input),
        arg(out2, F32, &[T, K], Output),
    ];
    launch(device, "rms_norm", &norm_args, &[eps]);
    device.synchronize().unwrap();

    let mut read = |buffers: [(BufferId, u64); 6]| {
        buffers
            .map(|(b, n)| download_f32(device, b, n as usize))
            .to_vec()
    };
    let fused = read([
        (q1, T * Q),
        (k1, T * R),
        (v1, T * R),
        (act1, T * I),
        (res1, T * K),
        (out1, T * K),
    ]);
    let sequences = read([
        (q2, T * Q),
        (k2, T * R),
        (v2, T * R),
        (act2, T * I),
        (res2, T * K),
        (out2, T * K),
    ]);
    (fused, sequences)
}

#[test]
fn fused_callables_equal_the_sequences_they_replace() {
    let (fused, sequences) = run_fused_and_sequences(&mut open_mock(""));
    assert_eq!(fused, sequences);
    // The inputs reached every output: no output is left as allocated.
    for values in &fused {
        assert!(values.iter().any(|v| *v != 0.0), "{values:?}");
        assert!(values.iter().all(|v| v.is_finite()), "{values:?}");
    }
}

#[test]
fn a_whole_decoder_step_runs_every_callable_deterministically() {
    let mut first_device = open_mock("");
    let first = run_decoder_step(&mut first_device);
    // The fused callables, which the step above does not use.
    run_fused_and_sequences(&mut first_device);
    let second = run_decoder_step(&mut open_mock(""));
    assert_eq!(first, second, "the mock device is not deterministic");
    let logits: Vec<f32> = first
        .chunks_exact(4)
        .map(|chunk| f32::from_le_bytes(chunk.try_into().unwrap()))
        .collect();
    assert!(logits.iter().all(|value| value.is_finite()), "{logits:?}");

    for name in first_device.callables().to_vec() {
        let index = first_device.callable_index(&name).unwrap();
        assert!(
            first_device.callable_launches(index) >= 1,
            "{name} never ran"
        );
    }
}

#[test]
fn bad_open_configs_are_refused_with_the_device_message() {
    let library = mock_library();
    let error = Device::open(&library, "fail_launch=soon").err().unwrap();
    assert_eq!(error.status(), Some(status::INVALID_ARGUMENT));
    assert_eq!(
        error.to_string(),
        "device open failed with INVALID_ARGUMENT: open: mock device option `fail_launch` \
         must be a non-negative integer, got `soon`"
    );
    let error = Device::open(&library, "hang_ms=1\0").err().unwrap();
    assert!(
        matches!(error, DeviceError::ConfigHasNul { position: 9 }),
        "{error}"
    );
}

#[test]
fn a_library_with_another_abi_version_is_refused() {
    let path = common::plugin_path(&library_file("plughost-device-wrong-abi"));
    let error = DeviceLibrary::load(&path).err().unwrap();
    assert!(
        matches!(
            error,
            DeviceError::AbiVersionMismatch {
                found: 999,
                expected: 1,
                ..
            }
        ),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("speaks device ABI 999; this host speaks 1"),
        "{message}"
    );
    assert!(
        message.contains(&library_file("plughost-device-wrong-abi")),
        "{message}"
    );
}

#[test]
fn a_missing_library_is_named_in_the_error() {
    let path = Path::new("/nonexistent/plughost/libplughost_device_nothing.so");
    let error = DeviceLibrary::load(path).err().unwrap();
    assert!(
        matches!(error, DeviceError::LibraryNotFound { .. }),
        "{error}"
    );
    assert_eq!(
        error.to_string(),
        "device library `/nonexistent/plughost/libplughost_device_nothing.so` does not exist"
    );
}
