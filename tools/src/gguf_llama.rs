//! A Llama-architecture GGUF converted into a Hugging Face `LlamaForCausalLM`'s `model.safetensors`.
//!
//! Names, shapes and the rotary row order come from the host's
//! [`plughost::model::gguf::llama`]. Values: every type is dequantized to f32, then stored as
//! f32 or rounded to bf16.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use indicatif::ProgressBar;

use crate::dequant::dequantize_into;
use plughost::model::gguf::llama::{LlamaParams, Rotary, hf_name, required_names, unpermute_rows};
use plughost::model::gguf::{Gguf, TensorInfo};

/// The dtype of the written weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightDtype {
    F32,
    Bf16,
}

impl WeightDtype {
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
        }
    }

    pub fn torch_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::Bf16 => "bfloat16",
        }
    }

    fn safetensors(self) -> safetensors::Dtype {
        match self {
            WeightDtype::F32 => safetensors::Dtype::F32,
            WeightDtype::Bf16 => safetensors::Dtype::BF16,
        }
    }

    fn size(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 => 2,
        }
    }
}

/// One output tensor, converted only when the safetensors writer asks for its bytes, so at
/// most one tensor is held in converted form at a time.
struct LazyTensor<'a> {
    gguf: &'a Gguf,
    info: &'a TensorInfo,
    shape: Vec<usize>,
    rotary: Rotary,
    dtype: WeightDtype,
    progress: &'a ProgressBar,
}

impl LazyTensor<'_> {
    fn values(&self) -> Vec<f32> {
        let mut values = Vec::with_capacity(self.info.num_elements());
        dequantize_into(
            self.info.kind,
            self.gguf.tensor_data(self.info),
            &mut values,
        );
        match self.rotary {
            Rotary::None => values,
            Rotary::Unpermute { heads } => unpermute_rows(&values, heads, self.info.dims[0]),
        }
    }
}

impl safetensors::View for LazyTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype.safetensors()
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let values = self.values();
        let bytes: Vec<u8> = match self.dtype {
            WeightDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            WeightDtype::Bf16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        };
        self.progress.inc(1);
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.info.num_elements() * self.dtype.size()
    }
}

/// Writes every tensor of `gguf` under its HF name to `path`, checking names and shapes first
/// so that conversion itself cannot fail halfway.
pub fn write_safetensors(
    gguf: &Gguf,
    params: &LlamaParams,
    dtype: WeightDtype,
    path: &Path,
    progress: &ProgressBar,
) -> Result<()> {
    let mut tensors = Vec::new();
    for info in gguf.tensors() {
        let (name, rotary) = hf_name(&info.name, params)
            .with_context(|| format!("GGUF tensor {} has no Hugging Face Llama name", info.name))?;
        let shape = info.shape();
        let expected = params.expected_shape(&name);
        ensure!(
            expected.as_ref() == Some(&shape),
            "GGUF tensor {} has shape {shape:?}, but the metadata implies {expected:?} for {name}",
            info.name
        );
        tensors.push((
            name,
            LazyTensor {
                gguf,
                info,
                shape,
                rotary,
                dtype,
                progress,
            },
        ));
    }
    check_complete(&tensors, params)?;
    progress.set_length(tensors.len() as u64);
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(tensors, Some(metadata), path)
        .with_context(|| format!("writing {}", path.display()))?;
    // The writer goes through a private temporary file; give the result the usual mode.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
            .with_context(|| format!("setting the permissions of {}", path.display()))?;
    }
    Ok(())
}

fn check_complete(tensors: &[(String, LazyTensor<'_>)], params: &LlamaParams) -> Result<()> {
    let names: std::collections::HashSet<&str> =
        tensors.iter().map(|(name, _)| name.as_str()).collect();
    let missing: Vec<String> = required_names(params)
        .into_iter()
        .filter(|n| !names.contains(n.as_str()))
        .collect();
    ensure!(missing.is_empty(), "the GGUF lacks tensors for {missing:?}");
    Ok(())
}
