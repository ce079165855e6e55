//! `plughost check` and `plughost plugin new|build`: loading a deployment's plugins to see that
//! they work, and the plugin author's scaffold and build.

use std::path::{Path, PathBuf};

use plughost::plugin_kit::{self, NewPlugin, PluginCommand, SdkSource};
use plughost::plugins::glue::GluePlugin;
use plughost::plugins::sampler::SamplerPlugin;
use plughost::plugins::scheduler::SchedulerPlugin;
use plughost::plugins::{Deployment, PluginRuntime, RuntimeOptions};

use crate::error::CliError;

/// `plughost check`: loads every plugin a deployment file names and runs its `init`.
pub fn check(config: &Path, cache_dir: Option<PathBuf>) -> Result<(), CliError> {
    let deployment = Deployment::from_file(config)?;
    let runtime = PluginRuntime::new(RuntimeOptions { cache_dir })?;
    if let Some(spec) = &deployment.scheduler {
        SchedulerPlugin::load(
            &runtime,
            &spec.component,
            &spec.config_json(),
            spec.limits(),
        )?;
        println!("scheduler  ok  {}", spec.component.display());
    }
    if let Some(spec) = &deployment.sampler {
        SamplerPlugin::load(
            &runtime,
            &spec.component,
            &spec.config_json(),
            spec.limits(),
        )?;
        println!("sampler    ok  {}", spec.component.display());
    }
    for (name, spec) in deployment.named_samplers().iter() {
        SamplerPlugin::load(
            &runtime,
            &spec.component,
            &spec.config_json(),
            spec.limits(),
        )
        .map_err(|source| CliError::NamedSampler {
            name: name.to_string(),
            source,
        })?;
        println!("sampler    ok  {} ({name})", spec.component.display());
    }
    if let Some(spec) = &deployment.glue {
        GluePlugin::load(
            &runtime,
            &spec.component,
            &spec.config_json(),
            spec.glue_limits(),
        )?;
        println!("glue       ok  {}", spec.component.display());
    }
    Ok(())
}

/// `plughost plugin new|build`; a build is checked by the same code as `plughost check`.
pub fn plugin(command: &PluginCommand) -> Result<(), CliError> {
    match command {
        PluginCommand::New {
            kind,
            name,
            path,
            sdk,
        } => {
            let sdk = SdkSource::parse(sdk.as_deref())?;
            let dir = plugin_kit::create(&NewPlugin {
                kind: *kind,
                name: name.clone(),
                parent: path.clone(),
                sdk,
            })?;
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
            let built = plugin_kit::build(dir)?;
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
