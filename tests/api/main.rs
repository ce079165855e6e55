//! API and serving tests in one binary, so the test build links wasmtime once for them: Anthropic's Messages API, OpenAI's Responses API, errors, evaluation (echo and prompt logprobs), generation, lifecycle, tools, structured outputs, batching, serving on the mock device, an OpenAI client, every response against OpenAI's published schemas, and `plughost bench`.
//!
//! The modules run as threads of one process. The server of [`common::api::server`] is shared
//! by all of them, so a test on it asserts only about its own requests; a test that reads
//! counters or drains starts an engine and server of its own.

#[path = "../common/mod.rs"]
mod common;

mod anthropic;
mod bench_cli;
mod engine_batching;
mod errors;
mod evaluation;
mod generation;
mod lifecycle;
mod openai_client;
mod openai_schemas;
mod responses;
mod serving_mock;
mod structured_outputs;
mod tools;
