//! Structured outputs over HTTP: JSON schemas, regexes, choices and `logit_bias` enforced by the host on the tiny Qwen3 and on SmolLM2, with the standard sampler and with a sampler that proposes forbidden tokens; and the real Qwen3 tokenizer's token environment.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use plughost::api::ApiConfig;
use plughost::engine::{
    EngineHandle, EngineOptions, EngineSetup, GenerationEvent, GenerationRequest,
};
use plughost::grammar::{Constraint, GrammarCompiler, LogitBias, MaskState, Progress};
use plughost::metrics::Metrics;
use plughost::model::Tokenizer;
use plughost::plugins::{FaultSettings, OnFailure, PluginSpec};
use plughost_sdk::sampler::SamplingParams;
use serde_json::{Value, json};

use crate::common::api::{MODEL, metric, server, spawn_server, tokenizer};
use crate::common::{self, api, smollm2};

/// Generous: a constrained request of at most a few hundred tokens on a tiny model.
const DEADLINE: Duration = Duration::from_secs(300);

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(DEADLINE)
        .build()
        .expect("client")
}

fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let response = client()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .expect("the server answers");
    let status = response.status().as_u16();
    let text = response.text().expect("a body");
    assert!(
        !text.contains("Infinity") && !text.contains("NaN"),
        "no JSON carries -inf or NaN: {text}"
    );
    (status, serde_json::from_str(&text).expect("a JSON body"))
}

/// Test schemas: nesting, arrays, enums, required fields, string patterns and number bounds,
/// every string and array bounded so outputs end within `max_tokens`.
fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        (
            "person",
            json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "role": {"enum": ["admin", "user", "guest"]}
                },
                "required": ["name", "age", "role"],
                "additionalProperties": false
            }),
        ),
        (
            "nested",
            json!({
                "type": "object",
                "properties": {
                    "id": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{3}$"},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 6},
                        "minItems": 1,
                        "maxItems": 3
                    },
                    "point": {
                        "type": "object",
                        "properties": {
                            "x": {"type": "integer", "minimum": -5, "maximum": 5},
                            "y": {"type": "integer", "minimum": 10, "maximum": 99}
                        },
                        "required": ["x", "y"],
                        "additionalProperties": false
                    },
                    "ok": {"type": "boolean"}
                },
                "required": ["id", "tags", "point", "ok"],
                "additionalProperties": false
            }),
        ),
        (
            "list",
            json!({
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 4
            }),
        ),
    ]
}

/// Every choice of a constrained response: finished by the grammar, parses, validates.
fn assert_valid(what: &str, schema: &Value, text: &str, finish_reason: &Value) {
    assert_eq!(
        finish_reason, "stop",
        "{what}: the grammar ends the output: {text:?}"
    );
    let value: Value = serde_json::from_str(text)
        .unwrap_or_else(|e| panic!("{what}: the output is not JSON ({e}): {text:?}"));
    let validator = jsonschema::validator_for(schema).expect("a valid test schema");
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| e.to_string())
        .collect();
    assert!(
        errors.is_empty(),
        "{what}: {text} breaks the schema: {errors:?}"
    );
}

fn completion_body(prompt: &str, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 200});
    for (key, value) in extra.as_object().expect("an object") {
        body[key] = value.clone();
    }
    body
}

fn schema_format(schema: &Value) -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "test", "strict": true, "schema": schema}})
}

/// Checks every schema, greedy and sampled (several seeds, `n` choices), on `base`.
fn check_schemas(base: &str, model: &str, chat: bool) {
    for (name, schema) in schemas() {
        for (temperature, seed) in [(0.0, 0), (1.0, 7), (1.0, 8)] {
            let what = format!("{model} {name} temperature {temperature} seed {seed}");
            let (status, body) = if chat {
                post(
                    base,
                    "/v1/chat/completions",
                    &json!({
                        "model": model,
                        "messages": [{"role": "user", "content": format!("Give me an example of {name} as JSON.")}],
                        "max_tokens": 200, "temperature": temperature, "seed": seed, "n": 2,
                        "response_format": schema_format(&schema),
                    }),
                )
            } else {
                post(
                    base,
                    "/v1/completions",
                    &json!({
                        "model": model, "prompt": "JSON:", "max_tokens": 200,
                        "temperature": temperature, "seed": seed, "n": 2,
                        "response_format": schema_format(&schema),
                    }),
                )
            };
            assert_eq!(status, 200, "{what}: {body}");
            for choice in body["choices"].as_array().expect("choices") {
                let text = if chat {
                    choice["message"]["content"].as_str()
                } else {
                    choice["text"].as_str()
                };
                assert_valid(
                    &what,
                    &schema,
                    text.expect("text"),
                    &choice["finish_reason"],
                );
            }
        }
    }
}

#[test]
fn json_schemas_hold_greedy_and_sampled_on_the_tiny_qwen3() {
    check_schemas(&server().base, MODEL, false);
}

#[test]
fn json_object_and_vllm_json_give_json() {
    let base = &server().base;
    let (status, body) = post(
        base,
        "/v1/completions",
        &completion_body(
            "x",
            json!({"response_format": {"type": "json_object"}, "temperature": 0}),
        ),
    );
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["text"].as_str().expect("text");
    if body["choices"][0]["finish_reason"] == "stop" {
        let value: Value = serde_json::from_str(text).expect("a JSON object");
        assert!(value.is_object(), "{text}");
    } else {
        // An unbounded object may run out of tokens; what it wrote is still an object's start.
        assert!(text.starts_with('{'), "{text}");
    }
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"], "additionalProperties": false});
    let (status, body) = post(
        base,
        "/v1/completions",
        &completion_body(
            "x",
            json!({"structured_outputs": {"json": schema}, "temperature": 0}),
        ),
    );
    assert_eq!(status, 200, "{body}");
    assert_valid(
        "structured_outputs.json",
        &schema,
        body["choices"][0]["text"].as_str().expect("text"),
        &body["choices"][0]["finish_reason"],
    );
}

#[test]
fn choice_and_regex_outputs_match() {
    let base = &server().base;
    let choices = ["alpha", "beta gamma", "δέλτα"];
    for seed in 0..4 {
        let (status, body) = post(
            base,
            "/v1/completions",
            &completion_body(
                "Pick:",
                json!({"structured_outputs": {"choice": choices}, "temperature": 1.0, "seed": seed}),
            ),
        );
        assert_eq!(status, 200, "{body}");
        let text = body["choices"][0]["text"].as_str().expect("text");
        assert!(choices.contains(&text), "{text:?} is one of {choices:?}");
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
    }
    let regex = "[0-9]{3}-[a-c]{2,4}";
    for seed in 0..4 {
        let (status, body) = post(
            base,
            "/v1/chat/completions",
            &json!({
                "model": MODEL, "messages": [{"role": "user", "content": "code?"}],
                "max_tokens": 50, "temperature": 1.0, "seed": seed,
                "structured_outputs": {"regex": regex},
            }),
        );
        assert_eq!(status, 200, "{body}");
        let text = body["choices"][0]["message"]["content"]
            .as_str()
            .expect("text");
        let ok = text.len() >= 6
            && text[..3].bytes().all(|b| b.is_ascii_digit())
            && &text[3..4] == "-"
            && (2..=4).contains(&text[4..].len())
            && text[4..].bytes().all(|b| (b'a'..=b'c').contains(&b));
        assert!(ok, "{text:?} matches {regex}");
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
    }
}

#[test]
fn a_grammar_dead_end_stops_with_its_reason() {
    let base = &server().base;
    // A regex whose language is empty: no token can ever start it.
    let body = completion_body("x", json!({"structured_outputs": {"regex": "[^\\s\\S]"}}));
    let (status, response) = post(base, "/v1/completions", &body);
    assert_eq!(status, 200, "{response}");
    let choice = &response["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{response}");
    assert_eq!(choice["stop_reason"], "grammar_dead_end", "{response}");
    assert_eq!(choice["text"], "");
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let text = client()
        .post(format!("{base}/v1/completions"))
        .json(&stream)
        .send()
        .expect("the server answers")
        .text()
        .expect("a body");
    let events = api::sse_data(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    let last: Value = serde_json::from_str(&events[events.len() - 2]).expect("a chunk");
    assert_eq!(
        last["choices"][0]["stop_reason"], "grammar_dead_end",
        "{text}"
    );
    // Ordinary stops carry no stop reason.
    let (_, plain) = post(
        base,
        "/v1/completions",
        &completion_body("x", json!({"max_tokens": 2})),
    );
    assert!(plain["choices"][0].get("stop_reason").is_none(), "{plain}");
}

#[test]
fn masked_tokens_never_appear_among_top_logprobs() {
    let (status, body) = post(
        &server().base,
        "/v1/chat/completions",
        &json!({
            "model": MODEL, "messages": [{"role": "user", "content": "yes or no?"}],
            "max_tokens": 10, "temperature": 0, "logprobs": true, "top_logprobs": 20,
            "structured_outputs": {"choice": ["yes", "no"]},
        }),
    );
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs");
    assert!(!content.is_empty());
    let first = &content[0];
    let top = first["top_logprobs"].as_array().expect("top logprobs");
    assert!(
        !top.is_empty() && top.len() < 20,
        "only tokens the grammar allows are alternatives: {top:?}"
    );
    for alternative in top {
        assert!(
            alternative["logprob"].as_f64().is_some_and(f64::is_finite),
            "{alternative}"
        );
        let token = alternative["token"].as_str().expect("token");
        assert!(
            "yes".starts_with(token) || "no".starts_with(token),
            "{token:?} cannot start either choice"
        );
    }
    let total: f64 = top
        .iter()
        .map(|a| a["logprob"].as_f64().expect("logprob").exp())
        .sum();
    assert!(
        (total - 1.0).abs() < 1e-3,
        "the allowed tokens carry all the mass after the mask: {total}"
    );
}

/// Greedy token ids of `prompt` straight from the engine, with `bias`.
fn engine_tokens(engine: &EngineHandle, prompt: &[u32], bias: LogitBias, n: u32) -> Vec<u32> {
    let request = GenerationRequest {
        logit_bias: bias,
        ..GenerationRequest::new(prompt.to_vec(), SamplingParams::GREEDY, n)
    };
    let (_, mut events) = engine.submit(request).expect("submitted");
    let mut tokens = Vec::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        while let Some(event) = tokio::time::timeout(DEADLINE, events.recv())
            .await
            .expect("the engine answers in time")
        {
            match event {
                GenerationEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
                GenerationEvent::Finished { .. } => break,
                GenerationEvent::Failed { message } | GenerationEvent::Unavailable { message } => {
                    panic!("{message}")
                }
                GenerationEvent::Rejected(r) => panic!("{r}"),
            }
        }
    });
    tokens
}

#[test]
fn logit_bias_moves_the_greedy_token_and_forces_one() {
    let server = server();
    let prompt = tokenizer()
        .encode("The capital of France", false)
        .expect("tokens");
    let plain = engine_tokens(&server.engine, &prompt, LogitBias::default(), 3);
    let banned = engine_tokens(
        &server.engine,
        &prompt,
        LogitBias::new(vec![(plain[0], -100.0)]),
        3,
    );
    assert_ne!(
        banned[0], plain[0],
        "-100 on the greedy token changes the output"
    );

    // The same over HTTP: the biased output differs; +100 forces the token `Z`.
    let http = |bias: Value| {
        let (status, body) = post(
            &server.base,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "logit_bias": bias}),
        );
        assert_eq!(status, 200, "{body}");
        body["choices"][0]["text"]
            .as_str()
            .expect("text")
            .to_string()
    };
    let greedy = http(json!({}));
    assert_ne!(http(json!({plain[0].to_string(): -100})), greedy);
    let z = tokenizer().encode("Z", false).expect("tokens");
    assert_eq!(z.len(), 1);
    assert_eq!(http(json!({z[0].to_string(): 100})), "ZZZ");
}

#[test]
fn bad_constraints_are_refused_with_400() {
    let base = &server().base;
    let cases = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"structured_outputs": {"regex": "(unclosed"}}),
            "structured_outputs.regex",
        ),
        (
            json!({"structured_outputs": {"grammar": "start: missing_rule"}}),
            "structured_outputs.grammar",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}),
            "structured_outputs.choice",
        ),
        (json!({"logit_bias": {"1": 150}}), "logit_bias"),
        (json!({"logit_bias": {"99999": 1}}), "logit_bias"),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
    ];
    for (extra, param) in cases {
        let (status, body) = post(
            base,
            "/v1/completions",
            &completion_body("x", extra.clone()),
        );
        assert_eq!(status, 400, "{extra}: {body}");
        assert_eq!(body["error"]["param"], param, "{extra}: {body}");
        assert!(!body["error"]["message"].as_str().unwrap_or("").is_empty());
    }
    let (_, body) = post(
        base,
        "/v1/completions",
        &completion_body(
            "x",
            json!({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}),
        ),
    );
    let message = body["error"]["message"].as_str().expect("message");
    assert!(
        message.contains("response_format") && message.contains("structured_outputs"),
        "both sources are named: {message}"
    );
}

/// A server on the tiny Qwen3 whose sampler proposes `<|im_start|>` (never valid inside
/// JSON) at every second position.
fn stubborn_server() -> &'static (String, Arc<EngineHandle>) {
    static SERVER: OnceLock<(String, Arc<EngineHandle>)> = OnceLock::new();
    SERVER.get_or_init(|| {
        // Its forbidden proposals are faults under its own policy: `fallback`, with no
        // back-off, so every row it gets wrong is drawn natively inside the mask.
        let plugin = |file: &str, config: toml::Table| PluginSpec {
            component: common::plugin_path(file),
            config,
            memory_mib: None,
            call_timeout_ms: None,
            failure: FaultSettings {
                on_failure: Some(OnFailure::Fallback),
                max_faults: Some(u32::MAX),
                ..Default::default()
            },
        };
        let im_start = tokenizer().encode("<|im_start|>", false).expect("tokens");
        assert_eq!(im_start.len(), 1);
        let mut config = toml::Table::new();
        config.insert("token_id".into(), toml::Value::Integer(im_start[0].into()));
        config.insert("every".into(), toml::Value::Integer(2));
        let setup = EngineSetup {
            model_dir: api::model_dir(),
            model_name: MODEL.into(),
            device_library: common::plugin_path("libplughost_device_mock.so"),
            device_config: String::new(),
            glue: plugin("plughost_model_qwen3.wasm", Default::default()),
            scheduler: Some(plugin("plughost_scheduler_fcfs.wasm", Default::default())),
            sampler: Some(plugin("plughost_sampler_stubborn.wasm", config)),
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
        let engine = Arc::new(
            EngineHandle::start(setup, Arc::new(Metrics::new())).expect("start the engine"),
        );
        engine.wait_ready().expect("the model loads");
        let base = format!(
            "http://{}",
            spawn_server(engine.clone(), ApiConfig::default())
        );
        (base, engine)
    })
}

#[test]
fn a_sampler_that_proposes_forbidden_tokens_still_gives_valid_json() {
    let (base, engine) = stubborn_server();
    let im_start = tokenizer().encode("<|im_start|>", false).expect("tokens")[0];
    // Unconstrained, the plugin's proposal goes through: it really is stubborn.
    let prompt = tokenizer().encode("x", false).expect("tokens");
    let tokens = engine_tokens(engine, &prompt, LogitBias::default(), 4);
    assert_eq!(tokens[0], im_start, "{tokens:?}");
    assert_eq!(tokens[2], im_start, "{tokens:?}");
    let before = rejections(base);
    check_schemas(base, MODEL, false);
    let after = rejections(base);
    assert!(
        after > before,
        "the host rejected the plugin's forbidden tokens ({before} -> {after})"
    );
}

fn rejections(base: &str) -> f64 {
    let text = client()
        .get(format!("{base}/metrics"))
        .send()
        .expect("metrics")
        .text()
        .expect("text");
    metric(&text, "plughost_grammar_rejections_total").expect("the rejection counter")
}

/// A server on SmolLM2-135M-Instruct (CPU device, standard sampler).
fn smollm2_server() -> &'static str {
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
            model_dir: smollm2::model_dir(),
            model_name: "smollm2-135m-instruct".into(),
            device_library: common::plugin_path("libplughost_device_cpu.so"),
            device_config: String::new(),
            glue: plugin("plughost_model_qwen3.wasm"),
            scheduler: Some(plugin("plughost_scheduler_fcfs.wasm")),
            sampler: Some(plugin("plughost_sampler_standard.wasm")),
            named_samplers: Default::default(),
            component_cache: Some(std::env::temp_dir().join("plughost-test-component-cache")),
            options: EngineOptions {
                max_num_seqs: 4,
                max_num_batched_tokens: 512,
                max_model_len: Some(1024),
                ..Default::default()
            },
            profile_output: None,
        };
        let engine =
            Arc::new(EngineHandle::start(setup, Arc::new(Metrics::new())).expect("engine starts"));
        engine.wait_ready().expect("SmolLM2 loads");
        format!("http://{}", spawn_server(engine, ApiConfig::default()))
    })
}

#[test]
fn json_schemas_hold_greedy_and_sampled_on_smollm2() {
    check_schemas(smollm2_server(), "smollm2-135m-instruct", true);
}

/// The real Qwen3 tokenizer (fetched by `cargo xtask test`): its token environment masks
/// every token of a valid document in, token by token, and accepts at the end.
#[test]
fn the_real_qwen3_tokenizer_walks_a_schema_token_by_token() {
    let dir = match std::env::var_os("PLUGHOST_QWEN3_TOKENIZER_DIR") {
        Some(dir) => std::path::PathBuf::from(dir),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/fixtures/qwen3-tokenizer"),
    };
    let tokenizer = Tokenizer::from_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "the Qwen3 tokenizer is not at {}: run `cargo xtask test` once ({e})",
            dir.display()
        )
    });
    // Qwen3-0.6B's logits rows: 151936, more than the tokenizer's 151669 tokens.
    let grammars = GrammarCompiler::new(tokenizer.clone(), 151_936, vec![151_645, 151_643]);
    let schema = schemas().remove(1).1;
    let grammar = grammars
        .compile(&Constraint::JsonSchema(schema))
        .expect("the schema compiles");
    let document =
        r#"{"id": "ab-123", "tags": ["x", "größe"], "point": {"x": -3, "y": 42}, "ok": true}"#;
    let tokens = tokenizer.encode(document, false).expect("tokens");
    let mut matcher = grammar.matcher();
    let mut progress = Progress::Continue;
    for (i, &token) in tokens.iter().enumerate() {
        matcher.compute_mask();
        assert_eq!(matcher.state(), &MaskState::Ready, "token {i}");
        assert!(
            matcher.allows(token),
            "token {i} ({token}) of the document is allowed"
        );
        let mut row = vec![0.0f32; 151_936];
        matcher.apply_mask(&mut row);
        assert!(row[token as usize].is_finite());
        assert!(row[151_700].is_infinite(), "padding rows are never allowed");
        progress = matcher.commit(token);
    }
    assert!(
        progress == Progress::Complete || matcher.is_accepting(),
        "the document is complete"
    );
    assert!(
        grammars.compile(&Constraint::Regex("(".into())).is_err(),
        "a bad regex is refused"
    );
}
