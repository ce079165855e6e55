//! A Qwen3 GGUF as llama.cpp's converter writes it (`tests/reference/make_qwen3_gguf.py`): the tokenizer, chat template and special tokens the host builds from its metadata against the tiny-qwen3 fixture's own files.
//!
//! The weights of the same files are held to the fixture's `transformers` references in
//! `parity.rs`.

use std::path::{Path, PathBuf};

use plughost::model::gguf::folder;
use plughost::model::{ChatMessage, ChatTemplate, GenerationDefaults, Tokenizer};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// The folder the host makes of the tiny Qwen3 GGUF, in a cache of its own; removed on drop.
struct GgufFolder {
    cache: PathBuf,
    dir: PathBuf,
}

impl GgufFolder {
    fn prepare() -> GgufFolder {
        let cache =
            std::env::temp_dir().join(format!("plughost-gguf-qwen3-{}", std::process::id()));
        let dir = folder::prepare(&fixture("tiny-qwen3-gguf").join("model.gguf"), &cache)
            .expect("the Qwen3 GGUF makes a model folder");
        GgufFolder { cache, dir }
    }
}

impl Drop for GgufFolder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.cache);
    }
}

#[test]
fn the_tokenizer_from_the_metadata_encodes_like_the_models_own() {
    let folder = GgufFolder::prepare();
    let from_gguf = Tokenizer::from_dir(&folder.dir).expect("the GGUF's tokenizer");
    let own = Tokenizer::from_dir(fixture("tiny-qwen3")).expect("the fixture's tokenizer");
    assert_eq!(from_gguf.vocab_size(), own.vocab_size());
    let texts = [
        "The year 2024 has 366 days, and pi is 3.14159.",
        "a\n\n2024 and  77 apples",
        "你好，世界！机器学习 🍕🍕 and ☕",
        "naïve café, déjà vu: Ελληνικά и русский",
        "I've been told he's there; we'll see.\t\tTabs   and spaces  ",
        "<|im_start|>user\nCount 1234567890<|im_end|>\n<|im_start|>assistant\n",
    ];
    for text in texts {
        let ids = from_gguf.encode(text, false).expect("encode");
        assert_eq!(ids, own.encode(text, false).expect("encode"), "{text:?}");
        assert_eq!(
            from_gguf.decode(&ids, false).expect("decode"),
            text,
            "{text:?}"
        );
    }
    // Qwen splits digits one by one: no token holds two of them.
    let ids = from_gguf.encode("9876543210", false).expect("encode");
    assert_eq!(ids.len(), 10, "{ids:?}");
}

#[test]
fn the_chat_template_and_end_token_come_from_the_metadata() {
    let folder = GgufFolder::prepare();
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi 😀 12"),
    ];
    let from_gguf = ChatTemplate::from_dir(&folder.dir).expect("the GGUF's template");
    let own = ChatTemplate::from_dir(fixture("tiny-qwen3")).expect("the fixture's template");
    for add_generation_prompt in [false, true] {
        assert_eq!(
            from_gguf
                .render(&messages, add_generation_prompt)
                .expect("render"),
            own.render(&messages, add_generation_prompt)
                .expect("render"),
        );
    }
    // A GGUF states one end token, the config's `<|im_end|>` (447); the model's own
    // generation_config.json adds `<|endoftext|>` (445), which no GGUF key carries.
    let defaults = GenerationDefaults::from_dir(&folder.dir).expect("generation_config.json");
    assert_eq!(defaults.eos_token_ids, [447]);
}
