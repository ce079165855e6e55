//! The Qwen3-0.6B-shaped model with random weights: its BF16 GGUF, written by the committed script `tests/reference/random_qwen3_0_6b_gguf.py`, and the quantized copies `llama-quantize` makes of it.
//!
//! Random weights give the real model's speed (every server does the same arithmetic on the
//! same bytes whatever their values) without a 1.2 GB download. Each file is made once, beside
//! the other models, and remade only when missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use super::llama;

/// The script's path, relative to the workspace root.
const SCRIPT: &str = "tests/reference/random_qwen3_0_6b_gguf.py";
/// The files' stem under the models folder.
const STEM: &str = "qwen3-0.6b-shape";

/// Where the Qwen3-0.6B-shaped files live and what makes them.
pub struct RandomQwen3 {
    models_dir: PathBuf,
    script: PathBuf,
    python: String,
    /// Qwen3's `tokenizer.json` and `tokenizer_config.json`, which the GGUF carries.
    tokenizer_dir: PathBuf,
}

impl RandomQwen3 {
    pub fn new(root: &Path, target_dir: &Path, python: String, tokenizer_dir: PathBuf) -> Self {
        RandomQwen3 {
            models_dir: target_dir.join("models"),
            script: root.join(SCRIPT),
            python,
            tokenizer_dir,
        }
    }

    /// The file of llama-quantize's type `kind` (`BF16`, `Q8_0`, `Q4_K_M`).
    pub fn path(&self, kind: &str) -> PathBuf {
        self.models_dir.join(format!("{STEM}.{kind}.gguf"))
    }

    /// The file of type `kind`, made first if missing: the BF16 file by the script, the others
    /// from it by `quantize` (asked for only then).
    pub fn gguf(
        &self,
        kind: &str,
        threads: usize,
        quantize: impl FnOnce() -> Result<PathBuf>,
    ) -> Result<PathBuf> {
        let bf16 = self.path("BF16");
        if !bf16.is_file() {
            self.write_bf16(&bf16)?;
        }
        let out = self.path(kind);
        if !is_newer(&out, &bf16) {
            let log = out.with_extension("gguf.quantize.log");
            llama::quantize_file(&quantize()?, &bf16, &out, kind, threads, &log)?;
        }
        Ok(out)
    }

    fn write_bf16(&self, out: &Path) -> Result<()> {
        std::fs::create_dir_all(&self.models_dir)
            .with_context(|| format!("creating {}", self.models_dir.display()))?;
        let partial = out.with_extension("gguf.partial");
        eprintln!(
            "$ {} {} {} {}",
            self.python,
            self.script.display(),
            partial.display(),
            self.tokenizer_dir.display()
        );
        let status = Command::new(&self.python)
            .arg(&self.script)
            .arg(&partial)
            .arg(&self.tokenizer_dir)
            .stdin(Stdio::null())
            .status()
            .with_context(|| format!("running {}", self.python))?;
        if !status.success() {
            std::fs::remove_file(&partial).ok();
            bail!(
                "{} failed ({status}); it needs the Python packages gguf and numpy \
                 (`pip install gguf numpy`; $PLUGHOST_PYTHON picks the interpreter)",
                self.script.display()
            );
        }
        std::fs::rename(&partial, out)
            .with_context(|| format!("moving {} to {}", partial.display(), out.display()))
    }
}

/// Whether `file` exists and was written after `source`.
fn is_newer(file: &Path, source: &Path) -> bool {
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    matches!((modified(file), modified(source)), (Some(f), Some(s)) if f >= s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_type_has_its_file_beside_the_models() {
        let m = RandomQwen3::new(
            Path::new("/w"),
            Path::new("/w/target"),
            "python3".into(),
            PathBuf::from("/w/target/fixtures/qwen3-tokenizer"),
        );
        assert_eq!(
            m.path("Q4_K_M"),
            Path::new("/w/target/models/qwen3-0.6b-shape.Q4_K_M.gguf")
        );
        assert_eq!(
            m.script,
            Path::new("/w/tests/reference/random_qwen3_0_6b_gguf.py")
        );
    }
}
