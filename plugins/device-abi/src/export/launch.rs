//! [`Launch`]: one launch as a device sees it, its arguments resolved to checked byte ranges of their buffers.

use std::ops::Range;
use std::slice;

use smallvec::SmallVec;

use crate::abi::{DType, TensorArg, status};
use crate::callables::{Access, CallableSpec, MAX_ARGS, ParamKind};
use crate::elements;
use crate::validate::ShapeBindings;

use super::DeviceFailure;
use super::buffers::{AlignedBytes, BufferTable, checked_range};
use super::views::{ArgView, ArgViews, ViewList, raw_rows};

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
    args: ResolvedArgs,
    params: &'a [i64],
    shapes: &'a ShapeBindings,
    buffers: &'a mut BufferTable,
    /// Copies of read-only arguments that overlap a written one, made by [`Launch::views`].
    snapshots: Vec<AlignedBytes>,
}

/// A launch's arguments, resolved; inline, so launching allocates nothing.
pub(super) type ResolvedArgs = SmallVec<[ResolvedArg; MAX_ARGS]>;

/// One argument of a launch: its buffer, the byte range it covers and its dtype.
pub(super) struct ResolvedArg {
    buffer: u64,
    bytes: Range<usize>,
    dtype: DType,
}

impl ResolvedArg {
    /// Finds the argument's buffer and checks that its elements fit inside it, and that the
    /// buffer's bytes are in a known order.
    pub(super) fn resolve(
        buffers: &BufferTable,
        arg: &TensorArg,
    ) -> Result<ResolvedArg, DeviceFailure> {
        let dtype = DType::from_code(arg.dtype)
            .ok_or_else(|| DeviceFailure::internal("dtype passed the spec check but is unknown"))?;
        let too_large = || DeviceFailure::new(status::OUT_OF_BOUNDS, "the shape is too large");
        let (row_len, outer) = arg
            .dims()
            .split_last()
            .map_or((1, &[][..]), |(l, o)| (*l, o));
        let rows = outer
            .iter()
            .try_fold(1u64, |count, &dim| count.checked_mul(dim))
            .ok_or_else(too_large)?;
        if !row_len.is_multiple_of(dtype.block_elements()) {
            return Err(DeviceFailure::invalid_argument(format!(
                "rows of {row_len} {dtype} elements are not whole blocks of {}",
                dtype.block_elements()
            )));
        }
        let len = dtype.tensor_bytes(rows, row_len).ok_or_else(too_large)?;
        if !arg.offset.is_multiple_of(dtype.size_bytes()) {
            return Err(DeviceFailure::invalid_argument(format!(
                "offset {} is not a multiple of the {dtype} size ({} bytes)",
                arg.offset,
                dtype.size_bytes()
            )));
        }
        let storage = buffers.get(arg.buffer)?;
        let bytes = checked_range(arg.buffer, storage.len(), arg.offset, len)?;
        buffers.check_not_poisoned(arg.buffer)?;
        Ok(ResolvedArg {
            buffer: arg.buffer,
            bytes,
            dtype,
        })
    }
}

impl<'a> Launch<'a> {
    /// A launch of `spec` over arguments resolved in `buffers`, whose shapes and params passed
    /// the spec check.
    pub(super) fn new(
        spec: &'static CallableSpec,
        args: ResolvedArgs,
        params: &'a [i64],
        shapes: &'a ShapeBindings,
        buffers: &'a mut BufferTable,
    ) -> Launch<'a> {
        Launch {
            spec,
            args,
            params,
            shapes,
            buffers,
            snapshots: Vec::new(),
        }
    }
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

    /// A trailing table of f32 params (one entry per pair along its symbol); inline up to 128
    /// entries (head dims up to 256), so the rotary's table never reaches the allocator.
    pub fn param_f32_table(&self, name: &str) -> SmallVec<[f32; 128]> {
        let index = self
            .spec
            .param_index(name)
            .unwrap_or_else(|| panic!("`{}` has no param `{name}`", self.spec.name));
        assert!(matches!(
            self.spec.params[index].kind,
            ParamKind::F32PerPair(_)
        ));
        // The spec check guarantees every entry fits in 32 bits.
        self.params[index..]
            .iter()
            .map(|&bits| f32::from_bits(bits as u32))
            .collect()
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
        // Only the bytes written are reached: a copy out may be reading the rest.
        if let Err(failure) = self.buffers.write_at(buffer, start, &bytes) {
            panic!("`{}` wrote into `{arg}`: {failure}", self.spec.name);
        }
    }

    /// The arrangement of the whole buffer under `arg`: [`AS_WRITTEN`], or what a launch set
    /// with [`Launch::rearrange`].
    ///
    /// [`AS_WRITTEN`]: super::AS_WRITTEN
    pub fn arrangement(&self, arg: &str) -> u64 {
        self.buffers.arrangement(self.arg(arg).buffer)
    }

    /// Whether every argument's buffer holds its bytes as the host wrote them: what a kernel
    /// that reads no arrangement asks of every launch before it looks at any argument by name.
    pub fn all_as_written(&self) -> bool {
        self.args
            .iter()
            .all(|arg| self.buffers.arrangement(arg.buffer) == super::AS_WRITTEN)
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
    ///
    /// If `change` panics or fails, the buffer is poisoned: its bytes are in no known order,
    /// so every later launch or read of it fails with INTERNAL until the host writes it whole
    /// or frees it.
    ///
    /// [`AS_WRITTEN`]: super::AS_WRITTEN
    /// [`DeviceBackend::restore`]: super::DeviceBackend::restore
    pub fn rearrange(
        &mut self,
        arg: &str,
        arrangement: u64,
        change: impl FnOnce(&mut [u8]) -> Result<(), DeviceFailure>,
    ) -> Result<(), DeviceFailure> {
        let buffer = self.arg(arg).buffer;
        self.buffers.rearrange(buffer, arrangement, change)
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
        if let Err(failure) = self.buffers.write_at(buffer, range.start, bytes) {
            panic!("`{}` wrote into `{arg}`: {failure}", self.spec.name);
        }
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
        let mut views = ViewList::new();
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
                            ArgView::Exclusive(Some(raw_rows(start, len)))
                        }
                    }
                }
            };
            views.push((view, resolved.dtype));
        }
        Ok(ArgViews::new(self.spec, views))
    }

    /// Copies each read-only argument that overlaps a written argument into `snapshots`, and
    /// returns for each argument the index of its snapshot.
    fn snapshot_overlapping_reads(
        &mut self,
    ) -> Result<SmallVec<[Option<usize>; MAX_ARGS]>, DeviceFailure> {
        self.snapshots.clear();
        let mut snapshot_of: SmallVec<[Option<usize>; MAX_ARGS]> =
            SmallVec::from_elem(None, self.args.len());
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
