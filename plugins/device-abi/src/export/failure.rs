//! [`DeviceFailure`]: a status code with its message, what crosses the ABI instead of a Rust error or panic.

use std::fmt;

use crate::abi::status;

/// A status code with its message; what crosses the ABI instead of a Rust error or panic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFailure {
    status: i32,
    message: String,
}

impl DeviceFailure {
    pub fn new(status: i32, message: impl Into<String>) -> DeviceFailure {
        DeviceFailure {
            status,
            message: message.into(),
        }
    }

    pub fn invalid_argument(message: impl Into<String>) -> DeviceFailure {
        DeviceFailure::new(status::INVALID_ARGUMENT, message)
    }

    pub fn launch_failed(message: impl Into<String>) -> DeviceFailure {
        DeviceFailure::new(status::LAUNCH_FAILED, message)
    }

    pub fn internal(message: impl Into<String>) -> DeviceFailure {
        DeviceFailure::new(status::INTERNAL, message)
    }

    pub fn status(&self) -> i32 {
        self.status
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The message, for the last-error slot that outlives the failure.
    pub(super) fn into_message(self) -> String {
        self.message
    }

    /// Prefixes the message with where it happened.
    pub fn context(self, prefix: impl fmt::Display) -> DeviceFailure {
        DeviceFailure {
            status: self.status,
            message: format!("{prefix}: {}", self.message),
        }
    }
}

impl fmt::Display for DeviceFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = status::name(self.status).unwrap_or("UNKNOWN");
        write!(f, "{name}: {}", self.message)
    }
}

impl std::error::Error for DeviceFailure {}
