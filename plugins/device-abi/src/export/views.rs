//! The arguments of one launch borrowed in place ([`ArgViews`]), and float tensors in the dtype they were passed in ([`FloatSlice`], [`FloatSliceMut`]).

use std::marker::PhantomData;
use std::ops::Range;
use std::slice;

use smallvec::SmallVec;

use crate::abi::DType;
use crate::callables::{CallableSpec, MAX_ARGS};

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

/// A written float argument of which a kernel writes a few rows (a KV cache at this step's
/// slots), in the dtype it was passed in. See [`ArgViews::float_rows_mut`].
#[derive(Debug)]
pub enum FloatRowsMut<'l> {
    F32(RowsMut<'l, f32>),
    F16(RowsMut<'l, u16>),
    BF16(RowsMut<'l, u16>),
}

/// Exclusive access to the elements of an argument, one range at a time: no `&mut` covers
/// the elements a kernel does not ask for, so a copy out may read them meanwhile.
#[derive(Debug)]
pub struct RowsMut<'l, T> {
    start: *mut T,
    len: usize,
    _borrow: PhantomData<&'l mut [T]>,
}

impl<'l, T> RowsMut<'l, T> {
    /// Rows over a slice the caller already borrows exclusively (tests, host memory).
    pub fn from_slice(elements: &'l mut [T]) -> RowsMut<'l, T> {
        RowsMut {
            start: elements.as_mut_ptr(),
            len: elements.len(),
            _borrow: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `range`, borrowed exclusively while the slice lives. Panics past the end.
    pub fn rows(&mut self, range: Range<usize>) -> &mut [T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "rows {range:?} of {}",
            self.len
        );
        // SAFETY: in bounds (checked above) of elements this value borrows exclusively for
        // `'l`; the slice borrows `self` mutably, so two of them never coexist.
        unsafe { slice::from_raw_parts_mut(self.start.add(range.start), range.len()) }
    }
}

/// Every argument of one launch, borrowed in place by [`Launch::views`](super::Launch::views).
///
/// Arguments the callable only reads come out shared (`f32`, `i32`, `float`), as often as
/// asked; arguments it writes or updates in place come out exclusive (`f32_mut`, `i32_mut`),
/// once each, so a kernel can hold its inputs and outputs at the same time. Asking for a dtype
/// the argument does not have, or for a written argument twice, is a bug in the device and
/// panics.
pub struct ArgViews<'l> {
    spec: &'static CallableSpec,
    views: ViewList<'l>,
}

/// Each argument's view and dtype, in spec order; inline, so a launch allocates nothing.
pub(super) type ViewList<'l> = SmallVec<[(ArgView<'l>, DType); MAX_ARGS]>;

/// One argument's bytes, borrowed as the callable's access to it allows.
pub(super) enum ArgView<'l> {
    Shared(&'l [u8]),
    /// Kept raw until a kernel takes it, so an argument taken row by row never has a `&mut`
    /// over all of it; `None` once taken.
    Exclusive(Option<RowsMut<'l, u8>>),
}

impl<'l> ArgViews<'l> {
    pub(super) fn new(spec: &'static CallableSpec, views: ViewList<'l>) -> Self {
        ArgViews { spec, views }
    }

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

    /// A read-only block-quantized argument's bytes, blocks in row order (see [`crate::blocks`]).
    pub fn blocks(&self, arg: &str) -> &'l [u8] {
        let dtype = self.dtype(arg);
        assert!(
            dtype.is_block_quantized(),
            "argument `{arg}` is {dtype}, not block-quantized"
        );
        self.shared(arg, dtype)
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

    /// A written float argument of which the kernel writes only some rows: unlike
    /// [`ArgViews::float_mut`], no `&mut` over the whole argument is made.
    pub fn float_rows_mut(&mut self, arg: &str) -> FloatRowsMut<'l> {
        let dtype = self.dtype(arg);
        let bytes = self.take_raw(arg, dtype);
        match dtype {
            DType::F32 => FloatRowsMut::F32(cast_rows(bytes)),
            DType::F16 => FloatRowsMut::F16(cast_rows(bytes)),
            DType::BF16 => FloatRowsMut::BF16(cast_rows(bytes)),
            other => panic!("argument `{arg}` is {other}, not a float tensor"),
        }
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
        let bytes = self.take_raw(arg, dtype);
        // SAFETY: the raw view's whole range, which it borrows exclusively for `'l`; the view
        // is consumed here, so this slice is the only access to these bytes.
        unsafe { slice::from_raw_parts_mut(bytes.start, bytes.len) }
    }

    fn take_raw(&mut self, arg: &str, dtype: DType) -> RowsMut<'l, u8> {
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

fn cast_rows<T: PlainElement>(bytes: RowsMut<'_, u8>) -> RowsMut<'_, T> {
    let start = bytes.start.cast::<T>();
    assert!(start.is_aligned() && bytes.len.is_multiple_of(size_of::<T>()));
    RowsMut {
        start,
        len: bytes.len / size_of::<T>(),
        _borrow: PhantomData,
    }
}

pub(super) fn raw_rows<'l>(start: *mut u8, len: usize) -> RowsMut<'l, u8> {
    RowsMut {
        start,
        len,
        _borrow: PhantomData,
    }
}

fn cast_slice_mut<T: PlainElement>(bytes: &mut [u8]) -> &mut [T] {
    let start = bytes.as_mut_ptr().cast::<T>();
    assert!(start.is_aligned() && bytes.len().is_multiple_of(size_of::<T>()));
    // SAFETY: as in `cast_slice`; the exclusive borrow moves from the bytes to the elements.
    unsafe { slice::from_raw_parts_mut(start, bytes.len() / size_of::<T>()) }
}
