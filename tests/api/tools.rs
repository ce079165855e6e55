//! Tool calling and reasoning through the API on the tiny Qwen3 with the real Qwen3 chat template: forced calls through the official openai client (streaming and not) parse and match their schemas, bad tool requests get 400 naming the field, and `<think>` blocks come back as `reasoning_content`.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use plughost::api::ApiConfig;
use plughost::engine::{EngineHandle, EngineOptions, EngineSetup};
use plughost::metrics::Metrics;
use plughost::plugins::PluginSpec;
use serde_json::{Value, json};

use crate::common;
use crate::common::api::{MODEL, model_dir, run_client_check, spawn_server};

/// The tiny Qwen3 with the real Qwen3 chat template (from the tokenizer reference, rendered
/// by `transformers`) and room for its tool prompt, in a scratch folder.
fn qwen3_template_model() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("plughost-qwen3-template-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch folder");
    for entry in std::fs::read_dir(model_dir()).expect("the fixture") {
        let path = entry.expect("an entry").path();
        std::fs::copy(&path, dir.join(path.file_name().expect("a name"))).expect("copy");
    }
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(model_dir().join("../qwen3-tokenizer-reference.json"))
            .expect("reference"),
    )
    .expect("JSON");
    let config_path = dir.join("tokenizer_config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).expect("config"))
            .expect("JSON");
    config["chat_template"] = reference["chat_template"].clone();
    std::fs::write(&config_path, config.to_string()).expect("write the config");
    // Qwen3's tool prompt alone outgrows the fixture's 512 positions; the mock device computes
    // any position alike.
    let model_config = dir.join("config.json");
    let mut model: Value =
        serde_json::from_str(&std::fs::read_to_string(&model_config).expect("config"))
            .expect("JSON");
    model["max_position_embeddings"] = json!(4096);
    std::fs::write(&model_config, model.to_string()).expect("write the model config");
    dir
}

/// The server of the Qwen3-template model, shared with the other APIs' tool checks.
pub(crate) fn server() -> &'static String {
    static BASE: OnceLock<String> = OnceLock::new();
    BASE.get_or_init(|| {
        let plugin = |file: &str| PluginSpec {
            component: common::plugin_path(file),
            config: Default::default(),
            memory_mib: None,
            call_timeout_ms: None,
            failure: Default::default(),
        };
        let setup = EngineSetup {
            model_dir: qwen3_template_model(),
            model_name: MODEL.into(),
            device_library: common::plugin_path("libplughost_device_mock.so"),
            device_config: String::new(),
            glue: plugin("plughost_model_qwen3.wasm"),
            scheduler: Some(plugin("plughost_scheduler_fcfs.wasm")),
            sampler: Some(plugin("plughost_sampler_standard.wasm")),
            named_samplers: Default::default(),
            component_cache: Some(std::env::temp_dir().join("plughost-test-component-cache")),
            options: EngineOptions {
                max_num_seqs: 8,
                max_num_batched_tokens: 512,
                block_size: 4,
                num_kv_blocks: Some(1024),
                ..Default::default()
            },
            profile_output: None,
        };
        let engine = Arc::new(EngineHandle::start(setup, Arc::new(Metrics::new())).expect("start"));
        engine.wait_ready().expect("the model loads");
        let addr = spawn_server(engine, ApiConfig::default());
        format!("http://{addr}")
    })
}

#[test]
fn forced_tool_calls_parse_and_match_through_the_openai_client() {
    run_client_check("openai_tools_check.py", server());
}

fn chat(body: Value) -> (u16, Value) {
    let response = reqwest::blocking::Client::new()
        .post(format!("{}/v1/chat/completions", server()))
        .json(&body)
        .send()
        .expect("sent");
    let status = response.status().as_u16();
    (status, response.json().expect("JSON"))
}

#[test]
fn bad_tool_requests_are_refused_naming_the_field() {
    let messages = json!([{"role": "user", "content": "hi"}]);
    let tool =
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
    for (extra, param) in [
        (
            json!({"tools": [{"type": "code_interpreter"}]}),
            "tools[0].type",
        ),
        (
            json!({"tools": [tool], "tool_choice": "always"}),
            "tool_choice",
        ),
        (
            json!({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
    ] {
        let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": 4});
        for (k, v) in extra.as_object().expect("an object") {
            body[k] = v.clone();
        }
        let (status, error) = chat(body);
        assert_eq!(status, 400, "{extra}: {error}");
        assert_eq!(error["error"]["param"], param, "{extra}: {error}");
    }
    // A forced call and a response format are two constraints: 400 naming both.
    let (status, error) = chat(json!({
        "model": MODEL, "messages": messages, "max_tokens": 4, "tools": [tool],
        "tool_choice": "required", "response_format": {"type": "json_object"},
    }));
    assert_eq!(status, 400, "{error}");
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("response_format") && message.contains("tool_choice"),
        "{message}"
    );
}

#[test]
fn the_qwen3_template_turns_reasoning_on_and_enable_thinking_off_leaves_content_whole() {
    let messages = json!([{"role": "user", "content": "Say something."}]);
    let (status, on) =
        chat(json!({"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}));
    assert_eq!(status, 200, "{on}");
    // The template writes `<think>`, so the answer carries the field (empty if the random
    // model did not open a block).
    assert!(
        on["choices"][0]["message"]["reasoning_content"].is_string(),
        "{on}"
    );
    let (status, off) = chat(json!({
        "model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": false},
    }));
    assert_eq!(status, 200, "{off}");
    assert_eq!(
        off["choices"][0]["message"]["reasoning_content"], "",
        "the prompt closed the block: {off}"
    );
    assert_eq!(off["usage"]["completion_tokens"], 12);
}

#[test]
fn a_schema_starts_after_the_reasoning_block_and_at_once_without_thinking() {
    let messages = json!([{"role": "user", "content": "Give me an object."}]);
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"], "additionalProperties": false});
    let format = json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}});
    // Thinking off: the prompt closed the block, so the whole answer is the schema's JSON.
    let (status, off) = chat(json!({
        "model": MODEL, "messages": messages, "max_tokens": 40, "temperature": 0,
        "response_format": format, "chat_template_kwargs": {"enable_thinking": false},
    }));
    assert_eq!(status, 200, "{off}");
    let content = off["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    let value: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{content:?}: {e}"));
    assert!(
        value["a"].as_i64().is_some_and(|a| (0..=9).contains(&a)),
        "{value}"
    );
    // Thinking on: the prompt opens the block and the model reasons freely; this random model
    // never closes it, so no token is forced into JSON and everything is reasoning.
    let (status, on) = chat(json!({
        "model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0,
        "response_format": format,
    }));
    assert_eq!(status, 200, "{on}");
    let message = &on["choices"][0]["message"];
    assert_eq!(on["choices"][0]["finish_reason"], "length", "{on}");
    assert!(
        message["reasoning_content"]
            .as_str()
            .is_some_and(|r| !r.is_empty()),
        "{on}"
    );
    assert_eq!(message["content"], "", "{on}");
    assert_eq!(
        on["usage"]["prompt_tokens"]
            .as_u64()
            .map(|n| n > off["usage"]["prompt_tokens"].as_u64().unwrap_or(0) - 10),
        Some(true)
    );
}
