//! A Hugging Face checkpoint folder: `config.json` and memory-mapped safetensors weights, or the weights of a GGUF the folder links to.
//!
//! A folder [`super::gguf::folder`] made for a GGUF holds a link to the file instead of
//! safetensors; its tensors are served under their Hugging Face names, in their stored
//! (possibly block-quantized) types.
//!
//! Every header is validated and every tensor's byte range checked against its file when the
//! checkpoint opens, so a [`TensorView`] handed out later always lies inside the mapping.
//! The mapping assumes nobody truncates the files while the checkpoint is open (true of
//! every mmap-based loader); a file that is already short is an error at open, never a SIGBUS.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::Deserialize;

use super::error::ModelError;
use super::gguf::GgmlType;
use super::gguf::folder::GGUF_LINK;
use super::gguf::weights::GgufWeights;

const CONFIG_FILE: &str = "config.json";
const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// The element types the host accepts for weights: plain floats, and GGUF's block-quantized
/// types (whose rows are whole blocks; see `plughost_device_abi::blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // ggml's names: Q4_K, Q6_K
pub enum DType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
}

impl DType {
    /// Bytes of one element, or of one block for the block-quantized types.
    pub fn size_in_bytes(self) -> usize {
        self.device_dtype().size_bytes() as usize
    }

    /// The device dtype that holds this type's bytes as they are.
    pub fn device_dtype(self) -> plughost_device_abi::DType {
        use plughost_device_abi::DType as Device;
        match self {
            DType::F32 => Device::F32,
            DType::F16 => Device::F16,
            DType::BF16 => Device::BF16,
            DType::Q8_0 => Device::Q8_0,
            DType::Q4_0 => Device::Q4_0,
            DType::Q4_1 => Device::Q4_1,
            DType::Q4_K => Device::Q4_K,
            DType::Q6_K => Device::Q6_K,
        }
    }

    fn from_ggml(kind: GgmlType) -> Self {
        match kind {
            GgmlType::F32 => DType::F32,
            GgmlType::F16 => DType::F16,
            GgmlType::BF16 => DType::BF16,
            GgmlType::Q8_0 => DType::Q8_0,
            GgmlType::Q4_0 => DType::Q4_0,
            GgmlType::Q4_1 => DType::Q4_1,
            GgmlType::Q4_K => DType::Q4_K,
            GgmlType::Q6_K => DType::Q6_K,
        }
    }

    fn from_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        match dtype {
            safetensors::Dtype::F32 => Some(DType::F32),
            safetensors::Dtype::F16 => Some(DType::F16),
            safetensors::Dtype::BF16 => Some(DType::BF16),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q4_K => "Q4_K",
            DType::Q6_K => "Q6_K",
        })
    }
}

/// One tensor of an open checkpoint: its raw little-endian bytes, borrowed from the mapping.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    name: &'a str,
    dtype: DType,
    shape: &'a [u64],
    data: &'a [u8],
    interleaved_heads: Option<usize>,
}

impl<'a> TensorView<'a> {
    pub fn name(&self) -> &'a str {
        self.name
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &'a [u64] {
        self.shape
    }

    /// The tensor's bytes exactly as stored: little-endian, row-major, not converted.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// The bytes with rows in Hugging Face order: [`TensorView::data`], except for a GGUF's
    /// `q_proj` and `k_proj`, whose rows are put back from llama.cpp's interleaved rotary
    /// order (rows move whole, blocks and all).
    pub fn data_in_hf_order(&self) -> std::borrow::Cow<'a, [u8]> {
        match (self.interleaved_heads, self.shape.first()) {
            (Some(heads), Some(&rows)) if rows > 0 => {
                let row_bytes = self.data.len() / rows as usize;
                std::borrow::Cow::Owned(super::gguf::llama::unpermute_rows(
                    self.data, heads, row_bytes,
                ))
            }
            _ => std::borrow::Cow::Borrowed(self.data),
        }
    }

    pub fn num_elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// The few `config.json` fields the host reads itself; the model-glue plugin parses the rest
/// from [`Checkpoint::config_json`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    pub architectures: Vec<String>,
    pub max_position_embeddings: u64,
    /// Empty when the config names none.
    pub eos_token_id: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// `torch_dtype`, or `dtype` as newer `transformers` versions write it.
    pub torch_dtype: Option<String>,
}

#[derive(Deserialize)]
struct RawModelConfig {
    architectures: Vec<String>,
    max_position_embeddings: u64,
    #[serde(default)]
    eos_token_id: Option<OneOrMany>,
    #[serde(default)]
    bos_token_id: Option<u32>,
    #[serde(default)]
    torch_dtype: Option<String>,
    #[serde(default)]
    dtype: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl From<RawModelConfig> for ModelConfig {
    fn from(raw: RawModelConfig) -> Self {
        ModelConfig {
            architectures: raw.architectures,
            max_position_embeddings: raw.max_position_embeddings,
            eos_token_id: match raw.eos_token_id {
                None => Vec::new(),
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) => ids,
            },
            bos_token_id: raw.bos_token_id,
            torch_dtype: raw.torch_dtype.or(raw.dtype),
        }
    }
}

impl ModelConfig {
    /// Parses `config.json` text; `path` only names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ModelError> {
        let raw =
            serde_json::from_str::<RawModelConfig>(text).map_err(|source| ModelError::Json {
                path: path.to_path_buf(),
                what: "model config",
                source,
            })?;
        if let (Some(torch_dtype), Some(dtype)) = (&raw.torch_dtype, &raw.dtype)
            && torch_dtype != dtype
        {
            return Err(ModelError::ConfigConflict {
                path: path.to_path_buf(),
                first: format!("torch_dtype {torch_dtype:?}"),
                second: format!("dtype {dtype:?}"),
            });
        }
        Ok(ModelConfig::from(raw))
    }
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

struct TensorEntry {
    shard: usize,
    dtype: safetensors::Dtype,
    shape: Vec<u64>,
    /// Absolute byte range inside the shard's mapping, checked at open.
    start: usize,
    end: usize,
}

/// An open checkpoint folder. Tensors are read in place from the memory-mapped files.
pub struct Checkpoint {
    dir: PathBuf,
    /// The weights of the GGUF the folder links to, instead of `shards` and `tensors`.
    gguf: Option<GgufWeights>,
    config_json: String,
    config: ModelConfig,
    /// `model.safetensors` or the shard index: the file named when a tensor is missing.
    weights_path: PathBuf,
    shards: Vec<Shard>,
    tensors: HashMap<String, TensorEntry>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("weights_path", &self.weights_path)
            .field("num_shards", &self.shards.len())
            .field("num_tensors", &self.tensors.len())
            .finish()
    }
}

impl Checkpoint {
    /// Reads `config.json` and maps the weights: `model.safetensors`, or the shards listed in
    /// `model.safetensors.index.json`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, ModelError> {
        let dir = dir.as_ref().to_path_buf();
        let config_path = dir.join(CONFIG_FILE);
        let config_json = read_text(&config_path)?;
        let config = ModelConfig::parse(&config_json, &config_path)?;

        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        let linked = dir.join(GGUF_LINK);
        if linked.is_file() {
            let gguf = GgufWeights::open(&linked).map_err(|source| ModelError::Gguf {
                path: linked.clone(),
                source,
            })?;
            return Ok(Checkpoint {
                dir,
                gguf: Some(gguf),
                config_json,
                config,
                weights_path: linked,
                shards: Vec::new(),
                tensors: HashMap::new(),
            });
        }
        let (weights_path, shards, tensors) = if single.is_file() {
            let (shard, tensors) = open_shard(single.clone(), 0)?;
            (single, vec![shard], tensors)
        } else if index.is_file() {
            let (shards, tensors) = open_sharded(&dir, &index)?;
            (index, shards, tensors)
        } else {
            return Err(ModelError::NoWeights { dir });
        };

        Ok(Checkpoint {
            dir,
            gguf: None,
            config_json,
            config,
            weights_path,
            shards,
            tensors,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The raw text of `config.json`, for the model-glue plugin.
    pub fn config_json(&self) -> &str {
        &self.config_json
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// `model.safetensors`, or `model.safetensors.index.json` for a sharded checkpoint.
    pub fn weights_path(&self) -> &Path {
        &self.weights_path
    }

    pub fn num_tensors(&self) -> usize {
        match &self.gguf {
            Some(gguf) => gguf.names().count(),
            None => self.tensors.len(),
        }
    }

    /// Every tensor name, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = match &self.gguf {
            Some(gguf) => gguf.names().collect(),
            None => self.tensors.keys().map(String::as_str).collect(),
        };
        names.sort_unstable();
        names
    }

    /// Drops this process's resident pages of tensor `name` (the file stays in the page cache
    /// and a later read maps them again): once a weight is in device memory its mapped copy
    /// would only count twice against the process's memory.
    pub fn release_pages(&self, name: &str) {
        if let Some(gguf) = &self.gguf {
            return gguf.release(name);
        }
        let Some(entry) = self.tensors.get(name) else {
            return;
        };
        let shard = &self.shards[entry.shard];
        // SAFETY: the mapping is a read-only shared mapping of the file, so dropping its pages
        // loses nothing: a later access reads the same bytes from the file again.
        let outcome = unsafe {
            shard.mmap.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                entry.start,
                entry.end - entry.start,
            )
        };
        if let Err(error) = outcome {
            tracing::debug!(name, %error, "could not release the pages of a weight");
        }
    }

    /// The tensor `name`, refusing safetensors dtypes other than F32, F16 and BF16.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, ModelError> {
        if let Some(gguf) = &self.gguf {
            let (name, tensor) = gguf.get(name).ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                path: self.weights_path.clone(),
            })?;
            return Ok(TensorView {
                name,
                dtype: DType::from_ggml(tensor.kind(gguf)),
                shape: tensor.shape(),
                data: gguf.bytes(tensor),
                interleaved_heads: tensor.interleaved_heads(),
            });
        }
        let Some((name, entry)) = self.tensors.get_key_value(name) else {
            return Err(ModelError::MissingTensor {
                name: name.to_string(),
                path: self.weights_path.clone(),
            });
        };
        let shard = &self.shards[entry.shard];
        let dtype =
            DType::from_safetensors(entry.dtype).ok_or_else(|| ModelError::UnsupportedDtype {
                name: name.clone(),
                dtype: entry.dtype.to_string(),
                path: shard.path.clone(),
            })?;
        Ok(TensorView {
            name,
            dtype,
            shape: &entry.shape,
            data: &shard.mmap[entry.start..entry.end],
            interleaved_heads: None,
        })
    }

    /// Checks that every `(name, shape)` the model needs exists with exactly that shape and an
    /// accepted dtype; the error is the first problem in `expected` order.
    pub fn check(&self, expected: &[(String, Vec<u64>)]) -> Result<(), ModelError> {
        for (name, shape) in expected {
            let view = self.tensor(name)?;
            if view.shape() != shape.as_slice() {
                let path = match self.tensors.get(name.as_str()) {
                    Some(entry) => self.shards[entry.shard].path.clone(),
                    None => self.weights_path.clone(),
                };
                return Err(ModelError::ShapeMismatch {
                    name: name.clone(),
                    actual: view.shape().to_vec(),
                    expected: shape.clone(),
                    path,
                });
            }
        }
        Ok(())
    }
}

fn read_text(path: &Path) -> Result<String, ModelError> {
    std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn map_file(path: &Path) -> Result<Mmap, ModelError> {
    let io_error = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io_error)?;
    // SAFETY: the mapping is read-only and private to this process. Its contents are validated
    // (header, every tensor range) before any view is handed out; like every mmap loader we rely
    // on the file not being truncated by someone else while the checkpoint is open.
    unsafe { Mmap::map(&file) }.map_err(io_error)
}

/// Maps one safetensors file and indexes its tensors under shard number `shard_index`.
fn open_shard(
    path: PathBuf,
    shard_index: usize,
) -> Result<(Shard, HashMap<String, TensorEntry>), ModelError> {
    let mmap = map_file(&path)?;
    let (header_len, metadata) =
        safetensors::SafeTensors::read_metadata(&mmap).map_err(|source| {
            ModelError::Safetensors {
                path: path.clone(),
                source,
            }
        })?;
    // read_metadata already checks that the ranges tile the data section exactly; checking
    // again here keeps the slicing in `Checkpoint::tensor` independent of that crate's rules.
    let data_start = 8 + header_len;
    let data_len = mmap.len().saturating_sub(data_start);
    let mut tensors = HashMap::new();
    for (name, info) in metadata.tensors() {
        let (start, end) = info.data_offsets;
        if start > end || end > data_len {
            return Err(ModelError::TensorOutOfBounds {
                path,
                name,
                start,
                end,
                len: data_len,
            });
        }
        let entry = TensorEntry {
            shard: shard_index,
            dtype: info.dtype,
            shape: info.shape.iter().map(|&d| d as u64).collect(),
            start: data_start + start,
            end: data_start + end,
        };
        tensors.insert(name, entry);
    }
    Ok((Shard { path, mmap }, tensors))
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

fn open_sharded(
    dir: &Path,
    index_path: &Path,
) -> Result<(Vec<Shard>, HashMap<String, TensorEntry>), ModelError> {
    let text = read_text(index_path)?;
    let index: ShardIndex = serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: index_path.to_path_buf(),
        what: "safetensors shard index",
        source,
    })?;
    let bad_index = |problem: String| ModelError::BadIndex {
        path: index_path.to_path_buf(),
        problem,
    };

    let file_names: BTreeSet<&str> = index.weight_map.values().map(String::as_str).collect();
    let mut shards = Vec::with_capacity(file_names.len());
    let mut shard_tensors = Vec::with_capacity(file_names.len());
    let mut file_to_shard = HashMap::new();
    for file_name in file_names {
        if !is_plain_file_name(file_name) {
            return Err(bad_index(format!(
                "names shard `{file_name}`, which is not a file name inside the folder"
            )));
        }
        let (shard, tensors) = open_shard(dir.join(file_name), shards.len())?;
        file_to_shard.insert(file_name, shards.len());
        shards.push(shard);
        shard_tensors.push(tensors);
    }

    let mut tensors = HashMap::with_capacity(index.weight_map.len());
    for (name, file_name) in &index.weight_map {
        let shard = file_to_shard[file_name.as_str()];
        let Some(entry) = shard_tensors[shard].remove(name) else {
            return Err(bad_index(format!(
                "maps tensor {name} to `{file_name}`, which does not contain it"
            )));
        };
        tensors.insert(name.clone(), entry);
    }
    Ok((shards, tensors))
}

fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\\')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_fields_parse_in_every_accepted_form() {
        let path = Path::new("config.json");
        // (config.json, eos_token_id, bos_token_id, torch_dtype)
        type Case = (&'static str, Vec<u32>, Option<u32>, Option<&'static str>);
        let cases: &[Case] = &[
            (
                r#"{"architectures":["Qwen3ForCausalLM"],"max_position_embeddings":40960,
                    "eos_token_id":151645,"bos_token_id":151643,"torch_dtype":"bfloat16","x":1}"#,
                vec![151645],
                Some(151643),
                Some("bfloat16"),
            ),
            (
                r#"{"architectures":["LlamaForCausalLM"],"max_position_embeddings":2048,
                    "eos_token_id":[1,2],"bos_token_id":null,"dtype":"float32"}"#,
                vec![1, 2],
                None,
                Some("float32"),
            ),
            (
                r#"{"architectures":[],"max_position_embeddings":8,"eos_token_id":null}"#,
                vec![],
                None,
                None,
            ),
        ];
        for (text, eos, bos, dtype) in cases {
            let config = ModelConfig::parse(text, path).expect(text);
            assert_eq!(&config.eos_token_id, eos, "{text}");
            assert_eq!(&config.bos_token_id, bos, "{text}");
            assert_eq!(config.torch_dtype.as_deref(), *dtype, "{text}");
        }
    }

    #[test]
    fn dtype_and_torch_dtype_may_both_be_given_but_must_agree() {
        let path = Path::new("/m/config.json");
        let both = |torch_dtype: &str, dtype: &str| {
            format!(
                r#"{{"architectures":[],"max_position_embeddings":8,
                    "torch_dtype":"{torch_dtype}","dtype":"{dtype}"}}"#
            )
        };
        let config = ModelConfig::parse(&both("bfloat16", "bfloat16"), path).expect("agree");
        assert_eq!(config.torch_dtype.as_deref(), Some("bfloat16"));
        let message = ModelConfig::parse(&both("bfloat16", "float32"), path)
            .unwrap_err()
            .to_string();
        assert_eq!(
            message,
            r#"/m/config.json: torch_dtype "bfloat16" and dtype "float32" disagree"#
        );
    }

    #[test]
    fn bad_configs_name_the_file() {
        let path = Path::new("/m/config.json");
        for text in [
            "not json",
            "{}",
            r#"{"architectures":"x","max_position_embeddings":1}"#,
        ] {
            let message = ModelConfig::parse(text, path).unwrap_err().to_string();
            assert!(message.contains("/m/config.json"), "{message}");
        }
    }

    #[test]
    fn checkpoints_and_tokenizers_are_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Checkpoint>();
        assert_send_sync::<crate::model::Tokenizer>();
        assert_send_sync::<crate::model::DecodeStream>();
    }

    #[test]
    fn shard_names_must_stay_inside_the_folder() {
        for name in ["", "..", "../x.safetensors", "a/b.safetensors", "a\\b"] {
            assert!(!is_plain_file_name(name), "{name}");
        }
        assert!(is_plain_file_name("model-00001-of-00002.safetensors"));
    }
}
