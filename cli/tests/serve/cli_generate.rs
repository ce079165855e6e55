//! `plughost generate` end to end: the reference continuation through the same engine, and a Chrome trace of every step.

use std::path::{Path, PathBuf};
use std::process::Command;

use plughost::model::Tokenizer;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn plugins_dir() -> PathBuf {
    let dir = std::env::var_os("PLUGHOST_PLUGINS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/plugins"));
    assert!(
        dir.join("libplughost_device_cpu.so").is_file(),
        "{} lacks the plugins: run `cargo xtask build-plugins`",
        dir.display()
    );
    dir
}

#[test]
fn generate_prints_the_reference_continuation_and_writes_a_trace() {
    generate_with_a_trace(&[]);
}

/// The device in a worker process: the same text, and the device's time by callable crosses
/// the process boundary into the trace.
#[test]
fn generate_in_a_device_worker_writes_the_same_trace() {
    generate_with_a_trace(&["--device-isolation", "process"]);
}

fn generate_with_a_trace(extra_args: &[&str]) {
    let model = workspace().join("tests/fixtures/tiny-qwen3");
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("reference.json")).expect("reference.json"),
    )
    .expect("parses");
    let prompt = &reference["prompts"][0];
    let text = prompt["text"].as_str().expect("prompt text");
    let ids: Vec<u32> = prompt["generated_token_ids"]
        .as_array()
        .expect("generated ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect();
    let tokenizer = Tokenizer::from_dir(&model).expect("tokenizer");
    let want = tokenizer.decode(&ids, true).expect("decode");

    let trace = std::env::temp_dir().join(format!(
        "plughost-generate-trace-{}-{}.json",
        std::process::id(),
        extra_args.len()
    ));
    let output = Command::new(env!("CARGO_BIN_EXE_plughost"))
        .args(["generate", "--model"])
        .arg(&model)
        .args([
            "--prompt",
            text,
            "--max-tokens",
            "32",
            "--ignore-eos",
            "--block-size",
            "4",
            "--num-kv-blocks",
            "64",
        ])
        .arg("--plugins-dir")
        .arg(plugins_dir())
        .arg("--component-cache")
        .arg(std::env::temp_dir().join("plughost-test-component-cache"))
        .arg("--profile-output")
        .arg(&trace)
        .args(extra_args)
        .output()
        .expect("plughost runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "generate failed: {stderr}");
    let stdout = String::from_utf8(output.stdout).expect("UTF-8 output");
    assert_eq!(
        stdout.strip_suffix('\n').unwrap_or(&stdout),
        want,
        "generate's text is the reference continuation"
    );
    assert!(stderr.contains("32 generated"), "{stderr}");

    let document: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).expect("trace written"))
            .expect("trace is JSON");
    let events = document["traceEvents"].as_array().expect("traceEvents");
    let spans = |cat: &str| -> Vec<u64> {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == cat)
            .map(|e| e["args"]["step"].as_u64().expect("step"))
            .collect()
    };
    let device_steps = spans("device");
    let host_steps = spans("host");
    // One prefill step and 31 decode steps, each with a device span and host spans.
    assert_eq!(device_steps.len(), 32, "a device span per step");
    for step in &device_steps {
        assert!(
            host_steps.iter().filter(|s| *s == step).count() >= 5,
            "host spans of step {step}"
        );
    }
    // Every step's device span says what each callable took of it: attention ran in each,
    // and the callables' times add up to no more than the span.
    for e in events
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == "device")
    {
        let callables = e["args"]["callables_ms"].as_object().expect("callables_ms");
        assert!(
            callables["paged_attention"]
                .as_f64()
                .is_some_and(|ms| ms > 0.0),
            "{e}"
        );
        let sum: f64 = callables.values().map(|ms| ms.as_f64().expect("ms")).sum();
        let span_ms = e["dur"].as_f64().expect("dur") / 1e3;
        assert!(
            sum <= span_ms * (1.0 + 1e-9) + 1e-6,
            "{sum} ms in callables, {span_ms} ms span: {e}"
        );
    }
    for e in events.iter().filter(|e| e["ph"] == "X") {
        assert!(
            e["ts"].as_f64().is_some() && e["dur"].as_f64().is_some_and(|d| d >= 0.0),
            "{e}"
        );
    }
    let _ = std::fs::remove_file(trace);
}
