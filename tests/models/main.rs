//! Model tests in one binary, so the test build links wasmtime once for them: checkpoints, tokenizers, Qwen3 parity with `transformers`, perplexity against `transformers`, a quantized GGUF against `transformers`, a Qwen3 GGUF's tokenizer against the model's own, and SmolLM2-135M-Instruct end to end.

#[path = "../common/mod.rs"]
mod common;

mod checkpoint;
mod gguf_quantized;
mod gguf_qwen3;
mod parity;
mod perplexity;
mod quantize_at_load;
mod qwen3;
mod smollm2_checkpoint;
mod smollm2_generation;
mod smollm2_tokenizer;
mod tokenizer;
