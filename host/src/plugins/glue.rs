//! The model-glue world on the host side: called at prepare time to describe a model and build its step program.

use std::path::Path;

use super::instance::{ContainedInstance, PluginState};
use super::{InstanceLimits, PluginError, PluginRuntime, PluginStats};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit/0.1",
        world: "model-glue",
    });
}

/// The records glue returns (`ModelInfo`, `StepProgram`, ...), as generated from the WIT.
pub use bindings::plughost::plugin::program as types;

super::instance::impl_world!(bindings::ModelGlue, ModelGluePre, "model-glue");

impl types::Host for PluginState {}

/// A loaded model-glue plugin.
pub struct GluePlugin {
    instance: ContainedInstance<bindings::ModelGlue>,
}

impl GluePlugin {
    pub fn load(
        runtime: &PluginRuntime,
        path: &Path,
        config: &str,
        limits: InstanceLimits,
    ) -> Result<Self, PluginError> {
        Ok(GluePlugin {
            instance: runtime.instantiate(path, config, limits)?,
        })
    }

    pub fn stats(&self) -> PluginStats {
        self.instance.stats()
    }

    fn plugin_result<T>(&self, result: Result<T, String>) -> Result<T, PluginError> {
        result.map_err(|message| PluginError::Plugin {
            plugin: self.instance.name().to_string(),
            message,
        })
    }

    /// Checks `config.json` and lists the weights and KV layout the model needs.
    pub fn describe(&mut self, config_json: &str) -> Result<types::ModelInfo, PluginError> {
        let result = self
            .instance
            .call(|world, store| world.call_describe(store, config_json))?;
        self.plugin_result(result)
    }

    /// Builds the step program of the model.
    pub fn build_program(&mut self, config_json: &str) -> Result<types::StepProgram, PluginError> {
        let result = self
            .instance
            .call(|world, store| world.call_build_program(store, config_json))?;
        self.plugin_result(result)
    }
}
