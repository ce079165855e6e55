//! The model layer's error type: reading a model folder (config, weights, tokenizer, chat template).

use std::path::PathBuf;

/// Every variant names the file, and where it applies the tensor, that it is about.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{} is not a valid {what}: {source}", path.display())]
    Json {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },

    /// Two fields of `config.json` that state the same thing say different things.
    #[error("{}: {first} and {second} disagree", path.display())]
    ConfigConflict {
        path: PathBuf,
        first: String,
        second: String,
    },

    /// A value of `generation_config.json` out of its range.
    #[error("{}: {message}", path.display())]
    GenerationConfig { path: PathBuf, message: String },

    #[error(
        "no weights in {}: expected model.safetensors or model.safetensors.index.json",
        dir.display()
    )]
    NoWeights { dir: PathBuf },

    /// A GGUF file that cannot be read or served: truncated, corrupt, of an unknown type or
    /// of an architecture the host does not serve.
    #[error("{}: {source}", path.display())]
    Gguf {
        path: PathBuf,
        #[source]
        source: super::gguf::GgufError,
    },

    #[error("{} is not a valid safetensors file: {source}", path.display())]
    Safetensors {
        path: PathBuf,
        #[source]
        source: safetensors::SafeTensorError,
    },

    #[error(
        "{}: tensor {name} claims bytes {start}..{end} but the data section holds {len} bytes",
        path.display()
    )]
    TensorOutOfBounds {
        path: PathBuf,
        name: String,
        start: usize,
        end: usize,
        len: usize,
    },

    #[error("shard index {} {problem}", path.display())]
    BadIndex { path: PathBuf, problem: String },

    #[error("tensor {name} is missing from {}", path.display())]
    MissingTensor { name: String, path: PathBuf },

    #[error(
        "tensor {name} has shape {actual:?}, the model needs {expected:?} (in {})",
        path.display()
    )]
    ShapeMismatch {
        name: String,
        actual: Vec<u64>,
        expected: Vec<u64>,
        path: PathBuf,
    },

    #[error(
        "tensor {name} in {} has dtype {dtype}; only F32, F16 and BF16 are supported",
        path.display()
    )]
    UnsupportedDtype {
        name: String,
        dtype: String,
        path: PathBuf,
    },

    #[error("cannot load tokenizer {}: {message}", path.display())]
    TokenizerLoad { path: PathBuf, message: String },

    /// Encoding or decoding failed inside the tokenizer loaded from `path`.
    #[error("tokenizer {} failed to {operation}: {message}", path.display())]
    Tokenize {
        path: PathBuf,
        operation: &'static str,
        message: String,
    },

    #[error("no chat template in {}: {searched}", dir.display())]
    ChatTemplateMissing { dir: PathBuf, searched: String },

    /// The template does not parse, or rendering failed (an unknown filter, a type error...).
    #[error("chat template from {}: {message}", path.display())]
    ChatTemplate { path: PathBuf, message: String },

    /// The template itself called `raise_exception(message)`, usually to reject a conversation.
    #[error("chat template from {} rejected the conversation: {message}", path.display())]
    ChatTemplateRaised { path: PathBuf, message: String },
}
