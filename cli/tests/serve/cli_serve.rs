//! `plughost serve` end to end: it serves a model that loads, and exits naming the config field of one it cannot compute.

use crate::serve_support::{free_port, plugins_dir, workspace};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Far beyond the second or so the tiny fixtures take to load in a debug build (and the few
/// seconds of SmolLM2's GGUF).
pub(crate) const DEADLINE: Duration = Duration::from_secs(120);

pub(crate) fn serve(model: &Path, port: u16, flags: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_plughost"))
        .args(["serve", "--model"])
        .arg(model)
        .args(["--port", &port.to_string(), "--num-kv-blocks", "64"])
        .args(flags)
        .arg("--plugins-dir")
        .arg(plugins_dir())
        .arg("--component-cache")
        .arg(std::env::temp_dir().join("plughost-test-component-cache"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("plughost starts")
}

pub(crate) fn stderr_of(child: &mut Child) -> String {
    let mut text = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        let _ = stderr.read_to_string(&mut text);
    }
    text
}

/// The status line of `GET /health`, or `None` while nothing listens.
pub(crate) fn health(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response.lines().next().map(str::to_string)
}

/// A copy of a fixture checkpoint whose config.json `edit` changed.
fn edited_fixture(name: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let from = workspace().join("tests/fixtures").join(name);
    let to = std::env::temp_dir().join(format!("plughost-cli-serve-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&to).expect("temp folder");
    for file in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(from.join(file), to.join(file)).expect("copy fixture file");
    }
    let text = std::fs::read_to_string(from.join("config.json")).expect("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&text).expect("config.json parses");
    edit(&mut config);
    std::fs::write(to.join("config.json"), config.to_string()).expect("write config.json");
    to
}

/// `plughost serve` on `model`, once `/health` answers 200; panics if it exits first.
pub(crate) fn serve_ready(model: &Path) -> (Child, u16) {
    let port = free_port();
    let mut child = serve(model, port, &[]);
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("poll plughost") {
            panic!(
                "plughost serve exited ({status}): {}",
                stderr_of(&mut child)
            );
        }
        if health(port).is_some_and(|line| line.contains(" 200 ")) {
            return (child, port);
        }
        assert!(started.elapsed() < DEADLINE, "/health never answered 200");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn serve_answers_once_the_model_loads_and_keeps_serving() {
    let (mut child, _) = serve_ready(&workspace().join("tests/fixtures/tiny-qwen3"));
    // The watch for a failed load must not stop a server whose model loaded.
    std::thread::sleep(Duration::from_millis(500));
    let still_running = child.try_wait().expect("poll plughost").is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        still_running,
        "plughost serve exited after the model loaded"
    );
}

/// Serves `model` until plughost exits on its own; its exit status and stderr.
pub(crate) fn run_until_exit(model: &Path, flags: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = serve(model, free_port(), flags);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll plughost") {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("plughost serve kept running: {}", stderr_of(&mut child));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    (status, stderr_of(&mut child))
}

#[test]
fn serve_exits_naming_the_config_field_it_cannot_compute() {
    let model = edited_fixture("tiny-llama", |config| {
        config["rope_parameters"] = serde_json::json!({
            "rope_type": "dynamic", "rope_theta": 500000.0, "factor": 4.0
        });
    });
    let (status, stderr) = run_until_exit(&model, &[]);
    let _ = std::fs::remove_dir_all(&model);
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("error: "), "{stderr}");
    assert!(
        stderr.contains(r#"config.json: rope_parameters.rope_type "dynamic" is not supported"#),
        "{stderr}"
    );
}

#[test]
fn serve_exits_when_the_model_fails_to_load_in_the_background() {
    // The glue accepts this config; the weights then do not fit it, which only loading finds.
    let model = edited_fixture("tiny-qwen3", |config| {
        config["intermediate_size"] = serde_json::json!(96);
    });
    let (status, stderr) = run_until_exit(&model, &[]);
    let _ = std::fs::remove_dir_all(&model);
    assert!(!status.success(), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: the model failed to load: ")
            && last.contains("model.layers.0.mlp.gate_proj.weight"),
        "{stderr}"
    );
}
