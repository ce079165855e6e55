//! Model glue for the Qwen3, Qwen2, Llama and Mistral families: checks config.json, lists the weights, and builds the step program.
//!
//! The families share one decoder layer: Qwen3 adds a per-head RMSNorm on queries and keys,
//! Qwen2 biases on the q, k and v projections. config.json is read in both `transformers` 4
//! and 5 styles. The rotary inverse frequencies (default, Llama 3 or YaRN scaling) are
//! computed here once and passed to the device as constants of the program; sliding-window
//! layers launch `paged_attention_window`. Anything this glue does not compute exactly
//! (other biases, other RoPE scalings or partial rotation, other layer types, quantized
//! weights, other activations) is refused with a message naming the config key.

mod config;
mod program;
mod rope;

pub use config::{Family, TransformerConfig};
pub use rope::{Rope, RopeScaling};

use plughost_sdk::model_glue::{ModelGlue, types};

pub struct DecoderGlue;

impl ModelGlue for DecoderGlue {
    fn init(config: &str) -> Result<Self, String> {
        let config = config.trim();
        if config.is_empty() || config == "{}" {
            Ok(DecoderGlue)
        } else {
            Err(format!("the decoder glue takes no options, got {config}"))
        }
    }

    fn describe(&self, config_json: &str) -> Result<types::ModelInfo, String> {
        Ok(program::describe(&TransformerConfig::parse(config_json)?))
    }

    fn build_program(&self, config_json: &str) -> Result<types::StepProgram, String> {
        Ok(program::build(&TransformerConfig::parse(config_json)?))
    }
}

#[cfg(target_arch = "wasm32")]
plughost_sdk::export_model_glue!(DecoderGlue);
