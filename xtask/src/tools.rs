//! Running the `plughost-tools` binary for the tasks that need a model, built together with what
//! the task builds anyway, so that the big dependencies compile once, with one set of features.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::plugins::Workspace;

/// plughost-tools' integration test. Building it makes cargo build the tools binary as well, with
/// the features `cargo test --workspace` unifies, so the test build that follows reuses every
/// artifact instead of building the host's dependencies a second time with other features.
const TOOLS_TEST: &str = "plughost_tools";

/// The binaries of a release build of the server and the tools, made by one cargo invocation.
pub struct ReleaseBinaries {
    pub plughost: PathBuf,
    pub tools: PathBuf,
}

fn executable(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX))
}

/// The tools binary in the test build's features (debug), built without running any test.
pub fn build_for_tests(workspace: &Workspace, env: &[(&str, &OsStr)]) -> Result<PathBuf> {
    workspace.cargo(
        &["test", "--workspace", "--no-run", "--test", TOOLS_TEST],
        env,
    )?;
    Ok(executable(
        &workspace.target_dir().join("debug"),
        "plughost-tools",
    ))
}

/// The packages of `plughost` and `plughost-tools`.
pub const RELEASE_PACKAGES: [&str; 2] = ["plughost-cli", "plughost-tools"];

/// `plughost` and `plughost-tools` in release, from one cargo invocation.
pub fn build_release(workspace: &Workspace) -> Result<ReleaseBinaries> {
    let mut args = vec!["build", "--release"];
    for package in RELEASE_PACKAGES {
        args.extend(["-p", package]);
    }
    workspace.cargo(&args, &[])?;
    Ok(release_binaries(workspace))
}

/// Where the release build puts `plughost` and `plughost-tools`.
pub fn release_binaries(workspace: &Workspace) -> ReleaseBinaries {
    let dir = workspace.target_dir().join("release");
    ReleaseBinaries {
        plughost: executable(&dir, "plughost"),
        tools: executable(&dir, "plughost-tools"),
    }
}

/// Runs `tools fetch-model ARGS` into the workspace's target folder and returns the folder it
/// prints last; its progress goes to stderr as it comes.
pub fn fetch_model<S: AsRef<OsStr>>(
    workspace: &Workspace,
    tools: &Path,
    args: &[S],
) -> Result<PathBuf> {
    let output = Command::new(tools)
        .arg("fetch-model")
        .arg("--target-dir")
        .arg(workspace.target_dir())
        .args(args)
        .current_dir(workspace.root())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", tools.display()))?;
    if !output.status.success() {
        bail!("{} fetch-model failed ({})", tools.display(), output.status);
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let folder = stdout
        .lines()
        .last()
        .context("fetch-model printed no folder")?;
    Ok(PathBuf::from(folder))
}

/// Runs `program ARGS` in the workspace root, failing on a non-zero exit.
pub fn run<S: AsRef<OsStr>>(workspace: &Workspace, program: &Path, args: &[S]) -> Result<()> {
    let status = Command::new(program)
        .args(args)
        .current_dir(workspace.root())
        .status()
        .with_context(|| format!("running {}", program.display()))?;
    if !status.success() {
        bail!("{} failed ({status})", program.display());
    }
    Ok(())
}
