//! The `repr(C)` types, status codes and function table of device ABI version 1; `include/plughost_device.h` mirrors this file.
//!
//! Contract shared by every entry point:
//! * a device library exports one symbol, [`ENTRY_SYMBOL`], returning a pointer to a static
//!   [`PlughostDeviceV1`]; the host reads `abi_version` and `struct_size` before anything else;
//! * functions that can fail return a status code ([`status`]); after a failure,
//!   `last_error` on the same handle returns the message (with a null handle: the last failure
//!   on the calling thread of a call that had no handle, such as `open`);
//! * nothing unwinds across the boundary;
//! * a handle may move between threads, but calls on one handle must not overlap; work a
//!   device does in the background (a revision 1.2 copy out) is no call, and goes on between
//!   and during calls.

use std::ffi::c_char;
use std::fmt;
use std::marker::{PhantomData, PhantomPinned};

/// The ABI version this crate describes; a host refuses a table with any other version.
pub const PLUGHOST_DEVICE_ABI_VERSION: u32 = 1;

/// The symbol every device library exports, of type [`EntryFn`].
pub const ENTRY_SYMBOL: &str = "plughost_device_v1";

/// The most dimensions a [`TensorArg`] can describe.
pub const MAX_RANK: usize = 4;

/// The environment variable a device library sees in a worker process: how many workers of
/// the same server came before this one ("0" in the first). A device may use it; the mock
/// device fires its one-shot faults only in the first worker.
pub const WORKER_RESTARTS_ENV: &str = "PLUGHOST_DEVICE_WORKER_RESTARTS";

/// Status codes returned by the entry points. Zero is success.
pub mod status {
    pub const OK: i32 = 0;
    /// A null pointer, an unknown callable, a malformed config, or arguments that do not match
    /// the callable's signature.
    pub const INVALID_ARGUMENT: i32 = 1;
    pub const OUT_OF_MEMORY: i32 = 2;
    /// A buffer id that was never allocated or was already freed.
    pub const UNKNOWN_BUFFER: i32 = 3;
    /// A byte range that does not fit inside its buffer.
    pub const OUT_OF_BOUNDS: i32 = 4;
    /// The callable ran and failed (bad data such as an out-of-range token id, or an injected fault).
    pub const LAUNCH_FAILED: i32 = 5;
    /// A bug inside the device, including a caught panic, and any later use of a buffer such a
    /// panic left half-rearranged (poisoned, until the host writes it whole or frees it).
    pub const INTERNAL: i32 = 6;

    /// The constant's name for a code, `None` for codes this ABI version does not define.
    pub fn name(code: i32) -> Option<&'static str> {
        match code {
            OK => Some("OK"),
            INVALID_ARGUMENT => Some("INVALID_ARGUMENT"),
            OUT_OF_MEMORY => Some("OUT_OF_MEMORY"),
            UNKNOWN_BUFFER => Some("UNKNOWN_BUFFER"),
            OUT_OF_BOUNDS => Some("OUT_OF_BOUNDS"),
            LAUNCH_FAILED => Some("LAUNCH_FAILED"),
            INTERNAL => Some("INTERNAL"),
            _ => None,
        }
    }
}

/// Element types; the first six follow the order of the WIT enum `program.dtype`.
///
/// The block-quantized types after them are ggml's (llama.cpp's) weight formats, stored block
/// by block exactly as a GGUF file holds them: a row of `K` elements is `K / block_elements()`
/// blocks. Only weights take them (the host uploads a GGUF tensor as it is), so the plugin
/// contract, whose buffers are activations and caches, does not name them.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // ggml's names: Q4_K, Q6_K
pub enum DType {
    F32 = 0,
    F16 = 1,
    BF16 = 2,
    I32 = 3,
    I64 = 4,
    U8 = 5,
    /// 32 elements: an f16 scale `d`, then 32 i8; `x = d * q`.
    Q8_0 = 6,
    /// 32 elements: an f16 scale `d`, then 16 bytes of nibbles; `x = d * (q - 8)`.
    Q4_0 = 7,
    /// 32 elements: f16 `d` and `m`, then 16 bytes of nibbles; `x = d * q + m`.
    Q4_1 = 8,
    /// 256 elements: f16 `d` and `dmin`, 12 bytes of eight 6-bit scales and mins, 128 bytes of
    /// nibbles; `x = d * scale * q - dmin * min` per 32 elements.
    Q4_K = 9,
    /// 256 elements: 128 bytes of low nibbles, 64 of high 2 bits, 16 i8 scales, an f16 `d`;
    /// `x = d * scale * (q - 32)` per 16 elements.
    Q6_K = 10,
}

impl DType {
    pub const ALL: [DType; 11] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4_K,
        DType::Q6_K,
    ];

    /// The block-quantized weight types.
    pub const BLOCK_QUANTIZED: [DType; 5] = [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4_K,
        DType::Q6_K,
    ];

    pub fn from_code(code: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|dtype| dtype.code() == code)
    }

    pub const fn code(self) -> u32 {
        self as u32
    }

    /// Bytes of one element, or of one block of [`DType::block_elements`] for the block types.
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::U8 => 1,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q4_K => 144,
            DType::Q6_K => 210,
        }
    }

    /// Elements one block holds: 1 for the plain types.
    pub const fn block_elements(self) -> u64 {
        match self {
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 32,
            DType::Q4_K | DType::Q6_K => 256,
            _ => 1,
        }
    }

    pub const fn is_block_quantized(self) -> bool {
        self.block_elements() > 1
    }

    /// Bytes of a tensor whose rows hold `row_len` elements, `rows` of them; `None` when a row
    /// is not a whole number of blocks or the size overflows.
    pub const fn tensor_bytes(self, rows: u64, row_len: u64) -> Option<u64> {
        let block = self.block_elements();
        if !row_len.is_multiple_of(block) {
            return None;
        }
        match (row_len / block).checked_mul(self.size_bytes()) {
            Some(row_bytes) => row_bytes.checked_mul(rows),
            None => None,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q4_K => "q4_k",
            DType::Q6_K => "q6_k",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a task uses a tensor argument; the order matches the WIT enum `program.arg-tag`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgTag {
    Input = 0,
    Output = 1,
    Inout = 2,
    OutputExisting = 3,
    NoDep = 4,
}

impl ArgTag {
    pub const ALL: [ArgTag; 5] = [
        ArgTag::Input,
        ArgTag::Output,
        ArgTag::Inout,
        ArgTag::OutputExisting,
        ArgTag::NoDep,
    ];

    pub fn from_code(code: u32) -> Option<ArgTag> {
        ArgTag::ALL.into_iter().find(|tag| tag.code() == code)
    }

    pub const fn code(self) -> u32 {
        self as u32
    }

    pub const fn name(self) -> &'static str {
        match self {
            ArgTag::Input => "INPUT",
            ArgTag::Output => "OUTPUT",
            ArgTag::Inout => "INOUT",
            ArgTag::OutputExisting => "OUTPUT_EXISTING",
            ArgTag::NoDep => "NO_DEP",
        }
    }
}

impl fmt::Display for ArgTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The opaque device state behind a handle; only the device library knows its layout.
#[repr(C)]
pub struct DeviceHandle {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

/// One tensor argument of a launch: a typed, shaped view into a device buffer.
///
/// `dtype` and `tag` stay raw codes because they arrive from foreign code; devices decode them
/// with [`DType::from_code`] and [`ArgTag::from_code`]. Entries of `shape` past `ndim` are ignored.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorArg {
    pub buffer: u64,
    /// Byte offset of the first element inside the buffer.
    pub offset: u64,
    pub dtype: u32,
    pub ndim: u32,
    pub shape: [u64; MAX_RANK],
    pub tag: u32,
}

impl TensorArg {
    /// A tensor argument, or an error when `shape` has more than [`MAX_RANK`] dimensions.
    pub fn new(
        buffer: u64,
        offset: u64,
        dtype: DType,
        shape: &[u64],
        tag: ArgTag,
    ) -> Result<TensorArg, RankError> {
        if shape.len() > MAX_RANK {
            return Err(RankError { rank: shape.len() });
        }
        let mut padded_shape = [0; MAX_RANK];
        padded_shape[..shape.len()].copy_from_slice(shape);
        Ok(TensorArg {
            buffer,
            offset,
            dtype: dtype.code(),
            ndim: shape.len() as u32,
            shape: padded_shape,
            tag: tag.code(),
        })
    }

    /// The first `ndim` entries of `shape` (all of them if `ndim` is out of range).
    pub fn dims(&self) -> &[u64] {
        let rank = (self.ndim as usize).min(MAX_RANK);
        &self.shape[..rank]
    }
}

/// A shape with more dimensions than a [`TensorArg`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankError {
    pub rank: usize,
}

impl fmt::Display for RankError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a tensor argument has at most {MAX_RANK} dimensions, got {}",
            self.rank
        )
    }
}

impl std::error::Error for RankError {}

/// Counters a device keeps since `open`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    pub allocations: u64,
    pub frees: u64,
    pub live_allocations: u64,
    pub live_bytes: u64,
    pub h2d_bytes: u64,
    pub h2d_calls: u64,
    pub d2h_bytes: u64,
    pub d2h_calls: u64,
    /// Launches that completed successfully, all callables together.
    pub launches: u64,
}

/// Opens a device. `config` is a NUL-terminated string whose format the device defines; null
/// means the empty string.
pub type OpenFn =
    unsafe extern "C" fn(config: *const c_char, out_handle: *mut *mut DeviceHandle) -> i32;
/// Releases every buffer and the handle itself. A null handle is ignored.
pub type CloseFn = unsafe extern "C" fn(handle: *mut DeviceHandle);
/// Allocates `bytes` zeroed bytes; ids are never 0 and never reused while the handle is open.
pub type AllocFn =
    unsafe extern "C" fn(handle: *mut DeviceHandle, bytes: u64, out_buffer: *mut u64) -> i32;
pub type FreeFn = unsafe extern "C" fn(handle: *mut DeviceHandle, buffer: u64) -> i32;
/// Host to device copy of `len` bytes into `buffer` at byte `offset`.
pub type WriteFn = unsafe extern "C" fn(
    handle: *mut DeviceHandle,
    buffer: u64,
    offset: u64,
    src: *const u8,
    len: u64,
) -> i32;
/// Device to host copy of `len` bytes from `buffer` at byte `offset`.
pub type ReadFn = unsafe extern "C" fn(
    handle: *mut DeviceHandle,
    buffer: u64,
    offset: u64,
    dst: *mut u8,
    len: u64,
) -> i32;
pub type CallableCountFn = unsafe extern "C" fn(handle: *mut DeviceHandle) -> u32;
/// A NUL-terminated name valid while the handle is open, or null for an index out of range.
pub type CallableNameFn =
    unsafe extern "C" fn(handle: *mut DeviceHandle, index: u32) -> *const c_char;
pub type LaunchFn = unsafe extern "C" fn(
    handle: *mut DeviceHandle,
    callable_index: u32,
    args: *const TensorArg,
    num_args: u32,
    params: *const i64,
    num_params: u32,
) -> i32;
/// Waits for all launched work; writes the device time spent since the previous synchronize.
pub type SynchronizeFn =
    unsafe extern "C" fn(handle: *mut DeviceHandle, out_device_ns: *mut u64) -> i32;
pub type StatsFn = unsafe extern "C" fn(handle: *mut DeviceHandle, out: *mut DeviceStats) -> i32;
/// Successful launches of one callable; 0 for an index out of range.
pub type CallableLaunchesFn = unsafe extern "C" fn(handle: *mut DeviceHandle, index: u32) -> u64;
/// Copies the last failure's message, truncated to `buf_len - 1` bytes and NUL-terminated, and
/// returns the full message length in bytes (like `snprintf`), so a caller can size its buffer.
pub type LastErrorFn =
    unsafe extern "C" fn(handle: *mut DeviceHandle, buf: *mut c_char, buf_len: usize) -> usize;

/// Writes the nanoseconds of device time spent in each callable's successful launches since
/// `open` into `out[..min(len, count)]` and returns the callable count `count`.
pub type CallableDeviceNsFn =
    unsafe extern "C" fn(handle: *mut DeviceHandle, out: *mut u64, len: u32) -> u32;

/// One byte range of a device buffer: a piece of a batched copy out (revision 1.2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyRange {
    pub buffer: u64,
    pub offset: u64,
    pub len: u64,
}

/// Revision 1.2: starts copying `ranges`, in order, into consecutive bytes of `dst` (exactly
/// `dst_len`, the ranges' total) and returns at once; the copy runs in the background while
/// launches go on. At most one copy is in flight per handle. Until `copy_out_poll` reports it
/// finished (or failed), or the handle is closed, the host promises:
/// * `dst` stays valid, and the host neither reads nor writes it;
/// * no launch or `write` writes a byte inside the ranges (launches may read them), and no
///   `free` names their buffers: the device refuses such a `free` and `write`.
///
/// The device resolves and checks every range before it returns, so a bad range fails here.
pub type CopyOutStartFn = unsafe extern "C" fn(
    handle: *mut DeviceHandle,
    ranges: *const CopyRange,
    num_ranges: u32,
    dst: *mut u8,
    dst_len: u64,
) -> i32;
/// Revision 1.2: writes 1 to `*out_done` once the copy `copy_out_start` began has finished,
/// which ends the host's promises, and 0 while it runs; with `wait` nonzero it returns only
/// when it finished. With no copy in flight it writes 1. A copy that failed returns its status
/// (the message in `last_error`); it is over too, and `dst` holds no defined bytes.
pub type CopyOutPollFn =
    unsafe extern "C" fn(handle: *mut DeviceHandle, wait: u32, out_done: *mut u32) -> i32;

/// The exported entry point: returns a pointer to a table that lives as long as the library.
pub type EntryFn = unsafe extern "C" fn() -> *const PlughostDeviceV1;

/// The prefix every table version starts with, so a host can read the version of a table whose
/// layout it does not know.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlughostDeviceHeader {
    pub abi_version: u32,
    /// `size_of` the whole table, so a host can refuse a table shorter than it expects.
    pub struct_size: u32,
}

/// The function table of ABI version 1. Entries are `Option` because a table written in C may
/// hold null pointers; a host checks every entry once at load.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PlughostDeviceV1 {
    pub abi_version: u32,
    pub struct_size: u32,
    pub open: Option<OpenFn>,
    pub close: Option<CloseFn>,
    pub alloc: Option<AllocFn>,
    pub free: Option<FreeFn>,
    pub write: Option<WriteFn>,
    pub read: Option<ReadFn>,
    pub callable_count: Option<CallableCountFn>,
    pub callable_name: Option<CallableNameFn>,
    pub launch: Option<LaunchFn>,
    pub synchronize: Option<SynchronizeFn>,
    pub stats: Option<StatsFn>,
    pub callable_launches: Option<CallableLaunchesFn>,
    pub last_error: Option<LastErrorFn>,
    /// Appended in revision 1.1: a host reads it only from a table whose `struct_size` covers
    /// it (see [`PlughostDeviceV1::MIN_SIZE`]); `None` means the device does not report it.
    pub callable_device_ns: Option<CallableDeviceNsFn>,
    /// Appended in revision 1.2, read only from a table whose `struct_size` covers them (see
    /// [`PlughostDeviceV1::SIZE_1_1`]): a batched copy out of device buffers that runs in the
    /// background. Both or neither: a device with neither keeps the host on synchronous
    /// `read`s.
    pub copy_out_start: Option<CopyOutStartFn>,
    pub copy_out_poll: Option<CopyOutPollFn>,
}

impl PlughostDeviceV1 {
    /// The `struct_size` a version 1 table of this revision carries.
    pub const SIZE: u32 = size_of::<PlughostDeviceV1>() as u32;
    /// The smallest `struct_size` a host accepts: the first revision's table, which ends
    /// before `callable_device_ns`.
    pub const MIN_SIZE: u32 = std::mem::offset_of!(PlughostDeviceV1, callable_device_ns) as u32;
    /// The `struct_size` of a revision 1.1 table, which ends before `copy_out_start`.
    pub const SIZE_1_1: u32 = std::mem::offset_of!(PlughostDeviceV1, copy_out_start) as u32;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::mem::offset_of;

    const HEADER: &str = include_str!("../include/plughost_device.h");

    /// Every `#define NAME VALUE` of the C header.
    fn header_defines() -> HashMap<String, String> {
        HEADER
            .lines()
            .filter_map(|line| line.trim().strip_prefix("#define "))
            .filter_map(|rest| {
                let mut words = rest.split_whitespace();
                Some((words.next()?.to_string(), words.next()?.to_string()))
            })
            .collect()
    }

    #[test]
    fn header_constants_match_rust() {
        let defines = header_defines();
        let mut expected: Vec<(String, u64)> = vec![
            (
                "PLUGHOST_DEVICE_ABI_VERSION".into(),
                PLUGHOST_DEVICE_ABI_VERSION.into(),
            ),
            ("PLUGHOST_MAX_RANK".into(), MAX_RANK as u64),
            (
                "PLUGHOST_TENSOR_ARG_SIZE".into(),
                size_of::<TensorArg>() as u64,
            ),
            (
                "PLUGHOST_TENSOR_ARG_OFFSET_OFFSET".into(),
                offset_of!(TensorArg, offset) as u64,
            ),
            (
                "PLUGHOST_TENSOR_ARG_OFFSET_DTYPE".into(),
                offset_of!(TensorArg, dtype) as u64,
            ),
            (
                "PLUGHOST_TENSOR_ARG_OFFSET_NDIM".into(),
                offset_of!(TensorArg, ndim) as u64,
            ),
            (
                "PLUGHOST_TENSOR_ARG_OFFSET_SHAPE".into(),
                offset_of!(TensorArg, shape) as u64,
            ),
            (
                "PLUGHOST_TENSOR_ARG_OFFSET_TAG".into(),
                offset_of!(TensorArg, tag) as u64,
            ),
            (
                "PLUGHOST_DEVICE_STATS_SIZE".into(),
                size_of::<DeviceStats>() as u64,
            ),
            (
                "PLUGHOST_DEVICE_STATS_OFFSET_LAUNCHES".into(),
                offset_of!(DeviceStats, launches) as u64,
            ),
            (
                "PLUGHOST_DEVICE_TABLE_V1_SIZE_LP64".into(),
                size_of::<PlughostDeviceV1>() as u64,
            ),
            (
                "PLUGHOST_DEVICE_TABLE_V1_OFFSET_LAST_ERROR_LP64".into(),
                offset_of!(PlughostDeviceV1, last_error) as u64,
            ),
            (
                "PLUGHOST_DEVICE_TABLE_V1_MIN_SIZE_LP64".into(),
                PlughostDeviceV1::MIN_SIZE.into(),
            ),
            (
                "PLUGHOST_DEVICE_TABLE_V1_SIZE_1_1_LP64".into(),
                PlughostDeviceV1::SIZE_1_1.into(),
            ),
            (
                "PLUGHOST_COPY_RANGE_SIZE".into(),
                size_of::<CopyRange>() as u64,
            ),
        ];
        for code in 0..=status::INTERNAL {
            let name = status::name(code).expect("status codes are dense");
            expected.push((format!("PLUGHOST_STATUS_{name}"), code as u64));
        }
        for dtype in DType::ALL {
            let name = dtype.name().to_uppercase();
            expected.push((format!("PLUGHOST_DTYPE_{name}"), dtype.code().into()));
        }
        for tag in ArgTag::ALL {
            expected.push((format!("PLUGHOST_TAG_{}", tag.name()), tag.code().into()));
        }

        for (name, value) in expected {
            if name.ends_with("_LP64") && cfg!(not(target_pointer_width = "64")) {
                continue;
            }
            let in_header = defines
                .get(&name)
                .unwrap_or_else(|| panic!("the header does not define {name}"));
            assert_eq!(in_header, &value.to_string(), "{name}");
        }
        assert_eq!(
            defines
                .get("PLUGHOST_DEVICE_ENTRY_SYMBOL")
                .map(String::as_str),
            Some(format!("\"{ENTRY_SYMBOL}\"").as_str())
        );
    }

    #[test]
    fn table_header_is_a_prefix_of_the_table() {
        assert_eq!(offset_of!(PlughostDeviceV1, abi_version), 0);
        assert_eq!(offset_of!(PlughostDeviceV1, struct_size), 4);
        assert_eq!(size_of::<PlughostDeviceHeader>(), 8);
    }

    #[test]
    fn codes_round_trip() {
        for dtype in DType::ALL {
            assert_eq!(DType::from_code(dtype.code()), Some(dtype));
        }
        for tag in ArgTag::ALL {
            assert_eq!(ArgTag::from_code(tag.code()), Some(tag));
        }
        assert_eq!(DType::from_code(11), None);
        assert_eq!(ArgTag::from_code(5), None);
        assert_eq!(status::name(7), None);
    }

    #[test]
    fn tensor_arg_new_pads_and_refuses_high_rank() {
        let arg = TensorArg::new(3, 16, DType::I32, &[2, 5], ArgTag::Output).unwrap();
        assert_eq!(arg.dims(), &[2, 5]);
        assert_eq!(arg.shape, [2, 5, 0, 0]);
        assert_eq!(arg.tag, ArgTag::Output.code());
        let error = TensorArg::new(3, 0, DType::F32, &[1; 5], ArgTag::Input).unwrap_err();
        assert_eq!(error.rank, 5);
    }
}
