//! Deployment generations in the library: unchanged components are shared, and a generation that cannot start fails whole, naming the slot.

use super::*;

/// A spec of `file` whose config is the TOML table `config`.
fn spec(file: &str, config: &str) -> plughost::plugins::PluginSpec {
    plughost::plugins::PluginSpec {
        component: plugins_dir().join(file),
        config: toml::from_str(config).expect("a TOML table"),
        memory_mib: None,
        call_timeout_ms: None,
        failure: Default::default(),
    }
}

/// A generation shares the components the previous one has unchanged (same instance), makes
/// new ones for what changed, and fails whole, naming the slot, when a component cannot start.
#[test]
fn a_generation_shares_what_is_unchanged_and_fails_whole() {
    use plughost::plugins::{
        Generation, GenerationError, NamedSamplers, PluginRuntime, RuntimeOptions, Slot,
    };
    let runtime = PluginRuntime::new(RuntimeOptions {
        cache_dir: Some(std::env::temp_dir().join("plughost-test-component-cache")),
    })
    .expect("the plugin runtime");
    let fcfs = spec("plughost_scheduler_fcfs.wasm", "");
    let standard = spec("plughost_sampler_standard.wasm", "");
    let first = Generation::build(
        &runtime,
        1,
        Some(&fcfs),
        Some(&standard),
        &NamedSamplers::default(),
        None,
    )
    .expect("generation 1");
    let same = Generation::build(
        &runtime,
        2,
        Some(&fcfs),
        Some(&standard),
        &NamedSamplers::default(),
        Some(&first),
    )
    .expect("generation 2");
    let (a, b) = (
        first.sampler().expect("sampler"),
        same.sampler().expect("sampler"),
    );
    assert!(
        Arc::ptr_eq(a, b),
        "an unchanged sampler is the same instance"
    );
    assert!(!same.loaded_anew(Slot::Scheduler) && !same.loaded_anew(Slot::Sampler));

    let tuned = spec(
        "plughost_scheduler_fcfs.wasm",
        "long_prefill_token_threshold = 64",
    );
    let third = Generation::build(
        &runtime,
        3,
        Some(&tuned),
        Some(&standard),
        &NamedSamplers::default(),
        Some(&same),
    )
    .expect("generation 3");
    assert!(
        third.loaded_anew(Slot::Scheduler),
        "a new config makes a new scheduler"
    );
    assert!(!third.loaded_anew(Slot::Sampler));
    let statuses = third.components();
    assert_eq!(statuses[0].generation, 3);
    assert_eq!(statuses[1].generation, 1);

    let trap = spec("plughost_scheduler_faulty.wasm", "trap_in_init = true");
    let error = Generation::build(
        &runtime,
        4,
        Some(&trap),
        Some(&standard),
        &NamedSamplers::default(),
        Some(&third),
    )
    .err()
    .expect("a scheduler that traps in init fails the generation");
    assert!(
        matches!(
            error,
            GenerationError::Load {
                slot: Slot::Scheduler,
                ..
            }
        ),
        "{error}"
    );
    let wrong_world = Generation::build(
        &runtime,
        4,
        Some(&fcfs),
        Some(&fcfs),
        &NamedSamplers::default(),
        Some(&third),
    )
    .err()
    .expect("a scheduler in the sampler slot fails the generation");
    assert_eq!(wrong_world.slot(), Slot::Sampler, "{wrong_world}");
    assert!(
        wrong_world
            .to_string()
            .contains("exports the scheduler world; the [sampler] slot needs sampler"),
        "{wrong_world}"
    );
}
