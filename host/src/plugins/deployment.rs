//! The deployment file (TOML): which scheduler, sampler and glue components to load, with the JSON config of each.
//!
//! ```toml
//! [scheduler]
//! component = "plughost_scheduler_fcfs.wasm"   # relative to this file
//! config = { long_prefill_token_threshold = 512 }
//! call_timeout_ms = 200
//!
//! [sampler]
//! component = "plughost_sampler_standard.wasm"
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::InstanceLimits;

#[derive(Debug, thiserror::Error)]
pub enum DeploymentError {
    #[error("cannot read deployment file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid deployment file {path}: {message}")]
    Parse { path: PathBuf, message: String },
}

/// One plugin of a deployment.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PluginSpec {
    /// The component file; a relative path is taken from the deployment file's folder.
    pub component: PathBuf,
    /// Handed to the plugin's `init` as JSON; an absent table becomes `{}`.
    #[serde(default = "empty_table")]
    pub config: toml::Table,
    /// Cap on the instance's linear memory.
    pub memory_mib: Option<u64>,
    /// Deadline of one call.
    pub call_timeout_ms: Option<u64>,
}

fn empty_table() -> toml::Table {
    toml::Table::new()
}

impl PluginSpec {
    /// The plugin's config as the JSON string its `init` receives.
    pub fn config_json(&self) -> String {
        serde_json::to_string(&self.config).unwrap_or_else(|_| "{}".to_string())
    }

    /// The instance limits, with the defaults where the file is silent.
    pub fn limits(&self) -> InstanceLimits {
        let mut limits = InstanceLimits::default();
        if let Some(mib) = self.memory_mib {
            limits.memory_bytes = (mib as usize).saturating_mul(1 << 20);
        }
        if let Some(ms) = self.call_timeout_ms {
            limits.call_timeout = Duration::from_millis(ms);
        }
        limits
    }
}

/// A whole deployment; a missing section means the host's default for it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Deployment {
    pub scheduler: Option<PluginSpec>,
    pub sampler: Option<PluginSpec>,
    pub glue: Option<PluginSpec>,
}

impl Deployment {
    pub fn from_file(path: &Path) -> Result<Self, DeploymentError> {
        let text = std::fs::read_to_string(path).map_err(|source| DeploymentError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::from_str_in(&text, base).map_err(|message| DeploymentError::Parse {
            path: path.to_path_buf(),
            message,
        })
    }

    /// Parses `text`, resolving relative component paths against `base`.
    pub fn from_str_in(text: &str, base: &Path) -> Result<Self, String> {
        let mut deployment: Deployment = toml::from_str(text).map_err(|e| e.to_string())?;
        for spec in [
            &mut deployment.scheduler,
            &mut deployment.sampler,
            &mut deployment.glue,
        ]
        .into_iter()
        .flatten()
        {
            if spec.component.is_relative() {
                spec.component = base.join(&spec.component);
            }
        }
        Ok(deployment)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_components_configs_and_limits() {
        let text = r#"
            [scheduler]
            component = "fcfs.wasm"
            config = { long_prefill_token_threshold = 512 }
            call_timeout_ms = 200

            [sampler]
            component = "/abs/sampler.wasm"
            memory_mib = 64
        "#;
        let d = Deployment::from_str_in(text, Path::new("/deploy")).expect("valid file");
        let scheduler = d.scheduler.expect("scheduler section");
        assert_eq!(scheduler.component, PathBuf::from("/deploy/fcfs.wasm"));
        assert_eq!(
            scheduler.config_json(),
            r#"{"long_prefill_token_threshold":512}"#
        );
        assert_eq!(scheduler.limits().call_timeout, Duration::from_millis(200));
        let sampler = d.sampler.expect("sampler section");
        assert_eq!(sampler.component, PathBuf::from("/abs/sampler.wasm"));
        assert_eq!(sampler.config_json(), "{}");
        assert_eq!(sampler.limits().memory_bytes, 64 << 20);
        assert!(d.glue.is_none());
    }

    #[test]
    fn rejects_unknown_keys_and_missing_components() {
        for text in [
            "[scheduler]\ncomponent = 'a'\ncolour = 1",
            "[sampler]\nconfig = {}",
            "[router]\ncomponent='x'",
        ] {
            assert!(
                Deployment::from_str_in(text, Path::new(".")).is_err(),
                "{text}"
            );
        }
    }
}
