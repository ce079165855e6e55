//! Loading device libraries through the versioned C ABI, and the safe wrapper over an open device.
//!
//! [`DeviceLibrary::load`] checks the ABI version, table size and every entry before any
//! device function runs. A [`Device`] owns one handle; every failed call becomes a
//! [`DeviceError`] carrying the device's own message. A [`DeviceSource`] opens the device in
//! this process or in a supervised [`worker`] process. The ABI types themselves live in the
//! `plughost-device-abi` crate and are re-exported here.

mod error;
mod handle;
mod library;
mod local;
pub mod worker;

pub use error::DeviceError;
pub use handle::{
    BufferId, BufferRange, CallableIndex, CopiedOut, Device, DeviceIsolation, DeviceSource,
    tensor_arg,
};
pub use library::DeviceLibrary;
pub use plughost_device_abi::{ArgTag, DType, DeviceStats, TensorArg, status};
