//! The safe wrapper over one open device: typed buffer ids and callable indices, and every failure turned into a `DeviceError` with the device's message.

use std::ffi::{CStr, CString};
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::Duration;

use plughost_device_abi::{ArgTag, DType, DeviceHandle, DeviceStats, TensorArg, status};

use super::error::DeviceError;
use super::library::{DeviceFunctions, DeviceLibrary, LoadedLibrary};

/// A device buffer; valid only on the device that allocated it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufferId(u64);

impl BufferId {
    /// The id the C ABI uses.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// A callable's position in the device's list; obtained from [`Device::callable_index`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallableIndex(u32);

impl CallableIndex {
    pub fn raw(self) -> u32 {
        self.0
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

/// One open device. Closed by [`Device::close`] or on drop, which frees all its buffers.
pub struct Device {
    library: Arc<LoadedLibrary>,
    handle: NonNull<DeviceHandle>,
    callable_names: Vec<String>,
}

// SAFETY: the ABI lets a handle move between threads as long as calls on it never overlap.
// `Device` is not `Sync`, so every call goes through one owner at a time.
unsafe impl Send for Device {}

impl Device {
    /// Opens a device with a config string whose format the device defines.
    pub fn open(library: &DeviceLibrary, config: &str) -> Result<Device, DeviceError> {
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
        let mut device = Device {
            library: Arc::clone(&library.loaded),
            handle,
            callable_names: Vec::new(),
        };
        device.callable_names = device.read_callable_names()?;
        Ok(device)
    }

    /// Closes the device, freeing every buffer it holds.
    pub fn close(self) {
        // Drop does the work; this method makes the end of a device's life visible in code.
    }

    pub fn alloc(&mut self, bytes: u64) -> Result<BufferId, DeviceError> {
        let mut id = 0;
        // SAFETY: a live handle and a writable out pointer.
        let code = unsafe { (self.functions().alloc)(self.handle.as_ptr(), bytes, &mut id) };
        self.check("alloc", code)?;
        Ok(BufferId(id))
    }

    pub fn free(&mut self, buffer: BufferId) -> Result<(), DeviceError> {
        // SAFETY: a live handle.
        let code = unsafe { (self.functions().free)(self.handle.as_ptr(), buffer.0) };
        self.check("free", code)
    }

    /// Copies `src` into `buffer` at byte `offset` (host to device).
    pub fn write(&mut self, buffer: BufferId, offset: u64, src: &[u8]) -> Result<(), DeviceError> {
        // SAFETY: `src` is readable for its length.
        let code = unsafe {
            (self.functions().write)(
                self.handle.as_ptr(),
                buffer.0,
                offset,
                src.as_ptr(),
                src.len() as u64,
            )
        };
        self.check("write", code)
    }

    /// Fills `dst` from `buffer` at byte `offset` (device to host).
    pub fn read(
        &mut self,
        buffer: BufferId,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), DeviceError> {
        // SAFETY: `dst` is writable for its length and not aliased.
        let code = unsafe {
            (self.functions().read)(
                self.handle.as_ptr(),
                buffer.0,
                offset,
                dst.as_mut_ptr(),
                dst.len() as u64,
            )
        };
        self.check("read", code)
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

    pub fn launch(
        &mut self,
        callable: CallableIndex,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<(), DeviceError> {
        let num_args = u32::try_from(args.len()).map_err(|_| DeviceError::TooMany {
            what: "tensor arguments",
            count: args.len(),
        })?;
        let num_params = u32::try_from(params.len()).map_err(|_| DeviceError::TooMany {
            what: "params",
            count: params.len(),
        })?;
        // SAFETY: `args` and `params` are readable for the counts passed.
        let code = unsafe {
            (self.functions().launch)(
                self.handle.as_ptr(),
                callable.0,
                args.as_ptr(),
                num_args,
                params.as_ptr(),
                num_params,
            )
        };
        self.check("launch", code)
    }

    /// Waits for launched work and returns the device time spent since the previous call.
    pub fn synchronize(&mut self) -> Result<Duration, DeviceError> {
        let mut device_ns = 0;
        // SAFETY: a live handle and a writable out pointer.
        let code = unsafe { (self.functions().synchronize)(self.handle.as_ptr(), &mut device_ns) };
        self.check("synchronize", code)?;
        Ok(Duration::from_nanos(device_ns))
    }

    pub fn stats(&self) -> Result<DeviceStats, DeviceError> {
        let mut stats = DeviceStats::default();
        // SAFETY: a live handle and a writable out pointer.
        let code = unsafe { (self.functions().stats)(self.handle.as_ptr(), &mut stats) };
        self.check("stats", code)?;
        Ok(stats)
    }

    /// Successful launches of one callable since open.
    pub fn callable_launches(&self, callable: CallableIndex) -> u64 {
        // SAFETY: a live handle.
        unsafe { (self.functions().callable_launches)(self.handle.as_ptr(), callable.0) }
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

impl Drop for Device {
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
