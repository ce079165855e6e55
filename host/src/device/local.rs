//! A device library opened in this process: the safe wrapper over its handle, every failure turned into a `DeviceError` with the device's message.

use std::ffi::{CStr, CString};
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::Duration;

use plughost_device_abi::{CopyRange, DeviceHandle, DeviceStats, TensorArg, status};

use super::error::DeviceError;
use super::handle::{BufferId, CallableIndex};
use super::library::{DeviceFunctions, DeviceLibrary, LoadedLibrary};

/// A device opened in this process. Closed on drop, which frees all its buffers.
pub(super) struct LocalDevice {
    library: Arc<LoadedLibrary>,
    handle: NonNull<DeviceHandle>,
}

// SAFETY: the ABI lets a handle move between threads as long as calls on it never overlap.
// `LocalDevice` is not `Sync`, so every call goes through one owner at a time.
unsafe impl Send for LocalDevice {}

impl LocalDevice {
    /// Opens a device with a config string whose format the device defines; the device and
    /// the names of its callables.
    pub(super) fn open(
        library: &DeviceLibrary,
        config: &str,
    ) -> Result<(LocalDevice, Vec<String>), DeviceError> {
        let config = CString::new(config).map_err(|error| DeviceError::ConfigHasNul {
            position: error.nul_position(),
        })?;
        let functions = library.loaded.functions;
        let mut handle = ptr::null_mut();
        // SAFETY: a NUL-terminated config and a writable out pointer, as the ABI requires.
        let code = unsafe { (functions.open)(config.as_ptr(), &mut handle) };
        if code != status::OK {
            // A failed open has no handle; the device keeps its message for a null handle.
            return Err(DeviceError::Call {
                operation: "open",
                status: code,
                message: last_error_message(&functions, ptr::null_mut()),
            });
        }
        let handle = NonNull::new(handle).ok_or_else(|| DeviceError::ContractViolation {
            operation: "open",
            message: "returned OK and a null handle".to_string(),
        })?;
        let device = LocalDevice {
            library: Arc::clone(&library.loaded),
            handle,
        };
        let names = device.read_callable_names()?;
        Ok((device, names))
    }

    pub(super) fn alloc(&mut self, bytes: u64) -> Result<BufferId, DeviceError> {
        let mut id = 0;
        // SAFETY: a live handle and a writable out pointer.
        let code = unsafe { (self.functions().alloc)(self.handle.as_ptr(), bytes, &mut id) };
        self.check("alloc", code)?;
        Ok(BufferId::from_raw(id))
    }

    pub(super) fn free(&mut self, buffer: BufferId) -> Result<(), DeviceError> {
        // SAFETY: a live handle.
        let code = unsafe { (self.functions().free)(self.handle.as_ptr(), buffer.raw()) };
        self.check("free", code)
    }

    /// Copies `src` into `buffer` at byte `offset` (host to device).
    pub(super) fn write(
        &mut self,
        buffer: BufferId,
        offset: u64,
        src: &[u8],
    ) -> Result<(), DeviceError> {
        // SAFETY: `src` is readable for its length.
        let code = unsafe {
            (self.functions().write)(
                self.handle.as_ptr(),
                buffer.raw(),
                offset,
                src.as_ptr(),
                src.len() as u64,
            )
        };
        self.check("write", code)
    }

    /// Fills `dst` from `buffer` at byte `offset` (device to host).
    pub(super) fn read(
        &mut self,
        buffer: BufferId,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        // SAFETY: `dst` is writable for its length and not aliased.
        let code = unsafe {
            (self.functions().read)(
                self.handle.as_ptr(),
                buffer.raw(),
                offset,
                dst.as_mut_ptr(),
                dst.len() as u64,
            )
        };
        self.check("read", code)
    }

    pub(super) fn launch(
        &mut self,
        callable: CallableIndex,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<(), DeviceError> {
        // `Device::launch` checked that both counts fit in a u32.
        let (num_args, num_params) = (args.len() as u32, params.len() as u32);
        // SAFETY: `args` and `params` are readable for the counts passed.
        let code = unsafe {
            (self.functions().launch)(
                self.handle.as_ptr(),
                callable.raw(),
                args.as_ptr(),
                num_args,
                params.as_ptr(),
                num_params,
            )
        };
        self.check("launch", code)
    }

    /// Waits for launched work and returns the device time spent since the previous call.
    pub(super) fn synchronize(&mut self) -> Result<Duration, DeviceError> {
        let mut device_ns = 0;
        // SAFETY: a live handle and a writable out pointer.
        let code = unsafe { (self.functions().synchronize)(self.handle.as_ptr(), &mut device_ns) };
        self.check("synchronize", code)?;
        Ok(Duration::from_nanos(device_ns))
    }

    pub(super) fn stats(&self) -> Result<DeviceStats, DeviceError> {
        let mut stats = DeviceStats::default();
        // SAFETY: a live handle and a writable out pointer.
        let code = unsafe { (self.functions().stats)(self.handle.as_ptr(), &mut stats) };
        self.check("stats", code)?;
        Ok(stats)
    }

    /// Whether the device copies out in the background (table revision 1.2).
    pub(super) fn copies_out_in_background(&self) -> bool {
        self.functions().copy_out.is_some()
    }

    /// Starts copying `ranges` into `dst` (exactly their total length) in the background.
    ///
    /// # Safety
    /// `dst` is writable for `len` bytes and stays valid and untouched until
    /// [`LocalDevice::copy_out_poll`] reports the copy ended or the device is dropped; until
    /// then nothing writes the ranges or frees their buffers (the ABI's revision 1.2 contract).
    pub(super) unsafe fn copy_out_start(
        &mut self,
        ranges: &[CopyRange],
        dst: *mut u8,
        len: usize,
    ) -> Result<(), DeviceError> {
        let (start, _) = self
            .functions()
            .copy_out
            .ok_or(DeviceError::NoBackgroundCopy)?;
        let count = u32::try_from(ranges.len()).map_err(|_| DeviceError::TooMany {
            what: "copy ranges",
            count: ranges.len(),
        })?;
        // SAFETY: `ranges` is readable for `count` ranges; `dst`'s contract is the caller's.
        let code = unsafe {
            start(
                self.handle.as_ptr(),
                ranges.as_ptr(),
                count,
                dst,
                len as u64,
            )
        };
        self.check("copy_out_start", code)
    }

    /// Whether the copy out in flight (if any) ended; with `wait`, waits for it. A copy that
    /// failed is over too, and its error comes back here.
    pub(super) fn copy_out_poll(&mut self, wait: bool) -> Result<bool, DeviceError> {
        let (_, poll) = self
            .functions()
            .copy_out
            .ok_or(DeviceError::NoBackgroundCopy)?;
        let mut done = 0u32;
        // SAFETY: a live handle and a writable out pointer.
        let code = unsafe { poll(self.handle.as_ptr(), u32::from(wait), &mut done) };
        self.check("copy_out_poll", code)?;
        Ok(done != 0)
    }

    /// Successful launches of one callable since open.
    pub(super) fn callable_launches(&self, callable: CallableIndex) -> u64 {
        // SAFETY: a live handle.
        unsafe { (self.functions().callable_launches)(self.handle.as_ptr(), callable.raw()) }
    }

    /// Device nanoseconds of each callable's successful launches since open, into `out`;
    /// false when the device does not report them.
    pub(super) fn callable_device_ns(&self, out: &mut Vec<u64>) -> bool {
        let Some(times) = self.functions().callable_device_ns else {
            return false;
        };
        // One call per step once `out` has the device's size; a second only when it grew.
        let len = u32::try_from(out.len()).unwrap_or(u32::MAX);
        // SAFETY: a live handle and `len` writable u64s.
        let count = unsafe { times(self.handle.as_ptr(), out.as_mut_ptr(), len) };
        if count > len {
            out.resize(count as usize, 0);
            // SAFETY: a live handle and `count` writable u64s.
            unsafe { times(self.handle.as_ptr(), out.as_mut_ptr(), count) };
        }
        out.truncate(count as usize);
        count > 0
    }

    fn functions(&self) -> &DeviceFunctions {
        &self.library.functions
    }

    fn check(&self, operation: &'static str, code: i32) -> Result<(), DeviceError> {
        if code == status::OK {
            return Ok(());
        }
        Err(DeviceError::Call {
            operation,
            status: code,
            message: last_error_message(self.functions(), self.handle.as_ptr()),
        })
    }

    fn read_callable_names(&self) -> Result<Vec<String>, DeviceError> {
        let functions = self.functions();
        // SAFETY: a live handle.
        let count = unsafe { (functions.callable_count)(self.handle.as_ptr()) };
        (0..count)
            .map(|index| {
                // SAFETY: a live handle; the name stays valid while it is open, and is copied now.
                let name = unsafe { (functions.callable_name)(self.handle.as_ptr(), index) };
                if name.is_null() {
                    return Err(DeviceError::ContractViolation {
                        operation: "callable_name",
                        message: format!("callable {index} of {count} has no name"),
                    });
                }
                // SAFETY: non-null names are NUL-terminated.
                let name = unsafe { CStr::from_ptr(name) };
                Ok(name.to_string_lossy().into_owned())
            })
            .collect()
    }
}

impl Drop for LocalDevice {
    fn drop(&mut self) {
        // SAFETY: the handle is live and closed exactly once, here.
        unsafe { (self.functions().close)(self.handle.as_ptr()) };
    }
}

/// Longer messages are cut; a broken device must not make the host allocate without bound.
const MAX_ERROR_MESSAGE_BYTES: usize = 64 * 1024;

/// The device's message for the last failure on `handle` (null: the last failed open).
fn last_error_message(functions: &DeviceFunctions, handle: *mut DeviceHandle) -> String {
    // SAFETY: a null buffer of length 0 only asks for the length.
    let full_len = unsafe { (functions.last_error)(handle, ptr::null_mut(), 0) };
    if full_len == 0 {
        return "the device gave no message".to_string();
    }
    let mut buf = vec![0u8; full_len.min(MAX_ERROR_MESSAGE_BYTES) + 1];
    // SAFETY: `buf` is writable for `buf.len()` bytes.
    unsafe { (functions.last_error)(handle, buf.as_mut_ptr().cast(), buf.len()) };
    let copied = buf.iter().position(|&byte| byte == 0).unwrap_or(buf.len());
    buf.truncate(copied);
    String::from_utf8_lossy(&buf).into_owned()
}
