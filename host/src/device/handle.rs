//! One open device, wherever it runs: in this process, or in a worker process the host supervises. Typed buffer ids and callable indices; every failure a `DeviceError`.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use plughost_device_abi::{ArgTag, CopyRange, DType, DeviceStats, TensorArg};

use super::error::DeviceError;
use super::library::DeviceLibrary;
use super::local::LocalDevice;
use super::worker::{SharedRegion, WorkerCommand, WorkerDevice};

/// A device buffer; valid only on the device that allocated it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufferId(u64);

impl BufferId {
    /// The id the C ABI uses.
    pub fn raw(self) -> u64 {
        self.0
    }

    pub(super) fn from_raw(raw: u64) -> BufferId {
        BufferId(raw)
    }
}

/// One contiguous byte range of a device buffer, the unit of the batched copies
/// ([`Device::read_ranges`], [`Device::write_ranges`]): a KV block is one range per layer's key
/// and value cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferRange {
    pub buffer: BufferId,
    pub offset: u64,
    pub len: u64,
}

impl BufferRange {
    /// Bytes `ranges` cover together.
    pub fn total_len(ranges: &[BufferRange]) -> u64 {
        ranges.iter().map(|range| range.len).sum()
    }
}

/// A callable's position in the device's list; obtained from [`Device::callable_index`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallableIndex(u32);

impl CallableIndex {
    pub fn raw(self) -> u32 {
        self.0
    }

    pub(super) fn from_raw(raw: u32) -> CallableIndex {
        CallableIndex(raw)
    }
}

/// A tensor argument over `buffer`, starting `offset_bytes` into it.
pub fn tensor_arg(
    buffer: BufferId,
    offset_bytes: u64,
    dtype: DType,
    shape: &[u64],
    tag: ArgTag,
) -> Result<TensorArg, DeviceError> {
    Ok(TensorArg::new(
        buffer.raw(),
        offset_bytes,
        dtype,
        shape,
        tag,
    )?)
}

/// Where the device library runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DeviceIsolation {
    /// In the server's process: a device crash or hang ends the server.
    #[default]
    InProcess,
    /// In a child process the host supervises: a crash or hang costs a restart.
    Process,
}

/// Everything needed to open the deployment's device, again after a worker restart.
#[derive(Clone, Debug)]
pub struct DeviceSource {
    library: PathBuf,
    config: String,
    isolation: DeviceIsolation,
    worker: Option<WorkerCommand>,
    timeout: Duration,
}

impl DeviceSource {
    /// The device library at `library` opened with `config`, in this process.
    pub fn in_process(library: impl Into<PathBuf>, config: impl Into<String>) -> DeviceSource {
        DeviceSource {
            library: library.into(),
            config: config.into(),
            isolation: DeviceIsolation::InProcess,
            worker: None,
            timeout: Duration::from_secs(60),
        }
    }

    /// The same device in a worker process started by `command` (by default this executable's
    /// `device-worker` subcommand); a call unanswered for `timeout` means a hung device.
    pub fn in_worker(mut self, command: Option<WorkerCommand>, timeout: Duration) -> DeviceSource {
        self.isolation = DeviceIsolation::Process;
        self.worker = command;
        self.timeout = timeout;
        self
    }

    pub fn isolation(&self) -> DeviceIsolation {
        self.isolation
    }

    pub fn library(&self) -> &Path {
        &self.library
    }

    pub fn config(&self) -> &str {
        &self.config
    }

    /// Opens the device; `restarts` counts the workers started before this one.
    pub fn open(&self, restarts: u32) -> Result<Device, DeviceError> {
        match self.isolation {
            DeviceIsolation::InProcess => {
                let library = DeviceLibrary::load(&self.library)?;
                Device::open(&library, &self.config)
            }
            DeviceIsolation::Process => {
                let command = match &self.worker {
                    Some(command) => command.clone(),
                    None => {
                        WorkerCommand::this_executable().map_err(|e| DeviceError::WorkerStart {
                            message: format!(
                                "cannot find this executable to run the device worker: {e}"
                            ),
                        })?
                    }
                };
                let (worker, callable_names) = WorkerDevice::start(
                    &command,
                    &self.library,
                    &self.config,
                    self.timeout,
                    restarts,
                )?;
                Ok(Device {
                    backend: Backend::Worker(RefCell::new(Box::new(worker))),
                    callable_names: callable_names.into(),
                    launch_completed: None,
                    copy_out: Box::default(),
                })
            }
        }
    }
}

enum Backend {
    Local(LocalDevice),
    /// Behind a cell: asking a worker for its counters is a request on its socket.
    Worker(RefCell<Box<WorkerDevice>>),
}

/// One open device. Closed by [`Device::close`] or on drop, which frees all its buffers.
pub struct Device {
    backend: Backend,
    /// A boxed slice: `Device` travels inside failed preparations' errors, so it stays small.
    callable_names: Box<[String]>,
    /// Called after each launch an in-process device completes. Boxed to keep `Device`, which
    /// failed preparations hand back inside their errors, small.
    launch_completed: Option<Box<LaunchHook>>,
    // Declared after `backend`, so dropped after it: closing an in-process device waits for
    // a copy out in flight, which writes into this staging memory. Boxed, like the hook.
    copy_out: Box<CopyOut>,
}

/// The host side of a background copy out of an in-process device: the staging memory it lands
/// in and the ranges it names, both kept from copy to copy, so that once they have the size of
/// the largest copy a copy allocates nothing. (A worker's copies land in its shared memory.)
#[derive(Default)]
struct CopyOut {
    /// Shared with the [`CopiedOut`]s of the last copy; a copy starts only when none is left.
    staging: Arc<Vec<u8>>,
    /// Bytes of `staging` the copy in flight, or the last one, fills.
    len: usize,
    ranges: Vec<CopyRange>,
    in_flight: bool,
}

/// The bytes of a copy out that ended ([`Device::copied_out_shared`]): shared memory, not a
/// copy, readable on any thread even after the device is gone.
#[derive(Clone)]
pub struct CopiedOut {
    memory: CopyMemory,
    len: usize,
}

#[derive(Clone)]
enum CopyMemory {
    /// An in-process device's staging memory.
    Host(Arc<Vec<u8>>),
    /// A worker's copy-out region.
    Region(Arc<SharedRegion>),
}

impl CopiedOut {
    /// How many clones share the memory, this one included.
    #[cfg(test)]
    pub(crate) fn holders(&self) -> usize {
        match &self.memory {
            CopyMemory::Host(staging) => Arc::strong_count(staging),
            CopyMemory::Region(region) => Arc::strong_count(region),
        }
    }
}

/// Bytes in host memory, as an in-process device's copy leaves them.
impl From<Vec<u8>> for CopiedOut {
    fn from(bytes: Vec<u8>) -> CopiedOut {
        CopiedOut {
            len: bytes.len(),
            memory: CopyMemory::Host(Arc::new(bytes)),
        }
    }
}

impl std::ops::Deref for CopiedOut {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        let bytes = match &self.memory {
            CopyMemory::Host(staging) => staging.as_slice(),
            CopyMemory::Region(region) => region.bytes(),
        };
        &bytes[..self.len.min(bytes.len())]
    }
}

/// What [`Device::on_launch_completed`] calls.
pub type LaunchHook = Arc<dyn Fn() + Send + Sync>;

impl Device {
    /// Opens a device in this process with a config string whose format the device defines.
    pub fn open(library: &DeviceLibrary, config: &str) -> Result<Device, DeviceError> {
        let (local, callable_names) = LocalDevice::open(library, config)?;
        Ok(Device {
            backend: Backend::Local(local),
            callable_names: callable_names.into(),
            launch_completed: None,
            copy_out: Box::default(),
        })
    }

    /// Calls `hook` after every launch an in-process device completes. A launch is a call
    /// that returns when its work is done, so a watchdog stamped by the hook times launches,
    /// not whole steps: a long prefill that keeps launching is not a hang. A device in a
    /// worker process reports the same through its progress replies instead.
    pub fn on_launch_completed(&mut self, hook: LaunchHook) {
        self.launch_completed = Some(Box::new(hook));
    }

    /// Closes the device, freeing every buffer it holds.
    pub fn close(self) {
        // Drop does the work; this method makes the end of a device's life visible in code.
    }

    pub fn isolation(&self) -> DeviceIsolation {
        match self.backend {
            Backend::Local(_) => DeviceIsolation::InProcess,
            Backend::Worker(_) => DeviceIsolation::Process,
        }
    }

    pub fn alloc(&mut self, bytes: u64) -> Result<BufferId, DeviceError> {
        match &mut self.backend {
            Backend::Local(device) => device.alloc(bytes),
            Backend::Worker(worker) => worker.get_mut().alloc(bytes).map(BufferId),
        }
    }

    pub fn free(&mut self, buffer: BufferId) -> Result<(), DeviceError> {
        match &mut self.backend {
            Backend::Local(device) => device.free(buffer),
            Backend::Worker(worker) => worker.get_mut().free(buffer.0),
        }
    }

    /// Copies `src` into `buffer` at byte `offset` (host to device).
    pub fn write(&mut self, buffer: BufferId, offset: u64, src: &[u8]) -> Result<(), DeviceError> {
        match &mut self.backend {
            Backend::Local(device) => device.write(buffer, offset, src),
            Backend::Worker(worker) => worker.get_mut().write(buffer.0, offset, src),
        }
    }

    /// Fills `dst` from `buffer` at byte `offset` (device to host).
    pub fn read(
        &mut self,
        buffer: BufferId,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        match &mut self.backend {
            Backend::Local(device) => device.read(buffer, offset, dst),
            Backend::Worker(worker) => worker.get_mut().read(buffer.0, offset, dst),
        }
    }

    /// Copies every range, in order, into consecutive bytes of `dst` (device to host), as one
    /// call: in a worker process one request and one reply carry all of them through the
    /// shared region. `dst` must be exactly as long as the ranges together.
    pub fn read_ranges(
        &mut self,
        ranges: &[BufferRange],
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        check_range_bytes("read_ranges", ranges, dst.len())?;
        match &mut self.backend {
            Backend::Local(device) => {
                let mut at = 0;
                for range in ranges {
                    let end = at + range.len as usize;
                    device.read(range.buffer, range.offset, &mut dst[at..end])?;
                    at = end;
                }
                Ok(())
            }
            Backend::Worker(worker) => worker.get_mut().read_ranges(ranges, dst),
        }
    }

    /// Copies consecutive bytes of `src` into every range, in order (host to device), as one
    /// call. `src` must be exactly as long as the ranges together.
    pub fn write_ranges(&mut self, ranges: &[BufferRange], src: &[u8]) -> Result<(), DeviceError> {
        check_range_bytes("write_ranges", ranges, src.len())?;
        match &mut self.backend {
            Backend::Local(device) => {
                let mut at = 0;
                for range in ranges {
                    let end = at + range.len as usize;
                    device.write(range.buffer, range.offset, &src[at..end])?;
                    at = end;
                }
                Ok(())
            }
            Backend::Worker(worker) => worker.get_mut().write_ranges(ranges, src),
        }
    }

    /// Whether [`Device::start_copy_out`] is available: the device's table has revision 1.2's
    /// background copy out. Without it, copies out are synchronous [`Device::read_ranges`].
    pub fn copies_out_in_background(&self) -> bool {
        match &self.backend {
            Backend::Local(device) => device.copies_out_in_background(),
            Backend::Worker(worker) => worker.borrow().copies_out_in_background(),
        }
    }

    /// Starts copying every range, in order, into staging memory the device side keeps, and
    /// returns at once: the copy runs in the background while launches go on. At most one copy
    /// is in flight. Until [`Device::poll_copy_out`] reports its end, the caller writes no byte
    /// of the ranges (no `write`, no launch that writes them; launches may read them) and frees
    /// none of their buffers.
    pub fn start_copy_out(&mut self, ranges: &[BufferRange]) -> Result<(), DeviceError> {
        if self.copy_out.in_flight {
            return Err(DeviceError::ContractViolation {
                operation: "start_copy_out",
                message: "a copy out is already in flight".into(),
            });
        }
        let len =
            usize::try_from(BufferRange::total_len(ranges)).map_err(|_| DeviceError::TooMany {
                what: "bytes to copy out",
                count: usize::MAX,
            })?;
        let copy_out = &mut self.copy_out;
        match &mut self.backend {
            Backend::Local(device) => {
                let staging = Arc::get_mut(&mut copy_out.staging)
                    .ok_or_else(DeviceError::copy_out_still_read)?;
                if staging.len() < len {
                    staging.resize(len, 0);
                }
                copy_out.ranges.clear();
                copy_out.ranges.extend(ranges.iter().map(|range| CopyRange {
                    buffer: range.buffer.raw(),
                    offset: range.offset,
                    len: range.len,
                }));
                // SAFETY: `staging` holds `len` bytes and is neither touched nor moved while
                // the copy is in flight: `start_copy_out` refuses a second copy, no
                // `CopiedOut` shares it (checked above, and none is made until
                // `poll_copy_out` saw the end), and it is dropped after the device, whose close
                // waits for the copy. The caller keeps the ranges unwritten.
                unsafe { device.copy_out_start(&copy_out.ranges, staging.as_mut_ptr(), len) }?;
            }
            Backend::Worker(worker) => worker.get_mut().copy_out_start(ranges, len)?,
        }
        copy_out.len = len;
        copy_out.in_flight = true;
        Ok(())
    }

    /// Makes the staging memory of background copies out hold `len` bytes now, so that copies
    /// up to that size allocate nothing; a no-op for a device without them.
    pub fn reserve_copy_out(&mut self, len: usize) -> Result<(), DeviceError> {
        if !self.copies_out_in_background() || self.copy_out.in_flight {
            return Ok(());
        }
        match &mut self.backend {
            Backend::Local(_) => {
                let staging = Arc::get_mut(&mut self.copy_out.staging)
                    .ok_or_else(DeviceError::copy_out_still_read)?;
                if staging.len() < len {
                    staging.resize(len, 0);
                }
                Ok(())
            }
            Backend::Worker(worker) => worker.get_mut().reserve_copy_out(len),
        }
    }

    /// Whether a copy out is in flight: started, its end not yet seen by [`Device::poll_copy_out`].
    pub fn copy_out_in_flight(&self) -> bool {
        self.copy_out.in_flight
    }

    /// The copied bytes once the copy out in flight has ended, `None` while it runs; with
    /// `wait`, waits for its end. An error (a lost worker) ends the copy too, with no bytes.
    pub fn poll_copy_out(&mut self, wait: bool) -> Result<Option<&[u8]>, DeviceError> {
        if !self.copy_out.in_flight {
            return Ok(None);
        }
        let polled = match &mut self.backend {
            Backend::Local(device) => device.copy_out_poll(wait),
            Backend::Worker(worker) => worker.get_mut().copy_out_poll(wait),
        };
        match polled {
            Ok(false) => return Ok(None),
            Ok(true) => self.copy_out.in_flight = false,
            Err(e) => {
                self.copy_out.in_flight = false;
                return Err(e);
            }
        }
        Ok(Some(self.copied_out()))
    }

    /// The bytes of the last copy out that ended (empty while one runs), until the next starts.
    pub fn copied_out(&mut self) -> &[u8] {
        if self.copy_out.in_flight {
            return &[];
        }
        let len = self.copy_out.len;
        match &mut self.backend {
            Backend::Local(_) => &self.copy_out.staging[..len],
            Backend::Worker(worker) => worker.get_mut().copied_out(len),
        }
    }

    /// The bytes of the last copy out that ended, as a value another thread can read while
    /// this device goes on; `None` while a copy runs. The memory stays alive as long as any
    /// clone does, and no copy out starts into it until the last is dropped.
    pub fn copied_out_shared(&self) -> Option<CopiedOut> {
        if self.copy_out.in_flight {
            return None;
        }
        let len = self.copy_out.len;
        let memory = match &self.backend {
            Backend::Local(_) => CopyMemory::Host(Arc::clone(&self.copy_out.staging)),
            Backend::Worker(worker) => CopyMemory::Region(worker.borrow().copy_region()?),
        };
        Some(CopiedOut { memory, len })
    }

    /// The names of the device's callables; a name's position is its [`CallableIndex`].
    pub fn callables(&self) -> &[String] {
        &self.callable_names
    }

    pub fn callable_index(&self, name: &str) -> Result<CallableIndex, DeviceError> {
        self.callable_names
            .iter()
            .position(|candidate| candidate == name)
            // The names came from a u32 count, so the position fits.
            .map(|index| CallableIndex(index as u32))
            .ok_or_else(|| DeviceError::UnknownCallable {
                name: name.to_string(),
            })
    }

    pub fn callable_name(&self, callable: CallableIndex) -> Option<&str> {
        self.callable_names
            .get(callable.0 as usize)
            .map(String::as_str)
    }

    /// Runs a callable. In a worker process the launch is queued, and a failure is reported
    /// by the next call that waits for the device (`synchronize`, `read`, ...).
    pub fn launch(
        &mut self,
        callable: CallableIndex,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<(), DeviceError> {
        if u32::try_from(args.len()).is_err() {
            return Err(DeviceError::TooMany {
                what: "tensor arguments",
                count: args.len(),
            });
        }
        if u32::try_from(params.len()).is_err() {
            return Err(DeviceError::TooMany {
                what: "params",
                count: params.len(),
            });
        }
        match &mut self.backend {
            Backend::Local(device) => {
                device.launch(callable, args, params)?;
                if let Some(hook) = &self.launch_completed {
                    hook();
                }
                Ok(())
            }
            Backend::Worker(worker) => worker.get_mut().launch(callable.0, args, params),
        }
    }

    /// Hands the queued launches to a worker process without waiting for them, so it computes
    /// while this process goes on. An in-process device has already run them.
    pub fn submit(&mut self) -> Result<(), DeviceError> {
        match &mut self.backend {
            Backend::Local(_) => Ok(()),
            Backend::Worker(worker) => worker.get_mut().submit(),
        }
    }

    /// Waits for launched work and returns the device time spent since the previous call.
    pub fn synchronize(&mut self) -> Result<Duration, DeviceError> {
        match &mut self.backend {
            Backend::Local(device) => device.synchronize(),
            Backend::Worker(worker) => worker.get_mut().synchronize(),
        }
    }

    /// [`Device::synchronize`], then [`Device::read`] into `dst`: in a worker process both in
    /// one round trip, so a step's end costs one wake of each side. Returns the device time
    /// and the time this process spent copying the bytes into `dst`.
    pub fn synchronize_and_read(
        &mut self,
        buffer: BufferId,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(Duration, Duration), DeviceError> {
        match &mut self.backend {
            Backend::Local(device) => {
                let device_time = device.synchronize()?;
                let read_started = Instant::now();
                device.read(buffer, offset, dst)?;
                Ok((device_time, read_started.elapsed()))
            }
            Backend::Worker(worker) => worker.get_mut().synchronize_read(buffer.0, offset, dst),
        }
    }

    pub fn stats(&self) -> Result<DeviceStats, DeviceError> {
        match &self.backend {
            Backend::Local(device) => device.stats(),
            Backend::Worker(worker) => worker.borrow_mut().stats(),
        }
    }

    /// Device nanoseconds spent in each callable's successful launches since open, in
    /// callable order, into `out`; false when the device does not report them.
    pub fn callable_device_ns(&self, out: &mut Vec<u64>) -> Result<bool, DeviceError> {
        match &self.backend {
            Backend::Local(device) => Ok(device.callable_device_ns(out)),
            Backend::Worker(worker) => worker.borrow_mut().callable_device_ns(out),
        }
    }

    /// Successful launches of one callable since open.
    pub fn callable_launches(&self, callable: CallableIndex) -> u64 {
        match &self.backend {
            Backend::Local(device) => device.callable_launches(callable),
            Backend::Worker(worker) => worker.borrow_mut().callable_launches(callable.0),
        }
    }
}

/// A batched copy's host buffer must hold the ranges exactly: a mismatch is a host bug, refused
/// before any byte moves.
fn check_range_bytes(
    operation: &'static str,
    ranges: &[BufferRange],
    host_len: usize,
) -> Result<(), DeviceError> {
    let total = BufferRange::total_len(ranges);
    if total != host_len as u64 {
        return Err(DeviceError::RangeLength {
            operation,
            ranges: total,
            host: host_len,
        });
    }
    Ok(())
}
