//! End-to-end tests of the device C ABI: the host's loader and `Device` wrapper driving the mock device library.
//!
//! Needs `libplughost_device_mock.so` and `libplughost_device_wrong_abi.so` in the plugins
//! folder (`cargo xtask build-plugins`).
//!
//! Split by concept: [`buffers`], [`launches`], [`counters`], [`faults`], [`step_inputs`],
//! [`decoder`] and [`library`]; the helpers below drive a device for all of them.

mod buffers;
mod counters;
mod decoder;
mod faults;
mod launches;
mod library;
mod step_inputs;

use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};

use plughost::device::{
    ArgTag, BufferId, DType, Device, DeviceError, DeviceLibrary, TensorArg, tensor_arg,
};

use crate::common;

fn library_file(crate_name: &str) -> String {
    format!("{DLL_PREFIX}{}{DLL_SUFFIX}", crate_name.replace('-', "_"))
}

fn mock_library() -> DeviceLibrary {
    let path = common::plugin_path(&library_file("plughost-device-mock"));
    DeviceLibrary::load(&path).unwrap_or_else(|error| panic!("{error}"))
}

fn open_mock(config: &str) -> Device {
    Device::open(&mock_library(), config).unwrap_or_else(|error| panic!("{error}"))
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

fn i32_bytes(values: &[i32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

fn upload(device: &mut Device, bytes: &[u8]) -> BufferId {
    let buffer = device.alloc(bytes.len() as u64).unwrap();
    device.write(buffer, 0, bytes).unwrap();
    buffer
}

fn upload_f32(device: &mut Device, values: &[f32]) -> BufferId {
    upload(device, &f32_bytes(values))
}

fn upload_i32(device: &mut Device, values: &[i32]) -> BufferId {
    upload(device, &i32_bytes(values))
}

fn download_f32(device: &mut Device, buffer: BufferId, count: usize) -> Vec<f32> {
    let mut bytes = vec![0; count * 4];
    device.read(buffer, 0, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|chunk| f32::from_le_bytes(chunk.try_into().unwrap()))
        .collect()
}

fn download_i32(device: &mut Device, buffer: BufferId, count: usize) -> Vec<i32> {
    let mut bytes = vec![0; count * 4];
    device.read(buffer, 0, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|chunk| i32::from_le_bytes(chunk.try_into().unwrap()))
        .collect()
}

fn arg(buffer: BufferId, dtype: DType, shape: &[u64], tag: ArgTag) -> TensorArg {
    tensor_arg(buffer, 0, dtype, shape, tag).unwrap()
}

fn launch(device: &mut Device, name: &str, args: &[TensorArg], params: &[i64]) {
    let callable = device.callable_index(name).unwrap();
    device
        .launch(callable, args, params)
        .unwrap_or_else(|error| panic!("{name}: {error}"));
}

/// The status and message of a device call that must fail.
fn expect_call_error(result: Result<(), DeviceError>) -> (i32, String) {
    match result {
        Err(DeviceError::Call {
            status, message, ..
        }) => (status, message),
        Err(other) => panic!("expected a device call error, got {other}"),
        Ok(()) => panic!("expected a device call error, got success"),
    }
}
