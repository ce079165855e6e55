//! Shared by the tests that serve the tiny fixture: a real engine on the CPU device behind a real HTTP server, and SSE helpers.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use plughost::api::{ApiConfig, serve};
use plughost::engine::{EngineHandle, EngineOptions, EngineSetup};
use plughost::metrics::Metrics;
use plughost::model::Tokenizer;
use plughost::plugins::PluginSpec;
use serde_json::Value;

use crate::common;

pub const MODEL: &str = "tiny-qwen3";

pub fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(MODEL)
}

/// A built component with no config, the default limits and failure policy.
pub fn plugin(file: &str) -> PluginSpec {
    PluginSpec {
        component: common::plugin_path(file),
        config: Default::default(),
        memory_mib: None,
        call_timeout_ms: None,
        failure: Default::default(),
    }
}

/// Starts an engine on the CPU device with its defaults (the highest level this CPU has) and
/// waits until the model is loaded. The tiny Qwen3's weights are f32, so bf16 products never
/// apply: its greedy tokens match the `transformers` references at every level.
pub fn start_engine() -> Arc<EngineHandle> {
    start_engine_on("libplughost_device_cpu.so", "")
}

/// Starts an engine on the given device library (with its config string) and waits for it.
pub fn start_engine_on(device: &str, device_config: &str) -> Arc<EngineHandle> {
    let setup = EngineSetup {
        model_dir: model_dir(),
        model_name: MODEL.into(),
        device_library: common::plugin_path(device),
        device_config: device_config.into(),
        glue: plugin("plughost_model_qwen3.wasm"),
        scheduler: Some(plugin("plughost_scheduler_fcfs.wasm")),
        sampler: Some(plugin("plughost_sampler_standard.wasm")),
        named_samplers: Default::default(),
        component_cache: Some(std::env::temp_dir().join("plughost-test-component-cache")),
        options: EngineOptions {
            max_num_seqs: 8,
            max_num_batched_tokens: 256,
            block_size: 4,
            num_kv_blocks: Some(256),
            ..Default::default()
        },
        profile_output: None,
    };
    let engine =
        Arc::new(EngineHandle::start(setup, Arc::new(Metrics::new())).expect("start the engine"));
    engine.wait_ready().expect("the model loads");
    engine
}

/// A server on its own thread and runtime, for the whole test process.
pub struct TestServer {
    pub base: String,
    pub engine: Arc<EngineHandle>,
}

/// The process-wide server, started on first use.
pub fn server() -> &'static TestServer {
    static SERVER: OnceLock<TestServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let engine = start_engine();
        let addr = spawn_server(engine.clone(), ApiConfig::default());
        TestServer {
            base: format!("http://{addr}"),
            engine,
        }
    })
}

/// Serves `engine` on 127.0.0.1 from a background thread until the process ends.
pub fn spawn_server(engine: Arc<EngineHandle>, config: ApiConfig) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            tx.send(listener.local_addr().expect("address"))
                .expect("report the address");
            serve(listener, engine, config, std::future::pending())
                .await
                .expect("serve");
        });
    });
    rx.recv().expect("the server starts")
}

pub fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(model_dir()).expect("tokenizer")
}

/// One prompt of `reference.json`: token ids and Hugging Face's greedy continuation.
pub struct ReferencePrompt {
    pub name: String,
    pub token_ids: Vec<u32>,
    pub generated_token_ids: Vec<u32>,
}

pub fn reference_prompts() -> Vec<ReferencePrompt> {
    let text = std::fs::read_to_string(model_dir().join("reference.json")).expect("reference.json");
    let json: Value = serde_json::from_str(&text).expect("reference.json is JSON");
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .expect("a list of ids")
            .iter()
            .map(|i| i.as_u64().expect("an id") as u32)
            .collect()
    };
    json["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| ReferencePrompt {
            name: p["name"].as_str().expect("name").to_string(),
            token_ids: ids(&p["token_ids"]),
            generated_token_ids: ids(&p["generated_token_ids"]),
        })
        .collect()
}

/// The `data:` payloads of an SSE body, in order (comments and blank lines skipped).
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .flat_map(|event| event.lines())
        .filter_map(|line| line.strip_prefix("data:"))
        .map(|data| data.trim_start().to_string())
        .collect()
}

/// A metric's value from Prometheus text, for a name with no labels.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// Runs `tests/clients/SCRIPT BASE MODEL` with the test Python (`cargo xtask test` installs the
/// clients and sets `PLUGHOST_TEST_PYTHON`), and fails unless it prints only `ok`.
pub fn run_client_check(script: &str, base: &str) {
    let python = std::env::var("PLUGHOST_TEST_PYTHON").unwrap_or_else(|_| {
        panic!(
            "PLUGHOST_TEST_PYTHON is not set: `cargo xtask test` installs the clients and sets it"
        )
    });
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("clients")
        .join(script);
    let output = std::process::Command::new(python)
        .arg(&script)
        .arg(base)
        .arg(MODEL)
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.trim() == "ok",
        "{} failed:\n{stdout}\n{stderr}",
        script.display()
    );
}
