//! What a `plughost` command can fail with: the library's typed errors, kept as they are, and
//! the few failures that belong to the command line itself.

use std::net::AddrParseError;
use std::path::PathBuf;

use plughost::engine::EngineError;
use plughost::model::ModelError;
use plughost::plugin_kit::PluginKitError;
use plughost::plugins::{DeploymentError, PluginError, PluginRejection};
use plughost_bench::BenchError;

/// The error a command ends with; `main` prints it after `error: ` and exits non-zero.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Deployment(#[from] DeploymentError),
    #[error(transparent)]
    Plugin(#[from] PluginError),
    /// A `[samplers.NAME]` component of the deployment that did not load.
    #[error("[samplers.{name}] {source}")]
    NamedSampler { name: String, source: PluginError },
    #[error(transparent)]
    PluginKit(#[from] PluginKitError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Rejected(#[from] PluginRejection),
    #[error(transparent)]
    Bench(#[from] BenchError),
    #[error(transparent)]
    Perplexity(#[from] plughost::perplexity::PerplexityError),
    #[error(
        "--quantize {target} applies to f32/f16/bf16 safetensors; {} is a GGUF file, served in its stored types",
        path.display()
    )]
    QuantizeGguf { path: PathBuf, target: &'static str },
    #[error(
        "{flag} applies to a device worker; it has no effect with --device-isolation in-process"
    )]
    NeedsWorker { flag: &'static str },
    #[error("device worker: {0}")]
    DeviceWorker(#[from] plughost::device::worker::WorkerError),
    /// A default component or device that is not in the plugins folder.
    #[error("{} does not exist; build the plugins with `cargo xtask build-plugins`", .0.display())]
    MissingPlugin(PathBuf),
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read the plugins folder {}: {source}", path.display())]
    PluginsFolder {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Every glue component in the plugins folder refused the model's config.json.
    #[error("no model glue in {} accepts {}:\n{}", dir.display(), config.display(), refusals.join("\n"))]
    NoGlue {
        dir: PathBuf,
        config: PathBuf,
        refusals: Vec<String>,
    },
    #[error("the model has no chat template")]
    NoChatTemplate,
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {tokens} tokens, the context holds {context}")]
    PromptTooLong { tokens: usize, context: u32 },
    /// The engine ended the generation with an error.
    #[error("{0}")]
    Generation(String),
    /// `--api-key`, `--allowed-origins` and the other HTTP options, as the API layer checks them.
    #[error("{0}")]
    HttpOptions(String),
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot listen for signals: {0}")]
    Signals(std::io::Error),
    #[error("invalid --host/--port {address}: {source}")]
    Address {
        address: String,
        source: AddrParseError,
    },
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("server error: {0}")]
    Server(std::io::Error),
}
