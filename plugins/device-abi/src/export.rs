//! Exports a Rust device through the C ABI: handles, the buffer table, stats, last error, argument checks and panic containment, over the [`DeviceBackend`] trait.
//!
//! A device crate implements [`DeviceBackend`] (config parsing and the math of each callable)
//! and calls [`export_device!`](crate::export_device); everything else about the ABI lives here,
//! so every Rust device counts, checks and reports errors the same way.
//!
//! One concept per module: `failure` (the status and message of a failure),
//! `buffers` (device memory and the order its bytes are in), `checked` (the spec checks of
//! recent launches, reused while their shapes repeat), `copy_out` (the thread that
//! copies ranges out in the background, ABI revision 1.2), `launch` (one launch's
//! resolved arguments), `views` (those arguments borrowed in place), `state` (everything
//! behind a handle) and `entry_points` (the C functions of the table, with panic
//! containment).

mod buffers;
mod checked;
mod copy_out;
mod entry_points;
mod failure;
mod launch;
mod slabs;
mod state;
mod views;

pub use buffers::AlignedBytes;
pub use copy_out::CopyOutFault;
pub use entry_points::device_table;
pub use failure::DeviceFailure;
pub use launch::Launch;
pub use views::{ArgViews, FloatRowsMut, FloatSlice, FloatSliceMut, RowsMut};

/// What a device implements; the export layer calls it only with checked arguments.
pub trait DeviceBackend: Send + Sized + 'static {
    /// Creates the device from the `open` config string (empty when the host passes none).
    fn open(config: &str) -> Result<Self, DeviceFailure>;

    /// Bytes the device can hold at once; an `alloc` past it fails with OUT_OF_MEMORY.
    fn memory_capacity(&self) -> u64 {
        u64::MAX
    }

    /// What the background copy thread injects into the next copy out (a delay, a crash);
    /// nothing by default. Called on the thread that starts the copy.
    fn copy_out_fault(&mut self) -> CopyOutFault {
        CopyOutFault::default()
    }

    /// Runs one launch. Every argument already matches the callable's spec and fits its buffer.
    fn launch(&mut self, launch: &mut Launch<'_>) -> Result<(), DeviceFailure>;

    /// Puts a buffer that a launch left in an arrangement of the backend's own (see
    /// [`Launch::rearrange`]) back in the order the host wrote it; called before the host reads
    /// or writes part of its bytes (a write of the whole buffer replaces them instead). Backends
    /// that never rearrange are never asked. A panic or failure here poisons the buffer, as in
    /// [`Launch::rearrange`].
    fn restore(&mut self, arrangement: u64, bytes: &mut [u8]) -> Result<(), DeviceFailure> {
        let _ = bytes;
        Err(DeviceFailure::internal(format!(
            "the device cannot restore its arrangement {arrangement}"
        )))
    }
}

/// The arrangement of a buffer as the host wrote it.
pub const AS_WRITTEN: u64 = 0;

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
