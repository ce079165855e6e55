//! The failure policy of one plugin component: how many faults it may make, how long it is backed off, and what its requests get meanwhile.
//!
//! A component that makes `max_faults` faults within a sliding `fault_window_s` is *backed
//! off* for `backoff_s`: no call reaches it, and the host's built-in policy serves in its
//! place (`on_failure = "fallback"`) or the affected requests fail (`"reject"`). Each back-off
//! that follows another doubles, up to `max_backoff_s`; a whole `fault_window_s` without a
//! fault after a back-off ends resets the doubling. `disable_after` back-offs, when set,
//! disable the component for good. The tracker is shared between the engine thread, which
//! records faults, and the status readers (`/admin/deployment`, `/metrics`, `/health`),
//! which never wait on a plugin call.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use super::generation::Slot;

/// What the requests a component fails get.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    /// The host's built-in policy serves them: FCFS for a scheduler, the native standard
    /// sampler for a sampler.
    Fallback,
    /// They fail with an error naming the component and the cause.
    Reject,
}

impl OnFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            OnFailure::Fallback => "fallback",
            OnFailure::Reject => "reject",
        }
    }

    /// The default of a slot: a scheduler's fault only reorders work, so FCFS stands in; a
    /// sampler's output is the answer, so its requests fail rather than silently change.
    pub fn default_for(slot: Slot) -> OnFailure {
        match slot {
            Slot::Scheduler => OnFailure::Fallback,
            Slot::Sampler => OnFailure::Reject,
        }
    }
}

/// The failure-policy keys of one deployment section, as written; `None` takes the default.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSettings {
    pub max_faults: Option<u32>,
    pub fault_window_s: Option<f64>,
    pub backoff_s: Option<f64>,
    pub max_backoff_s: Option<f64>,
    pub disable_after: Option<u32>,
    pub on_failure: Option<OnFailure>,
}

/// A component's failure policy, every value resolved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultPolicy {
    pub max_faults: u32,
    pub fault_window: Duration,
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// Back-offs after which the component is disabled; `None`: never.
    pub disable_after: Option<u32>,
    pub on_failure: OnFailure,
}

pub const DEFAULT_MAX_FAULTS: u32 = 5;
pub const DEFAULT_FAULT_WINDOW: Duration = Duration::from_secs(60);
pub const DEFAULT_BACKOFF: Duration = Duration::from_secs(10);
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(600);

impl FaultPolicy {
    /// The defaults of `slot`.
    pub fn default_for(slot: Slot) -> FaultPolicy {
        FaultPolicy {
            max_faults: DEFAULT_MAX_FAULTS,
            fault_window: DEFAULT_FAULT_WINDOW,
            backoff: DEFAULT_BACKOFF,
            max_backoff: DEFAULT_MAX_BACKOFF,
            disable_after: None,
            on_failure: OnFailure::default_for(slot),
        }
    }
}

impl FaultSettings {
    /// Checks the values; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_faults == Some(0) {
            return Err("max_faults must be at least 1".into());
        }
        if self.disable_after == Some(0) {
            return Err("disable_after must be at least 1 (omit it to never disable)".into());
        }
        for (key, value) in [
            ("fault_window_s", self.fault_window_s),
            ("backoff_s", self.backoff_s),
            ("max_backoff_s", self.max_backoff_s),
        ] {
            if let Some(v) = value
                && !(v.is_finite() && v > 0.0 && v <= 1e9)
            {
                return Err(format!(
                    "{key} must be a positive number of seconds, got {v}"
                ));
            }
        }
        let backoff = self.backoff_s.unwrap_or(DEFAULT_BACKOFF.as_secs_f64());
        let cap = self
            .max_backoff_s
            .unwrap_or(DEFAULT_MAX_BACKOFF.as_secs_f64());
        if cap < backoff {
            return Err(format!(
                "max_backoff_s ({cap}) must be at least backoff_s ({backoff})"
            ));
        }
        Ok(())
    }

    /// The policy for a component in `slot`, the defaults filling what is unset.
    pub fn resolve(&self, slot: Slot) -> FaultPolicy {
        let d = FaultPolicy::default_for(slot);
        let secs = |v: Option<f64>, default| v.map(Duration::from_secs_f64).unwrap_or(default);
        FaultPolicy {
            max_faults: self.max_faults.unwrap_or(d.max_faults),
            fault_window: secs(self.fault_window_s, d.fault_window),
            backoff: secs(self.backoff_s, d.backoff),
            max_backoff: secs(self.max_backoff_s, d.max_backoff),
            disable_after: self.disable_after,
            on_failure: self.on_failure.unwrap_or(d.on_failure),
        }
    }
}

/// Where a component stands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ComponentState {
    Active,
    /// No call reaches it until `until`.
    BackingOff {
        until: SystemTime,
        remaining: Duration,
    },
    /// For good, until a reload loads it again.
    Disabled,
}

impl ComponentState {
    pub fn as_str(&self) -> &'static str {
        match self {
            ComponentState::Active => "active",
            ComponentState::BackingOff { .. } => "backing_off",
            ComponentState::Disabled => "disabled",
        }
    }

    /// Every state's name, for gauges that show one of them as 1.
    pub const NAMES: [&'static str; 3] = ["active", "backing_off", "disabled"];
}

/// Why a component took no call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Unavailable {
    BackingOff { remaining: Duration },
    Disabled { backoffs: u32 },
}

/// What a request a component failed gets told, kept typed up to the HTTP layer, which picks
/// the status from the variant.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PluginRejection {
    /// The component faulted: for a sampler, on this request's own row (found by re-running
    /// it alone); for a scheduler, on the step that would have admitted it.
    #[error(
        "the {slot} plugin {plugin} failed on this request: {cause} (its deployment sets \
         on_failure = \"reject\")"
    )]
    Faulted {
        slot: Slot,
        plugin: String,
        cause: String,
    },
    /// The component is backed off after repeated faults.
    #[error(
        "the {slot} plugin {plugin} is backed off for {retry_after_s} s after repeated faults, \
         and its deployment sets on_failure = \"reject\""
    )]
    BackingOff {
        slot: Slot,
        plugin: String,
        retry_after_s: u64,
    },
    #[error(
        "the {slot} plugin {plugin} is disabled after repeated faults (a reload loads it \
         again), and its deployment sets on_failure = \"reject\""
    )]
    Disabled { slot: Slot, plugin: String },
}

impl PluginRejection {
    /// The rejection of a request a component could not serve because it is `unavailable`.
    pub fn unavailable(slot: Slot, plugin: &str, unavailable: Unavailable) -> PluginRejection {
        match unavailable {
            Unavailable::BackingOff { remaining } => PluginRejection::BackingOff {
                slot,
                plugin: plugin.to_string(),
                // Whole seconds, rounded up, so a client that waits that long finds it back.
                retry_after_s: remaining.as_secs() + u64::from(remaining.subsec_nanos() > 0),
            },
            Unavailable::Disabled { .. } => PluginRejection::Disabled {
                slot,
                plugin: plugin.to_string(),
            },
        }
    }
}

#[derive(Debug, Default)]
struct Tracked {
    /// Faults within the window, oldest first.
    recent: VecDeque<Instant>,
    faults: u64,
    last_fault: Option<Instant>,
    /// Back-offs since the doubling last reset; the next lasts `backoff * 2^level`.
    level: u32,
    backoffs: u32,
    /// The back-off under way, or the last one's end.
    backoff_until: Option<Instant>,
    disabled: bool,
}

/// Counts one component's faults under its policy and says whether it may be called.
#[derive(Debug)]
pub struct FaultTracker {
    name: String,
    slot: Slot,
    policy: FaultPolicy,
    tracked: Mutex<Tracked>,
}

impl FaultTracker {
    pub fn new(name: String, slot: Slot, policy: FaultPolicy) -> FaultTracker {
        FaultTracker {
            name,
            slot,
            policy,
            tracked: Mutex::new(Tracked::default()),
        }
    }

    pub fn policy(&self) -> &FaultPolicy {
        &self.policy
    }

    pub fn on_failure(&self) -> OnFailure {
        self.policy.on_failure
    }

    pub fn slot(&self) -> Slot {
        self.slot
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tracked> {
        self.tracked
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Every fault so far.
    pub fn faults(&self) -> u64 {
        self.lock().faults
    }

    /// Back-offs so far.
    pub fn backoffs(&self) -> u32 {
        self.lock().backoffs
    }

    /// The component's state now.
    pub fn state(&self) -> ComponentState {
        let t = self.lock();
        if t.disabled {
            return ComponentState::Disabled;
        }
        let now = Instant::now();
        match t.backoff_until {
            Some(until) if until > now => {
                let remaining = until - now;
                ComponentState::BackingOff {
                    until: SystemTime::now() + remaining,
                    remaining,
                }
            }
            _ => ComponentState::Active,
        }
    }

    /// `Ok` when a call may reach the component now.
    pub fn admit(&self) -> Result<(), Unavailable> {
        let t = self.lock();
        if t.disabled {
            return Err(Unavailable::Disabled {
                backoffs: t.backoffs,
            });
        }
        match t.backoff_until {
            Some(until) => {
                let now = Instant::now();
                if until > now {
                    Err(Unavailable::BackingOff {
                        remaining: until - now,
                    })
                } else {
                    Ok(())
                }
            }
            None => Ok(()),
        }
    }

    /// Records one fault; starts a back-off (or disables the component) when it is the
    /// `max_faults`-th within the window. Returns the state it leaves the component in.
    pub fn record_fault(&self, cause: &dyn fmt::Display) -> ComponentState {
        let now = Instant::now();
        let p = &self.policy;
        {
            let mut t = self.lock();
            t.faults += 1;
            // A whole window without trouble after the last back-off: start doubling afresh.
            if t.level > 0
                && let Some(ended) = t.backoff_until
                && ended <= now
            {
                let quiet_since = t.last_fault.map_or(ended, |f| f.max(ended));
                if now.duration_since(quiet_since) >= p.fault_window {
                    t.level = 0;
                }
            }
            t.last_fault = Some(now);
            while t
                .recent
                .front()
                .is_some_and(|&f| now.duration_since(f) >= p.fault_window)
            {
                t.recent.pop_front();
            }
            t.recent.push_back(now);
            tracing::warn!(
                slot = %self.slot,
                plugin = %self.name,
                faults = t.faults,
                in_window = t.recent.len(),
                max_faults = p.max_faults,
                "plugin fault: {cause}"
            );
            let already_off = t.disabled || t.backoff_until.is_some_and(|u| u > now);
            if already_off || (t.recent.len() as u32) < p.max_faults {
                drop(t);
                return self.state();
            }
            t.recent.clear();
            t.backoffs += 1;
            if p.disable_after.is_some_and(|n| t.backoffs >= n) {
                t.disabled = true;
                tracing::error!(
                    slot = %self.slot,
                    plugin = %self.name,
                    backoffs = t.backoffs,
                    on_failure = p.on_failure.as_str(),
                    "plugin disabled after {} back-offs (disable_after); a reload loads it again",
                    t.backoffs
                );
            } else {
                let factor = 1u32.checked_shl(t.level.min(31)).unwrap_or(u32::MAX);
                let length = p
                    .backoff
                    .checked_mul(factor)
                    .unwrap_or(p.max_backoff)
                    .min(p.max_backoff);
                t.level = t.level.saturating_add(1);
                t.backoff_until = Some(now + length);
                tracing::error!(
                    slot = %self.slot,
                    plugin = %self.name,
                    backoff_s = length.as_secs_f64(),
                    on_failure = p.on_failure.as_str(),
                    "plugin backed off after {} faults within {} s",
                    p.max_faults,
                    p.fault_window.as_secs_f64()
                );
            }
        }
        self.state()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker(max_faults: u32, window_ms: u64, backoff_ms: u64, cap_ms: u64) -> FaultTracker {
        FaultTracker::new(
            "p".into(),
            Slot::Sampler,
            FaultPolicy {
                max_faults,
                fault_window: Duration::from_millis(window_ms),
                backoff: Duration::from_millis(backoff_ms),
                max_backoff: Duration::from_millis(cap_ms),
                disable_after: None,
                on_failure: OnFailure::Reject,
            },
        )
    }

    fn remaining(state: ComponentState) -> Duration {
        match state {
            ComponentState::BackingOff { remaining, .. } => remaining,
            other => panic!("expected a back-off, got {other:?}"),
        }
    }

    #[test]
    fn backs_off_at_max_faults_and_doubles_up_to_the_cap() {
        let t = tracker(2, 60_000, 100_000, 300_000);
        assert_eq!(t.record_fault(&"a"), ComponentState::Active);
        let first = remaining(t.record_fault(&"b"));
        assert!(first > Duration::from_secs(90) && first <= Duration::from_secs(100));
        assert!(matches!(t.admit(), Err(Unavailable::BackingOff { .. })));
        // Pretend the back-off ended; the next two faults back off twice as long.
        t.lock().backoff_until = Some(Instant::now());
        assert_eq!(t.admit(), Ok(()));
        t.record_fault(&"c");
        let second = remaining(t.record_fault(&"d"));
        assert!(second > Duration::from_secs(190), "{second:?}");
        t.lock().backoff_until = Some(Instant::now());
        t.record_fault(&"e");
        let third = remaining(t.record_fault(&"f"));
        assert!(third <= Duration::from_secs(300), "capped: {third:?}");
        assert!(third > Duration::from_secs(290), "{third:?}");
        assert_eq!(t.backoffs(), 3);
        assert_eq!(t.faults(), 6);
    }

    #[test]
    fn faults_outside_the_window_do_not_add_up() {
        let t = tracker(2, 30, 1_000, 1_000);
        t.record_fault(&"a");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(t.record_fault(&"b"), ComponentState::Active);
    }

    #[test]
    fn a_clean_window_after_a_back_off_resets_the_doubling() {
        let t = tracker(1, 30, 100_000, 1_000_000);
        t.record_fault(&"a");
        t.lock().backoff_until = Some(Instant::now());
        std::thread::sleep(Duration::from_millis(60));
        let again = remaining(t.record_fault(&"b"));
        assert!(again <= Duration::from_secs(100), "not doubled: {again:?}");
    }

    #[test]
    fn disable_after_disables_for_good() {
        let mut policy = FaultPolicy::default_for(Slot::Scheduler);
        policy.max_faults = 1;
        policy.disable_after = Some(1);
        let t = FaultTracker::new("p".into(), Slot::Scheduler, policy);
        assert_eq!(t.record_fault(&"a"), ComponentState::Disabled);
        assert_eq!(t.admit(), Err(Unavailable::Disabled { backoffs: 1 }));
    }

    #[test]
    fn settings_resolve_with_slot_defaults_and_reject_nonsense() {
        let none = FaultSettings::default();
        assert_eq!(none.resolve(Slot::Sampler).on_failure, OnFailure::Reject);
        assert_eq!(
            none.resolve(Slot::Scheduler).on_failure,
            OnFailure::Fallback
        );
        assert_eq!(none.resolve(Slot::Sampler).max_faults, 5);
        for bad in [
            FaultSettings {
                max_faults: Some(0),
                ..Default::default()
            },
            FaultSettings {
                backoff_s: Some(-1.0),
                ..Default::default()
            },
            FaultSettings {
                backoff_s: Some(20.0),
                max_backoff_s: Some(10.0),
                ..Default::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
