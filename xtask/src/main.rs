//! Project tasks: `cargo xtask build-plugins`, `cargo xtask test`, `cargo xtask bench-plugins`.

mod fixtures;
mod plugins;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "plughost project tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build every plugin (WebAssembly components and device libraries) in release into target/plugins.
    BuildPlugins,
    /// Build the plugins, check formatting and lints, then run the whole test suite.
    Test {
        /// Skip `cargo fmt --check` and `cargo clippy`.
        #[arg(long)]
        no_lint: bool,
        /// Extra arguments for `cargo test` (after `--`).
        #[arg(last = true)]
        cargo_args: Vec<String>,
    },
    /// Build the plugins and run the plugin-boundary benchmark in release.
    BenchPlugins,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let workspace = plugins::Workspace::discover()?;
    match cli.command {
        Command::BuildPlugins => {
            let dir = workspace.build_plugins()?;
            println!("{}", dir.display());
        }
        Command::Test {
            no_lint,
            cargo_args,
        } => {
            let dir = workspace.build_plugins()?;
            let tokenizer =
                fixtures::fetch_qwen3_tokenizer(workspace.root(), workspace.target_dir())?;
            if !no_lint {
                workspace.cargo(&["fmt", "--all", "--check"], &[])?;
                workspace.cargo(
                    &[
                        "clippy",
                        "--workspace",
                        "--all-targets",
                        "--",
                        "-D",
                        "warnings",
                    ],
                    &[],
                )?;
            }
            let mut args = vec!["test", "--workspace"];
            args.extend(cargo_args.iter().map(String::as_str));
            workspace.cargo(
                &args,
                &[
                    ("PLUGHOST_PLUGINS_DIR", dir.as_os_str()),
                    ("PLUGHOST_QWEN3_TOKENIZER_DIR", tokenizer.as_os_str()),
                ],
            )?;
        }
        Command::BenchPlugins => {
            let dir = workspace.build_plugins()?;
            workspace.cargo(
                &["bench", "-p", "plughost", "--bench", "plugin_boundary"],
                &[("PLUGHOST_PLUGINS_DIR", dir.as_os_str())],
            )?;
        }
    }
    Ok(())
}
