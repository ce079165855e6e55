//! A deployment generation: the immutable set of scheduler and sampler components the engine runs, built and dry-run before it serves.
//!
//! A generation is made whole or not at all: every component it names is compiled (through
//! the process's one engine and its cache), instantiated, initialised and called once on a
//! synthetic batch whose answer is checked. Only then can the engine swap it in. A component
//! whose file, config and limits are unchanged from the previous generation is shared with it,
//! instance and counters included, so a reload pays only for what changed.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use plughost_sdk::sampler::SamplingParams;
use serde::Serialize;

use super::deployment::{DEFAULT_SAMPLER_NAME, NamedSamplers};
use super::instance::{ContainedInstance, World};
use super::logits::LogitsBatch;
use super::policy::{ComponentState, FaultPolicy, FaultTracker};
use super::sampler::{SamplerPlugin, SequenceToSample};
use super::scheduler::SchedulerPlugin;
use super::{InstanceLimits, PluginError, PluginRuntime, PluginSpec, PluginStats};
use crate::sched::{self, Phase, RequestView, Resources};

/// The place a component takes in a deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Slot {
    Scheduler,
    Sampler,
}

impl Slot {
    pub fn as_str(self) -> &'static str {
        match self {
            Slot::Scheduler => "scheduler",
            Slot::Sampler => "sampler",
        }
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a generation could not be built; it names the component.
#[derive(Debug, thiserror::Error)]
pub enum GenerationError {
    #[error("[{slot}] {}: {source}", path.display())]
    Load {
        slot: Slot,
        path: PathBuf,
        #[source]
        source: PluginError,
    },
    #[error("[{slot}] {}: the dry run failed: {message}", path.display())]
    DryRun {
        slot: Slot,
        path: PathBuf,
        message: String,
    },
}

impl GenerationError {
    pub fn slot(&self) -> Slot {
        match self {
            GenerationError::Load { slot, .. } | GenerationError::DryRun { slot, .. } => *slot,
        }
    }

    pub fn path(&self) -> &Path {
        match self {
            GenerationError::Load { path, .. } | GenerationError::DryRun { path, .. } => path,
        }
    }
}

/// What identifies a loaded component, fixed when it loads.
#[derive(Debug, Clone)]
struct Identity {
    slot: Slot,
    /// A sampler's name in the deployment; `None` for the scheduler.
    name: Option<String>,
    path: PathBuf,
    sha256: String,
    wit_version: String,
    config_json: String,
    limits: InstanceLimits,
    policy: FaultPolicy,
    /// The generation that loaded it; later generations may share it.
    generation: u64,
    loaded_at: SystemTime,
}

impl Identity {
    fn same_as(&self, spec: &PluginSpec, sha256: &str) -> bool {
        self.path == spec.component
            && self.sha256 == sha256
            && self.config_json == spec.config_json()
            && self.limits == spec.limits()
            && self.policy == spec.fault_policy(self.slot)
    }
}

/// One loaded component: its identity and its plugin, which the engine thread calls.
pub struct LoadedComponent<P> {
    identity: Identity,
    plugin: Mutex<P>,
    /// The plugin's fault counts and state, readable without waiting for a call to end.
    faults: Arc<FaultTracker>,
}

impl<P> LoadedComponent<P> {
    /// The plugin, for one call. Only the engine thread calls plugins; the admin listing takes
    /// the lock briefly to read counters.
    pub fn plugin(&self) -> MutexGuard<'_, P> {
        self.plugin
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn sha256(&self) -> &str {
        &self.identity.sha256
    }

    pub fn wit_version(&self) -> &str {
        &self.identity.wit_version
    }

    pub fn path(&self) -> &Path {
        &self.identity.path
    }

    pub fn slot(&self) -> Slot {
        self.identity.slot
    }

    /// The component's failure policy, fault counts and state.
    pub fn faults(&self) -> &FaultTracker {
        &self.faults
    }

    /// The file's stem, as error messages and metric labels name the component.
    pub fn name(&self) -> String {
        component_name(&self.identity.path)
    }
}

impl LoadedComponent<SamplerPlugin> {
    /// Records that the host found one row of this sampler's output at fault on its own (a
    /// token the grammar mask forbids, say): one fault under the component's policy, which
    /// may back it off. Returns what the row gets.
    pub fn row_faulted(&self, cause: &dyn fmt::Display) -> super::OnFailure {
        self.faults.record_fault(cause);
        self.faults.on_failure()
    }
}

fn component_name(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// A component's failure policy as `/admin/deployment` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyStatus {
    pub on_failure: &'static str,
    pub max_faults: u32,
    pub fault_window_s: f64,
    pub backoff_s: f64,
    pub max_backoff_s: f64,
    /// Back-offs after which the component is disabled; `null`: never.
    pub disable_after: Option<u32>,
}

impl From<&FaultPolicy> for PolicyStatus {
    fn from(p: &FaultPolicy) -> Self {
        PolicyStatus {
            on_failure: p.on_failure.as_str(),
            max_faults: p.max_faults,
            fault_window_s: p.fault_window.as_secs_f64(),
            backoff_s: p.backoff.as_secs_f64(),
            max_backoff_s: p.max_backoff.as_secs_f64(),
            disable_after: p.disable_after,
        }
    }
}

/// A component's state as `/health` and `/metrics` show it, read without touching the plugin.
#[derive(Debug, Clone, Serialize)]
pub struct ComponentHealth {
    pub slot: Slot,
    /// The file's stem.
    pub component: String,
    /// `active`, `backing_off` or `disabled`.
    pub state: &'static str,
    /// Unix seconds (with a fraction) when the back-off ends; only while `backing_off`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backing_off_until: Option<f64>,
    pub faults: u64,
    pub backoffs: u32,
}

fn component_health<P>(c: &LoadedComponent<P>) -> ComponentHealth {
    let state = c.faults.state();
    ComponentHealth {
        slot: c.identity.slot,
        component: c.name(),
        state: state.as_str(),
        backing_off_until: backing_off_until(&state),
        faults: c.faults.faults(),
        backoffs: c.faults.backoffs(),
    }
}

fn backing_off_until(state: &ComponentState) -> Option<f64> {
    match state {
        ComponentState::BackingOff { until, .. } => until
            .duration_since(SystemTime::UNIX_EPOCH)
            .ok()
            .map(|d| (d.as_secs_f64() * 1e3).round() / 1e3),
        _ => None,
    }
}

/// A component as `/admin/deployment` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct ComponentStatus {
    pub slot: Slot,
    /// A sampler's name, which requests choose it by (`"sampler": "NAME"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Whether requests that name no sampler get this one.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub default: bool,
    pub world: &'static str,
    pub file: String,
    pub sha256: String,
    pub wit_version: String,
    /// The generation that loaded this component.
    pub generation: u64,
    /// Unix seconds when it loaded.
    pub loaded_at: u64,
    pub calls: u64,
    pub faults: u32,
    /// `active`; `backing_off` after `max_faults` faults within the window, until
    /// `backing_off_until`; `disabled` after `disable_after` back-offs.
    pub state: &'static str,
    /// Unix seconds (with a fraction) when the back-off ends; only while `backing_off`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backing_off_until: Option<f64>,
    /// Back-offs so far.
    pub backoffs: u32,
    /// Instances dropped after a call because they kept more memory than the host lets an
    /// instance keep between calls.
    pub memory_resets: u32,
    pub failure_policy: PolicyStatus,
}

pub type LoadedSampler = LoadedComponent<SamplerPlugin>;

/// One sampler of a generation: its name, and its component (`None`: the built-in, native).
struct NamedSampler {
    name: String,
    component: Option<Arc<LoadedSampler>>,
}

/// A request named a sampler the deployment does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown sampler `{name}`; this deployment has: {}", known.join(", "))]
pub struct UnknownSampler {
    pub name: String,
    pub known: Vec<String>,
}

/// The scheduler and samplers the engine runs, numbered; immutable once built.
pub struct Generation {
    number: u64,
    loaded_at: SystemTime,
    scheduler: Option<Arc<LoadedComponent<SchedulerPlugin>>>,
    /// `default` first, then the named samplers in the file's order.
    samplers: Vec<NamedSampler>,
    /// Which of `samplers` requests that name none get.
    default_sampler: usize,
    /// The deployment fingerprint with these components; set once the model is known.
    fingerprint: String,
}

impl Generation {
    /// Builds generation `number` from the specs: `None` runs the built-in policy natively;
    /// `sampler` is the one named `default`, `named` the others. Components equal to
    /// `previous`'s (a sampler: of the same name) are shared with it; every other one is
    /// compiled, instantiated, initialised and dry-run here, on the caller's thread.
    pub fn build(
        runtime: &PluginRuntime,
        number: u64,
        scheduler: Option<&PluginSpec>,
        sampler: Option<&PluginSpec>,
        named: &NamedSamplers,
        previous: Option<&Generation>,
    ) -> Result<Generation, GenerationError> {
        let loaded_at = SystemTime::now();
        let scheduler = match scheduler {
            None => None,
            Some(spec) => Some(load(
                runtime,
                (Slot::Scheduler, None),
                spec,
                number,
                loaded_at,
                previous.and_then(|p| p.scheduler.as_ref()),
                dry_run_scheduler,
            )?),
        };
        let specs = std::iter::once((DEFAULT_SAMPLER_NAME, sampler))
            .chain(named.iter().map(|(name, spec)| (name, Some(spec))));
        let mut samplers = Vec::new();
        for (name, spec) in specs {
            let component = match spec {
                None => None,
                Some(spec) => {
                    let previous = previous.and_then(|p| p.sampler_named(name).ok().flatten());
                    Some(load(
                        runtime,
                        (Slot::Sampler, Some(name)),
                        spec,
                        number,
                        loaded_at,
                        previous,
                        dry_run_sampler,
                    )?)
                }
            };
            samplers.push(NamedSampler {
                name: name.to_string(),
                component,
            });
        }
        let default_sampler = samplers
            .iter()
            .position(|s| s.name == named.default_name())
            .unwrap_or(0);
        Ok(Generation {
            number,
            loaded_at,
            scheduler,
            samplers,
            default_sampler,
            fingerprint: String::new(),
        })
    }

    /// Records the deployment fingerprint, before the generation is shared.
    pub fn set_fingerprint(&mut self, fingerprint: String) {
        self.fingerprint = fingerprint;
    }

    /// The `system_fingerprint` of requests that start under this generation.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn number(&self) -> u64 {
        self.number
    }

    pub fn loaded_at(&self) -> SystemTime {
        self.loaded_at
    }

    pub fn scheduler(&self) -> Option<&LoadedComponent<SchedulerPlugin>> {
        self.scheduler.as_deref()
    }

    /// The sampler requests that name none get; `None`: the built-in one, run natively.
    pub fn sampler(&self) -> Option<&Arc<LoadedSampler>> {
        self.samplers
            .get(self.default_sampler)
            .and_then(|s| s.component.as_ref())
    }

    /// The sampler a request names, or the default for `None`.
    pub fn sampler_for(
        &self,
        name: Option<&str>,
    ) -> Result<Option<&Arc<LoadedSampler>>, UnknownSampler> {
        match name {
            None => Ok(self.sampler()),
            Some(name) => self.sampler_named(name),
        }
    }

    fn sampler_named(&self, name: &str) -> Result<Option<&Arc<LoadedSampler>>, UnknownSampler> {
        self.samplers
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.component.as_ref())
            .ok_or_else(|| UnknownSampler {
                name: name.to_string(),
                known: self.sampler_names().map(str::to_string).collect(),
            })
    }

    /// The names requests may choose, `default` first.
    pub fn sampler_names(&self) -> impl Iterator<Item = &str> {
        self.samplers.iter().map(|s| s.name.as_str())
    }

    /// The name of the sampler requests that name none get.
    pub fn default_sampler_name(&self) -> &str {
        self.samplers
            .get(self.default_sampler)
            .map_or(DEFAULT_SAMPLER_NAME, |s| s.name.as_str())
    }

    /// Whether this generation took `slot`'s component (the default sampler's, for samplers)
    /// anew rather than sharing the previous one.
    pub fn loaded_anew(&self, slot: Slot) -> bool {
        let generation = match slot {
            Slot::Scheduler => self.scheduler.as_ref().map(|c| c.identity.generation),
            Slot::Sampler => self.sampler().map(|c| c.identity.generation),
        };
        generation == Some(self.number)
    }

    /// Each component's state, scheduler first; never waits for a plugin call.
    pub fn component_health(&self) -> Vec<ComponentHealth> {
        let mut list = Vec::new();
        if let Some(c) = &self.scheduler {
            list.push(component_health(c));
        }
        for sampler in &self.samplers {
            if let Some(c) = &sampler.component {
                list.push(component_health(c));
            }
        }
        list
    }

    /// The components with their counters, scheduler first, then the samplers by name.
    pub fn components(&self) -> Vec<ComponentStatus> {
        let mut list = Vec::new();
        if let Some(c) = &self.scheduler {
            list.push(status(c, SchedulerPlugin::WORLD, c.plugin().stats()));
        }
        for (i, sampler) in self.samplers.iter().enumerate() {
            if let Some(c) = &sampler.component {
                let mut entry = status(c, SamplerPlugin::WORLD, c.plugin().stats());
                entry.default = i == self.default_sampler;
                list.push(entry);
            }
        }
        list
    }
}

/// A host-side plugin type and the world it loads.
pub(crate) trait PluginWorld: Sized {
    const WORLD: &'static str;
    type Bindings: World;
    fn from_instance(instance: ContainedInstance<Self::Bindings>) -> Self;
}

fn status<P>(c: &LoadedComponent<P>, world: &'static str, stats: PluginStats) -> ComponentStatus {
    let id = &c.identity;
    let state = c.faults.state();
    ComponentStatus {
        slot: id.slot,
        name: id.name.clone(),
        default: false,
        world,
        file: id.path.display().to_string(),
        sha256: id.sha256.clone(),
        wit_version: id.wit_version.clone(),
        generation: id.generation,
        loaded_at: unix_seconds(id.loaded_at),
        calls: stats.calls,
        faults: u32::try_from(c.faults.faults()).unwrap_or(u32::MAX),
        state: state.as_str(),
        backing_off_until: backing_off_until(&state),
        backoffs: c.faults.backoffs(),
        memory_resets: stats.memory_resets,
        failure_policy: PolicyStatus::from(&id.policy),
    }
}

pub fn unix_seconds(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Loads one component for `place` (its slot, and a sampler's name).
fn load<P: PluginWorld>(
    runtime: &PluginRuntime,
    place: (Slot, Option<&str>),
    spec: &PluginSpec,
    number: u64,
    loaded_at: SystemTime,
    previous: Option<&Arc<LoadedComponent<P>>>,
    dry_run: impl FnOnce(&mut P) -> Result<(), String>,
) -> Result<Arc<LoadedComponent<P>>, GenerationError> {
    let (slot, name) = place;
    let path = spec.component.clone();
    let failed = |source| GenerationError::Load {
        slot,
        path: path.clone(),
        source,
    };
    let compiled = runtime.compile(&path).map_err(failed)?;
    if let Some(previous) = previous
        && previous.identity.same_as(spec, &compiled.sha256)
    {
        return Ok(previous.clone());
    }
    let config_json = spec.config_json();
    let limits = spec.limits();
    let policy = spec.fault_policy(slot);
    let mut instance = runtime
        .instantiate_component::<P::Bindings>(&path, &compiled, &config_json, limits)
        .map_err(failed)?;
    instance.set_fault_policy(slot, policy);
    let faults = instance.fault_tracker().clone();
    let mut plugin = P::from_instance(instance);
    dry_run(&mut plugin).map_err(|message| GenerationError::DryRun {
        slot,
        path: path.clone(),
        message,
    })?;
    Ok(Arc::new(LoadedComponent {
        identity: Identity {
            slot,
            name: name.map(str::to_string),
            path,
            sha256: compiled.sha256,
            wit_version: compiled.wit_version,
            config_json,
            limits,
            policy,
            generation: number,
            loaded_at,
        },
        plugin: Mutex::new(plugin),
        faults,
    }))
}

/// Schedules two waiting requests with room for both; the plan must pass the host's checks
/// and run something.
fn dry_run_scheduler(plugin: &mut SchedulerPlugin) -> Result<(), String> {
    let views: Vec<RequestView> = (1..=2u64)
        .map(|id| RequestView {
            id,
            phase: Phase::Waiting,
            priority: 0,
            arrival_us: id,
            prompt_len: 8,
            computed_len: 0,
            cached_prefix_len: 0,
            output_len: 0,
            max_output: 8,
            blocks_held: 0,
        })
        .collect();
    let resources = Resources {
        token_budget: 64,
        max_running: 8,
        block_size: 16,
        free_blocks: 16,
        total_blocks: 16,
    };
    // Step 0: no engine step, so the first real one counts up from it.
    let plan = plugin
        .schedule(0, &views, &resources)
        .map_err(|e| e.to_string())?;
    sched::validate_plan(&plan, &views, &resources).map_err(|e| format!("invalid plan: {e}"))?;
    if plan.run.is_empty() {
        return Err("the plan runs nothing while two requests wait and all fit".into());
    }
    Ok(())
}

/// Samples a batch of two rows, one greedy and one at temperature 1; the plugin must return
/// one token in the vocabulary per row (the sampler checks both on every call).
fn dry_run_sampler(plugin: &mut SamplerPlugin) -> Result<(), String> {
    const VOCAB: usize = 64;
    let values: Vec<f32> = (0..2 * VOCAB)
        .map(|i| ((i * 37 % 61) as f32) / 8.0 - 4.0)
        .collect();
    let mut batch = LogitsBatch::new(values, VOCAB);
    let sequences = [
        SequenceToSample {
            request: 1,
            position: 0,
            params: SamplingParams::GREEDY,
        },
        SequenceToSample {
            request: 2,
            position: 3,
            params: SamplingParams {
                temperature: 1.0,
                seed: 7,
                ..SamplingParams::GREEDY
            },
        },
    ];
    plugin
        .sample(&mut batch, &sequences)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_slot_and_the_file() {
        let error = GenerationError::DryRun {
            slot: Slot::Sampler,
            path: PathBuf::from("/p/s.wasm"),
            message: "returned 1 tokens for 2 sequences".into(),
        };
        assert_eq!(
            error.to_string(),
            "[sampler] /p/s.wasm: the dry run failed: returned 1 tokens for 2 sequences"
        );
        assert_eq!(error.slot(), Slot::Sampler);
    }
}
