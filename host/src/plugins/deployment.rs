//! The deployment file (TOML): which scheduler, sampler and glue components to load, with the JSON config of each.
//!
//! ```toml
//! [scheduler]
//! component = "plughost_scheduler_fcfs.wasm"   # relative to this file
//! config = { long_prefill_token_threshold = 512 }
//! call_timeout_ms = 200
//!
//! [sampler]                                    # the sampler named "default"
//! component = "plughost_sampler_standard.wasm"
//!
//! [samplers.creative]                          # chosen per request: "sampler": "creative"
//! component = "plughost_sampler_banned.wasm"
//! on_failure = "fallback"      # the failure policy: see `policy`
//! max_faults = 3
//! fault_window_s = 30
//! ```
//!
//! A top-level `default_sampler = "NAME"` (before the first table) makes requests that name
//! no sampler use `NAME` instead of `default`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::InstanceLimits;
use super::generation::Slot;
use super::policy::{FaultPolicy, FaultSettings, OnFailure};

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
#[serde(try_from = "SectionKeys")]
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
    /// The failure policy's keys (`max_faults`, `on_failure`, ...), as written.
    pub failure: FaultSettings,
}

/// Every key a section may hold, flat as in the file; the failure policy's keys are gathered
/// into [`FaultSettings`] (serde's `flatten` would lose `deny_unknown_fields`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SectionKeys {
    component: PathBuf,
    #[serde(default = "empty_table")]
    config: toml::Table,
    memory_mib: Option<u64>,
    call_timeout_ms: Option<u64>,
    max_faults: Option<u32>,
    fault_window_s: Option<f64>,
    backoff_s: Option<f64>,
    max_backoff_s: Option<f64>,
    disable_after: Option<u32>,
    on_failure: Option<OnFailure>,
}

impl TryFrom<SectionKeys> for PluginSpec {
    type Error = String;

    fn try_from(keys: SectionKeys) -> Result<Self, String> {
        let failure = FaultSettings {
            max_faults: keys.max_faults,
            fault_window_s: keys.fault_window_s,
            backoff_s: keys.backoff_s,
            max_backoff_s: keys.max_backoff_s,
            disable_after: keys.disable_after,
            on_failure: keys.on_failure,
        };
        failure.validate()?;
        if keys.call_timeout_ms == Some(0) {
            return Err("call_timeout_ms must be at least 1".into());
        }
        if keys.memory_mib == Some(0) {
            return Err("memory_mib must be at least 1".into());
        }
        Ok(PluginSpec {
            component: keys.component,
            config: keys.config,
            memory_mib: keys.memory_mib,
            call_timeout_ms: keys.call_timeout_ms,
            failure,
        })
    }
}

fn empty_table() -> toml::Table {
    toml::Table::new()
}

impl PluginSpec {
    /// The plugin's config as the JSON string its `init` receives.
    pub fn config_json(&self) -> String {
        serde_json::to_string(&self.config).unwrap_or_else(|_| "{}".to_string())
    }

    /// The instance limits of a scheduler or sampler, called every step, with the defaults
    /// where the file is silent.
    pub fn limits(&self) -> InstanceLimits {
        self.limits_over(InstanceLimits::default())
    }

    /// The instance limits of the model glue, called only at prepare time.
    pub fn glue_limits(&self) -> InstanceLimits {
        self.limits_over(InstanceLimits::for_prepare())
    }

    fn limits_over(&self, defaults: InstanceLimits) -> InstanceLimits {
        let mut limits = defaults;
        if let Some(mib) = self.memory_mib {
            limits.memory_bytes = (mib as usize).saturating_mul(1 << 20);
        }
        if let Some(ms) = self.call_timeout_ms {
            limits.call_timeout = Duration::from_millis(ms);
        }
        limits
    }

    /// The failure policy of this component in `slot`, with the slot's defaults where the
    /// file is silent.
    pub fn fault_policy(&self, slot: Slot) -> FaultPolicy {
        self.failure.resolve(slot)
    }
}

/// The name of the sampler in the `[sampler]` section (or the built-in one when it is absent).
pub const DEFAULT_SAMPLER_NAME: &str = "default";

/// A whole deployment; a missing section means the host's default for it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Deployment {
    /// Which sampler serves requests that name none; `default` when absent.
    default_sampler: Option<String>,
    pub scheduler: Option<PluginSpec>,
    pub sampler: Option<PluginSpec>,
    #[serde(default)]
    samplers: std::collections::BTreeMap<String, PluginSpec>,
    pub glue: Option<PluginSpec>,
}

/// The samplers a deployment names besides `[sampler]`, and the one requests that name none get.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NamedSamplers {
    samplers: Vec<(String, PluginSpec)>,
    default: Option<String>,
}

impl NamedSamplers {
    /// The `[samplers.NAME]` sections, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &PluginSpec)> {
        self.samplers
            .iter()
            .map(|(name, spec)| (name.as_str(), spec))
    }

    /// The sampler requests get when they name none: `default_sampler`, else `default`.
    pub fn default_name(&self) -> &str {
        self.default.as_deref().unwrap_or(DEFAULT_SAMPLER_NAME)
    }
}

/// A sampler name a request can send: letters, digits, `-`, `_` and `.`.
fn valid_sampler_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
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
        .chain(deployment.samplers.values_mut())
        {
            if spec.component.is_relative() {
                spec.component = base.join(&spec.component);
            }
        }
        deployment.check_sampler_names()?;
        Ok(deployment)
    }

    fn check_sampler_names(&self) -> Result<(), String> {
        for name in self.samplers.keys() {
            if name == DEFAULT_SAMPLER_NAME {
                return Err(format!(
                    "[samplers.{DEFAULT_SAMPLER_NAME}]: the name `{DEFAULT_SAMPLER_NAME}` \
                     belongs to the [sampler] section"
                ));
            }
            if !valid_sampler_name(name) {
                return Err(format!(
                    "[samplers.{name}]: a sampler name is 1 to 64 letters, digits, `-`, `_` or `.`"
                ));
            }
        }
        if let Some(default) = &self.default_sampler
            && default != DEFAULT_SAMPLER_NAME
            && !self.samplers.contains_key(default)
        {
            return Err(format!(
                "default_sampler = {default:?} names no sampler; the file names: {}",
                self.sampler_names().join(", ")
            ));
        }
        Ok(())
    }

    /// `default`, then the `[samplers.NAME]` names in order.
    fn sampler_names(&self) -> Vec<&str> {
        std::iter::once(DEFAULT_SAMPLER_NAME)
            .chain(self.samplers.keys().map(String::as_str))
            .collect()
    }

    /// The `[samplers.NAME]` sections and the `default_sampler` choice.
    pub fn named_samplers(&self) -> NamedSamplers {
        NamedSamplers {
            samplers: self
                .samplers
                .iter()
                .map(|(name, spec)| (name.clone(), spec.clone()))
                .collect(),
            default: self.default_sampler.clone(),
        }
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
            on_failure = "fallback"
            max_faults = 2
            fault_window_s = 0.5
            backoff_s = 1
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
        let policy = sampler.fault_policy(Slot::Sampler);
        assert_eq!(policy.on_failure, OnFailure::Fallback);
        assert_eq!(policy.max_faults, 2);
        assert_eq!(policy.fault_window, Duration::from_millis(500));
        assert_eq!(policy.backoff, Duration::from_secs(1));
        assert_eq!(
            scheduler.fault_policy(Slot::Scheduler),
            FaultPolicy::default_for(Slot::Scheduler)
        );
        assert!(d.glue.is_none());
    }

    #[test]
    fn names_samplers_and_a_default() {
        let text = r#"
            default_sampler = "creative"
            [sampler]
            component = "standard.wasm"
            [samplers.creative]
            component = "banned.wasm"
            config = { banned = [1, 2] }
            [samplers.exact-1]
            component = "/abs/greedy.wasm"
        "#;
        let d = Deployment::from_str_in(text, Path::new("/deploy")).expect("valid file");
        let named = d.named_samplers();
        assert_eq!(named.default_name(), "creative");
        let list: Vec<(&str, &Path)> = named
            .iter()
            .map(|(name, spec)| (name, spec.component.as_path()))
            .collect();
        assert_eq!(
            list,
            [
                ("creative", Path::new("/deploy/banned.wasm")),
                ("exact-1", Path::new("/abs/greedy.wasm"))
            ]
        );
        let plain = Deployment::from_str_in("[sampler]\ncomponent='s.wasm'", Path::new("."))
            .expect("valid file");
        assert_eq!(plain.named_samplers().default_name(), "default");
        assert_eq!(plain.named_samplers().iter().count(), 0);
    }

    #[test]
    fn refuses_bad_sampler_names_naming_them() {
        for (text, named) in [
            (
                "default_sampler = 'fast'\n[samplers.slow]\ncomponent='a'",
                "fast",
            ),
            ("[samplers.default]\ncomponent='a'", "default"),
            ("[samplers.'a b']\ncomponent='a'", "a b"),
        ] {
            let error = Deployment::from_str_in(text, Path::new(".")).expect_err(text);
            assert!(error.contains(named), "{text}: {error}");
        }
    }

    #[test]
    fn rejects_unknown_keys_and_missing_components() {
        for text in [
            "[scheduler]\ncomponent = 'a'\ncolour = 1",
            "[sampler]\nconfig = {}",
            "[router]\ncomponent='x'",
            "[sampler]\ncomponent = 'a'\non_failure = 'retry'",
            "[sampler]\ncomponent = 'a'\nmax_faults = 0",
            "[sampler]\ncomponent = 'a'\nbackoff_s = 20\nmax_backoff_s = 5",
        ] {
            assert!(
                Deployment::from_str_in(text, Path::new(".")).is_err(),
                "{text}"
            );
        }
    }
}
