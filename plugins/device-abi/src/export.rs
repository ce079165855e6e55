//! Exports a Rust device through the C ABI: handles, the buffer table, stats, last error, argument checks and panic containment, over the [`DeviceBackend`] trait.
//!
//! A device crate implements [`DeviceBackend`] (config parsing and the math of each callable)
//! and calls [`export_device!`](crate::export_device); everything else about the ABI lives here,
//! so every Rust device counts, checks and reports errors the same way.

use std::alloc::{self, Layout};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char};
use std::fmt;
use std::ops::{Deref, DerefMut, Range};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::{self, NonNull};
use std::slice;
use std::time::{Duration, Instant};

use crate::abi::{
    AllocFn, CallableCountFn, CallableLaunchesFn, CallableNameFn, CloseFn, DType, DeviceHandle,
    DeviceStats, FreeFn, LastErrorFn, LaunchFn, OpenFn, PLUGHOST_DEVICE_ABI_VERSION,
    PlughostDeviceV1, ReadFn, StatsFn, SynchronizeFn, TensorArg, WriteFn, status,
};
use crate::callables::{self, Access, CallableSpec, ParamKind};
use crate::elements;
use crate::validate::{self, ShapeBindings};

/// What a device implements; the export layer calls it only with checked arguments.
pub trait DeviceBackend: Send + Sized + 'static {
    /// Creates the device from the `open` config string (empty when the host passes none).
    fn open(config: &str) -> Result<Self, DeviceFailure>;

    /// Bytes the device can hold at once; an `alloc` past it fails with OUT_OF_MEMORY.
    fn memory_capacity(&self) -> u64 {
        u64::MAX
    }

    /// Runs one launch. Every argument already matches the callable's spec and fits its buffer.
    fn launch(&mut self, launch: &mut Launch<'_>) -> Result<(), DeviceFailure>;

    /// Puts a buffer that a launch left in an arrangement of the backend's own (see
    /// [`Launch::rearrange`]) back in the order the host wrote it; called before the host reads
    /// or writes any of its bytes. Backends that never rearrange are never asked.
    fn restore(&mut self, arrangement: u64, bytes: &mut [u8]) -> Result<(), DeviceFailure> {
        let _ = bytes;
        Err(DeviceFailure::internal(format!(
            "the device cannot restore its arrangement {arrangement}"
        )))
    }
}

/// The arrangement of a buffer as the host wrote it.
pub const AS_WRITTEN: u64 = 0;

/// A status code with its message; what crosses the ABI instead of a Rust error or panic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFailure {
    status: i32,
    message: String,
}

impl DeviceFailure {
    pub fn new(status: i32, message: impl Into<String>) -> DeviceFailure {
        DeviceFailure {
            status,
            message: message.into(),
        }
    }

    pub fn invalid_argument(message: impl Into<String>) -> DeviceFailure {
        DeviceFailure::new(status::INVALID_ARGUMENT, message)
    }

    pub fn launch_failed(message: impl Into<String>) -> DeviceFailure {
        DeviceFailure::new(status::LAUNCH_FAILED, message)
    }

    pub fn internal(message: impl Into<String>) -> DeviceFailure {
        DeviceFailure::new(status::INTERNAL, message)
    }

    pub fn status(&self) -> i32 {
        self.status
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// Prefixes the message with where it happened.
    pub fn context(self, prefix: impl fmt::Display) -> DeviceFailure {
        DeviceFailure {
            status: self.status,
            message: format!("{prefix}: {}", self.message),
        }
    }
}

impl fmt::Display for DeviceFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = status::name(self.status).unwrap_or("UNKNOWN");
        write!(f, "{name}: {}", self.message)
    }
}

impl std::error::Error for DeviceFailure {}

/// One launch as a device sees it: resolved shape symbols, params, and typed access to the
/// bytes of each argument.
///
/// Two ways to reach the elements: `read_*`/`write_*` copy out and copy in, so arguments that
/// alias the same buffer stay safe without thought; [`Launch::views`] borrows every argument in
/// place for devices whose memory is host memory. Asking for an argument, symbol or param the
/// spec does not have is a bug in the device and panics; the export layer turns that panic
/// into an INTERNAL error.
pub struct Launch<'a> {
    spec: &'static CallableSpec,
    args: Vec<ResolvedArg>,
    params: &'a [i64],
    shapes: ShapeBindings,
    buffers: &'a mut BufferTable,
    /// Copies of read-only arguments that overlap a written one, made by [`Launch::views`].
    snapshots: Vec<AlignedBytes>,
}

struct ResolvedArg {
    buffer: u64,
    bytes: Range<usize>,
    dtype: DType,
}

impl Launch<'_> {
    pub fn spec(&self) -> &'static CallableSpec {
        self.spec
    }

    /// The value of a shape symbol such as `"T"` or `"D"`.
    pub fn dim(&self, symbol: &str) -> usize {
        let value = self
            .shapes
            .get(symbol)
            .unwrap_or_else(|| panic!("`{}` has no shape symbol `{symbol}`", self.spec.name));
        usize::try_from(value).expect("a checked dimension fits in memory")
    }

    pub fn param(&self, name: &str) -> i64 {
        let index = self
            .spec
            .param_index(name)
            .unwrap_or_else(|| panic!("`{}` has no param `{name}`", self.spec.name));
        self.params[index]
    }

    /// A param passed as the bits of an f32.
    pub fn param_f32(&self, name: &str) -> f32 {
        let index = self
            .spec
            .param_index(name)
            .unwrap_or_else(|| panic!("`{}` has no param `{name}`", self.spec.name));
        assert_eq!(self.spec.params[index].kind, ParamKind::F32Bits);
        // The spec check guarantees the value fits in 32 bits.
        f32::from_bits(self.params[index] as u32)
    }

    pub fn dtype(&self, arg: &str) -> DType {
        self.arg(arg).dtype
    }

    /// The argument's bytes, without copying.
    pub fn bytes(&self, arg: &str) -> &[u8] {
        let resolved = self.arg(arg);
        &self.buffers.storage(resolved.buffer)[resolved.bytes.clone()]
    }

    /// The argument's elements as f32, widening f16 and bf16.
    pub fn read_f32(&self, arg: &str) -> Vec<f32> {
        elements::decode_float(self.dtype(arg), self.bytes(arg))
            .unwrap_or_else(|| panic!("argument `{arg}` is not a float tensor"))
    }

    pub fn read_i32(&self, arg: &str) -> Vec<i32> {
        assert_eq!(self.dtype(arg), DType::I32, "argument `{arg}`");
        elements::decode_i32(self.bytes(arg))
    }

    /// `count` f32 elements of a float argument starting at element `first`, widening f16 and
    /// bf16; for reading a few rows of a large tensor such as a KV cache.
    pub fn read_f32_at(&self, arg: &str, first: usize, count: usize) -> Vec<f32> {
        let size = self.dtype(arg).size_bytes() as usize;
        let bytes = &self.bytes(arg)[first * size..(first + count) * size];
        elements::decode_float(self.dtype(arg), bytes)
            .unwrap_or_else(|| panic!("argument `{arg}` is not a float tensor"))
    }

    /// Overwrites every element of an f32 argument.
    pub fn write_f32(&mut self, arg: &str, values: &[f32]) {
        assert_eq!(self.dtype(arg), DType::F32, "argument `{arg}`");
        self.write_bytes(arg, &elements::encode_f32(values));
    }

    /// Overwrites every element of an i32 argument.
    pub fn write_i32(&mut self, arg: &str, values: &[i32]) {
        assert_eq!(self.dtype(arg), DType::I32, "argument `{arg}`");
        self.write_bytes(arg, &elements::encode_i32(values));
    }

    /// Overwrites `values.len()` elements of a float argument starting at element `first`,
    /// rounding them to its dtype and leaving the rest as they are (a KV cache written at a few
    /// slots).
    pub fn write_float_at(&mut self, arg: &str, first: usize, values: &[f32]) {
        let dtype = self.dtype(arg);
        let bytes = elements::encode_float(dtype, values)
            .unwrap_or_else(|| panic!("argument `{arg}` is not a float tensor"));
        let (buffer, range) = {
            let resolved = self.arg(arg);
            (resolved.buffer, resolved.bytes.clone())
        };
        let start = range.start + first * dtype.size_bytes() as usize;
        let end = start + bytes.len();
        assert!(
            end <= range.end,
            "`{}` wrote past the end of `{arg}`",
            self.spec.name
        );
        self.buffers.storage_mut(buffer)[start..end].copy_from_slice(&bytes);
    }

    /// The arrangement of the whole buffer under `arg`: [`AS_WRITTEN`], or what a launch set
    /// with [`Launch::rearrange`].
    pub fn arrangement(&self, arg: &str) -> u64 {
        self.buffers.arrangement(self.arg(arg).buffer)
    }

    /// Whether `arg` spans its whole buffer, so rearranging the buffer moves no other
    /// argument's bytes.
    pub fn spans_buffer(&self, arg: &str) -> bool {
        let resolved = self.arg(arg);
        resolved.bytes == (0..self.buffers.storage(resolved.buffer).len())
    }

    /// Lets `change` move the bytes of the whole buffer under `arg` in place, and records that
    /// they are now in `arrangement` (a code of the backend's own; [`AS_WRITTEN`] when
    /// `change` restores the host's order). A device whose kernels read a tensor faster in
    /// another order (weights in panels) arranges it once and keeps it so: until the host
    /// reads or writes the buffer, when [`DeviceBackend::restore`] puts it back.
    pub fn rearrange(&mut self, arg: &str, arrangement: u64, change: impl FnOnce(&mut [u8])) {
        let buffer = self.arg(arg).buffer;
        change(self.buffers.storage_mut(buffer));
        self.buffers.set_arrangement(buffer, arrangement);
    }

    fn write_bytes(&mut self, arg: &str, bytes: &[u8]) {
        let (buffer, range) = {
            let resolved = self.arg(arg);
            (resolved.buffer, resolved.bytes.clone())
        };
        assert_eq!(
            bytes.len(),
            range.len(),
            "`{}` wrote the wrong number of bytes to `{arg}`",
            self.spec.name
        );
        self.buffers.storage_mut(buffer)[range].copy_from_slice(bytes);
    }

    /// Borrows every argument in place, without copying: arguments the callable only reads as
    /// shared slices, arguments it writes as exclusive ones (see [`ArgViews`]).
    ///
    /// Arguments may alias. A read-only argument whose bytes overlap a written one is copied
    /// first, so it shows the values from before the launch, as [`Launch::read_f32`] would. Two
    /// written arguments that overlap are refused with INVALID_ARGUMENT: the result would
    /// depend on the order of the kernel's writes. Elements are in native byte order, which is
    /// the ABI's little-endian order on every target this crate supports.
    pub fn views(&mut self) -> Result<ArgViews<'_>, DeviceFailure> {
        let snapshot_of = self.snapshot_overlapping_reads()?;
        let buffers = &mut *self.buffers;
        let snapshots = &self.snapshots;
        let mut views = Vec::with_capacity(self.args.len());
        for (index, resolved) in self.args.iter().enumerate() {
            let view = match snapshot_of[index] {
                Some(snapshot) => ArgView::Shared(&snapshots[snapshot]),
                None => {
                    let len = resolved.bytes.len();
                    // SAFETY: `base_ptr` is the start of the buffer's allocation, taken as a raw
                    // pointer so no reference to the whole buffer stays live, and `resolve_arg`
                    // checked that `bytes` lies inside it. Every exclusive slice made here is
                    // disjoint from every other slice into buffer memory: a read-only argument
                    // overlapping a written one now reads its snapshot, and overlapping written
                    // arguments were refused. The slices live as long as the exclusive borrow of
                    // `self`, the only path to the buffer table during a launch, and a buffer's
                    // allocation never moves or shrinks while it is allocated.
                    unsafe {
                        let start = buffers.base_ptr(resolved.buffer).add(resolved.bytes.start);
                        if self.spec.args[index].access == Access::Read {
                            ArgView::Shared(slice::from_raw_parts(start, len))
                        } else {
                            ArgView::Exclusive(Some(slice::from_raw_parts_mut(start, len)))
                        }
                    }
                }
            };
            views.push((view, resolved.dtype));
        }
        Ok(ArgViews {
            spec: self.spec,
            views,
        })
    }

    /// Copies each read-only argument that overlaps a written argument into `snapshots`, and
    /// returns for each argument the index of its snapshot.
    fn snapshot_overlapping_reads(&mut self) -> Result<Vec<Option<usize>>, DeviceFailure> {
        self.snapshots.clear();
        let mut snapshot_of = vec![None; self.args.len()];
        let written = |index: usize| self.spec.args[index].access != Access::Read;
        for first in 0..self.args.len() {
            for second in first + 1..self.args.len() {
                let (a, b) = (&self.args[first], &self.args[second]);
                let overlap = a.buffer == b.buffer
                    && a.bytes.start < b.bytes.end
                    && b.bytes.start < a.bytes.end;
                if !overlap {
                    continue;
                }
                let reader = match (written(first), written(second)) {
                    (true, true) => {
                        return Err(DeviceFailure::invalid_argument(format!(
                            "arguments `{}` and `{}` overlap in buffer {}, and the callable writes both",
                            self.spec.args[first].name, self.spec.args[second].name, a.buffer
                        )));
                    }
                    (true, false) => second,
                    (false, true) => first,
                    (false, false) => continue,
                };
                if snapshot_of[reader].is_none() {
                    let resolved = &self.args[reader];
                    let bytes = &self.buffers.storage(resolved.buffer)[resolved.bytes.clone()];
                    let copy = AlignedBytes::copy_of(bytes).map_err(|problem| {
                        DeviceFailure::new(
                            status::OUT_OF_MEMORY,
                            format!(
                                "copying argument `{}`, which overlaps a written argument: {problem}",
                                self.spec.args[reader].name
                            ),
                        )
                    })?;
                    snapshot_of[reader] = Some(self.snapshots.len());
                    self.snapshots.push(copy);
                }
            }
        }
        Ok(snapshot_of)
    }

    fn arg(&self, name: &str) -> &ResolvedArg {
        let index = self
            .spec
            .arg_index(name)
            .unwrap_or_else(|| panic!("`{}` has no argument `{name}`", self.spec.name));
        &self.args[index]
    }
}

/// The elements of a float argument in the dtype it was passed in; f16 and bf16 as raw bits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FloatSlice<'l> {
    F32(&'l [f32]),
    F16(&'l [u16]),
    BF16(&'l [u16]),
}

impl FloatSlice<'_> {
    pub fn len(&self) -> usize {
        match self {
            FloatSlice::F32(values) => values.len(),
            FloatSlice::F16(bits) | FloatSlice::BF16(bits) => bits.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A written float argument in the dtype it was passed in; f16 and bf16 as raw bits.
#[derive(Debug, PartialEq)]
pub enum FloatSliceMut<'l> {
    F32(&'l mut [f32]),
    F16(&'l mut [u16]),
    BF16(&'l mut [u16]),
}

/// Every argument of one launch, borrowed in place by [`Launch::views`].
///
/// Arguments the callable only reads come out shared (`f32`, `i32`, `float`), as often as
/// asked; arguments it writes or updates in place come out exclusive (`f32_mut`, `i32_mut`),
/// once each, so a kernel can hold its inputs and outputs at the same time. Asking for a dtype
/// the argument does not have, or for a written argument twice, is a bug in the device and
/// panics.
pub struct ArgViews<'l> {
    spec: &'static CallableSpec,
    views: Vec<(ArgView<'l>, DType)>,
}

enum ArgView<'l> {
    Shared(&'l [u8]),
    /// `None` once taken.
    Exclusive(Option<&'l mut [u8]>),
}

impl<'l> ArgViews<'l> {
    pub fn dtype(&self, arg: &str) -> DType {
        self.views[self.index(arg)].1
    }

    /// A read-only f32 argument.
    pub fn f32(&self, arg: &str) -> &'l [f32] {
        cast_slice(self.shared(arg, DType::F32))
    }

    /// A read-only i32 argument.
    pub fn i32(&self, arg: &str) -> &'l [i32] {
        cast_slice(self.shared(arg, DType::I32))
    }

    /// A read-only float argument in whichever of f32, f16 or bf16 it was passed.
    pub fn float(&self, arg: &str) -> FloatSlice<'l> {
        let dtype = self.dtype(arg);
        let bytes = self.shared(arg, dtype);
        match dtype {
            DType::F32 => FloatSlice::F32(cast_slice(bytes)),
            DType::F16 => FloatSlice::F16(cast_slice(bytes)),
            DType::BF16 => FloatSlice::BF16(cast_slice(bytes)),
            other => panic!("argument `{arg}` is {other}, not a float tensor"),
        }
    }

    /// A written f32 argument; its current contents are visible, so it also serves in-place
    /// updates.
    pub fn f32_mut(&mut self, arg: &str) -> &'l mut [f32] {
        cast_slice_mut(self.take_exclusive(arg, DType::F32))
    }

    /// A written float argument in whichever of f32, f16 or bf16 it was passed.
    pub fn float_mut(&mut self, arg: &str) -> FloatSliceMut<'l> {
        match self.dtype(arg) {
            DType::F32 => FloatSliceMut::F32(cast_slice_mut(self.take_exclusive(arg, DType::F32))),
            DType::F16 => FloatSliceMut::F16(cast_slice_mut(self.take_exclusive(arg, DType::F16))),
            DType::BF16 => {
                FloatSliceMut::BF16(cast_slice_mut(self.take_exclusive(arg, DType::BF16)))
            }
            other => panic!("argument `{arg}` is {other}, not a float tensor"),
        }
    }

    pub fn i32_mut(&mut self, arg: &str) -> &'l mut [i32] {
        cast_slice_mut(self.take_exclusive(arg, DType::I32))
    }

    fn index(&self, arg: &str) -> usize {
        self.spec
            .arg_index(arg)
            .unwrap_or_else(|| panic!("`{}` has no argument `{arg}`", self.spec.name))
    }

    fn shared(&self, arg: &str, dtype: DType) -> &'l [u8] {
        match self.views[self.index(arg)] {
            (ArgView::Shared(bytes), actual) if actual == dtype => bytes,
            (ArgView::Shared(_), actual) => panic!("argument `{arg}` is {actual}, not {dtype}"),
            (ArgView::Exclusive(_), _) => {
                panic!("argument `{arg}` is written by the callable; borrow it exclusively")
            }
        }
    }

    fn take_exclusive(&mut self, arg: &str, dtype: DType) -> &'l mut [u8] {
        let index = self.index(arg);
        match &mut self.views[index] {
            (ArgView::Exclusive(slot), actual) if *actual == dtype => slot
                .take()
                .unwrap_or_else(|| panic!("argument `{arg}` was already borrowed")),
            (ArgView::Exclusive(_), actual) => panic!("argument `{arg}` is {actual}, not {dtype}"),
            (ArgView::Shared(_), _) => {
                panic!(
                    "argument `{arg}` is only read by the callable; it cannot be borrowed mutably"
                )
            }
        }
    }
}

/// Elements that every bit pattern of their size is a valid value of.
trait PlainElement: Copy {}
impl PlainElement for f32 {}
impl PlainElement for i32 {}
impl PlainElement for u16 {}

fn cast_slice<T: PlainElement>(bytes: &[u8]) -> &[T] {
    let start = bytes.as_ptr().cast::<T>();
    assert!(start.is_aligned() && bytes.len().is_multiple_of(size_of::<T>()));
    // SAFETY: aligned (buffers are 64-byte aligned and offsets a multiple of the element size,
    // checked again above), in bounds, and any bit pattern is a valid `T`.
    unsafe { slice::from_raw_parts(start, bytes.len() / size_of::<T>()) }
}

fn cast_slice_mut<T: PlainElement>(bytes: &mut [u8]) -> &mut [T] {
    let start = bytes.as_mut_ptr().cast::<T>();
    assert!(start.is_aligned() && bytes.len().is_multiple_of(size_of::<T>()));
    // SAFETY: as in `cast_slice`; the exclusive borrow moves from the bytes to the elements.
    unsafe { slice::from_raw_parts_mut(start, bytes.len() / size_of::<T>()) }
}

/// The bytes of one device buffer: zeroed when allocated and 64-byte aligned, so a device can
/// view them in place as f32, i32 or 16-bit elements, with rows starting on a cache line.
struct AlignedBytes {
    /// The start of the allocation, or an aligned dangling pointer when `len` is 0.
    start: NonNull<u8>,
    len: usize,
}

// SAFETY: `AlignedBytes` owns its allocation exclusively, as a `Vec<u8>` does.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access only reads, as with a `Vec<u8>`.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    const ALIGN: usize = 64;

    /// `len` zero bytes. Large allocations come from the allocator's zeroed pages, so memory
    /// is touched only when used.
    fn zeroed(len: usize) -> Result<AlignedBytes, String> {
        if len == 0 {
            #[repr(align(64))]
            struct CacheLine;
            return Ok(AlignedBytes {
                start: NonNull::<CacheLine>::dangling().cast(),
                len,
            });
        }
        let layout = Layout::from_size_align(len, Self::ALIGN).map_err(|e| e.to_string())?;
        // SAFETY: the layout's size is not zero.
        let start = unsafe { alloc::alloc_zeroed(layout) };
        let start = NonNull::new(start).ok_or("the system allocator has no memory left")?;
        Ok(AlignedBytes { start, len })
    }

    fn copy_of(bytes: &[u8]) -> Result<AlignedBytes, String> {
        let mut copy = AlignedBytes::zeroed(bytes.len())?;
        copy.copy_from_slice(bytes);
        Ok(copy)
    }

    /// The start of the allocation, without making a reference to its bytes.
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.start.as_ptr()
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: allocated in `zeroed` with this layout, which was valid then.
            unsafe {
                let layout = Layout::from_size_align_unchecked(self.len, Self::ALIGN);
                alloc::dealloc(self.start.as_ptr(), layout);
            }
        }
    }
}

impl Deref for AlignedBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `start` is valid for `len` initialized bytes (or dangling and aligned for 0).
        unsafe { slice::from_raw_parts(self.start.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { slice::from_raw_parts_mut(self.start.as_ptr(), self.len) }
    }
}

/// Device buffers by id. Ids start at 1 and are never reused, so a stale id cannot alias a
/// newer buffer.
#[derive(Default)]
struct BufferTable {
    last_id: u64,
    buffers: HashMap<u64, AlignedBytes>,
    /// The buffers a launch rearranged, with their arrangement; the rest are as written.
    arrangements: HashMap<u64, u64>,
}

impl BufferTable {
    fn insert(&mut self, storage: AlignedBytes) -> u64 {
        self.last_id += 1;
        self.buffers.insert(self.last_id, storage);
        self.last_id
    }

    fn remove(&mut self, id: u64) -> Result<AlignedBytes, DeviceFailure> {
        self.arrangements.remove(&id);
        self.buffers.remove(&id).ok_or_else(|| unknown_buffer(id))
    }

    fn arrangement(&self, id: u64) -> u64 {
        self.arrangements.get(&id).copied().unwrap_or(AS_WRITTEN)
    }

    fn set_arrangement(&mut self, id: u64, arrangement: u64) {
        if arrangement == AS_WRITTEN {
            self.arrangements.remove(&id);
        } else {
            self.arrangements.insert(id, arrangement);
        }
    }

    fn get(&self, id: u64) -> Result<&AlignedBytes, DeviceFailure> {
        self.buffers.get(&id).ok_or_else(|| unknown_buffer(id))
    }

    fn get_mut(&mut self, id: u64) -> Result<&mut AlignedBytes, DeviceFailure> {
        self.buffers.get_mut(&id).ok_or_else(|| unknown_buffer(id))
    }

    /// A buffer that a launch already resolved; its absence is a bug in this module.
    fn storage(&self, id: u64) -> &[u8] {
        self.buffers.get(&id).expect("launch buffers stay alive")
    }

    fn storage_mut(&mut self, id: u64) -> &mut [u8] {
        self.buffers
            .get_mut(&id)
            .expect("launch buffers stay alive")
    }

    /// The start of a buffer that a launch already resolved, as a raw pointer.
    fn base_ptr(&mut self, id: u64) -> *mut u8 {
        self.buffers
            .get_mut(&id)
            .expect("launch buffers stay alive")
            .as_mut_ptr()
    }
}

fn unknown_buffer(id: u64) -> DeviceFailure {
    DeviceFailure::new(status::UNKNOWN_BUFFER, format!("unknown buffer {id}"))
}

/// The byte range `offset..offset+len` of a buffer of `buffer_len` bytes, if it fits.
fn checked_range(
    buffer: u64,
    buffer_len: usize,
    offset: u64,
    len: u64,
) -> Result<Range<usize>, DeviceFailure> {
    let out_of_bounds = || {
        let end = offset as u128 + len as u128;
        DeviceFailure::new(
            status::OUT_OF_BOUNDS,
            format!("bytes {offset}..{end} do not fit in buffer {buffer} of {buffer_len} bytes"),
        )
    };
    let end = offset.checked_add(len).ok_or_else(out_of_bounds)?;
    let start = usize::try_from(offset).map_err(|_| out_of_bounds())?;
    let end = usize::try_from(end).map_err(|_| out_of_bounds())?;
    if end > buffer_len {
        return Err(out_of_bounds());
    }
    Ok(start..end)
}

/// Everything behind one handle.
struct DeviceState<B> {
    backend: B,
    buffers: BufferTable,
    stats: DeviceStats,
    launches_by_callable: Vec<u64>,
    callable_names: Vec<CString>,
    /// Launch time not yet reported by `synchronize`.
    unreported_device_time: Duration,
    last_error: String,
}

impl<B: DeviceBackend> DeviceState<B> {
    fn new(backend: B) -> DeviceState<B> {
        let callable_names = callables::ALL
            .iter()
            .map(|spec| CString::new(spec.name).expect("callable names have no NUL"))
            .collect();
        DeviceState {
            backend,
            buffers: BufferTable::default(),
            stats: DeviceStats::default(),
            launches_by_callable: vec![0; callables::ALL.len()],
            callable_names,
            unreported_device_time: Duration::ZERO,
            last_error: String::new(),
        }
    }

    fn alloc(&mut self, bytes: u64) -> Result<u64, DeviceFailure> {
        let out_of_memory = |detail: String| {
            DeviceFailure::new(
                status::OUT_OF_MEMORY,
                format!("alloc of {bytes} bytes: {detail}"),
            )
        };
        let capacity = self.backend.memory_capacity();
        let available = capacity.saturating_sub(self.stats.live_bytes);
        if bytes > available {
            return Err(out_of_memory(format!(
                "only {available} of {capacity} bytes are free"
            )));
        }
        let len = usize::try_from(bytes)
            .map_err(|_| out_of_memory("larger than the address space".into()))?;
        let storage = AlignedBytes::zeroed(len).map_err(out_of_memory)?;
        let id = self.buffers.insert(storage);
        self.stats.allocations += 1;
        self.stats.live_allocations += 1;
        self.stats.live_bytes += bytes;
        Ok(id)
    }

    fn free(&mut self, buffer: u64) -> Result<(), DeviceFailure> {
        let storage = self.buffers.remove(buffer).map_err(|f| f.context("free"))?;
        self.stats.frees += 1;
        self.stats.live_allocations -= 1;
        self.stats.live_bytes -= storage.len() as u64;
        Ok(())
    }

    /// Puts a buffer the backend rearranged back in the order the host wrote it.
    fn restore(&mut self, buffer: u64) -> Result<(), DeviceFailure> {
        let arrangement = self.buffers.arrangement(buffer);
        if arrangement != AS_WRITTEN {
            let storage = self.buffers.get_mut(buffer)?;
            self.backend.restore(arrangement, storage)?;
            self.buffers.set_arrangement(buffer, AS_WRITTEN);
        }
        Ok(())
    }

    fn write(&mut self, buffer: u64, offset: u64, src: &[u8]) -> Result<(), DeviceFailure> {
        self.restore(buffer).map_err(|f| f.context("write"))?;
        let storage = self
            .buffers
            .get_mut(buffer)
            .map_err(|f| f.context("write"))?;
        let range = checked_range(buffer, storage.len(), offset, src.len() as u64)
            .map_err(|f| f.context("write"))?;
        storage[range].copy_from_slice(src);
        self.stats.h2d_bytes += src.len() as u64;
        self.stats.h2d_calls += 1;
        Ok(())
    }

    fn read(&mut self, buffer: u64, offset: u64, dst: &mut [u8]) -> Result<(), DeviceFailure> {
        self.restore(buffer).map_err(|f| f.context("read"))?;
        let storage = self.buffers.get(buffer).map_err(|f| f.context("read"))?;
        let range = checked_range(buffer, storage.len(), offset, dst.len() as u64)
            .map_err(|f| f.context("read"))?;
        dst.copy_from_slice(&storage[range]);
        self.stats.d2h_bytes += dst.len() as u64;
        self.stats.d2h_calls += 1;
        Ok(())
    }

    fn launch(
        &mut self,
        callable_index: u32,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<(), DeviceFailure> {
        let index = callable_index as usize;
        let spec = callables::ALL.get(index).ok_or_else(|| {
            DeviceFailure::invalid_argument(format!(
                "launch: unknown callable index {callable_index}, the device has {}",
                callables::ALL.len()
            ))
        })?;
        self.launch_checked(index, spec, args, params)
            .map_err(|failure| failure.context(format_args!("launch `{}`", spec.name)))
    }

    fn launch_checked(
        &mut self,
        index: usize,
        spec: &'static CallableSpec,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<(), DeviceFailure> {
        let shapes =
            validate::check_launch(spec, args, params).map_err(DeviceFailure::invalid_argument)?;
        let resolved = args
            .iter()
            .enumerate()
            .map(|(arg_index, arg)| {
                self.resolve_arg(arg).map_err(|failure| {
                    let name = spec.args[arg_index].name;
                    failure.context(format_args!("argument `{name}` (#{arg_index})"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut launch = Launch {
            spec,
            args: resolved,
            params,
            shapes,
            buffers: &mut self.buffers,
            snapshots: Vec::new(),
        };
        let started = Instant::now();
        let outcome = self.backend.launch(&mut launch);
        self.unreported_device_time += started.elapsed();
        outcome?;
        self.stats.launches += 1;
        self.launches_by_callable[index] += 1;
        Ok(())
    }

    /// Finds the argument's buffer and checks that its elements fit inside it.
    fn resolve_arg(&self, arg: &TensorArg) -> Result<ResolvedArg, DeviceFailure> {
        let dtype = DType::from_code(arg.dtype)
            .ok_or_else(|| DeviceFailure::internal("dtype passed the spec check but is unknown"))?;
        let too_large = || DeviceFailure::new(status::OUT_OF_BOUNDS, "the shape is too large");
        let elements = arg
            .dims()
            .iter()
            .try_fold(1u64, |count, &dim| count.checked_mul(dim))
            .ok_or_else(too_large)?;
        let len = elements
            .checked_mul(dtype.size_bytes())
            .ok_or_else(too_large)?;
        if !arg.offset.is_multiple_of(dtype.size_bytes()) {
            return Err(DeviceFailure::invalid_argument(format!(
                "offset {} is not a multiple of the {dtype} size ({} bytes)",
                arg.offset,
                dtype.size_bytes()
            )));
        }
        let storage = self.buffers.get(arg.buffer)?;
        let bytes = checked_range(arg.buffer, storage.len(), arg.offset, len)?;
        Ok(ResolvedArg {
            buffer: arg.buffer,
            bytes,
            dtype,
        })
    }

    fn take_device_time(&mut self) -> Duration {
        std::mem::take(&mut self.unreported_device_time)
    }
}

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
fn contain<T>(
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
            // SAFETY: as above; `body` no longer borrows the state.
            unsafe { (*state).last_error = failure.message };
            failure.status
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
            record_handleless_error(failure.message);
            failure.status
        }
    }
}

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

unsafe extern "C" fn free<B: DeviceBackend>(handle: *mut DeviceHandle, buffer: u64) -> i32 {
    // SAFETY: forwarded ABI contract.
    unsafe { with_state::<B>(handle, "free", |state| state.free(buffer)) }
}

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

/// Every Rust device provides the shared callable table, so the count needs no state.
unsafe extern "C" fn callable_count(handle: *mut DeviceHandle) -> u32 {
    if handle.is_null() {
        return 0;
    }
    callables::ALL.len() as u32
}

unsafe extern "C" fn callable_name<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    index: u32,
) -> *const c_char {
    let state = handle.cast::<DeviceState<B>>();
    if state.is_null() {
        return ptr::null();
    }
    // SAFETY: a live handle; the names live as long as it does.
    let names = unsafe { &(*state).callable_names };
    names
        .get(index as usize)
        .map_or(ptr::null(), |name| name.as_ptr())
}

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
            *out = state.stats;
            Ok(())
        })
    }
}

unsafe extern "C" fn callable_launches<B: DeviceBackend>(
    handle: *mut DeviceHandle,
    index: u32,
) -> u64 {
    let state = handle.cast::<DeviceState<B>>();
    if state.is_null() {
        return 0;
    }
    // SAFETY: a live handle that no other call is using.
    let launches = unsafe { &(*state).launches_by_callable };
    launches.get(index as usize).copied().unwrap_or(0)
}

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
            copy_message(&(*state).last_error, buf, buf_len)
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
        last_error: Some(last_error::<B> as LastErrorFn),
    }
}

/// Exports `plughost_device_v1` for a [`DeviceBackend`] type. Use it once per cdylib.
#[macro_export]
macro_rules! export_device {
    ($backend:ty) => {
        /// The device entry point: the function table of this library.
        #[unsafe(no_mangle)]
        pub extern "C" fn plughost_device_v1() -> *const $crate::PlughostDeviceV1 {
            static TABLE: $crate::PlughostDeviceV1 = $crate::export::device_table::<$backend>();
            &TABLE
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::ArgTag;

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
            let code = unsafe { (TABLE.open.unwrap())(config.as_ptr(), &mut handle) };
            if code != status::OK {
                return Err((code, Caller::error_of(ptr::null_mut())));
            }
            Ok(Caller { handle })
        }

        fn error_of(handle: *mut DeviceHandle) -> String {
            let len = unsafe { (TABLE.last_error.unwrap())(handle, ptr::null_mut(), 0) };
            let mut buf = vec![0u8; len + 1];
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
            self.check(unsafe { (TABLE.alloc.unwrap())(self.handle, bytes, &mut id) })?;
            Ok(id)
        }

        fn write_f32(&self, id: u64, values: &[f32]) -> Result<(), (i32, String)> {
            let bytes = elements::encode_f32(values);
            self.check(unsafe {
                (TABLE.write.unwrap())(self.handle, id, 0, bytes.as_ptr(), bytes.len() as u64)
            })
        }

        fn read_f32(&self, id: u64, count: usize) -> Result<Vec<f32>, (i32, String)> {
            let mut bytes = vec![0u8; count * 4];
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
            self.check(unsafe {
                (TABLE.launch.unwrap())(self.handle, index as u32, args.as_ptr(), 2, ptr::null(), 0)
            })
        }

        fn stats(&self) -> DeviceStats {
            let mut stats = DeviceStats::default();
            self.check(unsafe { (TABLE.stats.unwrap())(self.handle, &mut stats) })
                .unwrap();
            stats
        }
    }

    impl Drop for Caller {
        fn drop(&mut self) {
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

    /// `add` that keeps `y` (when it spans its buffer) with its elements reversed, as a device
    /// keeps weights in an order of its own.
    struct ReversesY;

    const REVERSED: u64 = 7;

    fn reverse_f32(bytes: &mut [u8]) {
        let mut values = elements::decode_float(DType::F32, bytes).unwrap();
        values.reverse();
        bytes.copy_from_slice(&elements::encode_f32(&values));
    }

    impl DeviceBackend for ReversesY {
        fn open(_config: &str) -> Result<Self, DeviceFailure> {
            Ok(ReversesY)
        }

        fn launch(&mut self, launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
            if launch.spans_buffer("y") && launch.arrangement("y") == AS_WRITTEN {
                launch.rearrange("y", REVERSED, reverse_f32);
            }
            let mut y = launch.read_f32("y");
            if launch.arrangement("y") == REVERSED {
                y.reverse();
            }
            let x: Vec<f32> = launch
                .read_f32("x")
                .iter()
                .zip(&y)
                .map(|(a, b)| a + b)
                .collect();
            launch.write_f32("x", &x);
            Ok(())
        }

        fn restore(&mut self, arrangement: u64, bytes: &mut [u8]) -> Result<(), DeviceFailure> {
            assert_eq!(arrangement, REVERSED);
            reverse_f32(bytes);
            Ok(())
        }
    }

    #[test]
    fn a_rearranged_buffer_is_restored_before_the_host_touches_it() {
        let mut state = DeviceState::new(ReversesY);
        let x = state.alloc(12).unwrap();
        let y = state.alloc(12).unwrap();
        state.write(x, 0, &elements::encode_f32(&[0.0; 3])).unwrap();
        state
            .write(y, 0, &elements::encode_f32(&[1.0, 2.0, 3.0]))
            .unwrap();
        let add = |state: &mut DeviceState<ReversesY>| {
            let (index, _) = callables::by_name("add").unwrap();
            let args = [
                TensorArg::new(x, 0, DType::F32, &[1, 3], ArgTag::Inout).unwrap(),
                TensorArg::new(y, 0, DType::F32, &[1, 3], ArgTag::Input).unwrap(),
            ];
            state.launch(index as u32, &args, &[]).unwrap();
        };
        let read = |state: &mut DeviceState<ReversesY>, buffer| {
            let mut bytes = vec![0; 12];
            state.read(buffer, 0, &mut bytes).unwrap();
            elements::decode_float(DType::F32, &bytes).unwrap()
        };
        add(&mut state);
        assert_eq!(state.buffers.arrangement(y), REVERSED);
        add(&mut state);
        assert_eq!(read(&mut state, x), [2.0, 4.0, 6.0]);
        assert_eq!(read(&mut state, y), [1.0, 2.0, 3.0]);
        assert_eq!(state.buffers.arrangement(y), AS_WRITTEN);
        // A write into part of a rearranged buffer lands where the host meant it.
        add(&mut state);
        state.write(y, 4, &elements::encode_f32(&[5.0])).unwrap();
        assert_eq!(read(&mut state, y), [1.0, 5.0, 3.0]);
        add(&mut state);
        assert_eq!(read(&mut state, x), [4.0, 11.0, 12.0]);
        state.free(y).unwrap();
        assert!(state.buffers.arrangements.is_empty());
    }

    /// `add` through [`Launch::views`]; `rotary` borrows `q` and `k` and leaves them as they are.
    struct InPlace;

    impl DeviceBackend for InPlace {
        fn open(_config: &str) -> Result<Self, DeviceFailure> {
            Ok(InPlace)
        }

        fn launch(&mut self, launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
            let mut views = launch.views()?;
            match views.spec.name {
                "add" => {
                    let y = views.f32("y");
                    let x = views.f32_mut("x");
                    assert_eq!(x.as_ptr() as usize % 4, 0);
                    for (x, y) in x.iter_mut().zip(y) {
                        *x += y;
                    }
                }
                "rotary" => {
                    views.f32_mut("q");
                    views.f32_mut("k");
                    views.f32_mut("k");
                }
                other => panic!("InPlace does not run `{other}`"),
            }
            Ok(())
        }
    }

    fn f32_arg(buffer: u64, first: u64, shape: &[u64], tag: ArgTag) -> TensorArg {
        TensorArg::new(buffer, first * 4, DType::F32, shape, tag).unwrap()
    }

    fn run(
        state: &mut DeviceState<InPlace>,
        name: &str,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<(), DeviceFailure> {
        let (index, _) = callables::by_name(name).unwrap();
        // As the C entry point does, so a panic comes back as an INTERNAL failure.
        contain("launch", || state.launch(index as u32, args, params))
    }

    fn read_all(state: &mut DeviceState<InPlace>, buffer: u64, count: usize) -> Vec<f32> {
        let mut bytes = vec![0; count * 4];
        state.read(buffer, 0, &mut bytes).unwrap();
        elements::decode_float(DType::F32, &bytes).unwrap()
    }

    #[test]
    fn views_borrow_in_place_and_snapshot_aliased_reads() {
        let mut state = DeviceState::new(InPlace);
        let x = state.alloc(16).unwrap();
        let y = state.alloc(16).unwrap();
        assert_eq!(state.buffers.storage(x).as_ptr() as usize % 64, 0);
        let reset = |state: &mut DeviceState<InPlace>| {
            state
                .write(x, 0, &elements::encode_f32(&[1.0, 2.0, 3.0, 4.0]))
                .unwrap();
            state
                .write(y, 0, &elements::encode_f32(&[10.0, 20.0, 30.0, 40.0]))
                .unwrap();
        };
        let (inout, input) = (ArgTag::Inout, ArgTag::Input);
        let cases: [(&str, [TensorArg; 2], [f32; 4]); 3] = [
            (
                "distinct buffers",
                [f32_arg(x, 0, &[1, 4], inout), f32_arg(y, 0, &[1, 4], input)],
                [11.0, 22.0, 33.0, 44.0],
            ),
            (
                "y is x",
                [f32_arg(x, 0, &[1, 4], inout), f32_arg(x, 0, &[1, 4], input)],
                [2.0, 4.0, 6.0, 8.0],
            ),
            (
                "y overlaps x shifted by one element",
                [f32_arg(x, 1, &[1, 3], inout), f32_arg(x, 0, &[1, 3], input)],
                // x[1..4] += old x[0..3]
                [1.0, 3.0, 5.0, 7.0],
            ),
        ];
        for (what, args, expected) in cases {
            reset(&mut state);
            run(&mut state, "add", &args, &[]).unwrap();
            assert_eq!(read_all(&mut state, x, 4), expected, "{what}");
        }
    }

    #[test]
    fn overlapping_written_arguments_are_refused() {
        let mut state = DeviceState::new(InPlace);
        let buffer = state.alloc(64).unwrap();
        let positions = state.alloc(4).unwrap();
        let rotary = |q_first: u64, k_first: u64| {
            [
                f32_arg(buffer, q_first, &[1, 4], ArgTag::Inout),
                f32_arg(buffer, k_first, &[1, 4], ArgTag::Inout),
                TensorArg::new(positions, 0, DType::I32, &[1], ArgTag::Input).unwrap(),
            ]
        };
        let params = [4, 0];
        let error = run(&mut state, "rotary", &rotary(0, 2), &params).unwrap_err();
        assert_eq!(error.status(), status::INVALID_ARGUMENT);
        assert_eq!(
            error.message(),
            format!(
                "launch `rotary`: arguments `q` and `k` overlap in buffer {buffer}, and the callable writes both"
            )
        );
        // Disjoint ranges of one buffer are fine; borrowing `k` twice is a device bug.
        let error = run(&mut state, "rotary", &rotary(0, 4), &params).unwrap_err();
        assert_eq!(error.status(), status::INTERNAL);
        assert!(
            error.message().contains("`k` was already borrowed"),
            "{error}"
        );
    }

    #[test]
    fn aligned_bytes_are_zeroed_and_aligned() {
        for len in [0, 1, 63, 64, 4097] {
            let bytes = AlignedBytes::zeroed(len).unwrap();
            assert_eq!(bytes.len(), len);
            assert_eq!(bytes.as_ptr() as usize % AlignedBytes::ALIGN, 0, "{len}");
            assert!(bytes.iter().all(|&byte| byte == 0));
            let copy = AlignedBytes::copy_of(&bytes).unwrap();
            assert_eq!(&copy[..], &bytes[..]);
        }
    }

    #[test]
    fn last_error_truncates_and_terminates() {
        let message = "hello";
        let mut buf = [0x7f as c_char; 4];
        let len = unsafe { copy_message(message, buf.as_mut_ptr(), buf.len()) };
        assert_eq!(len, 5);
        assert_eq!(buf.map(|byte| byte as u8), *b"hel\0");
    }
}
