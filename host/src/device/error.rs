//! The device layer's error type: loading a device library, and device calls that failed.

use std::path::PathBuf;

use plughost_device_abi::{RankError, status};

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("device library `{}` does not exist", path.display())]
    LibraryNotFound { path: PathBuf },

    #[error("cannot load device library `{}`: {source}", path.display())]
    LoadFailed {
        path: PathBuf,
        #[source]
        source: libloading::Error,
    },

    #[error("device library `{}` does not export `{symbol}`: {source}", path.display())]
    MissingSymbol {
        path: PathBuf,
        symbol: &'static str,
        #[source]
        source: libloading::Error,
    },

    #[error("device library `{}`: `{symbol}` returned a null table", path.display())]
    NullTable { path: PathBuf, symbol: &'static str },

    #[error(
        "device library `{}` speaks device ABI {found}; this host speaks {expected}",
        path.display()
    )]
    AbiVersionMismatch {
        path: PathBuf,
        found: u32,
        expected: u32,
    },

    #[error(
        "device library `{}` declares a function table of {found} bytes, host expects at least {expected}",
        path.display()
    )]
    TableTooSmall {
        path: PathBuf,
        found: u32,
        expected: u32,
    },

    #[error("device library `{}` leaves function table entry `{entry}` null", path.display())]
    NullEntry { path: PathBuf, entry: &'static str },

    #[error("device config contains a NUL byte at position {position}")]
    ConfigHasNul { position: usize },

    /// A device call returned a non-zero status; `message` is the device's `last_error`.
    #[error("device {operation} failed with {}: {message}", status_name(*status))]
    Call {
        operation: &'static str,
        status: i32,
        message: String,
    },

    /// The device returned something the ABI rules out, e.g. a null handle from a successful open.
    #[error("device broke the ABI contract in {operation}: {message}")]
    ContractViolation {
        operation: &'static str,
        message: String,
    },

    /// A batched copy whose host buffer is not exactly as long as its ranges together.
    #[error("device {operation}: the ranges cover {ranges} bytes, the host buffer holds {host}")]
    RangeLength {
        operation: &'static str,
        ranges: u64,
        host: usize,
    },

    /// A copy out in the background asked of a device whose table lacks revision 1.2's entries.
    #[error("the device does not copy out in the background (device table revision 1.2)")]
    NoBackgroundCopy,

    #[error("the device has no callable `{name}`")]
    UnknownCallable { name: String },

    #[error("a launch passes at most {} {what}, got {count}", u32::MAX)]
    TooMany { what: &'static str, count: usize },

    #[error(transparent)]
    Rank(#[from] RankError),

    /// The device worker process could not be started or could not open its device.
    #[error("cannot start the device worker: {message}")]
    WorkerStart { message: String },

    /// The device worker process died or stopped answering; the device and everything on it
    /// is gone, and a new worker must prepare the model again.
    #[error("{cause}")]
    WorkerLost { cause: String },
}

impl DeviceError {
    /// The refusal of a copy out into memory a reader of the last copy's bytes still holds.
    pub(crate) fn copy_out_still_read() -> DeviceError {
        DeviceError::ContractViolation {
            operation: "start_copy_out",
            message: "the bytes of the last copy out are still being read".into(),
        }
    }

    /// Whether the device is gone with its worker process, rather than one call having failed.
    pub fn is_worker_lost(&self) -> bool {
        matches!(self, DeviceError::WorkerLost { .. })
    }
}

impl DeviceError {
    /// The device's status code, for errors the device itself reported.
    pub fn status(&self) -> Option<i32> {
        match self {
            DeviceError::Call { status, .. } => Some(*status),
            _ => None,
        }
    }
}

fn status_name(code: i32) -> String {
    match status::name(code) {
        Some(name) => name.to_string(),
        None => format!("unknown status {code}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_what_is_wrong() {
        let cases = [
            (
                DeviceError::AbiVersionMismatch {
                    path: "/x/libdev.so".into(),
                    found: 7,
                    expected: 1,
                },
                "device library `/x/libdev.so` speaks device ABI 7; this host speaks 1",
            ),
            (
                DeviceError::Call {
                    operation: "launch",
                    status: status::INVALID_ARGUMENT,
                    message: "launch `linear`: takes 3 tensor arguments".into(),
                },
                "device launch failed with INVALID_ARGUMENT: launch `linear`: takes 3 tensor arguments",
            ),
            (
                DeviceError::Call {
                    operation: "alloc",
                    status: 42,
                    message: "?".into(),
                },
                "device alloc failed with unknown status 42: ?",
            ),
        ];
        for (error, expected) in cases {
            assert_eq!(error.to_string(), expected);
        }
    }
}
