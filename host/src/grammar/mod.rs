//! Constrained decoding: the output constraints a request may set, compiled by llguidance into per-token masks the engine applies before any sampler sees a row.
//!
//! The pieces, one per file: [`Constraint`] (what a request asks for), [`GrammarError`],
//! the model's token environment (built once per model from its tokenizer),
//! [`GrammarCompiler`] (compiles a constraint once per distinct text and caches it),
//! [`GrammarMatcher`] (one request's parser state: its mask, the tokens it committed,
//! whether it may stop or is at a dead end), [`MaskWorker`] (computes a step's masks on a
//! host thread while the device runs the step) and [`LogitBias`] (the request's additive
//! offsets, applied before the mask).

mod compiler;
mod constraint;
mod error;
mod logit_bias;
mod mask_worker;
mod matcher;
mod token_env;

pub use compiler::{CompiledGrammar, GrammarCompiler, ReasoningBlock};
pub use constraint::Constraint;
pub use error::GrammarError;
pub use logit_bias::{LogitBias, MAX_LOGIT_BIAS};
pub use mask_worker::{MaskJobs, MaskWorker};
pub use matcher::{GrammarMatcher, MaskState, Progress};
