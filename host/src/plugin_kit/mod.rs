//! Creating and building plugin crates outside this workspace: `plughost plugin new` and `plughost plugin build`.
//!
//! A plugin crate is an ordinary Rust library (`crate-type = ["cdylib"]`)
//! marked with `[package.metadata.plughost] kind = ...`, whose sample config
//! sits beside the marker. The binary carries a copy of the SDK, so a new
//! crate builds without this repository and without a registry release.

mod compile;
mod scaffold;
mod sdk;

use std::path::{Path, PathBuf};

pub use compile::{BuiltPlugin, build};
pub use scaffold::{NewPlugin, create};
pub use sdk::SdkSource;

/// The three kinds of WebAssembly plugin, named as in the WIT worlds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PluginKind {
    Scheduler,
    Sampler,
    #[value(name = "model-glue")]
    ModelGlue,
}

impl PluginKind {
    /// The WIT world, the metadata `kind` and the SDK feature, which share one name.
    pub fn world(self) -> &'static str {
        match self {
            PluginKind::Scheduler => "scheduler",
            PluginKind::Sampler => "sampler",
            PluginKind::ModelGlue => "model-glue",
        }
    }

    /// The table a deployment file names this kind's component in.
    pub fn deployment_slot(self) -> &'static str {
        match self {
            PluginKind::Scheduler => "scheduler",
            PluginKind::Sampler => "sampler",
            PluginKind::ModelGlue => "glue",
        }
    }

    pub fn from_world(world: &str) -> Option<PluginKind> {
        [
            PluginKind::Scheduler,
            PluginKind::Sampler,
            PluginKind::ModelGlue,
        ]
        .into_iter()
        .find(|k| k.world() == world)
    }
}

/// Why a plugin crate could not be created or built.
#[derive(Debug, thiserror::Error)]
pub enum PluginKitError {
    #[error("invalid plugin name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("{} already exists and is not empty; choose another name or --path", .0.display())]
    TargetNotEmpty(PathBuf),
    #[error("--sdk {0}: {1}")]
    BadSdk(String, String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {reason}", manifest.display())]
    NotAPlugin { manifest: PathBuf, reason: String },
    #[error("running {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error(
        "rustup could not install the {target} target ({status}); run `rustup target add {target}`"
    )]
    TargetInstall { target: String, status: String },
    #[error("cargo build failed ({0}); its output is above")]
    BuildFailed(String),
    #[error("cargo built no .wasm component for {0}; is its crate-type cdylib?")]
    NoComponent(String),
    #[error("{}: not a WebAssembly component: {reason}", path.display())]
    BadComponent { path: PathBuf, reason: String },
    #[error(transparent)]
    Contract(#[from] crate::plugins::ContractError),
}

impl PluginKitError {
    fn io(path: &Path, source: std::io::Error) -> PluginKitError {
        PluginKitError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// `plughost plugin ...`
#[derive(Debug, Clone, clap::Subcommand)]
pub enum PluginCommand {
    /// Create a plugin crate, ready to build, outside any workspace.
    New {
        /// The world the plugin exports.
        kind: PluginKind,
        /// The crate's name (a valid Rust crate name); also the folder's name.
        name: String,
        /// The folder to create the crate in (default: the current one).
        #[arg(long, default_value = ".")]
        path: PathBuf,
        /// The SDK to depend on: a path to a plughost-sdk crate, or a registry version.
        /// Default: a copy of the SDK this binary ships, written into the crate.
        #[arg(long)]
        sdk: Option<String>,
    },
    /// Build a plugin crate for wasm32-wasip2 in release, check it as `plughost check` does,
    /// and print the component's path, sha256 and WIT version.
    Build {
        /// The plugin crate's folder.
        #[arg(default_value = ".")]
        dir: PathBuf,
    },
}
