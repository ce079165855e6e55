//! The `plughost` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use plughost::plugins::glue::GluePlugin;
use plughost::plugins::sampler::SamplerPlugin;
use plughost::plugins::scheduler::SchedulerPlugin;
use plughost::plugins::{Deployment, PluginRuntime, RuntimeOptions};

#[derive(Parser)]
#[command(
    name = "plughost",
    version,
    about = "LLM serving host with WebAssembly scheduling, sampling and model-glue plugins"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load every plugin a deployment file names, run its `init`, and report.
    Check {
        /// The deployment file (TOML).
        #[arg(long)]
        config: PathBuf,
        /// Where compiled components are cached.
        #[arg(long, env = "PLUGHOST_CACHE_DIR")]
        cache_dir: Option<PathBuf>,
    },
}

fn check(config: &PathBuf, cache_dir: Option<PathBuf>) -> Result<(), String> {
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
    if let Some(spec) = &deployment.glue {
        GluePlugin::load(
            &runtime,
            &spec.component,
            &spec.config_json(),
            spec.limits(),
        )
        .map_err(|e| e.to_string())?;
        println!("glue       ok  {}", spec.component.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Check { config, cache_dir } => check(config, cache_dir.clone()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
