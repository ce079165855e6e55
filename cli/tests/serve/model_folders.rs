//! `plughost serve` on model folders: each family's tiny fixture (Qwen2, Mistral, Llama 3, YaRN) answers its reference continuation over HTTP, `--max-model-len` is refused past what a model covers, and generation_config.json's defaults and end tokens apply unless `--generation-config` says otherwise.

use std::io::Write;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Child;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use plughost::model::Tokenizer;

use crate::cli_serve::{health, run_until_exit, serve, stderr_of};
use crate::serve_support::{LOAD_DEADLINE, free_port, read_response, workspace};

const FAMILIES: [&str; 4] = [
    "tiny-qwen2",
    "tiny-mistral",
    "tiny-llama3",
    "tiny-qwen3-yarn",
];

fn fixture(name: &str) -> PathBuf {
    workspace().join("tests/fixtures").join(name)
}

/// Waits until `child`, serving on `port`, answers `/health` with 200.
fn wait_healthy(child: &mut Child, port: u16, name: &str) {
    let started = Instant::now();
    while !health(port).is_some_and(|line| line.contains(" 200 ")) {
        if let Some(status) = child.try_wait().expect("poll plughost") {
            panic!(
                "{name}: plughost serve exited ({status}): {}",
                stderr_of(child)
            );
        }
        assert!(started.elapsed() < LOAD_DEADLINE, "{name}: never healthy");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `POST /v1/completions` with `body`; the status and the parsed body.
fn complete(port: u16, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let body = body.to_string();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("read timeout");
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).expect("send");
    let response = read_response(&mut stream).expect("a response");
    let parsed = serde_json::from_str(&response.body).expect("a JSON body");
    (response.status, parsed)
}

/// Each reference prompt of fixture `name`: its text and its greedy continuation's token ids.
fn reference_continuations(name: &str) -> Vec<(String, Vec<u32>)> {
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(name).join("reference.json")).expect("reference.json"),
    )
    .expect("parses");
    reference["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|prompt| {
            let ids = prompt["generated_token_ids"]
                .as_array()
                .expect("generated ids")
                .iter()
                .map(|v| v.as_u64().expect("id") as u32)
                .collect();
            (prompt["text"].as_str().expect("text").to_string(), ids)
        })
        .collect()
}

#[test]
fn each_family_serves_its_reference_continuation() {
    for name in FAMILIES {
        let model = fixture(name);
        let tokenizer = Tokenizer::from_dir(&model).expect("tokenizer");
        let port = free_port();
        let mut child = serve(&model, port, &[]);
        wait_healthy(&mut child, port, name);
        for (text, ids) in reference_continuations(name) {
            let want = tokenizer.decode(&ids, true).expect("decode");
            let (status, body) = complete(
                port,
                &serde_json::json!({
                    "model": name, "prompt": text, "max_tokens": 32,
                    "temperature": 0, "ignore_eos": true
                }),
            );
            assert_eq!(status, 200, "{name}: {body}");
            assert_eq!(body["choices"][0]["text"], want, "{name}: {text:?}");
            assert_eq!(body["usage"]["completion_tokens"], 32, "{name}");
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[test]
fn max_model_len_past_what_the_model_covers_is_refused_naming_both_numbers() {
    // (fixture, the longest --max-model-len it covers): YaRN stretches 32 positions 4 times;
    // the others cover max_position_embeddings, Mistral too past its sliding window of 12.
    let cases = [
        ("tiny-qwen3-yarn", 128),
        ("tiny-mistral-swa", 512),
        ("tiny-llama3", 512),
        ("tiny-qwen2", 512),
    ];
    for (name, covered) in cases {
        let past = (covered + 1).to_string();
        let (status, stderr) = run_until_exit(&fixture(name), &["--max-model-len", &past]);
        assert!(!status.success(), "{name}: {stderr}");
        let message =
            format!("--max-model-len {past} is above the {covered} positions the model covers");
        assert!(stderr.contains(&message), "{name}: {stderr}");
    }
    // At the limit it serves: YaRN's 128 is 4 times its pretrained window.
    let port = free_port();
    let mut child = serve(
        &fixture("tiny-qwen3-yarn"),
        port,
        &["--max-model-len", "128"],
    );
    wait_healthy(&mut child, port, "tiny-qwen3-yarn at 128");
    let _ = child.kill();
    let _ = child.wait();
}

/// The greedy continuation of tiny-qwen3's first reference prompt: its text and token ids.
fn tiny_qwen3_reference() -> (String, Vec<u32>) {
    reference_continuations("tiny-qwen3").swap_remove(0)
}

/// A copy of tiny-qwen3 whose generation_config.json is `generation_config`; removed on drop.
struct ModelCopy(PathBuf);

impl ModelCopy {
    fn new(generation_config: &serde_json::Value) -> ModelCopy {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let from = fixture("tiny-qwen3");
        let to = std::env::temp_dir().join(format!(
            "plughost-model-folders-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&to).expect("temp folder");
        for file in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ] {
            std::fs::copy(from.join(file), to.join(file)).expect("copy fixture file");
        }
        std::fs::write(
            to.join("generation_config.json"),
            generation_config.to_string(),
        )
        .expect("write generation_config.json");
        ModelCopy(to)
    }
}

impl Drop for ModelCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Serves `model` with `flags`, runs `requests` (bodies without the model and prompt), and
/// returns each response's body.
fn answers(
    model: &ModelCopy,
    flags: &[&str],
    requests: &[serde_json::Value],
) -> Vec<serde_json::Value> {
    let (prompt, _) = tiny_qwen3_reference();
    let port = free_port();
    let flags = [&["--served-model-name", "tiny-qwen3"], flags].concat();
    let mut child = serve(&model.0, port, &flags);
    wait_healthy(&mut child, port, "tiny-qwen3 copy");
    let bodies = requests
        .iter()
        .map(|request| {
            let mut body = request.clone();
            body["model"] = "tiny-qwen3".into();
            body["prompt"] = prompt.clone().into();
            let (status, body) = complete(port, &body);
            assert_eq!(status, 200, "{flags:?} {request}: {body}");
            body
        })
        .collect();
    let _ = child.kill();
    let _ = child.wait();
    bodies
}

#[test]
fn generation_config_defaults_apply_where_the_request_is_silent_unless_turned_off() {
    let (_, greedy) = tiny_qwen3_reference();
    let tokenizer = Tokenizer::from_dir(fixture("tiny-qwen3")).expect("tokenizer");
    let text = |n: usize| tokenizer.decode(&greedy[..n], true).expect("decode");
    let model = ModelCopy::new(&serde_json::json!({"max_new_tokens": 3, "temperature": 0.0}));
    let requests = [
        serde_json::json!({"ignore_eos": true}),
        serde_json::json!({"ignore_eos": true, "max_tokens": 5}),
        serde_json::json!({"ignore_eos": true, "seed": 7}),
    ];
    // The file's: 3 tokens, greedy; the request's max_tokens wins over the file's.
    let from_file = answers(&model, &[], &requests);
    assert_eq!(from_file[0]["usage"]["completion_tokens"], 3);
    assert_eq!(from_file[0]["choices"][0]["text"], text(3));
    assert_eq!(from_file[1]["usage"]["completion_tokens"], 5);
    assert_eq!(from_file[1]["choices"][0]["text"], text(5));
    assert_eq!(from_file[2]["choices"][0]["text"], text(3));
    // Turned off: OpenAI's 16 tokens for a completion, sampled at temperature 1.
    let off = answers(&model, &["--generation-config", "vllm"], &requests);
    assert_eq!(off[0]["usage"]["completion_tokens"], 16);
    assert_eq!(off[1]["usage"]["completion_tokens"], 5);
    assert_ne!(
        off[2]["choices"][0]["text"],
        text(16),
        "seeded sampling at temperature 1 reproduced the greedy continuation"
    );
    // Another folder's file.
    let elsewhere = ModelCopy::new(&serde_json::json!({"max_new_tokens": 4, "temperature": 0.0}));
    let folder = elsewhere.0.to_str().expect("UTF-8 path");
    let other = answers(&model, &["--generation-config", folder], &requests[..1]);
    assert_eq!(other[0]["usage"]["completion_tokens"], 4);
    assert_eq!(other[0]["choices"][0]["text"], text(4));
    // The defaults in force decide the tokens of a request silent on them, so each source
    // is its own deployment fingerprint.
    let fingerprints: Vec<&str> = [&from_file[0], &off[0], &other[0]]
        .iter()
        .map(|body| body["system_fingerprint"].as_str().expect("a fingerprint"))
        .collect();
    assert!(
        fingerprints[0] != fingerprints[1]
            && fingerprints[1] != fingerprints[2]
            && fingerprints[0] != fingerprints[2],
        "{fingerprints:?}"
    );
}

#[test]
fn generation_config_end_tokens_end_the_answer_even_with_its_defaults_off() {
    let (_, greedy) = tiny_qwen3_reference();
    let tokenizer = Tokenizer::from_dir(fixture("tiny-qwen3")).expect("tokenizer");
    // The first generated token not generated before it: as an end token, the answer stops
    // there. config.json's own end token stays one.
    let stop = (1..greedy.len())
        .find(|&k| !greedy[..k].contains(&greedy[k]))
        .expect("a new token");
    let model = ModelCopy::new(&serde_json::json!({"eos_token_id": [greedy[stop]]}));
    let request = [serde_json::json!({"max_tokens": 32, "temperature": 0})];
    for flags in [&[][..], &["--generation-config", "vllm"][..]] {
        let body = &answers(&model, flags, &request)[0];
        assert_eq!(
            body["choices"][0]["finish_reason"], "stop",
            "{flags:?}: {body}"
        );
        assert_eq!(
            body["choices"][0]["text"],
            tokenizer.decode(&greedy[..stop], true).expect("decode"),
            "{flags:?}"
        );
    }
}
