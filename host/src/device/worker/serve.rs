//! The device worker process's side: it opens the device library the host names and runs the host's requests on it, in order, until the host closes it or goes away.

use std::io::{self, BufReader, BufWriter, Read};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use plughost_device_abi::{CopyRange, TensorArg, status};

use super::protocol::{
    Op, PROGRESS_EVERY, RANGE_BYTES, ReplyCounters, ReplyHeader, RequestHeader, TENSOR_ARG_BYTES,
    decode_range, decode_tensor_arg,
};
use super::region::{REGION_BYTES, SharedRegion};
use crate::device::error::DeviceError;
use crate::device::handle::{BufferId, CallableIndex};
use crate::device::library::DeviceLibrary;
use crate::device::local::LocalDevice;

/// Why the worker stopped before the host closed it.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot reach the host at {}: {source}", socket.display())]
    Connect {
        socket: std::path::PathBuf,
        source: io::Error,
    },
    #[error("cannot map the shared region: {0}")]
    Region(io::Error),
    #[error("the host's connection failed: {0}")]
    Connection(#[from] io::Error),
    #[error("the host's first request was {0:?}, not open")]
    NotOpenedFirst(&'static str),
}

/// Serves the host at `socket` until it sends close or disconnects. A device fault that kills
/// this process (a crash, an abort) is what the host's supervisor is there for.
pub fn run_worker(socket: &Path, region: &Path) -> Result<(), WorkerError> {
    // A worker that outlives its host would hold the device; the kernel ends it with the host.
    // (Strictly, with the host thread that started it: the engine thread, which lives as long
    // as the engine.)
    if let Err(e) =
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
    {
        eprintln!("device worker: cannot tie its life to the host's: {e}");
    }
    let stream = UnixStream::connect(socket).map_err(|source| WorkerError::Connect {
        socket: socket.to_path_buf(),
        source,
    })?;
    let region = SharedRegion::open(region).map_err(WorkerError::Region)?;
    let mut session = Session {
        reader: BufReader::with_capacity(1 << 20, PollingStream(stream.try_clone()?)),
        writer: BufWriter::new(stream),
        region,
        device: None,
        copy_region: None,
        copy_ranges: Vec::new(),
        pending: None,
        payload: Vec::new(),
        args: Vec::new(),
        params: Vec::new(),
        callable_times: Vec::new(),
        launches: 0,
        last_reply: Instant::now(),
    };
    session.serve()
}

/// How long the worker keeps looking for the next request before it sleeps on the socket:
/// longer than the host's work between two decode steps, short enough that an idle server
/// soon stops spending a core on it.
const POLL_FOR: Duration = Duration::from_millis(1);

/// The control socket as the worker reads it: with nothing to read, the worker looks again
/// for [`POLL_FOR`], giving its core to any other thread between looks, and only then sleeps
/// in a blocking read. A write to a socket whose reader sleeps wakes the reader on the
/// writer's core, where it waited for the engine to block before it ran: a step's first
/// launches started some 100 µs after the engine sent them, and a lone SmolLM2 token at Q8_0
/// decoded up to 2.7% slower in a worker than in the server's process (docs/reliability.md).
/// Looking again keeps the worker on a core of its own between steps.
struct PollingStream(UnixStream);

impl Read for PollingStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let until = Instant::now() + POLL_FOR;
        loop {
            match rustix::net::recv(&self.0, &mut *buf, rustix::net::RecvFlags::DONTWAIT) {
                Ok((read, _)) => return Ok(read),
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= until {
                return self.0.read(buf);
            }
            std::thread::yield_now();
        }
    }
}

/// The first failure of a request without a reply, reported by the next one that has one.
struct Pending {
    op: Op,
    status: i32,
    message: String,
}

struct Session {
    reader: BufReader<PollingStream>,
    writer: BufWriter<UnixStream>,
    region: SharedRegion,
    device: Option<LocalDevice>,
    // After `device`, so dropped after it: closing the device waits for a copy out in flight,
    // which writes into this region.
    copy_region: Option<SharedRegion>,
    /// A copy out's ranges, decoded; reused.
    copy_ranges: Vec<CopyRange>,
    pending: Option<Pending>,
    /// Reused from request to request, so a launch allocates nothing once warm.
    payload: Vec<u8>,
    args: Vec<TensorArg>,
    params: Vec<i64>,
    callable_times: Vec<u64>,
    /// Launches completed, for the progress replies.
    launches: u64,
    /// When the host last heard from the worker.
    last_reply: Instant,
}

impl Session {
    fn serve(&mut self) -> Result<(), WorkerError> {
        loop {
            let header = match RequestHeader::read(&mut self.reader) {
                Ok(header) => header,
                // The host closed the connection: it is gone or done with us.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            self.payload.clear();
            (&mut self.reader)
                .take(header.payload_len)
                .read_to_end(&mut self.payload)?;
            if self.device.is_none() && header.op != Op::Open {
                return Err(WorkerError::NotOpenedFirst(header.op.name()));
            }
            match header.op {
                Op::Close => return Ok(()),
                Op::Open => self.open()?,
                Op::Launch | Op::Write | Op::WriteRanges => {
                    self.run_without_reply(&header);
                    if header.op == Op::Launch && self.last_reply.elapsed() >= PROGRESS_EVERY {
                        self.reply(status::OK, Op::Progress, self.launches, &[])?;
                    }
                }
                _ => self.run_with_reply(&header)?,
            }
        }
    }

    fn open(&mut self) -> Result<(), WorkerError> {
        let split = self
            .payload
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.payload.len());
        let library = String::from_utf8_lossy(&self.payload[..split]).into_owned();
        let config =
            String::from_utf8_lossy(self.payload.get(split + 1..).unwrap_or_default()).into_owned();
        let opened =
            DeviceLibrary::load(&library).and_then(|library| LocalDevice::open(&library, &config));
        match opened {
            Ok((device, names)) => {
                let names = names.join("\0");
                let copies_out = u64::from(device.copies_out_in_background());
                self.device = Some(device);
                self.reply(status::OK, Op::Open, copies_out, names.as_bytes())
            }
            // The host shows the message as the in-process open would have.
            Err(e) => {
                let status = error_status(&e);
                self.reply(status, Op::Open, 0, error_message(e).as_bytes())
            }
        }
    }

    /// Runs a launch or a write unless an earlier one failed since the last reply.
    fn run_without_reply(&mut self, header: &RequestHeader) {
        if self.pending.is_some() {
            return;
        }
        let Some(device) = self.device.as_mut() else {
            return;
        };
        let result = match header.op {
            Op::Write => match region_range(header.d, header.c) {
                Some(range) => device.write(
                    BufferId::from_raw(header.a),
                    header.b,
                    &self.region.bytes()[range],
                ),
                None => Err(out_of_region(header)),
            },
            Op::WriteRanges => copy_ranges(header, &self.payload, |range, (buffer, offset)| {
                device.write(
                    BufferId::from_raw(buffer),
                    offset,
                    &self.region.bytes()[range],
                )
            }),
            _ => {
                decode_launch(header, &self.payload, &mut self.args, &mut self.params);
                let launched = device.launch(
                    CallableIndex::from_raw(header.a as u32),
                    &self.args,
                    &self.params,
                );
                self.launches += u64::from(launched.is_ok());
                launched
            }
        };
        if let Err(e) = result {
            self.pending = Some(Pending {
                op: header.op,
                status: error_status(&e),
                message: error_message(e),
            });
        }
    }

    fn run_with_reply(&mut self, header: &RequestHeader) -> Result<(), WorkerError> {
        if let Some(pending) = self.pending.take() {
            return self.reply(pending.status, pending.op, 0, pending.message.as_bytes());
        }
        let Some(device) = self.device.as_mut() else {
            return Err(WorkerError::NotOpenedFirst(header.op.name()));
        };
        // The counters, for the replies that carry them; nothing on the heap.
        let mut counters = ReplyCounters::new();
        let times = &mut self.callable_times;
        let mut callable_times = |counters: &mut ReplyCounters, device: &LocalDevice| {
            let reported = device.callable_device_ns(times);
            counters.push_callable_times(reported.then_some(&times[..]));
        };
        let result = match header.op {
            Op::Alloc => device.alloc(header.a).map(BufferId::raw),
            Op::Free => device.free(BufferId::from_raw(header.a)).map(|()| 0),
            Op::Read => match region_range(0, header.c) {
                Some(range) => device
                    .read(
                        BufferId::from_raw(header.a),
                        header.b,
                        &mut self.region.bytes_mut()[range],
                    )
                    .and_then(|()| {
                        counters.push_stats(&device.stats()?);
                        Ok(0)
                    }),
                None => Err(out_of_region(header)),
            },
            Op::ReadRanges => {
                let region = &mut self.region;
                copy_ranges(header, &self.payload, |range, (buffer, offset)| {
                    device.read(
                        BufferId::from_raw(buffer),
                        offset,
                        &mut region.bytes_mut()[range],
                    )
                })
                .and_then(|()| {
                    counters.push_stats(&device.stats()?);
                    Ok(0)
                })
            }
            // The counters come with the answers that end a step, so reading them after it
            // costs no round trip.
            Op::Synchronize => device.synchronize().and_then(|t| {
                counters.push_stats(&device.stats()?);
                callable_times(&mut counters, device);
                Ok(t.as_nanos() as u64)
            }),
            Op::SynchronizeRead => match region_range(0, header.c) {
                Some(range) => device.synchronize().and_then(|t| {
                    device.read(
                        BufferId::from_raw(header.a),
                        header.b,
                        &mut self.region.bytes_mut()[range],
                    )?;
                    counters.push_stats(&device.stats()?);
                    callable_times(&mut counters, device);
                    Ok(t.as_nanos() as u64)
                }),
                None => Err(out_of_region(header)),
            },
            Op::Stats => device.stats().map(|stats| {
                counters.push_stats(&stats);
                0
            }),
            Op::CallableDeviceNs => {
                callable_times(&mut counters, device);
                Ok(0)
            }
            Op::CallableLaunches => {
                Ok(device.callable_launches(CallableIndex::from_raw(header.a as u32)))
            }
            Op::MapCopyRegion => map_copy_region(header, &self.payload, device).map(|region| {
                self.copy_region = Some(region);
                0
            }),
            Op::CopyOutStart => {
                self.copy_ranges.clear();
                self.copy_ranges.extend(
                    self.payload
                        .chunks_exact(RANGE_BYTES)
                        .take(header.count as usize)
                        .map(|bytes| {
                            let (buffer, offset, len) = decode_range(bytes);
                            CopyRange {
                                buffer,
                                offset,
                                len,
                            }
                        }),
                );
                let total: u64 = self
                    .copy_ranges
                    .iter()
                    .map(|r| r.len)
                    .fold(0, u64::saturating_add);
                match self.copy_region.as_mut() {
                    Some(region) if total <= region.bytes().len() as u64 => {
                        // SAFETY: the region holds `total` bytes and stays mapped until the
                        // device is dropped (it is dropped after it); the host reads it only
                        // after a poll reply reports the copy's end, and maps no new region
                        // while a copy is in flight (`map_copy_region` refuses then).
                        unsafe {
                            device.copy_out_start(
                                &self.copy_ranges,
                                region.as_mut_ptr(),
                                total as usize,
                            )
                        }
                        .map(|()| 0)
                    }
                    _ => Err(DeviceError::ContractViolation {
                        operation: "copy_out_start",
                        message: format!("{total} bytes do not fit the copy-out region"),
                    }),
                }
            }
            Op::CopyOutPoll => device.copy_out_poll(header.a != 0).map(u64::from),
            _ => Ok(0),
        };
        match result {
            Ok(value) => self.reply(status::OK, header.op, value, counters.as_bytes()),
            Err(e) => {
                let status = error_status(&e);
                self.reply(status, header.op, 0, error_message(e).as_bytes())
            }
        }
    }

    fn reply(
        &mut self,
        status: i32,
        op: Op,
        value: u64,
        payload: &[u8],
    ) -> Result<(), WorkerError> {
        let header = ReplyHeader {
            status,
            op,
            value,
            payload_len: payload.len() as u64,
        };
        header.write(&mut self.writer, payload)?;
        self.last_reply = Instant::now();
        Ok(())
    }
}

fn decode_launch(
    header: &RequestHeader,
    payload: &[u8],
    args: &mut Vec<TensorArg>,
    params: &mut Vec<i64>,
) {
    args.clear();
    params.clear();
    let args_bytes = (header.count as usize).saturating_mul(TENSOR_ARG_BYTES);
    let (arg_bytes, param_bytes) = payload.split_at(args_bytes.min(payload.len()));
    args.extend(
        arg_bytes
            .chunks_exact(TENSOR_ARG_BYTES)
            .map(decode_tensor_arg),
    );
    params.extend(
        param_bytes
            .chunks_exact(8)
            .take(header.b as usize)
            .map(|chunk| i64::from_le_bytes(chunk.try_into().unwrap_or_default())),
    );
}

/// Runs `copy` on each of the request's ranges with the part of the region that holds its
/// bytes: consecutive from `d` on (0 for a read, whose header leaves `d` at 0).
fn copy_ranges(
    header: &RequestHeader,
    payload: &[u8],
    mut copy: impl FnMut(std::ops::Range<usize>, (u64, u64)) -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    let mut at = header.d;
    for bytes in payload
        .chunks_exact(RANGE_BYTES)
        .take(header.count as usize)
    {
        let (buffer, offset, len) = decode_range(bytes);
        let range = region_range(at, len).ok_or_else(|| DeviceError::ContractViolation {
            operation: header.op.name(),
            message: format!(
                "{len} bytes at {at} do not fit the {REGION_BYTES}-byte shared region"
            ),
        })?;
        copy(range, (buffer, offset))?;
        at += len;
    }
    Ok(())
}

/// The copy-out region the host names, mapped; refused while a copy out is in flight, whose
/// bytes go to the region mapped now.
fn map_copy_region(
    header: &RequestHeader,
    payload: &[u8],
    device: &mut LocalDevice,
) -> Result<SharedRegion, DeviceError> {
    if device.copies_out_in_background() && !device.copy_out_poll(false)? {
        return Err(DeviceError::ContractViolation {
            operation: "map_copy_region",
            message: "a copy out is in flight".into(),
        });
    }
    let path = std::path::PathBuf::from(String::from_utf8_lossy(payload).into_owned());
    SharedRegion::open_sized(&path, header.a as usize).map_err(|e| DeviceError::ContractViolation {
        operation: "map_copy_region",
        message: format!("cannot map {}: {e}", path.display()),
    })
}

fn region_range(start: u64, len: u64) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(start).ok()?;
    let end = start.checked_add(usize::try_from(len).ok()?)?;
    (end <= REGION_BYTES).then_some(start..end)
}

fn out_of_region(header: &RequestHeader) -> DeviceError {
    DeviceError::ContractViolation {
        operation: header.op.name(),
        message: format!(
            "{} bytes at {} do not fit the {REGION_BYTES}-byte shared region",
            header.c, header.d
        ),
    }
}

fn error_status(error: &DeviceError) -> i32 {
    match error {
        DeviceError::Call { status, .. } => *status,
        _ => status::INTERNAL,
    }
}

/// The device's own message for a failed call, or the whole error for anything else.
fn error_message(error: DeviceError) -> String {
    match error {
        DeviceError::Call { message, .. } => message,
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    use super::{POLL_FOR, PollingStream};

    #[test]
    fn a_polling_read_gets_bytes_sent_while_it_looks_after_it_slept_and_the_end() {
        let (mut host, worker) = UnixStream::pair().unwrap();
        let mut worker = PollingStream(worker);
        let mut buf = [0u8; 16];
        // Already there.
        host.write_all(b"first").unwrap();
        assert_eq!(worker.read(&mut buf).unwrap(), 5);
        assert_eq!(&buf[..5], b"first");
        // Sent while the reader looks, then long after it went to sleep.
        for (delay, message) in [
            (POLL_FOR / 4, &b"soon"[..]),
            (POLL_FOR * 20, &b"much later"[..]),
        ] {
            let mut writer = host.try_clone().unwrap();
            let sent = std::thread::spawn(move || {
                std::thread::sleep(delay);
                writer.write_all(message).unwrap();
            });
            let read = worker.read(&mut buf).unwrap();
            assert_eq!(&buf[..read], message);
            sent.join().unwrap();
        }
        // The host hangs up: the end of the stream, after the last bytes.
        host.write_all(b"last").unwrap();
        drop(host);
        let read = worker.read(&mut buf).unwrap();
        assert_eq!(&buf[..read], b"last");
        assert_eq!(worker.read(&mut buf).unwrap(), 0);
    }
}
