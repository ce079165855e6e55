//! Model glue for Qwen3 and Llama: checks config.json, lists the weights, and builds the step program.
//!
//! Both families share one decoder layer; Qwen3 adds a per-head RMSNorm on
//! queries and keys and sets `head_dim` explicitly. config.json is read in
//! both `transformers` 4 and 5 styles. Anything this glue does not compute
//! exactly (attention or MLP biases, RoPE scaling or partial rotation,
//! sliding-window layers, quantized weights, other activations) is refused
//! with a message naming the config key.

mod config;
mod program;

pub use config::{Family, TransformerConfig};

use plughost_sdk::model_glue::{ModelGlue, types};

pub struct DecoderGlue;

impl ModelGlue for DecoderGlue {
    fn init(config: &str) -> Result<Self, String> {
        let config = config.trim();
        if config.is_empty() || config == "{}" {
            Ok(DecoderGlue)
        } else {
            Err(format!(
                "the qwen3/llama glue takes no options, got {config}"
            ))
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
