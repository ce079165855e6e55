//! Loading and opening a device library: bad open configs get the device's message, another ABI version is refused, and a missing library is named.

use std::path::Path;

use plughost::device::{Device, DeviceError, DeviceLibrary, status};

use crate::common;

use super::{library_file, mock_library};

#[test]
fn bad_open_configs_are_refused_with_the_device_message() {
    let library = mock_library();
    let error = Device::open(&library, "fail_launch=soon").err().unwrap();
    assert_eq!(error.status(), Some(status::INVALID_ARGUMENT));
    assert_eq!(
        error.to_string(),
        "device open failed with INVALID_ARGUMENT: open: mock device option `fail_launch` \
         must be a non-negative integer, got `soon`"
    );
    let error = Device::open(&library, "hang_ms=1\0").err().unwrap();
    assert!(
        matches!(error, DeviceError::ConfigHasNul { position: 9 }),
        "{error}"
    );
}

#[test]
fn a_library_with_another_abi_version_is_refused() {
    let path = common::plugin_path(&library_file("plughost-device-wrong-abi"));
    let error = DeviceLibrary::load(&path).err().unwrap();
    assert!(
        matches!(
            error,
            DeviceError::AbiVersionMismatch {
                found: 999,
                expected: 1,
                ..
            }
        ),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("speaks device ABI 999; this host speaks 1"),
        "{message}"
    );
    assert!(
        message.contains(&library_file("plughost-device-wrong-abi")),
        "{message}"
    );
}

#[test]
fn a_missing_library_is_named_in_the_error() {
    let path = Path::new("/nonexistent/plughost/libplughost_device_nothing.so");
    let error = DeviceLibrary::load(path).err().unwrap();
    assert!(
        matches!(error, DeviceError::LibraryNotFound { .. }),
        "{error}"
    );
    assert_eq!(
        error.to_string(),
        "device library `/nonexistent/plughost/libplughost_device_nothing.so` does not exist"
    );
}
