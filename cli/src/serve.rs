//! `plughost serve`: the HTTP API over the engine, its shutdown signals, and exiting when the
//! engine fails so that a supervisor restarts the process.

use std::net::SocketAddr;
use std::sync::Arc;

use plughost::api::options::HttpArgs;
use plughost::engine::{EngineError, EngineHandle};
use plughost::metrics::Metrics;

use crate::error::CliError;
use crate::options::{ConnectionArgs, ModelArgs};

/// SIGINT and SIGTERM, listened to from start-up so that none is missed.
struct ShutdownSignals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn listen() -> Result<ShutdownSignals, CliError> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let listen = |kind| signal(kind).map_err(CliError::Signals);
            Ok(ShutdownSignals {
                interrupt: listen(SignalKind::interrupt())?,
                terminate: listen(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(ShutdownSignals {})
    }

    /// The next signal's name and the exit code a process killed by it would have.
    async fn next(&mut self) -> (&'static str, i32) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.interrupt.recv() => ("SIGINT", 130),
            _ = self.terminate.recv() => ("SIGTERM", 143),
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            ("Ctrl-C", 130)
        }
    }

    /// Resolves at the first signal; a second one ends the process at once.
    async fn first_then_watch(mut self, shutdown_timeout: std::time::Duration) {
        let (name, _) = self.next().await;
        tracing::info!(
            "{name}: no longer accepting connections; requests in flight have {} s to finish (send it again to exit at once)",
            shutdown_timeout.as_secs()
        );
        tokio::spawn(async move {
            let (name, code) = self.next().await;
            eprintln!("{name} while draining: exiting at once");
            std::process::exit(code);
        });
    }
}

/// Raises the soft limit of open files to the hard one (each connection holds one) and returns
/// the limit in force.
fn raise_open_file_limit() -> u64 {
    #[cfg(unix)]
    {
        match rlimit::increase_nofile_limit(u64::MAX) {
            Ok(limit) => limit,
            Err(e) => {
                let soft = rlimit::getrlimit(rlimit::Resource::NOFILE)
                    .map(|(soft, _)| soft)
                    .unwrap_or(1024);
                tracing::warn!("cannot raise the open-file limit ({e}); it stays at {soft}");
                soft
            }
        }
    }
    #[cfg(not(unix))]
    u64::MAX
}

/// `plughost serve`: the HTTP API until a signal drains it or the engine fails.
pub fn serve(
    model: &ModelArgs,
    host: &str,
    port: u16,
    http: &HttpArgs,
    connections: &ConnectionArgs,
) -> Result<(), CliError> {
    let api_config = http.api_config().map_err(CliError::HttpOptions)?;
    let open_files = raise_open_file_limit();
    let limits = connections.limits(open_files);
    let setup = model.setup()?;
    let runtime = tokio::runtime::Runtime::new().map_err(CliError::Runtime)?;
    let result = runtime.block_on(async {
        let signals = ShutdownSignals::listen()?;
        let address = format!("{host}:{port}");
        let addr: SocketAddr = address
            .parse()
            .map_err(|source| CliError::Address { address, source })?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| CliError::Listen { address: addr, source })?;
        // `--port 0` asks the system for a port: name the one it gave.
        let addr = listener.local_addr().unwrap_or(addr);
        plughost::api::options::warn_if_open(addr, &api_config);
        let metrics = Arc::new(Metrics::with_names(http.metrics_names));
        let engine = Arc::new(EngineHandle::start(setup, metrics)?);
        plughost::engine::triggers::start(&engine, model.reload_source());
        tracing::info!(
            "listening on http://{addr} (the model loads in the background; /health answers 200 once it is ready); up to {} connections, open-file limit {open_files}",
            limits.max_connections
        );
        // A model that failed to load never will, and an engine that died, stalled or hung
        // never recovers: stop serving and exit with the error, so a supervisor restarts us.
        let drain = api_config.drain.clone();
        let failure = Arc::new(std::sync::Mutex::new(None));
        let shutdown = {
            let (engine, failure) = (engine.clone(), failure.clone());
            let shutdown_timeout = limits.shutdown_timeout;
            async move {
                tokio::select! {
                    () = signals.first_then_watch(shutdown_timeout) => drain.start(),
                    fault = engine_fault(engine) => {
                        let message = fault.to_string();
                        if matches!(fault, EngineError::Faulted(_)) {
                            // The engine thread may be stuck in the device for good: bound the
                            // exit, but first keep answering a moment, so probes see /health 503
                            // and clients read the errors they were sent.
                            exit_after(2 * FAULT_GRACE, &message);
                            tokio::time::sleep(FAULT_GRACE).await;
                        }
                        if let Ok(mut slot) = failure.lock() {
                            *slot = Some(fault);
                        }
                    }
                }
            }
        };
        let app = plughost::api::router(engine.clone(), api_config);
        let served = plughost::api::serve_app(listener, app, limits, shutdown).await;
        tracing::info!("shutting down: closing the engine, the runtime and the device");
        engine.shutdown();
        if let Some(fault) = failure.lock().ok().and_then(|mut slot| slot.take()) {
            return Err(fault.into());
        }
        // The device may have hung while the engine was closing.
        if let Err(fault @ EngineError::Faulted(_)) = engine.summary() {
            return Err(fault.into());
        }
        served.map_err(CliError::Server)
    });
    // Every connection is closed by now; a validation still running on the blocking pool must
    // not hold the exit up.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

/// How long a failed engine's server goes on answering (503) before it stops accepting.
const FAULT_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Exits the process non-zero with `message` after `delay`, unless it has exited by then.
fn exit_after(delay: std::time::Duration, message: &str) {
    let message = message.to_string();
    let _ = std::thread::Builder::new()
        .name("fault-exit".into())
        .spawn(move || {
            std::thread::sleep(delay);
            eprintln!("error: {message}");
            std::process::exit(1);
        });
}

/// Resolves with the error if the model fails to load or the engine fails later; never
/// resolves for a healthy engine.
async fn engine_fault(engine: Arc<EngineHandle>) -> EngineError {
    let (sender, receiver) = tokio::sync::oneshot::channel();
    // A thread of its own, because `wait_fault` blocks: a task on the runtime's blocking pool
    // would hold up the runtime's shutdown for good. If the thread
    // cannot start, the sender is dropped with it and the server runs on as without the watch.
    let _ = std::thread::Builder::new()
        .name("engine-fault-watch".into())
        .spawn(move || {
            let _ = sender.send(engine.wait_fault());
        });
    match receiver.await {
        Ok(message) => message,
        Err(_) => std::future::pending().await,
    }
}
