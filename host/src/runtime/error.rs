//! Errors of the runtime layer.

use crate::device::DeviceError;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The glue's program names something the host does not have.
    #[error("invalid step program: {0}")]
    Program(String),
    /// A weight is missing, or its shape or dtype differs from what the model needs.
    #[error("{0}")]
    Weight(String),
    /// The step asked for more than the runtime was prepared for, or is inconsistent.
    #[error("invalid step: {0}")]
    Step(String),
    #[error("invalid runtime config: {0}")]
    Config(String),
}
