//! Errors of the plugin layer: loading failures, traps, and a plugin's own errors kept apart.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("cannot read plugin component {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot compile plugin component {path}: {message}")]
    Compile { path: PathBuf, message: String },
    #[error(
        "plugin component {path} does not implement the {world} world of plughost:plugin@{version}: {message}"
    )]
    Incompatible {
        path: PathBuf,
        world: &'static str,
        version: &'static str,
        message: String,
    },
    /// The component was built for another contract version or world; it is never compiled.
    #[error(transparent)]
    Contract(#[from] super::ContractError),
    #[error("plugin {plugin} failed to instantiate: {message}")]
    Instantiate { plugin: String, message: String },
    /// The plugin ran and returned an error of its own; the instance stays usable.
    #[error("plugin {plugin} returned an error: {message}")]
    Plugin { plugin: String, message: String },
    /// The plugin answered, but with output the host refuses (an invalid plan, a token outside
    /// the vocabulary, the wrong number of tokens); the instance stays usable.
    #[error("plugin {plugin} gave output the host refuses: {message}")]
    Refused { plugin: String, message: String },
    /// The call exceeded its deadline; the instance was dropped.
    #[error("plugin {plugin} exceeded its {limit_ms} ms call deadline")]
    Timeout { plugin: String, limit_ms: u64 },
    /// The guest trapped (including running out of its memory cap); the instance was dropped.
    #[error("plugin {plugin} trapped: {message}")]
    Trap { plugin: String, message: String },
    /// The plugin faulted `max_faults` times within its window and takes no call until its
    /// back-off ends.
    #[error("plugin {plugin} is backed off after repeated faults for {remaining_ms} ms more")]
    BackingOff { plugin: String, remaining_ms: u64 },
    /// The plugin was backed off `disable_after` times and takes no call until a reload.
    #[error("plugin {plugin} is disabled after {backoffs} back-offs")]
    Disabled { plugin: String, backoffs: u32 },
    #[error("plugin runtime setup failed: {0}")]
    Runtime(String),
}

impl PluginError {
    /// True when the instance was lost (a trap or a timeout), as opposed to the plugin reporting an error.
    pub fn is_fault(&self) -> bool {
        matches!(self, PluginError::Timeout { .. } | PluginError::Trap { .. })
    }

    /// True when the failure policy kept the call from the plugin (backed off or disabled).
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            PluginError::BackingOff { .. } | PluginError::Disabled { .. }
        )
    }
}
