//! The runtime: prepares a model's step program on a device once, then runs one flattened batch per step.
//!
//! `prepare` takes the program from the model glue, uploads the weights,
//! allocates the KV cache (f32, f16 or bf16), the scratch buffers and the pooled step-input
//! buffers, each sized for the largest step. `execute` allocates nothing on
//! the device: it refreshes the step inputs, launches the prepared tasks
//! with the step's shapes, and reads back the logits rows of the sequences
//! that emit a token.

mod deps;
mod error;
mod extents;
mod kv_blocks;
mod kv_dtype;
mod load;
mod prepared;
pub mod program;
mod refresh;
mod step;

pub use deps::TaskGraph;
pub use error::RuntimeError;
pub use extents::Extents;
pub use kv_dtype::KvCacheDtype;
pub use load::{LoadError, ModelRecipe, load_described, load_model, load_with_recipe};
pub use prepared::{Runtime, RuntimeConfig, WeightSource, WeightView};
pub use step::{StepSequence, StepTiming};
