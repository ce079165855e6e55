//! The `plughost` command line: `serve`, `generate`, `bench`, `check` and `plugin`.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use plughost::cli::{ConnectionArgs, ModelArgs};
use plughost::engine::{
    EngineError, EngineHandle, GenerationEvent, GenerationRequest, StopConditions,
};
use plughost::metrics::Metrics;
use plughost::model::ChatMessage;
use plughost::plugins::glue::GluePlugin;
use plughost::plugins::sampler::SamplerPlugin;
use plughost::plugins::scheduler::SchedulerPlugin;
use plughost::plugins::{Deployment, PluginRuntime, RuntimeOptions};
use plughost_sdk::sampler::SamplingParams;

// glibc's malloc keeps what large requests freed in per-thread arenas (gigabytes after a few
// concurrent multi-megabyte bodies); mimalloc returns freed pages to the system.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc.h's `mi_option_purge_delay`, the option before `mi_option_use_numa_nodes` in
/// mimalloc 2 and 3 alike; libmimalloc-sys exports the one but not the other.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t =
    libmimalloc_sys::mi_option_use_numa_nodes - 1;

/// Makes mimalloc return freed pages to the system when they are freed. By default it waits
/// 10 ms and then purges only when the freeing thread allocates again, so the memory of a big
/// request freed on a thread that then sleeps (a blocking-pool thread after validation) stays
/// resident.
fn purge_freed_memory_at_once() {
    // SAFETY: a plain option store; called first thing in `main`, before any other thread
    // exists, as mimalloc asks of option changes.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
}

#[derive(Parser)]
#[command(
    name = "plughost",
    version,
    about = "LLM serving host with WebAssembly scheduling, sampling and model-glue plugins"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// `json` writes one JSON object per log line (with the request's span fields);
    /// `RUST_LOG` picks the levels either way.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API.
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 8000)]
        port: u16,
        #[command(flatten)]
        http: plughost::api::options::HttpArgs,
        #[command(flatten)]
        connections: ConnectionArgs,
    },
    /// Generate one completion through the same engine and print it.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        prompt: String,
        /// Render the prompt as one user message through the model's chat template.
        #[arg(long)]
        chat: bool,
        #[arg(long, default_value_t = 64)]
        max_tokens: u32,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long)]
        seed: Option<u64>,
        /// Keep going past end-of-sequence tokens.
        #[arg(long)]
        ignore_eos: bool,
    },
    /// Load every plugin a deployment file names, run its `init`, and report.
    Check {
        /// The deployment file (TOML).
        #[arg(long)]
        config: PathBuf,
        /// Where compiled components are cached.
        #[arg(long, env = "PLUGHOST_CACHE_DIR")]
        cache_dir: Option<PathBuf>,
    },
    /// Create and build plugin crates outside this repository.
    #[command(subcommand)]
    Plugin(plughost::plugin_kit::PluginCommand),
    /// Load-test an OpenAI-compatible server, in the manner of `vllm bench serve`.
    Bench(plughost::bench::BenchOptions),
}

fn check(config: &std::path::Path, cache_dir: Option<PathBuf>) -> Result<(), String> {
    let deployment = Deployment::from_file(config).map_err(|e| e.to_string())?;
    let runtime = PluginRuntime::new(RuntimeOptions { cache_dir }).map_err(|e| e.to_string())?;
    if let Some(spec) = &deployment.scheduler {
        SchedulerPlugin::load(
            &runtime,
            &spec.component,
            &spec.config_json(),
            spec.limits(),
        )
        .map_err(|e| e.to_string())?;
        println!("scheduler  ok  {}", spec.component.display());
    }
    if let Some(spec) = &deployment.sampler {
        SamplerPlugin::load(
            &runtime,
            &spec.component,
            &spec.config_json(),
            spec.limits(),
        )
        .map_err(|e| e.to_string())?;
        println!("sampler    ok  {}", spec.component.display());
    }
    for (name, spec) in deployment.named_samplers().iter() {
        SamplerPlugin::load(
            &runtime,
            &spec.component,
            &spec.config_json(),
            spec.limits(),
        )
        .map_err(|e| format!("[samplers.{name}] {e}"))?;
        println!("sampler    ok  {} ({name})", spec.component.display());
    }
    if let Some(spec) = &deployment.glue {
        GluePlugin::load(
            &runtime,
            &spec.component,
            &spec.config_json(),
            spec.glue_limits(),
        )
        .map_err(|e| e.to_string())?;
        println!("glue       ok  {}", spec.component.display());
    }
    Ok(())
}

/// `plughost plugin new|build`; a build is checked by the same code as `plughost check`.
fn plugin(command: &plughost::plugin_kit::PluginCommand) -> Result<(), String> {
    use plughost::plugin_kit::{self, NewPlugin, PluginCommand, SdkSource};
    match command {
        PluginCommand::New {
            kind,
            name,
            path,
            sdk,
        } => {
            let sdk = SdkSource::parse(sdk.as_deref()).map_err(|e| e.to_string())?;
            let dir = plugin_kit::create(&NewPlugin {
                kind: *kind,
                name: name.clone(),
                parent: path.clone(),
                sdk,
            })
            .map_err(|e| e.to_string())?;
            println!(
                "created {} plugin {name} in {}",
                kind.world(),
                dir.display()
            );
            println!(
                "next: cargo test --manifest-path {0}/Cargo.toml && plughost plugin build {0}",
                dir.display()
            );
            Ok(())
        }
        PluginCommand::Build { dir } => {
            let built = plugin_kit::build(dir).map_err(|e| e.to_string())?;
            check(&built.deployment, None)?;
            println!("component    {}", built.wasm.display());
            println!("sha256       {}", built.sha256);
            println!(
                "wit          plughost:plugin@{}",
                built.wit_versions.join(", ")
            );
            println!("deployment   {}", built.deployment.display());
            Ok(())
        }
    }
}

struct GenerateArgs<'a> {
    prompt: &'a str,
    chat: bool,
    max_tokens: u32,
    temperature: f32,
    seed: Option<u64>,
    ignore_eos: bool,
}

fn generate(model: &ModelArgs, args: GenerateArgs<'_>) -> Result<(), String> {
    let engine =
        EngineHandle::start(model.setup()?, Arc::new(Metrics::new())).map_err(|e| e.to_string())?;
    let summary = engine.wait_ready().map_err(|e| e.to_string())?;
    let text = if args.chat {
        let template = summary
            .chat_template
            .as_ref()
            .ok_or("the model has no chat template")?;
        template
            .render(&[ChatMessage::new("user", args.prompt)], true)
            .map_err(|e| e.to_string())?
    } else {
        args.prompt.to_string()
    };
    let prompt_tokens = summary
        .tokenizer
        .encode(&text, !args.chat)
        .map_err(|e| e.to_string())?;
    if prompt_tokens.is_empty() {
        return Err("the prompt is empty".into());
    }
    let room = summary
        .max_model_len
        .saturating_sub(prompt_tokens.len() as u32);
    if room == 0 {
        return Err(format!(
            "the prompt has {} tokens, the context holds {}",
            prompt_tokens.len(),
            summary.max_model_len
        ));
    }
    let request = GenerationRequest {
        prompt_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            seed: args.seed.unwrap_or_else(rand::random),
            ..SamplingParams::GREEDY
        },
        max_tokens: args.max_tokens.min(room),
        stop: StopConditions {
            ignore_eos: args.ignore_eos,
            ..Default::default()
        },
        logprobs: false,
        priority: 0,
        sampler: None,
        request_id: None,
        constraint: None,
        logit_bias: Default::default(),
    };
    let submitted = std::time::Instant::now();
    let (_, mut events) = engine.submit(request).map_err(|e| e.to_string())?;
    let mut first_token = None;
    let mut stdout = std::io::stdout().lock();
    while let Some(event) = events.blocking_recv() {
        match event {
            GenerationEvent::Delta { text, .. } => {
                first_token.get_or_insert_with(std::time::Instant::now);
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            }
            GenerationEvent::Finished { reason, usage } => {
                let _ = writeln!(stdout);
                let ttft = first_token.map(|t| t - submitted).unwrap_or_default();
                let decode = first_token.map(|t| t.elapsed()).unwrap_or_default();
                let decode_rate = usage.completion_tokens.saturating_sub(1) as f64
                    / decode.as_secs_f64().max(1e-9);
                eprintln!(
                    "[{} prompt tokens, {} generated, finish reason {}; time to first token {:.3} s, decode {:.1} tokens/s]",
                    usage.prompt_tokens,
                    usage.completion_tokens,
                    reason.as_str(),
                    ttft.as_secs_f64(),
                    decode_rate
                );
                break;
            }
            GenerationEvent::Failed { message } => return Err(message),
            GenerationEvent::Rejected(rejection) => return Err(rejection.to_string()),
        }
    }
    engine.shutdown();
    Ok(())
}

/// SIGINT and SIGTERM, listened to from start-up so that none is missed.
struct ShutdownSignals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn listen() -> Result<ShutdownSignals, String> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let listen = |kind| signal(kind).map_err(|e| format!("cannot listen for signals: {e}"));
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

fn serve(
    model: &ModelArgs,
    host: &str,
    port: u16,
    http: &plughost::api::options::HttpArgs,
    connections: &ConnectionArgs,
) -> Result<(), String> {
    let api_config = http.api_config()?;
    let open_files = raise_open_file_limit();
    let limits = connections.limits(open_files);
    let setup = model.setup()?;
    let runtime = tokio::runtime::Runtime::new()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let result = runtime.block_on(async {
        let signals = ShutdownSignals::listen()?;
        let addr: SocketAddr = format!("{host}:{port}").parse().map_err(|e| format!("invalid --host/--port {host}:{port}: {e}"))?;
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        plughost::api::options::warn_if_open(addr, &api_config);
        let metrics = Arc::new(Metrics::with_names(http.metrics_names));
        let engine = Arc::new(EngineHandle::start(setup, metrics).map_err(|e| e.to_string())?);
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
                            *slot = Some(message);
                        }
                    }
                }
            }
        };
        let app = plughost::api::router(engine.clone(), api_config);
        let served = plughost::api::serve_app(listener, app, limits, shutdown).await;
        tracing::info!("shutting down: closing the engine, the runtime and the device");
        engine.shutdown();
        if let Some(message) = failure.lock().ok().and_then(|mut slot| slot.take()) {
            return Err(message);
        }
        // The device may have hung while the engine was closing.
        if let Err(fault @ EngineError::Faulted(_)) = engine.summary() {
            return Err(fault.to_string());
        }
        served.map_err(|e| format!("server error: {e}"))
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

fn main() -> ExitCode {
    purge_freed_memory_at_once();
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().with_current_span(true).init(),
    }
    let result = match &cli.command {
        Command::Serve {
            model,
            host,
            port,
            http,
            connections,
        } => serve(model, host, *port, http, connections),
        Command::Generate {
            model,
            prompt,
            chat,
            max_tokens,
            temperature,
            seed,
            ignore_eos,
        } => generate(
            model,
            GenerateArgs {
                prompt,
                chat: *chat,
                max_tokens: *max_tokens,
                temperature: *temperature,
                seed: *seed,
                ignore_eos: *ignore_eos,
            },
        ),
        Command::Check { config, cache_dir } => check(config, cache_dir.clone()),
        Command::Bench(options) => plughost::bench::main(options.clone()),
        Command::Plugin(command) => plugin(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
