//! A device library whose table claims ABI version 999, so tests can check that the host refuses it before calling anything.

use plughost_device_abi::PlughostDeviceV1;

/// No host that checks the version gets far enough to call a function, so none are provided.
static TABLE: PlughostDeviceV1 = PlughostDeviceV1 {
    abi_version: 999,
    struct_size: PlughostDeviceV1::SIZE,
    open: None,
    close: None,
    alloc: None,
    free: None,
    write: None,
    read: None,
    callable_count: None,
    callable_name: None,
    launch: None,
    synchronize: None,
    stats: None,
    callable_launches: None,
    last_error: None,
    callable_device_ns: None,
    copy_out_start: None,
    copy_out_poll: None,
};

#[unsafe(no_mangle)]
pub extern "C" fn plughost_device_v1() -> *const PlughostDeviceV1 {
    &TABLE
}
