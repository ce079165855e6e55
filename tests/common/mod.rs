//! Helpers every test group shares: the folder of built plugins (native device libraries and wasm components) the end-to-end tests load, a real server on the tiny fixture ([`api`]) and the SmolLM2 folder with its references ([`smollm2`]).

// Each group binary compiles all of these and calls its own part of them.
#![allow(dead_code)]

pub mod api;
pub mod smollm2;

use std::path::{Path, PathBuf};

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
