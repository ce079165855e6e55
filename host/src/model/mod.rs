//! Reading a Hugging Face model folder: `config.json`, safetensors weights, tokenizer, chat template.
//!
//! [`Checkpoint::open`] validates every safetensors header and tensor range before handing out
//! borrowed [`TensorView`]s over the memory-mapped files. [`Tokenizer`] wraps `tokenizer.json`
//! and makes [`DecodeStream`]s for streaming output. [`ChatTemplate`] renders
//! `tokenizer_config.json`'s template byte-for-byte as Hugging Face `transformers` does.
//! [`gguf`] reads llama.cpp's GGUF files, which the tools convert into such folders.
//! Every failure is a [`ModelError`] naming the file, and the tensor, it is about.

mod chat_template;
mod checkpoint;
mod error;
mod generation_config;
pub mod gguf;
mod pyfmt;
pub mod quantize;
mod tokenizer;

pub use chat_template::{ChatMessage, ChatTemplate, RenderOptions, ToolCall, ToolCallSyntax};
pub use checkpoint::{Checkpoint, DType, ModelConfig, TensorView};
pub use error::ModelError;
pub use generation_config::{GenerationConfigSource, GenerationDefaults};
pub use quantize::WeightQuantization;
pub use tokenizer::{Bounded, DecodeStream, Tokenizer};
