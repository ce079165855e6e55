//! The plugin kit end to end, as an author outside this repository uses it: `plugin new` in a temporary folder, a policy change, `plugin build`, and the result running in `plughost serve` (a sampler) or the engine (model glue).
//!
//! The first run compiles the new crate and its dependencies for wasm32-wasip2 from scratch
//! (about 40 s on two cores); its target dir, `target/plugin-kit-test`, is kept so later runs
//! only rebuild the crate (about 5 s).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::serve_support::kit::{
    Built, TempDir, build, make_greedy_take_the_second_best, plughost, run, text,
};
use crate::serve_support::{Server, plugins_dir, workspace};

/// Far beyond the second or so the tiny fixtures take to load in a debug build.
const DEADLINE: Duration = Duration::from_secs(120);

/// The first completion token of a greedy request and the alternatives the server lists.
async fn first_token(server: &mut Server) -> (String, Vec<String>) {
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", server.base());
    let body = json!({"model": "tiny-qwen3", "prompt": [31, 32, 33, 34], "max_tokens": 4,
                      "temperature": 0, "logprobs": 2, "ignore_eos": true});
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = server.child.try_wait() {
            panic!("plughost serve exited with {status}");
        }
        if let Ok(response) = client.post(&url).json(&body).send().await
            && response.status().is_success()
        {
            let value: Value = response.json().await.expect("a JSON completion");
            let logprobs = &value["choices"][0]["logprobs"];
            let token = logprobs["tokens"][0].as_str().expect("a token").to_string();
            let alternatives = logprobs["top_logprobs"][0]
                .as_object()
                .expect("top logprobs")
                .keys()
                .cloned()
                .collect();
            return (token, alternatives);
        }
        assert!(started.elapsed() < DEADLINE, "the server never answered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn new_refuses_a_bad_name_and_a_folder_in_use() {
    let temp = TempDir::new("refusals");
    let path = temp.0.to_str().expect("a UTF-8 temp path");
    let bad = run(plughost(&[
        "plugin", "new", "sampler", "2-bad", "--path", path,
    ]));
    assert!(!bad.status.success());
    assert!(
        text(&bad.stderr).contains("invalid plugin name \"2-bad\""),
        "{}",
        text(&bad.stderr)
    );
    std::fs::create_dir_all(temp.0.join("taken")).expect("folder");
    std::fs::write(temp.0.join("taken/notes.txt"), "mine").expect("file");
    let taken = run(plughost(&[
        "plugin",
        "new",
        "scheduler",
        "taken",
        "--path",
        path,
    ]));
    assert!(!taken.status.success());
    assert!(
        text(&taken.stderr).contains("already exists and is not empty"),
        "{}",
        text(&taken.stderr)
    );
    let sdk = run(plughost(&[
        "plugin",
        "new",
        "scheduler",
        "ok",
        "--path",
        path,
        "--sdk",
        "no/such/sdk",
    ]));
    assert!(!sdk.status.success());
    assert!(
        text(&sdk.stderr).contains("--sdk no/such/sdk"),
        "{}",
        text(&sdk.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampler_made_with_plugin_new_builds_and_serves_outside_the_workspace() {
    let temp = TempDir::new("end-to-end");
    let created =
        run(plughost(&["plugin", "new", "sampler", "second-best", "--path"]).arg(&temp.0));
    assert!(created.status.success(), "{}", text(&created.stderr));
    let crate_dir = temp.0.join("second-best");
    for file in [
        "Cargo.toml",
        "src/lib.rs",
        "README.md",
        "plughost-sdk/Cargo.toml",
        "plughost-sdk/wit/plugin.wit",
    ] {
        assert!(crate_dir.join(file).is_file(), "{file} was not written");
    }

    // A build error shows cargo's diagnostics and fails.
    let lib = crate_dir.join("src/lib.rs");
    let source = std::fs::read_to_string(&lib).expect("src/lib.rs");
    std::fs::write(
        &lib,
        format!("{source}\nfn broken() -> u32 {{ \"not a number\" }}\n"),
    )
    .expect("write");
    let failed = build(&crate_dir);
    assert!(!failed.status.success());
    let stderr = text(&failed.stderr);
    assert!(
        stderr.contains("mismatched types") && stderr.contains("cargo build failed"),
        "{stderr}"
    );

    // The author's change: greedy takes the second most likely token.
    std::fs::write(&lib, &source).expect("write");
    make_greedy_take_the_second_best(&crate_dir);
    let built = Built::build(&crate_dir);
    let (stdout, field) = (&built.stdout, |name: &str| built.field(name));
    assert!(stdout.contains("sampler    ok"), "{stdout}");
    let wasm = PathBuf::from(field("component"));
    let bytes = std::fs::read(&wasm).expect("the component exists");
    let sha256: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(field("sha256"), sha256);
    assert_eq!(
        field("wit"),
        format!("plughost:plugin@{}", plughost_sdk::CONTRACT_VERSION)
    );

    // Served with the default sampler, then with the new one: the new one's first token is
    // the default's second choice.
    let mut standard = Server::start(&["--num-kv-blocks", "64"]);
    let (best, alternatives) = first_token(&mut standard).await;
    drop(standard);
    let deploy = temp.0.join("deploy.toml");
    std::fs::write(
        &deploy,
        format!(
            "[sampler]\ncomponent = {:?}\nconfig = {{ top_k = 40 }}\n",
            wasm.display().to_string()
        ),
    )
    .expect("write the deployment");
    let deploy_arg = deploy.display().to_string();
    let mut custom = Server::start(&["--num-kv-blocks", "64", "--config", &deploy_arg]);
    let (second, _) = first_token(&mut custom).await;
    assert_ne!(second, best, "the new sampler changed the output");
    assert!(
        alternatives.contains(&second),
        "{second:?} is not among {alternatives:?}"
    );
}

const BIGRAM_VOCAB: usize = 448;

/// The token the test bigram model predicts after `token`: a bijection of the vocabulary.
fn bigram_next(token: usize) -> usize {
    (5 * token + 3) % BIGRAM_VOCAB
}

/// A bigram checkpoint in `dir` whose greedy continuation of token t is `bigram_next(t)`:
/// one-hot embeddings, and an LM head row v that is one-hot at the token v follows.
fn write_bigram_checkpoint(dir: &Path) {
    let n = BIGRAM_VOCAB;
    let mut embed = vec![0f32; n * n];
    let mut head = vec![0f32; n * n];
    for t in 0..n {
        embed[t * n + t] = 1.0;
        head[bigram_next(t) * n + t] = 1.0;
    }
    let bytes =
        |values: &[f32]| -> Vec<u8> { values.iter().flat_map(|v| v.to_le_bytes()).collect() };
    let (embed, head) = (bytes(&embed), bytes(&head));
    let header = json!({
        "embed.weight": {"dtype": "F32", "shape": [n, n], "data_offsets": [0, embed.len()]},
        "lm_head.weight": {"dtype": "F32", "shape": [n, n],
                           "data_offsets": [embed.len(), embed.len() + head.len()]},
    })
    .to_string();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.extend(&embed);
    file.extend(&head);
    std::fs::create_dir_all(dir).expect("model folder");
    std::fs::write(dir.join("model.safetensors"), file).expect("weights");
    let config = json!({"architectures": ["BigramForCausalLM"], "vocab_size": n,
                        "hidden_size": n, "max_position_embeddings": 256, "eos_token_id": 0,
                        "torch_dtype": "float32"});
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config.json");
    let fixture = workspace().join("tests/fixtures/tiny-qwen3");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture.join(file), dir.join(file)).expect("tokenizer files");
    }
}

#[test]
fn model_glue_made_with_plugin_new_runs_its_model_on_the_cpu_device() {
    use plughost::engine::{
        EngineHandle, EngineOptions, EngineSetup, GenerationEvent, GenerationRequest,
        StopConditions,
    };
    use plughost::plugins::PluginSpec;
    use plughost_sdk::sampler::SamplingParams;

    let temp = TempDir::new("glue");
    let created = run(plughost(&["plugin", "new", "model-glue", "bigram", "--path"]).arg(&temp.0));
    assert!(created.status.success(), "{}", text(&created.stderr));
    let built = build(&temp.0.join("bigram"));
    let stdout = text(&built.stdout);
    assert!(
        built.status.success(),
        "{}\n{}",
        stdout,
        text(&built.stderr)
    );
    assert!(stdout.contains("glue       ok"), "{stdout}");
    let wasm = stdout
        .lines()
        .find_map(|l| l.strip_prefix("component"))
        .map(|p| PathBuf::from(p.trim()))
        .expect("a component line");

    let model = temp.0.join("model");
    write_bigram_checkpoint(&model);
    let setup = EngineSetup {
        model_dir: model,
        model_name: "bigram".into(),
        device_library: plugins_dir().join("libplughost_device_cpu.so"),
        device_config: String::new(),
        glue: PluginSpec {
            component: wasm,
            config: Default::default(),
            memory_mib: None,
            call_timeout_ms: None,
            failure: Default::default(),
        },
        scheduler: None,
        sampler: None,
        named_samplers: Default::default(),
        component_cache: Some(std::env::temp_dir().join("plughost-test-component-cache")),
        options: EngineOptions {
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
            block_size: 4,
            num_kv_blocks: Some(64),
            ..Default::default()
        },
        profile_output: None,
    };
    let engine = EngineHandle::start(
        setup,
        std::sync::Arc::new(plughost::metrics::Metrics::new()),
    )
    .expect("the engine starts");
    engine
        .wait_ready()
        .expect("the bigram model loads through the new glue");
    let (_, mut events) = engine
        .submit(GenerationRequest {
            stop: StopConditions {
                ignore_eos: true,
                ..Default::default()
            },
            ..GenerationRequest::new(vec![10, 20, 30], SamplingParams::GREEDY, 8)
        })
        .expect("submitted");
    let mut tokens = Vec::new();
    while let Some(event) = events.blocking_recv() {
        match event {
            GenerationEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
            GenerationEvent::Finished { .. } => break,
            GenerationEvent::Failed { message } | GenerationEvent::Unavailable { message } => {
                panic!("generation failed: {message}")
            }
            GenerationEvent::Rejected(r) => panic!("generation rejected: {r}"),
        }
    }
    engine.shutdown();
    let mut expected = Vec::new();
    let mut last = 30;
    for _ in 0..8 {
        last = bigram_next(last);
        expected.push(last as u32);
    }
    assert_eq!(tokens, expected);
}
