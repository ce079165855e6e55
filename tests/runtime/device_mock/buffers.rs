//! Device memory: bytes written come back unchanged, copies out of range and unknown buffers are refused, and a memory limit gives out-of-memory.

use plughost::device::status;

use super::{expect_call_error, open_mock};

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
