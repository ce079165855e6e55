//! Helpers every test group shares: the folder of built plugins (native device libraries and wasm components) the end-to-end tests load, a real server on the tiny fixture ([`api`]) and the SmolLM2 folder with its references ([`smollm2`]).

// Each group binary compiles all of these and calls its own part of them.
#![allow(dead_code)]

pub mod api;
pub mod smollm2;

use std::path::{Path, PathBuf};

use plughost::device::{Device, DeviceLibrary};
use plughost::plugins::glue::GluePlugin;
use plughost::plugins::{InstanceLimits, PluginRuntime, RuntimeOptions};

/// `PLUGHOST_PLUGINS_DIR` if set, else `<workspace root>/target/plugins`, where
/// `cargo xtask build-plugins` puts them.
pub fn plugins_dir() -> PathBuf {
    match std::env::var_os("PLUGHOST_PLUGINS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let tests_crate = Path::new(env!("CARGO_MANIFEST_DIR"));
            let workspace_root = tests_crate.parent().unwrap_or(tests_crate);
            workspace_root.join("target").join("plugins")
        }
    }
}

/// The path of a built plugin; panics with how to build it when it is missing, because a
/// silently skipped test would hide a broken build.
pub fn plugin_path(file_name: &str) -> PathBuf {
    let path = plugins_dir().join(file_name);
    if !path.is_file() {
        panic!(
            "plugin `{}` is missing; run `cargo xtask build-plugins` first \
             (or point PLUGHOST_PLUGINS_DIR at a folder that holds it)",
            path.display()
        );
    }
    path
}

/// The device library `device_file` of the plugins folder opened with `device_config`, and the
/// model glue loaded for preparing a model: what `plughost::runtime::load_model` takes.
/// The cosine similarity of two logits rows, in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum();
    let norm = |v: &[f32]| v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

pub fn device_and_glue(device_file: &str, device_config: &str) -> (Device, GluePlugin) {
    let library = DeviceLibrary::load(plugin_path(device_file)).expect("the device loads");
    let device = Device::open(&library, device_config).expect("the device opens");
    let plugins = PluginRuntime::new(RuntimeOptions {
        cache_dir: Some(std::env::temp_dir().join("plughost-test-component-cache")),
    })
    .expect("plugin runtime");
    let glue = GluePlugin::load(
        &plugins,
        &plugin_path("plughost_model_qwen3.wasm"),
        "",
        InstanceLimits::for_prepare(),
    )
    .expect("glue loads");
    (device, glue)
}
