//! The arguments of one launch borrowed in place ([`ArgViews`]), and float tensors in the dtype they were passed in ([`FloatSlice`], [`FloatSliceMut`]).

use std::slice;

use crate::abi::DType;
use crate::callables::CallableSpec;

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

/// Every argument of one launch, borrowed in place by [`Launch::views`](super::Launch::views).
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

/// One argument's bytes, borrowed as the callable's access to it allows.
pub(super) enum ArgView<'l> {
    Shared(&'l [u8]),
    /// `None` once taken.
    Exclusive(Option<&'l mut [u8]>),
}

impl<'l> ArgViews<'l> {
    pub(super) fn new(spec: &'static CallableSpec, views: Vec<(ArgView<'l>, DType)>) -> Self {
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
