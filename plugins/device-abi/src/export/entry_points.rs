//! The C entry points of a Rust device and the function table that holds them: each checks its pointers, runs on the state behind the handle, contains panics and records the last error.

use std::cell::RefCell;
use std::ffi::{CStr, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use crate::abi::{
    AllocFn, CallableCountFn, CallableDeviceNsFn, CallableLaunchesFn, CallableNameFn, CloseFn,
    CopyOutPollFn, CopyOutStartFn, CopyRange, DeviceHandle, DeviceStats, FreeFn, LastErrorFn,
    LaunchFn, OpenFn, PLUGHOST_DEVICE_ABI_VERSION, PlughostDeviceV1, ReadFn, StatsFn,
    SynchronizeFn, TensorArg, WriteFn, status,
};
use crate::callables;

use super::state::DeviceState;
use super::{DeviceBackend, DeviceFailure};

thread_local! {
    /// The last failure of a call that had no handle to record it on (a failed `open`).
    static HANDLELESS_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn record_handleless_error(message: String) {
    HANDLELESS_ERROR.with_borrow_mut(|slot| *slot = message);
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    if let Some(message) = payload.downcast_ref::<&str>() {
        message
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message
    } else {
        "a non-string panic payload"
    }
}

/// Runs `body`, turning a panic into an INTERNAL failure.
pub(super) fn contain<T>(
    operation: &str,
    body: impl FnOnce() -> Result<T, DeviceFailure>,
) -> Result<T, DeviceFailure> {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|payload| {
        Err(DeviceFailure::internal(format!(
            "{operation} panicked: {}",
            panic_message(payload.as_ref())
        )))
    })
}

/// Runs `body` on the state behind `handle`, records a failure as the handle's last error and
/// returns the status code.
///
/// # Safety
/// `handle` is null or a live handle from `open::<B>` that no other call is using.
unsafe fn with_state<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    operation: &str,
    body: impl FnOnce(&mut DeviceState<B>) -> Result<(), DeviceFailure>,
) -> i32 {
    let state = handle.cast::<DeviceState<B>>();
    if state.is_null() {
        record_handleless_error(format!("{operation}: the device handle is null"));
        return status::INVALID_ARGUMENT;
    }
    // SAFETY: the caller guarantees a live, unshared handle; the borrow ends with `body`.
    match contain(operation, || body(unsafe { &mut *state })) {
        Ok(()) => status::OK,
        Err(failure) => {
            let code = failure.status();
            // SAFETY: as above; `body` no longer borrows the state.
            unsafe { (*state).set_last_error(failure.into_message()) };
            code
        }
    }
}

/// Borrows `count` elements at `data`; a null pointer is only accepted for zero elements.
///
/// # Safety
/// A non-null `data` points to `count` readable elements that outlive the returned slice.
unsafe fn foreign_slice<'a, T>(
    data: *const T,
    count: u64,
    what: &str,
) -> Result<&'a [T], DeviceFailure> {
    if count == 0 {
        return Ok(&[]);
    }
    if data.is_null() {
        return Err(DeviceFailure::invalid_argument(format!(
            "{what} is null but its length is {count}"
        )));
    }
    let count = usize::try_from(count)
        .map_err(|_| DeviceFailure::invalid_argument(format!("{what} is too long")))?;
    // SAFETY: non-null and, by the caller's guarantee, valid for `count` elements.
    Ok(unsafe { std::slice::from_raw_parts(data, count) })
}

/// Like [`foreign_slice`], writable.
///
/// # Safety
/// A non-null `data` points to `count` writable elements, unaliased while the slice lives.
unsafe fn foreign_slice_mut<'a, T>(
    data: *mut T,
    count: u64,
    what: &str,
) -> Result<&'a mut [T], DeviceFailure> {
    if count == 0 {
        return Ok(&mut []);
    }
    if data.is_null() {
        return Err(DeviceFailure::invalid_argument(format!(
            "{what} is null but its length is {count}"
        )));
    }
    let count = usize::try_from(count)
        .map_err(|_| DeviceFailure::invalid_argument(format!("{what} is too long")))?;
    // SAFETY: non-null and, by the caller's guarantee, valid and unaliased for `count` elements.
    Ok(unsafe { std::slice::from_raw_parts_mut(data, count) })
}

fn null_out_pointer(operation: &str, name: &str) -> DeviceFailure {
    DeviceFailure::invalid_argument(format!("{operation}: `{name}` is null"))
}

/// `plughost_device_v1.open`.
///
/// # Safety
/// A non-null `config` is a NUL-terminated string; a non-null `out_handle` points to writable
/// storage for one handle.
unsafe extern "C" fn open<B: DeviceBackend>(
    config: *const c_char,
    out_handle: *mut *mut DeviceHandle,
) -> i32 {
    let opened = contain("open", || {
        if out_handle.is_null() {
            return Err(null_out_pointer("open", "out_handle"));
        }
        let config = if config.is_null() {
            ""
        } else {
            // SAFETY: the ABI requires a NUL-terminated string.
            unsafe { CStr::from_ptr(config) }.to_str().map_err(|_| {
                DeviceFailure::invalid_argument("open: the config string is not UTF-8")
            })?
        };
        let backend = B::open(config).map_err(|failure| failure.context("open"))?;
        Ok(Box::into_raw(Box::new(DeviceState::new(backend))).cast::<DeviceHandle>())
    });
    match opened {
        Ok(handle) => {
            // SAFETY: checked non-null above; the caller provides writable storage.
            unsafe { *out_handle = handle };
            status::OK
        }
        Err(failure) => {
            let code = failure.status();
            record_handleless_error(failure.into_message());
            code
        }
    }
}

/// `plughost_device_v1.close`.
///
/// # Safety
/// `handle` is null or a live handle from `open::<B>`, closed once and used by no other call.
unsafe extern "C" fn close<B: DeviceBackend>(handle: *mut DeviceHandle) {
    if handle.is_null() {
        return;
    }
    // A panic while dropping has nowhere to be reported, but it must not unwind into the host.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the handle came from `open::<B>` and the host closes it once.
        drop(unsafe { Box::from_raw(handle.cast::<DeviceState<B>>()) });
    }));
}

/// `plughost_device_v1.alloc`.
///
/// # Safety
/// As [`with_state`]; a non-null `out_buffer` points to writable storage for one id.
unsafe extern "C" fn alloc<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    bytes: u64,
    out_buffer: *mut u64,
) -> i32 {
    // SAFETY: forwarded ABI contract.
    unsafe {
        with_state::<B>(handle, "alloc", |state| {
            if out_buffer.is_null() {
                return Err(null_out_pointer("alloc", "out_buffer"));
            }
            let id = state.alloc(bytes)?;
            *out_buffer = id;
            Ok(())
        })
    }
}

/// `plughost_device_v1.free`.
///
/// # Safety
/// As [`with_state`].
unsafe extern "C" fn free<B: DeviceBackend>(handle: *mut DeviceHandle, buffer: u64) -> i32 {
    // SAFETY: forwarded ABI contract.
    unsafe { with_state::<B>(handle, "free", |state| state.free(buffer)) }
}

/// `plughost_device_v1.write`.
///
/// # Safety
/// As [`with_state`]; a non-null `src` holds `len` readable bytes.
unsafe extern "C" fn write<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    buffer: u64,
    offset: u64,
    src: *const u8,
    len: u64,
) -> i32 {
    // SAFETY: forwarded ABI contract: `src` holds `len` readable bytes.
    unsafe {
        with_state::<B>(handle, "write", |state| {
            let src = foreign_slice(src, len, "write: `src`")?;
            state.write(buffer, offset, src)
        })
    }
}

/// `plughost_device_v1.read`.
///
/// # Safety
/// As [`with_state`]; a non-null `dst` holds `len` writable bytes that nothing else uses
/// during the call.
unsafe extern "C" fn read<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    buffer: u64,
    offset: u64,
    dst: *mut u8,
    len: u64,
) -> i32 {
    // SAFETY: forwarded ABI contract: `dst` holds `len` writable bytes.
    unsafe {
        with_state::<B>(handle, "read", |state| {
            let dst = foreign_slice_mut(dst, len, "read: `dst`")?;
            state.read(buffer, offset, dst)
        })
    }
}

/// `plughost_device_v1.copy_out_start` (revision 1.2).
///
/// # Safety
/// As [`with_state`]; a non-null `ranges` holds `num_ranges` readable ranges; a non-null
/// `dst` holds `dst_len` writable bytes that stay valid and untouched by the host until
/// `copy_out_poll` reports the copy done or the handle is closed.
unsafe extern "C" fn copy_out_start<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    ranges: *const CopyRange,
    num_ranges: u32,
    dst: *mut u8,
    dst_len: u64,
) -> i32 {
    // SAFETY: forwarded ABI contract.
    unsafe {
        with_state::<B>(handle, "copy_out_start", |state| {
            let ranges = foreign_slice(ranges, num_ranges.into(), "copy_out_start: `ranges`")?;
            if dst.is_null() && dst_len > 0 {
                return Err(null_out_pointer("copy_out_start", "dst"));
            }
            state.copy_out_start(ranges, dst, dst_len)
        })
    }
}

/// `plughost_device_v1.copy_out_poll` (revision 1.2).
///
/// # Safety
/// As [`with_state`]; a non-null `out_done` points to writable storage for one `u32`.
unsafe extern "C" fn copy_out_poll<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    wait: u32,
    out_done: *mut u32,
) -> i32 {
    // SAFETY: forwarded ABI contract.
    unsafe {
        with_state::<B>(handle, "copy_out_poll", |state| {
            if out_done.is_null() {
                return Err(null_out_pointer("copy_out_poll", "out_done"));
            }
            let done = state.copy_out_poll(wait != 0)?;
            *out_done = u32::from(done);
            Ok(())
        })
    }
}

/// Every Rust device provides the shared callable table, so the count needs no state.
///
/// # Safety
/// None: the handle is only compared with null (the function is `unsafe` to fit the table).
unsafe extern "C" fn callable_count(handle: *mut DeviceHandle) -> u32 {
    if handle.is_null() {
        return 0;
    }
    callables::ALL.len() as u32
}

/// `plughost_device_v1.callable_name`.
///
/// # Safety
/// `handle` is null or a live handle from `open::<B>`.
unsafe extern "C" fn callable_name<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    index: u32,
) -> *const c_char {
    let state = handle.cast::<DeviceState<B>>();
    if state.is_null() {
        return ptr::null();
    }
    // SAFETY: a live handle; the names live as long as it does.
    let state = unsafe { &*state };
    state
        .callable_name(index)
        .map_or(ptr::null(), |name| name.as_ptr())
}

/// `plughost_device_v1.launch`.
///
/// # Safety
/// As [`with_state`]; non-null `args` and `params` hold `num_args` and `num_params`
/// readable elements.
unsafe extern "C" fn launch<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    callable_index: u32,
    args: *const TensorArg,
    num_args: u32,
    params: *const i64,
    num_params: u32,
) -> i32 {
    // SAFETY: forwarded ABI contract: `args` and `params` hold the given counts.
    unsafe {
        with_state::<B>(handle, "launch", |state| {
            let args = foreign_slice(args, num_args.into(), "launch: `args`")?;
            let params = foreign_slice(params, num_params.into(), "launch: `params`")?;
            state.launch(callable_index, args, params)
        })
    }
}

/// `plughost_device_v1.synchronize`.
///
/// # Safety
/// As [`with_state`]; a non-null `out_device_ns` points to writable storage for one `u64`.
unsafe extern "C" fn synchronize<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    out_device_ns: *mut u64,
) -> i32 {
    // SAFETY: forwarded ABI contract.
    unsafe {
        with_state::<B>(handle, "synchronize", |state| {
            if out_device_ns.is_null() {
                return Err(null_out_pointer("synchronize", "out_device_ns"));
            }
            let nanos = state.take_device_time().as_nanos();
            *out_device_ns = u64::try_from(nanos).unwrap_or(u64::MAX);
            Ok(())
        })
    }
}

/// `plughost_device_v1.stats`.
///
/// # Safety
/// As [`with_state`]; a non-null `out` points to writable storage for one [`DeviceStats`].
unsafe extern "C" fn stats<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    out: *mut DeviceStats,
) -> i32 {
    // SAFETY: forwarded ABI contract.
    unsafe {
        with_state::<B>(handle, "stats", |state| {
            if out.is_null() {
                return Err(null_out_pointer("stats", "out"));
            }
            *out = state.stats();
            Ok(())
        })
    }
}

/// `plughost_device_v1.callable_launches`.
///
/// # Safety
/// `handle` is null or a live handle from `open::<B>` that no other call is using.
unsafe extern "C" fn callable_launches<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    index: u32,
) -> u64 {
    let state = handle.cast::<DeviceState<B>>();
    if state.is_null() {
        return 0;
    }
    // SAFETY: a live handle that no other call is using.
    let state = unsafe { &*state };
    state.launches_of(index)
}

/// `plughost_device_v1.callable_device_ns`.
///
/// # Safety
/// `handle` is null or a live handle from `open::<B>` that no other call is using; a non-null
/// `out` holds `len` writable `u64`s.
unsafe extern "C" fn callable_device_ns<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    out: *mut u64,
    len: u32,
) -> u32 {
    let state = handle.cast::<DeviceState<B>>();
    if state.is_null() {
        return 0;
    }
    // SAFETY: a live handle that no other call is using.
    let state = unsafe { &*state };
    if !out.is_null() {
        // SAFETY: the caller promises `len` writable `u64`s at `out`.
        let out = unsafe { std::slice::from_raw_parts_mut(out, len as usize) };
        for (slot, ns) in out.iter_mut().zip(state.device_ns_by_callable()) {
            *slot = ns;
        }
    }
    u32::try_from(state.device_ns_by_callable().count()).unwrap_or(u32::MAX)
}

/// `plughost_device_v1.last_error`.
///
/// # Safety
/// `handle` is null or a live handle from `open::<B>` that no other call is using; a non-null
/// `buf` holds `buf_len` writable bytes.
unsafe extern "C" fn last_error<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    buf: *mut c_char,
    buf_len: usize,
) -> usize {
    let state = handle.cast::<DeviceState<B>>();
    // SAFETY: `buf` holds `buf_len` writable bytes; a non-null handle is live.
    unsafe {
        if state.is_null() {
            HANDLELESS_ERROR.with_borrow(|message| copy_message(message, buf, buf_len))
        } else {
            copy_message((*state).last_error(), buf, buf_len)
        }
    }
}

/// Copies as much of `message` as fits, NUL-terminated, and returns its full length.
///
/// # Safety
/// A non-null `buf` holds `buf_len` writable bytes.
unsafe fn copy_message(message: &str, buf: *mut c_char, buf_len: usize) -> usize {
    if !buf.is_null() && buf_len > 0 {
        let copied = message.len().min(buf_len - 1);
        // SAFETY: `copied + 1 <= buf_len` bytes are writable.
        unsafe {
            ptr::copy_nonoverlapping(message.as_ptr(), buf.cast::<u8>(), copied);
            *buf.add(copied) = 0;
        }
    }
    message.len()
}

/// The function table for device `B`; [`export_device!`](crate::export_device) puts it in a static.
pub const fn device_table<B: DeviceBackend>() -> PlughostDeviceV1 {
    PlughostDeviceV1 {
        abi_version: PLUGHOST_DEVICE_ABI_VERSION,
        struct_size: PlughostDeviceV1::SIZE,
        open: Some(open::<B> as OpenFn),
        close: Some(close::<B> as CloseFn),
        alloc: Some(alloc::<B> as AllocFn),
        free: Some(free::<B> as FreeFn),
        write: Some(write::<B> as WriteFn),
        read: Some(read::<B> as ReadFn),
        callable_count: Some(callable_count as CallableCountFn),
        callable_name: Some(callable_name::<B> as CallableNameFn),
        launch: Some(launch::<B> as LaunchFn),
        synchronize: Some(synchronize::<B> as SynchronizeFn),
        stats: Some(stats::<B> as StatsFn),
        callable_launches: Some(callable_launches::<B> as CallableLaunchesFn),
        callable_device_ns: Some(callable_device_ns::<B> as CallableDeviceNsFn),
        last_error: Some(last_error::<B> as LastErrorFn),
        copy_out_start: Some(copy_out_start::<B> as CopyOutStartFn),
        copy_out_poll: Some(copy_out_poll::<B> as CopyOutPollFn),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    use crate::abi::{ArgTag, DType};
    use crate::elements;
    use crate::export::Launch;

    /// Adds one to every element; panics when asked to, to show panics stay inside.
    struct PlusOne;

    impl DeviceBackend for PlusOne {
        fn open(config: &str) -> Result<Self, DeviceFailure> {
            match config {
                "" => Ok(PlusOne),
                other => Err(DeviceFailure::invalid_argument(format!(
                    "unknown option `{other}`"
                ))),
            }
        }

        fn memory_capacity(&self) -> u64 {
            1024
        }

        fn launch(&mut self, launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
            let x = launch.read_f32("x");
            if x.first() == Some(&-1.0) {
                panic!("asked to panic");
            }
            let y = launch.read_f32("y");
            let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b + 1.0).collect();
            launch.write_f32("x", &sum);
            Ok(())
        }
    }

    const TABLE: PlughostDeviceV1 = device_table::<PlusOne>();

    /// A minimal caller of the table, the way a host would use it.
    struct Caller {
        handle: *mut DeviceHandle,
    }

    impl Caller {
        fn open(config: &str) -> Result<Caller, (i32, String)> {
            let config = CString::new(config).unwrap();
            let mut handle = ptr::null_mut();
            // SAFETY: a NUL-terminated config and a writable out pointer.
            let code = unsafe { (TABLE.open.unwrap())(config.as_ptr(), &mut handle) };
            if code != status::OK {
                return Err((code, Caller::error_of(ptr::null_mut())));
            }
            Ok(Caller { handle })
        }

        fn error_of(handle: *mut DeviceHandle) -> String {
            // SAFETY: a null or live handle; a null buffer asks for the length only.
            let len = unsafe { (TABLE.last_error.unwrap())(handle, ptr::null_mut(), 0) };
            let mut buf = vec![0u8; len + 1];
            // SAFETY: as above; `buf` is writable for its length.
            unsafe { (TABLE.last_error.unwrap())(handle, buf.as_mut_ptr().cast(), buf.len()) };
            String::from_utf8(buf[..len].to_vec()).unwrap()
        }

        fn check(&self, code: i32) -> Result<(), (i32, String)> {
            if code == status::OK {
                Ok(())
            } else {
                Err((code, Caller::error_of(self.handle)))
            }
        }

        fn alloc(&self, bytes: u64) -> Result<u64, (i32, String)> {
            let mut id = 0;
            // SAFETY: a live handle and a writable out pointer.
            self.check(unsafe { (TABLE.alloc.unwrap())(self.handle, bytes, &mut id) })?;
            Ok(id)
        }

        fn write_f32(&self, id: u64, values: &[f32]) -> Result<(), (i32, String)> {
            let bytes = elements::encode_f32(values);
            // SAFETY: a live handle; `bytes` is readable for its length.
            self.check(unsafe {
                (TABLE.write.unwrap())(self.handle, id, 0, bytes.as_ptr(), bytes.len() as u64)
            })
        }

        fn read_f32(&self, id: u64, count: usize) -> Result<Vec<f32>, (i32, String)> {
            let mut bytes = vec![0u8; count * 4];
            // SAFETY: a live handle; `bytes` is writable for its length.
            self.check(unsafe {
                (TABLE.read.unwrap())(self.handle, id, 0, bytes.as_mut_ptr(), bytes.len() as u64)
            })?;
            Ok(elements::decode_float(DType::F32, &bytes).unwrap())
        }

        fn launch_add(&self, x: u64, y: u64, len: u64) -> Result<(), (i32, String)> {
            let args = [
                TensorArg::new(x, 0, DType::F32, &[1, len], ArgTag::Inout).unwrap(),
                TensorArg::new(y, 0, DType::F32, &[1, len], ArgTag::Input).unwrap(),
            ];
            let (index, _) = callables::by_name("add").unwrap();
            // SAFETY: a live handle; `args` holds the two arguments passed, and no params.
            self.check(unsafe {
                (TABLE.launch.unwrap())(self.handle, index as u32, args.as_ptr(), 2, ptr::null(), 0)
            })
        }

        fn stats(&self) -> DeviceStats {
            let mut stats = DeviceStats::default();
            // SAFETY: a live handle and a writable out pointer.
            self.check(unsafe { (TABLE.stats.unwrap())(self.handle, &mut stats) })
                .unwrap();
            stats
        }
    }

    impl Drop for Caller {
        fn drop(&mut self) {
            // SAFETY: the handle came from `open` and is closed once.
            unsafe { (TABLE.close.unwrap())(self.handle) };
        }
    }

    #[test]
    fn table_has_every_entry() {
        assert_eq!(TABLE.abi_version, PLUGHOST_DEVICE_ABI_VERSION);
        assert_eq!(TABLE.struct_size as usize, size_of::<PlughostDeviceV1>());
        assert!(TABLE.open.is_some() && TABLE.last_error.is_some());
    }

    #[test]
    fn open_failure_is_reported_without_a_handle() {
        let (code, message) = Caller::open("bogus").err().unwrap();
        assert_eq!(code, status::INVALID_ARGUMENT);
        assert_eq!(message, "open: unknown option `bogus`");
    }

    #[test]
    fn launch_reads_and_writes_through_the_table() {
        let device = Caller::open("").unwrap();
        let x = device.alloc(12).unwrap();
        let y = device.alloc(12).unwrap();
        device.write_f32(x, &[1.0, 2.0, 3.0]).unwrap();
        device.write_f32(y, &[10.0, 20.0, 30.0]).unwrap();
        device.launch_add(x, y, 3).unwrap();
        assert_eq!(device.read_f32(x, 3).unwrap(), vec![12.0, 23.0, 34.0]);
        let stats = device.stats();
        assert_eq!(stats.launches, 1);
        assert_eq!((stats.h2d_calls, stats.h2d_bytes), (2, 24));
        assert_eq!((stats.d2h_calls, stats.d2h_bytes), (1, 12));
        assert_eq!(stats.live_bytes, 24);
    }

    #[test]
    fn device_time_is_kept_per_callable() {
        let device = Caller::open("").unwrap();
        let x = device.alloc(16).unwrap();
        let y = device.alloc(16).unwrap();
        device.launch_add(x, y, 4).unwrap();
        device.launch_add(x, y, 4).unwrap();
        // A launch that fails (its backend panics on a first value of -1) counts nowhere.
        device.write_f32(x, &[-1.0]).unwrap();
        assert!(device.launch_add(x, y, 4).is_err());
        let count = callables::ALL.len();
        let mut times = vec![u64::MAX; count + 2];
        // SAFETY: a live handle and `times.len()` writable u64s.
        let reported = unsafe {
            (TABLE.callable_device_ns.unwrap())(
                device.handle,
                times.as_mut_ptr(),
                times.len() as u32,
            )
        };
        assert_eq!(reported as usize, count);
        assert_eq!(
            &times[count..],
            &[u64::MAX; 2],
            "nothing past the count is written"
        );
        let (add, _) = callables::by_name("add").unwrap();
        assert!(times[add] > 0, "{times:?}");
        let others: u64 = (0..count).filter(|&i| i != add).map(|i| times[i]).sum();
        assert_eq!(others, 0, "{times:?}");
        // A shorter buffer gets a prefix; no buffer, only the count.
        let mut first = [u64::MAX; 1];
        // SAFETY: as above, one u64; then a null buffer, which the entry point allows.
        unsafe {
            assert_eq!(
                (TABLE.callable_device_ns.unwrap())(device.handle, first.as_mut_ptr(), 1) as usize,
                count
            );
            assert_eq!(
                (TABLE.callable_device_ns.unwrap())(device.handle, ptr::null_mut(), 0) as usize,
                count
            );
        }
        assert_eq!(first[0], times[0]);
    }

    #[test]
    fn failures_set_the_last_error() {
        let device = Caller::open("").unwrap();
        let x = device.alloc(12).unwrap();

        let (code, message) = device.alloc(2000).unwrap_err();
        assert_eq!(code, status::OUT_OF_MEMORY);
        assert!(
            message.contains("only 1012 of 1024 bytes are free"),
            "{message}"
        );

        let (code, message) = device.read_f32(x, 4).unwrap_err();
        assert_eq!(code, status::OUT_OF_BOUNDS);
        assert_eq!(
            message,
            "read: bytes 0..16 do not fit in buffer 1 of 12 bytes"
        );

        let (code, message) = device.launch_add(x, 99, 3).unwrap_err();
        assert_eq!(code, status::UNKNOWN_BUFFER);
        assert_eq!(
            message,
            "launch `add`: argument `y` (#1): unknown buffer 99"
        );

        let (code, message) = device.launch_add(x, x, 4).unwrap_err();
        assert_eq!(code, status::OUT_OF_BOUNDS);
        assert!(message.starts_with("launch `add`: argument `x` (#0): bytes 0..16"));
    }

    #[test]
    fn a_panic_becomes_an_internal_error() {
        let device = Caller::open("").unwrap();
        let x = device.alloc(4).unwrap();
        device.write_f32(x, &[-1.0]).unwrap();
        let (code, message) = device.launch_add(x, x, 1).unwrap_err();
        assert_eq!(code, status::INTERNAL);
        assert!(
            message.contains("launch panicked: asked to panic"),
            "{message}"
        );
        // The device keeps working.
        device.write_f32(x, &[1.0]).unwrap();
        device.launch_add(x, x, 1).unwrap();
        assert_eq!(device.read_f32(x, 1).unwrap(), vec![3.0]);
    }

    #[test]
    fn last_error_truncates_and_terminates() {
        let message = "hello";
        let mut buf = [0x7f as c_char; 4];
        // SAFETY: `buf` is writable for its length.
        let len = unsafe { copy_message(message, buf.as_mut_ptr(), buf.len()) };
        assert_eq!(len, 5);
        assert_eq!(buf.map(|byte| byte as u8), *b"hel\0");
    }
}
