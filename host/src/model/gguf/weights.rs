//! A Llama-family GGUF's tensors under their Hugging Face names, in their stored types: what a checkpoint serves from a GGUF.

use std::collections::HashMap;
use std::path::Path;

use super::llama::{LlamaParams, Rotary, hf_name, required_names};
use super::{GgmlType, Gguf, GgufError, Result, rope};

/// One tensor: where it is in the file, its HF shape and the row order it is stored in.
#[derive(Debug)]
pub struct GgufTensor {
    index: usize,
    shape: Vec<u64>,
    rotary: Rotary,
}

impl GgufTensor {
    pub fn kind(&self, weights: &GgufWeights) -> GgmlType {
        weights.gguf.tensors()[self.index].kind
    }

    /// The HF shape (slowest-varying first).
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// For `q_proj` and `k_proj`: the number of heads whose rows are stored in llama.cpp's
    /// interleaved rotary order (see [`super::llama::unpermute_rows`]).
    pub fn interleaved_heads(&self) -> Option<usize> {
        match self.rotary {
            Rotary::None => None,
            Rotary::Unpermute { heads } => Some(heads),
        }
    }
}

/// The tensors of a mapped Llama-family GGUF, by HF name.
pub struct GgufWeights {
    gguf: Gguf,
    tensors: HashMap<String, GgufTensor>,
}

impl std::fmt::Debug for GgufWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufWeights")
            .field("gguf", &self.gguf)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufWeights {
    /// Maps `path` and names its tensors; a tensor the architecture does not have, one whose
    /// shape disagrees with the metadata, or a missing one is an error.
    pub fn open(path: &Path) -> Result<Self> {
        let mut gguf = Gguf::open(path)?;
        let params = LlamaParams::from_gguf(&gguf)?;
        gguf.drop_metadata();
        let mut tensors = HashMap::new();
        for (index, info) in gguf.tensors().iter().enumerate() {
            if info.name == rope::ROPE_FREQS {
                // Read into the config's rotary parameters by `from_gguf`.
                continue;
            }
            let Some((name, rotary)) = hf_name(&info.name, &params) else {
                return Err(GgufError::Unsupported(format!(
                    "GGUF tensor {} is not part of a {} model",
                    info.name,
                    params.architecture.gguf_name()
                )));
            };
            let shape = info.shape();
            let expected = params.expected_shape(&name);
            if expected.as_ref() != Some(&shape) {
                return Err(GgufError::Malformed(format!(
                    "GGUF tensor {} has shape {shape:?}, but the metadata implies {expected:?}",
                    info.name
                )));
            }
            let shape = shape.iter().map(|&d| d as u64).collect();
            tensors.insert(
                name,
                GgufTensor {
                    index,
                    shape,
                    rotary,
                },
            );
        }
        if let Some(missing) = required_names(&params)
            .into_iter()
            .find(|n| !tensors.contains_key(n))
        {
            return Err(GgufError::Malformed(format!(
                "the GGUF has no tensor for {missing}"
            )));
        }
        Ok(GgufWeights { gguf, tensors })
    }

    pub fn get(&self, name: &str) -> Option<(&str, &GgufTensor)> {
        self.tensors
            .get_key_value(name)
            .map(|(name, tensor)| (name.as_str(), tensor))
    }

    /// The stored bytes of `tensor`, in the file's row order.
    pub fn bytes(&self, tensor: &GgufTensor) -> &[u8] {
        self.gguf.tensor_data(&self.gguf.tensors()[tensor.index])
    }

    /// Lets go of this process's resident pages of tensor `name` (see [`Gguf::release`]).
    pub fn release(&self, name: &str) {
        if let Some(tensor) = self.tensors.get(name) {
            self.gguf.release(&self.gguf.tensors()[tensor.index]);
        }
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
}
