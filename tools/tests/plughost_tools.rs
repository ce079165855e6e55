//! The `plughost-tools` binary as `cargo xtask` runs it. `cargo xtask test` builds this test
//! first, which makes cargo build the binary with the features of the whole test build, and
//! then fetches the test model with it.

use std::path::{Path, PathBuf};
use std::process::Command;

fn tools() -> Command {
    Command::new(env!("CARGO_BIN_EXE_plughost-tools"))
}

/// The converted SmolLM2 folder `cargo xtask test` fetched.
fn smollm2_dir() -> PathBuf {
    let dir = std::env::var_os("PLUGHOST_SMOLLM2_DIR")
        .expect("PLUGHOST_SMOLLM2_DIR names the converted SmolLM2 folder; run `cargo xtask test`");
    PathBuf::from(dir)
}

fn modified(path: &Path) -> std::time::SystemTime {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn an_up_to_date_model_folder_is_reused_as_it_is() {
    let dir = smollm2_dir();
    let models = dir.parent().expect("the model folder has a parent");
    let weights = dir.join("model.safetensors");
    let before = modified(&weights);
    let output = tools()
        .args(["fetch-model", "smollm2-135m-instruct"])
        .env("PLUGHOST_MODELS_DIR", models)
        .output()
        .expect("plughost-tools runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert_eq!(
        stdout.lines().last(),
        Some(dir.to_str().unwrap()),
        "{stderr}"
    );
    assert_eq!(modified(&weights), before, "the weights were written again");
}

#[test]
fn an_unknown_model_is_refused_with_the_known_ones_named() {
    let output = tools()
        .args(["fetch-model", "gpt-5"])
        .output()
        .expect("plughost-tools runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("smollm2-135m-instruct"), "{stderr}");
}
