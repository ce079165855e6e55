//! The weight element types the tiles read: f16 and bf16 bits as types of their own, views of `u16` slices as them, and a launch's weights as one element type.

#[cfg(target_arch = "x86_64")]
use plughost_device_abi::export::FloatSlice;

/// f16 weight bits, a type of their own so kernels widen them as f16.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct F16Bits(u16);

impl F16Bits {
    pub fn to_f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }

    /// Rounded to the nearest f16, ties to even.
    pub fn from_f32(value: f32) -> F16Bits {
        F16Bits(half::f16::from_f32(value).to_bits())
    }
}

/// bf16 weight bits, a type of their own so kernels widen them as bf16.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Bf16Bits(u16);

impl Bf16Bits {
    pub fn to_f32(self) -> f32 {
        crate::widen::bf16_to_f32(self.0)
    }

    /// Rounded to the nearest bf16, ties to even.
    pub fn from_f32(value: f32) -> Bf16Bits {
        Bf16Bits(half::bf16::from_f32(value).to_bits())
    }
}

/// The same bits seen as the weight type a kernel widens.
pub(crate) fn as_wide<W: HalfBits>(bits: &[u16]) -> &[W] {
    const { assert!(size_of::<W>() == size_of::<u16>() && align_of::<W>() == align_of::<u16>()) };
    // SAFETY: `W` is a `repr(transparent)` newtype of `u16` (same size and alignment, checked
    // above), valid for every bit pattern.
    unsafe { std::slice::from_raw_parts(bits.as_ptr().cast(), bits.len()) }
}

/// As [`as_wide`], for bits a kernel writes.
pub(crate) fn as_wide_mut<W: HalfBits>(bits: &mut [u16]) -> &mut [W] {
    const { assert!(size_of::<W>() == size_of::<u16>() && align_of::<W>() == align_of::<u16>()) };
    // SAFETY: as in `as_wide`; the exclusive borrow moves to the result.
    unsafe { std::slice::from_raw_parts_mut(bits.as_mut_ptr().cast(), bits.len()) }
}

/// The bits under the weight type: [`as_wide`] undone.
#[cfg(target_arch = "x86_64")]
pub(crate) fn as_bits<W: HalfBits>(wide: &[W]) -> &[u16] {
    const { assert!(size_of::<W>() == size_of::<u16>() && align_of::<W>() == align_of::<u16>()) };
    // SAFETY: as in `as_wide`: `W` is a `repr(transparent)` newtype of `u16`.
    unsafe { std::slice::from_raw_parts(wide.as_ptr().cast(), wide.len()) }
}

/// The `repr(transparent)` newtypes of `u16` that [`as_wide`] may produce.
pub(crate) trait HalfBits: Copy {}
impl HalfBits for F16Bits {}
impl HalfBits for Bf16Bits {}

/// The most weight matrices one launch multiplies (`qkv_linear`'s three).
#[cfg(target_arch = "x86_64")]
pub(super) const MAX_MATRICES: usize = 3;

/// The weights of a launch as one element type, unused entries empty.
#[cfg(target_arch = "x86_64")]
pub(super) type Typed<'a, T> = [&'a [T]; MAX_MATRICES];

#[cfg(target_arch = "x86_64")]
pub(super) fn f32_values(w: FloatSlice<'_>) -> &[f32] {
    match w {
        FloatSlice::F32(values) => values,
        _ => &[],
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) fn bf16_bits(w: FloatSlice<'_>) -> &[u16] {
    match w {
        FloatSlice::BF16(bits) => bits,
        _ => &[],
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) fn f16_bits(w: FloatSlice<'_>) -> &[u16] {
    match w {
        FloatSlice::F16(bits) => bits,
        _ => &[],
    }
}

/// `weights` (which share a dtype, checked by [`matmul`]) as that dtype's elements.
#[cfg(target_arch = "x86_64")]
pub(super) fn typed<'a, T>(
    weights: &[FloatSlice<'a>],
    pick: fn(FloatSlice<'a>) -> &'a [T],
) -> Typed<'a, T> {
    std::array::from_fn(|p| weights.get(p).map_or(&[][..], |w| pick(*w)))
}
