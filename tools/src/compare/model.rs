//! What the comparison needs to know about the model folder: its shape (for KV cache sizes) and
//! its weight bytes (for the memory ratio and the bandwidth bound).

use std::fs::File;
use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use serde_json::Value;

/// Shape and sizes of a Hugging Face model folder.
#[derive(Debug, Clone)]
pub struct ModelFacts {
    pub layers: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub vocab_size: u64,
    pub tied_embeddings: bool,
    /// Sum of the `*.safetensors` file sizes.
    pub file_bytes: u64,
    /// Sum of the tensors' data, without the safetensors headers.
    pub tensor_bytes: u64,
    /// The input embedding matrix's bytes (also the output head when tied).
    pub embedding_bytes: u64,
}

impl ModelFacts {
    pub fn read(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        let config: Value = serde_json::from_str(
            &std::fs::read_to_string(&config_path)
                .with_context(|| format!("reading {}", config_path.display()))?,
        )
        .with_context(|| format!("parsing {}", config_path.display()))?;
        let int = |key: &str| {
            config[key]
                .as_u64()
                .with_context(|| format!("{} has no integer {key}", config_path.display()))
        };
        let heads = int("num_attention_heads")?;
        ensure!(heads > 0, "{} has zero heads", config_path.display());
        let head_dim = match config["head_dim"].as_u64() {
            Some(d) => d,
            None => int("hidden_size")? / heads,
        };
        let mut facts = ModelFacts {
            layers: int("num_hidden_layers")?,
            kv_heads: config["num_key_value_heads"].as_u64().unwrap_or(heads),
            head_dim,
            vocab_size: int("vocab_size")?,
            tied_embeddings: config["tie_word_embeddings"].as_bool().unwrap_or(false),
            file_bytes: 0,
            tensor_bytes: 0,
            embedding_bytes: 0,
        };
        let entries =
            std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))?;
        for entry in entries {
            let path = entry
                .with_context(|| format!("listing {}", dir.display()))?
                .path();
            if path.extension().is_none_or(|e| e != "safetensors") {
                continue;
            }
            facts.file_bytes += std::fs::metadata(&path)
                .with_context(|| format!("reading the size of {}", path.display()))?
                .len();
            let (tensors, embedding) = tensor_bytes(&path)?;
            facts.tensor_bytes += tensors;
            facts.embedding_bytes += embedding;
        }
        ensure!(
            facts.file_bytes > 0,
            "{} has no safetensors files",
            dir.display()
        );
        Ok(facts)
    }

    /// Shape and sizes of a GGUF file served as it is, from its metadata and tensors.
    pub fn read_gguf(path: &Path) -> Result<Self> {
        let file = plughost::model::gguf::Gguf::open(path)
            .with_context(|| format!("reading {}", path.display()))?;
        let arch = file.str("general.architecture")?.to_string();
        let int = |key: &str| file.u64(&format!("{arch}.{key}"));
        let heads = int("attention.head_count")?;
        ensure!(heads > 0, "{} has zero heads", path.display());
        let head_dim = match int("attention.key_length") {
            Ok(d) => d,
            Err(_) => int("embedding_length")? / heads,
        };
        let has = |name: &str| file.tensors().iter().any(|t| t.name == name);
        let mut facts = ModelFacts {
            layers: int("block_count")?,
            kv_heads: int("attention.head_count_kv").unwrap_or(heads),
            head_dim,
            vocab_size: file.array("tokenizer.ggml.tokens")?.len() as u64,
            tied_embeddings: !has("output.weight"),
            file_bytes: 0,
            tensor_bytes: 0,
            embedding_bytes: 0,
        };
        drop(file);
        facts.use_gguf_weights(path)?;
        Ok(facts)
    }

    /// Counts the tensors of `gguf` as the weights instead of the folder's safetensors: the
    /// bytes a server serving that file reads.
    pub fn use_gguf_weights(&mut self, gguf: &Path) -> Result<()> {
        let file = plughost::model::gguf::Gguf::open(gguf)
            .with_context(|| format!("reading {}", gguf.display()))?;
        let bytes = |t: &plughost::model::gguf::TensorInfo| file.tensor_data(t).len() as u64;
        self.tensor_bytes = file.tensors().iter().map(bytes).sum();
        self.embedding_bytes = file
            .tensors()
            .iter()
            .filter(|t| t.name == "token_embd.weight")
            .map(bytes)
            .sum();
        self.file_bytes = std::fs::metadata(gguf)
            .with_context(|| format!("reading the size of {}", gguf.display()))?
            .len();
        Ok(())
    }

    /// Bytes of K and V per token for `elem_bytes`-sized elements.
    pub fn kv_bytes_per_token(&self, elem_bytes: u64) -> u64 {
        2 * self.layers * self.kv_heads * self.head_dim * elem_bytes
    }
}

/// (all tensor data bytes, embedding bytes) from a safetensors header, without reading the data.
fn tensor_bytes(path: &Path) -> Result<(u64, u64)> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .with_context(|| format!("{} is too short for safetensors", path.display()))?;
    let len = u64::from_le_bytes(len);
    ensure!(
        len < 100 << 20,
        "{} claims a {len}-byte header",
        path.display()
    );
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header)
        .with_context(|| format!("reading the header of {}", path.display()))?;
    let header: Value = serde_json::from_slice(&header)
        .with_context(|| format!("parsing the header of {}", path.display()))?;
    let map = header
        .as_object()
        .with_context(|| format!("the header of {} is not an object", path.display()))?;
    let (mut total, mut embedding) = (0, 0);
    for (name, info) in map {
        if name == "__metadata__" {
            continue;
        }
        let offsets = &info["data_offsets"];
        let (Some(start), Some(end)) = (offsets[0].as_u64(), offsets[1].as_u64()) else {
            anyhow::bail!("{name} in {} has no data_offsets", path.display());
        };
        let bytes = end.saturating_sub(start);
        total += bytes;
        if name.ends_with("embed_tokens.weight") {
            embedding += bytes;
        }
    }
    Ok((total, embedding))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_of_a_gguf_come_from_its_metadata_and_tensors() {
        use plughost::model::gguf::GgufWriter;
        const F32: u32 = 0;
        let dir = std::env::temp_dir().join(format!("xtask-compare-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        let bytes = GgufWriter::default()
            .str("general.architecture", "qwen3")
            .u32("qwen3.block_count", 3)
            .u32("qwen3.attention.head_count", 4)
            .u32("qwen3.attention.head_count_kv", 2)
            .u32("qwen3.attention.key_length", 32)
            .u32("qwen3.embedding_length", 64)
            .strs("tokenizer.ggml.tokens", &["a", "b", "c"])
            .tensor("token_embd.weight", &[2, 3], F32, &[0u8; 24])
            .tensor("blk.0.attn_norm.weight", &[2], F32, &[0u8; 8])
            .build();
        std::fs::write(&path, &bytes).unwrap();
        let facts = ModelFacts::read_gguf(&path).unwrap();
        // key_length wins over embedding_length / heads (16).
        assert_eq!((facts.layers, facts.kv_heads, facts.head_dim), (3, 2, 32));
        assert_eq!(facts.vocab_size, 3);
        assert!(facts.tied_embeddings, "no output.weight");
        assert_eq!((facts.tensor_bytes, facts.embedding_bytes), (32, 24));
        assert_eq!(facts.file_bytes, bytes.len() as u64);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn facts_come_from_config_and_safetensors_headers() {
        let dir = std::env::temp_dir().join(format!("xtask-compare-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            r#"{"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2,
                "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": true}"#,
        )
        .unwrap();
        let header = br#"{"model.embed_tokens.weight":{"dtype":"BF16","shape":[4,2],"data_offsets":[0,16]},"w":{"dtype":"BF16","shape":[2],"data_offsets":[16,20]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header);
        bytes.extend([0u8; 20]);
        std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
        let facts = ModelFacts::read(&dir).unwrap();
        assert_eq!((facts.layers, facts.kv_heads, facts.head_dim), (2, 2, 16));
        assert_eq!((facts.tensor_bytes, facts.embedding_bytes), (20, 16));
        assert_eq!(facts.file_bytes, bytes.len() as u64);
        assert!(facts.tied_embeddings);
        assert_eq!(facts.kv_bytes_per_token(4), 2 * 2 * 2 * 16 * 4);
        std::fs::remove_dir_all(&dir).ok();
    }
}
