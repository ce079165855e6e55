//! What starts a deployment reload while serving: SIGHUP, and changes to the `--config` file (`--watch-config`).
//!
//! `POST /admin/reload` is the third trigger; it lives with the admin routes. All three call
//! [`EngineHandle::reload`], which re-reads the file; a failed reload leaves the running
//! deployment in place and is logged and counted there.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::EngineHandle;
use super::reload::ReloadSource;

/// How long the file watch waits after a change for the writes that follow it (an editor's
/// save, Kubernetes' symlink swap) before it reads the file.
const SETTLE: Duration = Duration::from_millis(200);

/// Gives the engine its reload source and starts the triggers `serve` has: SIGHUP always,
/// the file watch when asked for. Call from inside the async runtime.
pub fn start(engine: &Arc<EngineHandle>, source: ReloadSource) {
    engine.set_reload_source(source.clone());
    reload_on_sighup(engine);
    if source.watch {
        match source.config {
            Some(path) => watch_config(Arc::downgrade(engine), path),
            None => tracing::warn!("--watch-config has no --config file to watch"),
        }
    }
}

/// Reloads on every SIGHUP instead of dying of it. Without `--config` the reload fails with
/// a logged error saying how to enable it, and the server goes on.
#[cfg(unix)]
pub fn reload_on_sighup(engine: &Arc<EngineHandle>) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot handle SIGHUP, reload with POST /admin/reload: {e}");
            return;
        }
    };
    let engine = Arc::downgrade(engine);
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            let Some(engine) = engine.upgrade() else {
                return;
            };
            tracing::info!("SIGHUP: reloading the deployment");
            // The outcome is logged and counted by the reload itself.
            let _ = tokio::task::spawn_blocking(move || engine.reload()).await;
        }
    });
}

#[cfg(not(unix))]
pub fn reload_on_sighup(_engine: &Arc<EngineHandle>) {}

/// Watches the folder of `path` (so a replaced file and Kubernetes' `..data` symlink swap are
/// seen, not only writes in place) and reloads when the file's content changes. Ends when the
/// engine is gone.
pub fn watch_config(engine: Weak<EngineHandle>, path: PathBuf) {
    let spawned = std::thread::Builder::new()
        .name("config-watch".into())
        .spawn(move || {
            if let Err(e) = watch_loop(&engine, &path) {
                tracing::error!(file = %path.display(), "--watch-config stopped: {e}");
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the --watch-config thread: {e}");
    }
}

fn watch_loop(engine: &Weak<EngineHandle>, path: &Path) -> notify::Result<()> {
    use notify::Watcher;
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (tx, events) = std::sync::mpsc::channel();
    let mut watcher = notify::recommended_watcher(tx)?;
    watcher.watch(&folder, notify::RecursiveMode::NonRecursive)?;
    tracing::info!(file = %path.display(), "watching the deployment file for changes");
    let mut last = content_hash(path);
    loop {
        match events.recv_timeout(Duration::from_secs(1)) {
            Ok(_) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if engine.strong_count() == 0 {
                    return Ok(());
                }
                continue;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
        }
        // Let the burst of events of one change pass, then look once.
        std::thread::sleep(SETTLE);
        while events.try_recv().is_ok() {}
        let now = content_hash(path);
        if now.is_none() || now == last {
            // Gone for the moment (mid-swap) or unchanged (another file of the folder).
            continue;
        }
        last = now;
        let Some(engine) = engine.upgrade() else {
            return Ok(());
        };
        tracing::info!(file = %path.display(), "the deployment file changed: reloading");
        let _ = engine.reload();
    }
}

/// The SHA-256 of the file's content, following symlinks; `None` while it cannot be read.
fn content_hash(path: &Path) -> Option<[u8; 32]> {
    std::fs::read(path).ok().map(|b| Sha256::digest(&b).into())
}
