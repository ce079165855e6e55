//! Whether the server is draining: set at the first shutdown signal, read by `/ready`.
//!
//! A draining server still finishes the requests it accepted, so `/health` (liveness) stays
//! 200; `/ready` turns 503 so a load balancer stops sending it new work.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A flag shared by the router and whoever watches for the shutdown signal.
#[derive(Debug, Clone, Default)]
pub struct Drain(Arc<AtomicBool>);

impl Drain {
    /// From now on `/ready` answers 503.
    pub fn start(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_draining(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}
