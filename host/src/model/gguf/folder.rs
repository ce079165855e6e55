//! A GGUF file served as a model folder: `config.json`, the tokenizer files and `generation_config.json` written from its metadata, beside a link to the file itself.
//!
//! The host reads every model through a folder (the glue reads `config.json`, the tokenizer
//! and chat template come from `tokenizer.json` and `tokenizer_config.json`). For a GGUF those
//! few small files are derived from the metadata into a folder of the cache, rewritten at every
//! start (it takes a fraction of a second), and the weights stay in the GGUF: the folder's
//! [`GGUF_LINK`] points at the file, and [`crate::model::Checkpoint`] serves its tensors in
//! their stored types.

use std::path::{Path, PathBuf};

use sha2::Digest;

use super::llama::LlamaParams;
use super::tokenizer::GgufTokenizer;
use super::{GgmlType, Gguf, GgufError, Result};

/// The name of the link to the GGUF file inside its folder.
pub const GGUF_LINK: &str = "model.gguf";

/// The dtype `config.json` names for `gguf`, which `--kv-cache-dtype auto` caches keys and
/// values in: a file whose matrices are all BF16 (or all F16) is a bf16 (f16) checkpoint and
/// caches as a bf16 (f16) model folder does; quantized or F32 matrices give f32, the precision
/// the quantized weights are dequantized to in references. Vectors (norms, biases) are
/// often kept in F32 by the converters and do not count.
fn checkpoint_dtype(gguf: &Gguf) -> &'static str {
    let mut matrices = gguf.tensors().iter().filter(|t| t.dims.len() >= 2);
    match matrices.next().map(|t| t.kind) {
        Some(first @ (GgmlType::BF16 | GgmlType::F16)) if matrices.all(|t| t.kind == first) => {
            if first == GgmlType::BF16 {
                "bfloat16"
            } else {
                "float16"
            }
        }
        _ => "float32",
    }
}

/// Whether `path` names a GGUF file rather than a model folder.
pub fn is_gguf_file(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// Reads the GGUF at `file` and writes its model folder under `cache_root`; returns the
/// folder, named after the file (without `.gguf`) inside a directory keyed by the file's path.
pub fn prepare(file: &Path, cache_root: &Path) -> Result<PathBuf> {
    let file = file.canonicalize().map_err(|e| io_error(file, e))?;
    let gguf = Gguf::open(&file)?;
    let params = LlamaParams::from_gguf(&gguf)?;
    let tokenizer = GgufTokenizer::from_gguf(&gguf)?;
    let stem = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let key = sha2::Sha256::digest(file.as_os_str().as_encoded_bytes());
    let key: String = key[..8].iter().map(|b| format!("{b:02x}")).collect();
    let dir = cache_root.join("gguf").join(key).join(stem);
    std::fs::create_dir_all(&dir).map_err(|e| io_error(&dir, e))?;

    let json = |value: serde_json::Value| {
        serde_json::to_string_pretty(&value).unwrap_or_else(|_| value.to_string())
    };
    let files = [
        (
            "config.json",
            json(params.config_json(checkpoint_dtype(&gguf))),
        ),
        (
            "generation_config.json",
            json(params.generation_config_json()),
        ),
        ("tokenizer.json", tokenizer.tokenizer_json()?),
        (
            "tokenizer_config.json",
            json(tokenizer.tokenizer_config_json(params.context_length)),
        ),
    ];
    for (name, contents) in files {
        write_replacing(&dir.join(name), contents.as_bytes())?;
    }
    link_replacing(&file, &dir.join(GGUF_LINK))?;
    Ok(dir)
}

fn io_error(path: &Path, e: std::io::Error) -> GgufError {
    GgufError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// Writes through a temporary file and a rename, so a reader (another server starting on the
/// same file) never sees half a file.
fn write_replacing(path: &Path, contents: &[u8]) -> Result<()> {
    let temporary = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&temporary, contents).map_err(|e| io_error(&temporary, e))?;
    std::fs::rename(&temporary, path).map_err(|e| io_error(path, e))
}

#[cfg(unix)]
fn link_replacing(target: &Path, link: &Path) -> Result<()> {
    if std::fs::read_link(link).is_ok_and(|current| current == target) {
        return Ok(());
    }
    let temporary = link.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&temporary);
    std::os::unix::fs::symlink(target, &temporary).map_err(|e| io_error(&temporary, e))?;
    std::fs::rename(&temporary, link).map_err(|e| io_error(link, e))
}

#[cfg(not(unix))]
fn link_replacing(target: &Path, link: &Path) -> Result<()> {
    std::fs::hard_link(target, link)
        .or_else(|_| std::fs::copy(target, link).map(|_| ()))
        .map_err(|e| io_error(link, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::GgufWriter;

    /// A GGUF of a 32 × 2 matrix of each of `kinds` (ggml type ids) and a vector in F32.
    fn file_of(kinds: &[u32]) -> Gguf {
        let mut writer = GgufWriter::default().tensor("norm.weight", &[32], 0, &[0; 128]);
        for (i, &kind) in kinds.iter().enumerate() {
            // Bytes per row of 32: f32, f16 or bf16, and Q8_0's one block.
            let bytes = match kind {
                0 => 128,
                8 => 34,
                _ => 64,
            };
            let name = format!("blk.{i}.weight");
            writer = writer.tensor(&name, &[32, 2], kind, &vec![0; 2 * bytes]);
        }
        Gguf::parse(writer.build()).expect("the file parses")
    }

    #[test]
    fn the_config_names_the_float_type_all_matrices_share() {
        let (f32, f16, bf16, q8_0) = (0, 1, 30, 8);
        assert_eq!(checkpoint_dtype(&file_of(&[bf16, bf16])), "bfloat16");
        assert_eq!(checkpoint_dtype(&file_of(&[f16, f16])), "float16");
        assert_eq!(checkpoint_dtype(&file_of(&[f32, f32])), "float32");
        // Mixed float types, or any quantized matrix: f32, as for a quantized file.
        assert_eq!(checkpoint_dtype(&file_of(&[bf16, f32])), "float32");
        assert_eq!(checkpoint_dtype(&file_of(&[bf16, f16])), "float32");
        assert_eq!(checkpoint_dtype(&file_of(&[q8_0, q8_0])), "float32");
        assert_eq!(checkpoint_dtype(&file_of(&[bf16, q8_0])), "float32");
        assert_eq!(checkpoint_dtype(&file_of(&[])), "float32");
    }
}
