//! The tiny fixtures' tokenizer and chat template against the `transformers` references committed beside them.

use std::path::{Path, PathBuf};

use plughost::model::{ChatMessage, ChatTemplate, Tokenizer};
use serde::Deserialize;

const FIXTURES: [&str; 3] = ["tiny-qwen3", "tiny-qwen3-bf16", "tiny-llama"];

#[derive(Deserialize)]
struct Reference {
    vocab_size: usize,
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    name: String,
    text: String,
    token_ids: Vec<u32>,
    generated_token_ids: Vec<u32>,
    generated_text: String,
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn reference(name: &str) -> Reference {
    let text =
        std::fs::read_to_string(fixture(name).join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("reference.json parses")
}

/// Streams `ids` through a [`plughost::model::DecodeStream`], checking every delta is whole text.
fn stream_decode(tokenizer: &Tokenizer, ids: &[u32]) -> String {
    let mut stream = tokenizer.decode_stream(false);
    let mut text = String::new();
    for &id in ids {
        if let Some(delta) = stream.step(id).expect("decode step") {
            text.push_str(&delta);
        }
    }
    text.push_str(&stream.flush().expect("flush").unwrap_or_default());
    text
}

#[test]
fn prompts_and_generations_match_the_reference() {
    let mut failures = Vec::new();
    for name in FIXTURES {
        let reference = reference(name);
        let tokenizer = Tokenizer::from_dir(fixture(name)).expect(name);
        assert_eq!(tokenizer.vocab_size(), reference.vocab_size, "{name}");
        for prompt in &reference.prompts {
            let case = format!("{name}/{}", prompt.name);
            let ids = tokenizer.encode(&prompt.text, false).expect("encode");
            if ids != prompt.token_ids {
                failures.push(format!(
                    "{case}: encode gave {ids:?}, reference {:?}",
                    prompt.token_ids
                ));
            }
            let decoded = tokenizer
                .decode(&prompt.generated_token_ids, false)
                .expect("decode");
            if decoded != prompt.generated_text {
                failures.push(format!(
                    "{case}: decode gave {decoded:?}, reference {:?}",
                    prompt.generated_text
                ));
            }
            // Random generations split characters everywhere: the stream must still add up.
            let streamed = stream_decode(&tokenizer, &prompt.generated_token_ids);
            if streamed != prompt.generated_text {
                failures.push(format!(
                    "{case}: streamed {streamed:?}, reference {:?}",
                    prompt.generated_text
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn streaming_emoji_and_chinese_adds_up_to_the_full_decode() {
    let tokenizer = Tokenizer::from_dir(fixture("tiny-qwen3")).expect("tokenizer");
    let texts = [
        "你好，世界！机器学习 🍕🍕 and ☕",
        "👨\u{200d}👩\u{200d}👧 family 🇫🇷 flag",
        "<|im_start|>user\n😀<|im_end|>\n",
    ];
    for text in texts {
        let ids = tokenizer.encode(text, false).expect("encode");
        let full = tokenizer.decode(&ids, false).expect("decode");
        assert_eq!(stream_decode(&tokenizer, &ids), full, "{text:?}");
        let mut stream = tokenizer.decode_stream(false);
        for &id in &ids {
            if let Some(delta) = stream.step(id).expect("step") {
                assert!(
                    !delta.contains('\u{FFFD}'),
                    "{text:?}: delta {delta:?} splits a character"
                );
            }
        }
    }
}

#[test]
fn tiny_chat_template_renders_chatml() {
    let cases = [
        (
            false,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n",
        ),
        (
            true,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n",
        ),
    ];
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi 😀"),
    ];
    for name in FIXTURES {
        let template = ChatTemplate::from_dir(fixture(name)).expect(name);
        let tokenizer = Tokenizer::from_dir(fixture(name)).expect(name);
        for (add_generation_prompt, expected) in cases {
            let rendered = template
                .render(&messages, add_generation_prompt)
                .expect(name);
            assert_eq!(rendered, expected, "{name}");
            let ids = tokenizer.encode(&rendered, false).expect("encode");
            assert_eq!(
                tokenizer.decode(&ids, false).expect("decode"),
                rendered,
                "{name}"
            );
        }
    }
}
