//! The `plughost` command line: `serve`, `generate`, `perplexity`, `bench`, `check` and `plugin`.

mod check;
mod error;
mod generate;
mod options;
mod perplexity;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::CliError;

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
        model: options::ModelArgs,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Port to listen on; 0 lets the system pick one, which the log names.
        #[arg(long, default_value_t = 8000)]
        port: u16,
        #[command(flatten)]
        http: plughost::api::options::HttpArgs,
        #[command(flatten)]
        connections: options::ConnectionArgs,
    },
    /// Generate one completion through the same engine and print it.
    Generate {
        #[command(flatten)]
        model: options::ModelArgs,
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
    /// The perplexity of a text file through the same engine, windowed as llama-perplexity
    /// windows it: each window of --context tokens scores its second half (with --stride,
    /// windows start every S tokens and score their last S).
    Perplexity {
        #[command(flatten)]
        model: options::ModelArgs,
        /// The text to score.
        #[arg(long)]
        file: PathBuf,
        /// Tokens per window.
        #[arg(long, default_value_t = 512)]
        context: usize,
        /// Start a window every S tokens and score its last S (llama-perplexity's --ppl-stride).
        #[arg(long)]
        stride: Option<usize>,
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
    Bench(plughost_bench::BenchOptions),
    /// Run a device library for a server started with `--device-isolation process` (the
    /// server starts this itself).
    #[command(hide = true)]
    DeviceWorker {
        /// The server's control socket.
        #[arg(long)]
        socket: PathBuf,
        /// The server's shared memory region.
        #[arg(long)]
        region: PathBuf,
    },
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
        } => serve::serve(model, host, *port, http, connections),
        Command::Generate {
            model,
            prompt,
            chat,
            max_tokens,
            temperature,
            seed,
            ignore_eos,
        } => generate::generate(
            model,
            generate::GenerateArgs {
                prompt,
                chat: *chat,
                max_tokens: *max_tokens,
                temperature: *temperature,
                seed: *seed,
                ignore_eos: *ignore_eos,
            },
        ),
        Command::Perplexity {
            model,
            file,
            context,
            stride,
        } => perplexity::perplexity(model, file, *context, *stride),
        Command::Check { config, cache_dir } => check::check(config, cache_dir.clone()),
        Command::Bench(options) => plughost_bench::main(options.clone()).map_err(CliError::from),
        Command::Plugin(command) => check::plugin(command),
        Command::DeviceWorker { socket, region } => {
            plughost::device::worker::run_worker(socket, region).map_err(CliError::from)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
