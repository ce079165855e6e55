//! Plugin tests in one binary, so the test build links wasmtime once for them: every built component through the host, a sampler's faults and memory, the example plugins in a running engine, and components of both contract versions.
//!
//! The modules run as threads of one process. One test reads this process's resident set,
//! which any test running beside it would disturb: it holds [`whole_process`], and every
//! other test here holds [`shared_process`] for as long as it runs.

#[path = "../common/mod.rs"]
mod common;

mod examples;
mod faults;
mod host;
mod versions;

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Shared by the tests that may run beside one another, taken alone by one that measures the
/// whole process.
static PROCESS: RwLock<()> = RwLock::const_new(());

/// For a test that may run beside others (outside an async runtime).
pub fn shared_process() -> RwLockReadGuard<'static, ()> {
    PROCESS.blocking_read()
}

/// [`shared_process`], from an async test.
pub async fn shared_process_async() -> RwLockReadGuard<'static, ()> {
    PROCESS.read().await
}

/// For a test that measures the whole process: waits until no other test of this binary runs,
/// and keeps the others waiting until it is dropped.
pub fn whole_process() -> RwLockWriteGuard<'static, ()> {
    PROCESS.blocking_write()
}
