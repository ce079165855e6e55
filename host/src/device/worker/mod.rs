//! The device in a worker process: the host starts a child that loads the device library, and forwards every device call to it, so a device that crashes or hangs takes only the worker.
//!
//! The control messages go over a Unix socket ([`protocol`]); step inputs, logits and
//! weights cross through a shared memory region mapped once when the worker starts
//! ([`region`]). [`client`] is the host's side, [`serve`] the worker's.

mod client;
mod protocol;
mod region;
mod serve;

pub use client::{WORKER_RESTARTS_ENV, WorkerCommand, WorkerDevice};
pub(crate) use region::SharedRegion;
pub use serve::{WorkerError, run_worker};
