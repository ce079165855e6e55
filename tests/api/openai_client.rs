//! The official `openai` Python client against a real server: completions and chat, streaming and not, with usage.

use std::process::Command;

use crate::common::api::{MODEL, server};

#[test]
fn the_openai_python_client_works_unchanged() {
    let python = std::env::var("PLUGHOST_TEST_PYTHON").unwrap_or_else(|_| {
        panic!("PLUGHOST_TEST_PYTHON is not set: `cargo xtask test` installs the openai client and sets it")
    });
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/openai_client_check.py");
    let output = Command::new(&python)
        .arg(script)
        .arg(&server().base)
        .arg(MODEL)
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "openai client check failed:\n{stdout}\n{stderr}"
    );
    assert_eq!(stdout.trim(), "ok");
}
