//! The host's side of a device worker process: starting it, forwarding device calls over its socket and shared region, and turning its death or silence into [`DeviceError::WorkerLost`].

use std::ffi::OsString;
use std::io::{self, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use plughost_device_abi::{DeviceStats, TensorArg, status};

use super::protocol::{
    Op, RANGE_BYTES, REQUEST_HEADER_BYTES, ReplyHeader, RequestHeader, STATS_BYTES,
    TENSOR_ARG_BYTES, decode_callable_times, decode_stats, encode_range, encode_tensor_arg,
};
use super::region::{REGION_BYTES, SharedRegion};
use crate::device::error::DeviceError;
use crate::device::handle::BufferRange;

pub use plughost_device_abi::WORKER_RESTARTS_ENV;

/// The program that runs a device worker, and the arguments before `--socket` and `--region`.
#[derive(Clone, Debug)]
pub struct WorkerCommand {
    program: PathBuf,
    args: Vec<OsString>,
    arg0: Option<OsString>,
}

impl WorkerCommand {
    pub fn new(
        program: impl Into<PathBuf>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
    ) -> Self {
        WorkerCommand {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            arg0: None,
        }
    }

    /// This executable's `device-worker` subcommand: the `plughost` binary serves as its own
    /// worker. On Linux it is run as `/proc/self/exe`, the very file this process runs, so a
    /// binary replaced on disk while the server runs (an upgrade, a rebuild) is never mixed
    /// with the old one.
    pub fn this_executable() -> io::Result<WorkerCommand> {
        let running = Path::new("/proc/self/exe");
        let program = if running.exists() {
            running.to_path_buf()
        } else {
            std::env::current_exe()?
        };
        let mut command = WorkerCommand::new(program, ["device-worker"]);
        // What `ps` and `top` show, rather than `/proc/self/exe`.
        command.arg0 = Some("plughost-device-worker".into());
        Ok(command)
    }
}

/// Launch messages wait here until a call that needs an answer sends them all at once.
const BATCH_BYTES: usize = 1 << 20;

/// After a reply, the launches that go out as soon as they are queued: the worker wakes and
/// starts on them while the host queues the rest of the step.
const FIRST_SENT_LAUNCHES: usize = 8;

/// The part of the region that [`WorkerDevice::write`] fills before it waits for the worker.
/// Loading pushes every weight through it: a region page once touched stays resident in both
/// processes, so a window far smaller than the largest tensor keeps the load's footprint small,
/// at the cost of one round trip per window.
const WRITE_WINDOW: usize = 8 << 20;

/// How long a starting worker may take to connect and open its device.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A device library running in a child process.
pub struct WorkerDevice {
    child: Child,
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    region: SharedRegion,
    /// Where the next write's bytes go in the region; back to 0 after every reply.
    region_cursor: usize,
    batch: Vec<u8>,
    timeout: Duration,
    /// Why the worker is gone, once it is: every later call fails with it at once.
    lost: Option<String>,
    last_launch: Option<u32>,
    /// Launches queued since the last reply.
    launches_since_reply: usize,
    callable_names: Vec<String>,
    /// The counters the last `synchronize` or `read` brought, while nothing has been sent
    /// since: the engine reads them after every step.
    stats: Option<DeviceStats>,
    /// Each callable's device nanoseconds, as the last `synchronize` brought them.
    callable_times: Vec<u64>,
    /// Whether `callable_times` holds the device's report (`Some(false)`: the device does not
    /// report them), while nothing has been sent since that `synchronize`.
    callable_times_fresh: Option<bool>,
    /// The last reply's payload, reused from reply to reply.
    reply_body: Vec<u8>,
    /// A batched copy's ranges on the wire, reused from call to call.
    range_payload: Vec<u8>,
    /// Whether the worker's device copies out in the background (table revision 1.2).
    copies_out: bool,
    /// Where background copies out land, shared with the worker; made by the first one.
    /// Shared too with the host's readers of the last copy ([`WorkerDevice::copy_region`]).
    copy_region: Option<Arc<SharedRegion>>,
}

impl WorkerDevice {
    /// Starts a worker with `command`, has it open `library` with `config`, and returns it
    /// with the device's callable names. `restarts` is how many workers came before it.
    pub fn start(
        command: &WorkerCommand,
        library: &Path,
        config: &str,
        timeout: Duration,
        restarts: u32,
    ) -> Result<(WorkerDevice, Vec<String>), DeviceError> {
        let start_error = |message: String| DeviceError::WorkerStart { message };
        if !library.exists() {
            return Err(DeviceError::LibraryNotFound {
                path: library.to_path_buf(),
            });
        }
        if config.contains('\0') {
            return Err(DeviceError::ConfigHasNul {
                position: config.find('\0').unwrap_or_default(),
            });
        }
        let library = std::path::absolute(library).unwrap_or_else(|_| library.to_path_buf());
        let region = SharedRegion::create()
            .map_err(|e| start_error(format!("cannot create the shared region: {e}")))?;
        let socket_dir = SocketDir::create()
            .map_err(|e| start_error(format!("cannot create the socket directory: {e}")))?;
        let socket_path = socket_dir.path.join("control.sock");
        let listener = UnixListener::bind(&socket_path)
            .map_err(|e| start_error(format!("cannot listen on {}: {e}", socket_path.display())))?;
        let mut child = Command::new(&command.program);
        if let Some(arg0) = &command.arg0 {
            child.arg0(arg0);
        }
        let mut child = child
            .args(&command.args)
            .arg("--socket")
            .arg(&socket_path)
            .arg("--region")
            .arg(region.path_for_worker())
            .env(WORKER_RESTARTS_ENV, restarts.to_string())
            // Its own process group: a Ctrl-C in the terminal is the server's to handle (it
            // drains, then closes the worker), not a crash of the worker mid-drain.
            .process_group(0)
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| start_error(format!("cannot run {}: {e}", command.program.display())))?;
        let stream = match accept_worker(&listener, &mut child) {
            Ok(stream) => stream,
            Err(message) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(start_error(message));
            }
        };
        drop(socket_dir);
        let reader = stream
            .try_clone()
            .map_err(|e| start_error(format!("cannot share the worker's socket: {e}")))?;
        let mut worker = WorkerDevice {
            child,
            stream,
            reader: BufReader::with_capacity(1 << 16, reader),
            region,
            region_cursor: 0,
            batch: Vec::with_capacity(BATCH_BYTES),
            timeout: timeout.max(START_TIMEOUT),
            lost: None,
            last_launch: None,
            launches_since_reply: 0,
            callable_names: Vec::new(),
            stats: None,
            callable_times: Vec::new(),
            callable_times_fresh: None,
            reply_body: Vec::new(),
            range_payload: Vec::new(),
            copies_out: false,
            copy_region: None,
        };
        worker
            .set_timeouts()
            .map_err(|e| start_error(format!("cannot set the worker's timeouts: {e}")))?;
        let mut payload = library.as_os_str().as_encoded_bytes().to_vec();
        payload.push(0);
        payload.extend_from_slice(config.as_bytes());
        let mut header = RequestHeader::new(Op::Open);
        header.payload_len = payload.len() as u64;
        worker.copies_out = worker.request(header, &payload)? == 1;
        let names = std::mem::take(&mut worker.reply_body);
        worker.timeout = timeout;
        worker
            .set_timeouts()
            .map_err(|e| start_error(format!("cannot set the worker's timeouts: {e}")))?;
        let names: Vec<String> = if names.is_empty() {
            Vec::new()
        } else {
            String::from_utf8_lossy(&names)
                .split('\0')
                .map(str::to_string)
                .collect()
        };
        worker.callable_names = names.clone();
        Ok((worker, names))
    }

    pub fn alloc(&mut self, bytes: u64) -> Result<u64, DeviceError> {
        let mut header = RequestHeader::new(Op::Alloc);
        header.a = bytes;
        self.request(header, &[])
    }

    pub fn free(&mut self, buffer: u64) -> Result<(), DeviceError> {
        let mut header = RequestHeader::new(Op::Free);
        header.a = buffer;
        self.request(header, &[]).map(drop)
    }

    /// Copies `src` through the first [`WRITE_WINDOW`] bytes of the region, in pieces of
    /// that size; a write waits for an answer only when the window is full.
    pub fn write(&mut self, buffer: u64, offset: u64, src: &[u8]) -> Result<(), DeviceError> {
        self.check_lost()?;
        for (i, piece) in src.chunks(WRITE_WINDOW).enumerate() {
            if self.region_cursor + piece.len() > WRITE_WINDOW {
                self.request(RequestHeader::new(Op::Barrier), &[])?;
            }
            let at = self.region_cursor;
            self.region.bytes_mut()[at..at + piece.len()].copy_from_slice(piece);
            self.region_cursor += piece.len();
            let mut header = RequestHeader::new(Op::Write);
            header.a = buffer;
            header.b = offset + (i * WRITE_WINDOW) as u64;
            header.c = piece.len() as u64;
            header.d = at as u64;
            self.queue(header, &[])?;
        }
        Ok(())
    }

    pub fn read(&mut self, buffer: u64, offset: u64, dst: &mut [u8]) -> Result<(), DeviceError> {
        for (i, piece) in dst.chunks_mut(REGION_BYTES).enumerate() {
            let mut header = RequestHeader::new(Op::Read);
            header.a = buffer;
            header.b = offset + (i * REGION_BYTES) as u64;
            header.c = piece.len() as u64;
            self.request(header, &[])?;
            piece.copy_from_slice(&self.region.bytes()[..piece.len()]);
            self.stats = decode_stats(&self.reply_body);
        }
        Ok(())
    }

    /// Reads every range, in order, into `dst`: one request per region's worth of bytes.
    pub fn read_ranges(
        &mut self,
        ranges: &[BufferRange],
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        let mut payload = std::mem::take(&mut self.range_payload);
        let mut at = 0;
        let result = region_batches(ranges, &mut payload, |payload, count, bytes| {
            let mut header = RequestHeader::new(Op::ReadRanges);
            header.count = count;
            header.payload_len = payload.len() as u64;
            self.request(header, payload)?;
            dst[at..at + bytes].copy_from_slice(&self.region.bytes()[..bytes]);
            self.stats = decode_stats(&self.reply_body);
            at += bytes;
            Ok(())
        });
        self.range_payload = payload;
        result
    }

    /// Writes consecutive bytes of `src` into every range, in order; like [`Self::write`], it
    /// waits for an answer only when the region is full.
    pub fn write_ranges(&mut self, ranges: &[BufferRange], src: &[u8]) -> Result<(), DeviceError> {
        self.check_lost()?;
        let mut payload = std::mem::take(&mut self.range_payload);
        let mut at = 0;
        let result = region_batches(ranges, &mut payload, |payload, count, bytes| {
            if self.region_cursor + bytes > REGION_BYTES {
                self.request(RequestHeader::new(Op::Barrier), &[])?;
            }
            let cursor = self.region_cursor;
            self.region.bytes_mut()[cursor..cursor + bytes].copy_from_slice(&src[at..at + bytes]);
            self.region_cursor += bytes;
            at += bytes;
            let mut header = RequestHeader::new(Op::WriteRanges);
            header.count = count;
            header.d = cursor as u64;
            header.payload_len = payload.len() as u64;
            self.queue(header, payload)
        });
        self.range_payload = payload;
        result
    }

    pub fn copies_out_in_background(&self) -> bool {
        self.copies_out
    }

    /// Starts a background copy of `ranges` (`len` bytes together) into the copy-out region,
    /// mapping a larger region in the worker first when it needs one. The caller has seen the
    /// end of any earlier copy, so the worker writes no region the host replaces.
    pub fn copy_out_start(
        &mut self,
        ranges: &[BufferRange],
        len: usize,
    ) -> Result<(), DeviceError> {
        self.check_lost()?;
        self.reserve_copy_out(len)?;
        // The worker would write under a reader of the last copy's bytes.
        if self
            .copy_region
            .as_ref()
            .is_some_and(|r| Arc::strong_count(r) > 1)
        {
            return Err(DeviceError::copy_out_still_read());
        }
        let mut payload = std::mem::take(&mut self.range_payload);
        payload.clear();
        for range in ranges {
            encode_range(range.buffer.raw(), range.offset, range.len, &mut payload);
        }
        let mut header = RequestHeader::new(Op::CopyOutStart);
        header.count = u32::try_from(ranges.len()).map_err(|_| DeviceError::TooMany {
            what: "copy ranges",
            count: ranges.len(),
        })?;
        header.payload_len = payload.len() as u64;
        let started = self.request(header, &payload);
        self.range_payload = payload;
        started.map(drop)
    }

    /// Makes the copy-out region hold at least `len` bytes, mapped in the worker too. Called
    /// only while no copy out is in flight.
    pub fn reserve_copy_out(&mut self, len: usize) -> Result<(), DeviceError> {
        if self
            .copy_region
            .as_ref()
            .is_some_and(|r| r.bytes().len() >= len)
        {
            return Ok(());
        }
        // Whole MiBs, so blocks a little larger than before rarely need another region.
        let size = len.max(1).next_multiple_of(1 << 20);
        let region = SharedRegion::create_sized(size).map_err(|e| DeviceError::Call {
            operation: "map_copy_region",
            status: status::OUT_OF_MEMORY,
            message: format!("cannot create the copy-out region of {size} bytes: {e}"),
        })?;
        let path = region.path_for_worker();
        let mut header = RequestHeader::new(Op::MapCopyRegion);
        header.a = size as u64;
        let path = path.as_os_str().as_encoded_bytes();
        header.payload_len = path.len() as u64;
        self.request(header, path)?;
        // A reader of the old region keeps it mapped here; the worker writes only the new one.
        self.copy_region = Some(Arc::new(region));
        Ok(())
    }

    /// Whether the copy out in flight ended; with `wait`, the worker answers at its end.
    pub fn copy_out_poll(&mut self, wait: bool) -> Result<bool, DeviceError> {
        let mut header = RequestHeader::new(Op::CopyOutPoll);
        header.a = u64::from(wait);
        Ok(self.request(header, &[])? == 1)
    }

    /// The copy-out region, shared: its first bytes are the last copy's once a poll saw its end.
    pub(crate) fn copy_region(&self) -> Option<Arc<SharedRegion>> {
        self.copy_region.clone()
    }

    /// The first `len` bytes of the copy-out region: a copy's bytes once a poll saw its end.
    pub fn copied_out(&self, len: usize) -> &[u8] {
        self.copy_region
            .as_ref()
            .map_or(&[][..], |region| &region.bytes()[..len])
    }

    /// Queues the launch; its failure is reported by the next call that waits for an answer.
    pub fn launch(
        &mut self,
        callable: u32,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<(), DeviceError> {
        self.check_lost()?;
        let mut header = RequestHeader::new(Op::Launch);
        header.a = callable as u64;
        header.count = args.len() as u32;
        header.b = params.len() as u64;
        header.payload_len = (args.len() * TENSOR_ARG_BYTES + params.len() * 8) as u64;
        self.last_launch = Some(callable);
        self.stats = None;
        self.callable_times_fresh = None;
        if self.batch.len() + REQUEST_HEADER_BYTES + header.payload_len as usize > BATCH_BYTES {
            self.flush()?;
        }
        header.encode(&mut self.batch);
        for arg in args {
            encode_tensor_arg(arg, &mut self.batch);
        }
        for param in params {
            self.batch.extend_from_slice(&param.to_le_bytes());
        }
        self.launches_since_reply += 1;
        if self.launches_since_reply == FIRST_SENT_LAUNCHES {
            self.flush()?;
        }
        Ok(())
    }

    /// Sends the queued requests now (nothing, if none are queued); their failures come with
    /// the next reply.
    pub fn submit(&mut self) -> Result<(), DeviceError> {
        self.flush()
    }

    pub fn synchronize(&mut self) -> Result<Duration, DeviceError> {
        let device_ns = self.request(RequestHeader::new(Op::Synchronize), &[])?;
        self.keep_step_counters();
        Ok(Duration::from_nanos(device_ns))
    }

    /// The counters and callable times that the reply ending a step carries.
    fn keep_step_counters(&mut self) {
        self.stats = decode_stats(&self.reply_body);
        let times = self.reply_body.get(STATS_BYTES..).unwrap_or(&[]);
        self.callable_times_fresh = Some(decode_callable_times(times, &mut self.callable_times));
    }

    /// [`WorkerDevice::synchronize`], then [`WorkerDevice::read`] into `dst`: one round trip
    /// when `dst` fits the region, as the logits of a step do. Returns the device time and
    /// the time spent copying the bytes out of the region (or reading them, past the region).
    pub fn synchronize_read(
        &mut self,
        buffer: u64,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(Duration, Duration), DeviceError> {
        if dst.len() > REGION_BYTES {
            let device = self.synchronize()?;
            let read_started = Instant::now();
            self.read(buffer, offset, dst)?;
            return Ok((device, read_started.elapsed()));
        }
        let mut header = RequestHeader::new(Op::SynchronizeRead);
        header.a = buffer;
        header.b = offset;
        header.c = dst.len() as u64;
        let device_ns = self.request(header, &[])?;
        let copy_started = Instant::now();
        dst.copy_from_slice(&self.region.bytes()[..dst.len()]);
        let copy = copy_started.elapsed();
        self.keep_step_counters();
        Ok((Duration::from_nanos(device_ns), copy))
    }

    /// Each callable's device nanoseconds since open into `out`; false when the device does
    /// not report them. Free right after a `synchronize`, whose reply carries them.
    pub fn callable_device_ns(&mut self, out: &mut Vec<u64>) -> Result<bool, DeviceError> {
        let reported = match self.callable_times_fresh {
            Some(reported) => reported,
            None => {
                self.request(RequestHeader::new(Op::CallableDeviceNs), &[])?;
                decode_callable_times(&self.reply_body, &mut self.callable_times)
            }
        };
        out.clear();
        out.extend_from_slice(&self.callable_times);
        Ok(reported)
    }

    pub fn stats(&mut self) -> Result<DeviceStats, DeviceError> {
        if let Some(stats) = self.stats {
            return Ok(stats);
        }
        self.request(RequestHeader::new(Op::Stats), &[])?;
        decode_stats(&self.reply_body).ok_or_else(|| DeviceError::ContractViolation {
            operation: "stats",
            message: "the worker's stats were cut short".into(),
        })
    }

    pub fn callable_launches(&mut self, callable: u32) -> u64 {
        let mut header = RequestHeader::new(Op::CallableLaunches);
        header.a = callable as u64;
        self.request(header, &[]).unwrap_or(0)
    }

    fn check_lost(&self) -> Result<(), DeviceError> {
        match &self.lost {
            Some(cause) => Err(DeviceError::WorkerLost {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    fn queue(&mut self, header: RequestHeader, payload: &[u8]) -> Result<(), DeviceError> {
        self.stats = None;
        self.callable_times_fresh = None;
        if self.batch.len() + REQUEST_HEADER_BYTES + payload.len() > BATCH_BYTES {
            self.flush()?;
        }
        header.encode(&mut self.batch);
        self.batch.extend_from_slice(payload);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), DeviceError> {
        self.check_lost()?;
        let sent = self.stream.write_all(&self.batch);
        self.batch.clear();
        sent.map_err(|e| self.lose(Op::Launch, e))
    }

    /// Sends `header` (after every queued request) and waits for its reply, whose payload is
    /// left in `reply_body`. Returns the reply's value.
    fn request(&mut self, header: RequestHeader, payload: &[u8]) -> Result<u64, DeviceError> {
        self.check_lost()?;
        self.queue(header, payload)?;
        self.flush()?;
        self.region_cursor = 0;
        self.launches_since_reply = 0;
        // Each read waits at most the device timeout: progress replies, sent while launches
        // complete, restart that wait, so the timeout bounds a launch rather than a step.
        let reply = loop {
            let reply = ReplyHeader::read(&mut self.reader).map_err(|e| self.lose(header.op, e))?;
            if reply.op != Op::Progress {
                break reply;
            }
        };
        self.reply_body.clear();
        let read = (&mut self.reader)
            .take(reply.payload_len)
            .read_to_end(&mut self.reply_body);
        read.map_err(|e| self.lose(header.op, e))?;
        if reply.status != status::OK {
            return Err(DeviceError::Call {
                operation: reply.op.name(),
                status: reply.status,
                message: String::from_utf8_lossy(&self.reply_body).into_owned(),
            });
        }
        Ok(reply.value)
    }

    /// The worker stopped answering during `op`: ends it for good and says why.
    fn lose(&mut self, op: Op, error: io::Error) -> DeviceError {
        let timed_out = matches!(
            error.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        );
        let last = self
            .last_launch
            .and_then(|i| self.callable_names.get(i as usize))
            .map_or_else(|| "none".to_string(), |name| format!("`{name}`"));
        let cause = if timed_out {
            let _ = self.child.kill();
            let _ = self.child.wait();
            format!(
                "the device worker missed the {} s device timeout in {} (last launch: {last}); it was killed",
                self.timeout.as_secs_f64(),
                op.name()
            )
        } else {
            let status = wait_briefly(&mut self.child);
            format!(
                "the device worker {} during {} (last launch: {last})",
                describe_exit(status),
                op.name()
            )
        };
        tracing::error!(pid = self.child.id(), "{cause}");
        self.lost = Some(cause.clone());
        DeviceError::WorkerLost { cause }
    }

    fn set_timeouts(&self) -> io::Result<()> {
        self.stream.set_read_timeout(Some(self.timeout))?;
        self.stream.set_write_timeout(Some(self.timeout))
    }
}

impl Drop for WorkerDevice {
    fn drop(&mut self) {
        if self.lost.is_none() {
            self.batch.clear();
            let mut close = Vec::new();
            RequestHeader::new(Op::Close).encode(&mut close);
            let _ = self.stream.write_all(&close);
            if wait_briefly(&mut self.child).is_some() {
                return;
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Splits `ranges` into batches of at most a region's bytes (a longer range into pieces) and
/// calls `send` with each batch's ranges on the wire, their count and their bytes.
fn region_batches(
    ranges: &[BufferRange],
    payload: &mut Vec<u8>,
    mut send: impl FnMut(&[u8], u32, usize) -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    payload.clear();
    let (mut count, mut bytes) = (0u32, 0usize);
    for range in ranges {
        let mut done = 0u64;
        while done < range.len {
            if bytes == REGION_BYTES {
                send(payload, count, bytes)?;
                payload.clear();
                (count, bytes) = (0, 0);
            }
            let piece = (range.len - done).min((REGION_BYTES - bytes) as u64);
            encode_range(range.buffer.raw(), range.offset + done, piece, payload);
            done += piece;
            count += 1;
            bytes += piece as usize;
        }
    }
    if count > 0 {
        send(payload, count, bytes)?;
    }
    debug_assert_eq!(payload.len() % RANGE_BYTES, 0);
    Ok(())
}

/// Waits for the worker to connect, giving up when it exits first or takes too long.
fn accept_worker(listener: &UnixListener, child: &mut Child) -> Result<UnixStream, String> {
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("cannot wait for the worker: {e}"))?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream
                    .set_nonblocking(false)
                    .map_err(|e| format!("cannot use the worker's connection: {e}"))?;
                return Ok(stream);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("cannot accept the worker's connection: {e}")),
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "the device worker {} before it connected",
                describe_exit(Some(status))
            ));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the device worker did not connect within {} s",
                START_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The worker's exit status, if it ends within a moment; a socket closes as its process dies.
fn wait_briefly(child: &mut Child) -> Option<ExitStatus> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => return None,
        }
    }
}

fn describe_exit(status: Option<ExitStatus>) -> String {
    let Some(status) = status else {
        return "closed its connection".to_string();
    };
    if let Some(signal) = status.signal() {
        let name = match signal {
            4 => " (SIGILL)",
            6 => " (SIGABRT)",
            7 => " (SIGBUS)",
            8 => " (SIGFPE)",
            9 => " (SIGKILL)",
            11 => " (SIGSEGV)",
            15 => " (SIGTERM)",
            _ => "",
        };
        return format!("was killed by signal {signal}{name}");
    }
    match status.code() {
        Some(code) => format!("exited with code {code}"),
        None => "exited".to_string(),
    }
}

/// A private directory for the control socket, removed once the worker has connected.
struct SocketDir {
    path: PathBuf,
}

impl SocketDir {
    fn create() -> io::Result<SocketDir> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "plughost-device-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&path)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700))?;
        Ok(SocketDir { path })
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
