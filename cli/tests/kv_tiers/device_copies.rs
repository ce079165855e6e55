//! Batched range copies: the bytes `read_ranges` gathers are the bytes each range holds, and `write_ranges` scatters them back, on the mock and CPU devices in this process and in a worker process, including batches larger than the worker's shared region; a copy out in the background gathers the same bytes, and while it runs the device refuses to write its ranges or free their buffers; its bytes, shared with a reader, get no later copy until the reader lets go, and outlive the device.

use std::time::Duration;

use plughost::device::worker::WorkerCommand;
use plughost::device::{BufferId, BufferRange, Device, DeviceError, DeviceSource};

use super::serve_support::plugins_dir;

const MOCK: &str = "libplughost_device_mock.so";
const CPU: &str = "libplughost_device_cpu.so";

fn open(library: &str, in_worker: bool) -> Device {
    open_with(library, in_worker, "")
}

fn open_with(library: &str, in_worker: bool, config: &str) -> Device {
    let mut source = DeviceSource::in_process(plugins_dir().join(library), config);
    if in_worker {
        let command = WorkerCommand::new(env!("CARGO_BIN_EXE_plughost"), ["device-worker"]);
        source = source.in_worker(Some(command), Duration::from_secs(60));
    }
    source.open(0).unwrap_or_else(|e| panic!("{e}"))
}

/// A byte that differs from buffer to buffer and position to position.
fn pattern(buffer: usize, at: usize) -> u8 {
    (at.wrapping_mul(31) ^ (buffer * 77) ^ (at >> 11)) as u8
}

fn filled_buffers(device: &mut Device, sizes: &[usize]) -> Vec<BufferId> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let buffer = device.alloc(size as u64).unwrap();
            let bytes: Vec<u8> = (0..size).map(|at| pattern(i, at)).collect();
            device.write(buffer, 0, &bytes).unwrap();
            buffer
        })
        .collect()
}

/// `(buffer index, offset, len)` as ranges of `buffers`.
fn ranges_of(buffers: &[BufferId], spec: &[(usize, u64, u64)]) -> Vec<BufferRange> {
    spec.iter()
        .map(|&(buffer, offset, len)| BufferRange {
            buffer: buffers[buffer],
            offset,
            len,
        })
        .collect()
}

fn round_trip(library: &str, in_worker: bool, sizes: &[usize], spec: &[(usize, u64, u64)]) {
    let mut device = open(library, in_worker);
    let buffers = filled_buffers(&mut device, sizes);
    let ranges = ranges_of(&buffers, spec);
    let total = BufferRange::total_len(&ranges) as usize;
    let mut gathered = vec![0u8; total];
    device.read_ranges(&ranges, &mut gathered).unwrap();
    let mut at = 0;
    for (range, &(buffer, offset, len)) in ranges.iter().zip(spec) {
        let expected: Vec<u8> = (offset..offset + len)
            .map(|i| pattern(buffer, i as usize))
            .collect();
        assert!(
            gathered[at..at + range.len as usize] == expected[..],
            "range {range:?} (in worker: {in_worker})"
        );
        at += range.len as usize;
    }

    // Scatter the bytes back inverted, and read each range alone.
    let inverted: Vec<u8> = gathered.iter().map(|b| !b).collect();
    device.write_ranges(&ranges, &inverted).unwrap();
    let mut at = 0;
    for range in &ranges {
        let mut alone = vec![0u8; range.len as usize];
        device.read(range.buffer, range.offset, &mut alone).unwrap();
        assert!(
            alone[..] == inverted[at..at + alone.len()],
            "range {range:?} written back (in worker: {in_worker})"
        );
        at += alone.len();
    }
}

#[test]
fn blocks_gather_and_scatter_in_process_and_in_a_worker() {
    // Blocks of two "layers" in the `[B, ...]` layout: the same block offset in each buffer,
    // out of order, the way a block list arrives.
    let block = 4096u64;
    let ranges = [
        (0, 3 * block, block),
        (1, 3 * block, block),
        (0, 0, block),
        (1, 0, block),
        (0, 7 * block, block),
        (1, 7 * block, block),
    ];
    for library in [MOCK, CPU] {
        for in_worker in [false, true] {
            let sizes = [8 * block as usize, 8 * block as usize];
            round_trip(library, in_worker, &sizes, &ranges);
        }
    }
}

#[test]
fn a_batch_larger_than_the_shared_region_is_split() {
    // 3 × 30 MiB crosses the worker's 64 MiB region once, in the middle of a range.
    let size = 30 << 20;
    let ranges = [(0, 0, size), (1, 0, size), (2, 0, size)];
    round_trip(MOCK, true, &[size as usize; 3], &ranges);
}

#[test]
fn a_host_buffer_of_the_wrong_length_is_refused_before_copying() {
    for in_worker in [false, true] {
        let mut device = open(MOCK, in_worker);
        let buffer = device.alloc(64).unwrap();
        let ranges = [BufferRange {
            buffer,
            offset: 0,
            len: 32,
        }];
        let error = device.read_ranges(&ranges, &mut [0u8; 31]).unwrap_err();
        assert!(
            matches!(
                error,
                DeviceError::RangeLength {
                    ranges: 32,
                    host: 31,
                    ..
                }
            ),
            "{error}"
        );
        let error = device.write_ranges(&ranges, &[0u8; 33]).unwrap_err();
        assert!(
            matches!(
                error,
                DeviceError::RangeLength {
                    ranges: 32,
                    host: 33,
                    ..
                }
            ),
            "{error}"
        );
        // A range past the buffer's end is the device's refusal, as for a single read.
        let past = [BufferRange {
            buffer,
            offset: 48,
            len: 32,
        }];
        let error = device.read_ranges(&past, &mut [0u8; 32]).unwrap_err();
        assert!(matches!(error, DeviceError::Call { .. }), "{error}");
    }
}

#[test]
fn a_background_copy_out_gathers_what_read_ranges_gathers() {
    let block = 4096u64;
    let spec = [
        (0, 3 * block, block),
        (1, 3 * block, block),
        (0, 0, block),
        (1, 0, block),
    ];
    // The mock's copies wait 3 s on its copy thread, so they are still running when the
    // refusals below are tried; the CPU device's copy at once.
    for (library, config) in [(MOCK, "copy_ms=3000"), (CPU, "")] {
        for in_worker in [false, true] {
            let what = format!("{library} (in worker: {in_worker})");
            let mut device = open_with(library, in_worker, config);
            assert!(device.copies_out_in_background(), "{what}");
            let buffers = filled_buffers(&mut device, &[8 * block as usize; 3]);
            let ranges = ranges_of(&buffers, &spec);
            let mut expected = vec![0u8; 4 * block as usize];
            device.read_ranges(&ranges, &mut expected).unwrap();
            device.start_copy_out(&ranges).unwrap();
            assert!(device.copy_out_in_flight());
            assert!(device.start_copy_out(&ranges).is_err(), "one at a time");
            // Bytes outside the ranges, and buffers the copy does not read, stay the host's.
            device.write(buffers[0], block, &[7u8; 16]).unwrap();
            device.write(buffers[2], 0, &[7u8; 16]).unwrap();
            // A worker queues writes, so their refusal comes back with the next call that has
            // a reply: the first free, which is not run then; the second one is.
            let attempts = [
                device.write(buffers[0], 3 * block + 8, &[9u8; 16]),
                device.free(buffers[1]),
                device.free(buffers[1]),
            ];
            let copied = device.poll_copy_out(true).unwrap().map(<[u8]>::to_vec);
            assert!(!device.copy_out_in_flight());
            let refusals = attempts
                .iter()
                .filter(|attempt| {
                    attempt
                        .as_ref()
                        .is_err_and(|e| e.to_string().contains("being copied out"))
                })
                .count();
            assert!(
                library == CPU || refusals == if in_worker { 2 } else { 3 },
                "{what}: a write into a range being copied, or a free of its buffer, went \
                 through: {attempts:?}"
            );
            assert!(copied.as_deref() == Some(&expected[..]), "{what}");
            // Once it ended, the ranges are the host's again.
            device.write(buffers[0], 3 * block + 8, &[9u8; 16]).unwrap();
            device.free(buffers[1]).unwrap();
            assert_eq!(
                device.poll_copy_out(false).unwrap(),
                None,
                "nothing in flight"
            );
            // The bytes shared with a reader on another thread: no copy lands on them until
            // the reader lets go, and they outlive the device.
            let shared = device.copied_out_shared().expect("the copy ended");
            assert!(shared[..] == expected[..], "{what}");
            let ranges = ranges_of(&buffers, &[(0, 0, block), (2, 0, block)]);
            let refused = device
                .start_copy_out(&ranges)
                .expect_err("memory still read");
            assert!(
                refused.to_string().contains("still being read"),
                "{refused}"
            );
            let reader = std::thread::spawn(move || shared.to_vec());
            let read = reader.join().unwrap();
            assert!(
                read == expected,
                "{what}: the reader saw the first copy's bytes"
            );
            device.start_copy_out(&ranges).unwrap();
            assert!(device.poll_copy_out(true).unwrap().is_some(), "{what}");
            let kept = device.copied_out_shared().expect("the copy ended");
            drop(device);
            let second: Vec<u8> = (0..block as usize)
                .map(|at| pattern(0, at))
                .chain((0..block as usize).map(|at| if at < 16 { 7 } else { pattern(2, at) }))
                .collect();
            assert!(
                kept.to_vec() == second,
                "{what}: the bytes outlive the device"
            );
        }
    }
}
