//! Running the workspace's test binaries side by side: the suite's binaries spend much of their time waiting on servers they start, so two at a time finish sooner than one after another.

use std::collections::VecDeque;
use std::ffi::OsStr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::plugins::Workspace;

/// One test binary cargo built, and the package folder it runs in (as `cargo test` runs it).
struct TestBinary {
    name: String,
    executable: PathBuf,
    package_dir: PathBuf,
}

/// Builds every test target of the workspace (nothing, when a lint build already did) and
/// lists the executables in cargo's order.
fn build(workspace: &Workspace, env: &[(&str, &OsStr)]) -> Result<Vec<TestBinary>> {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command
        .args([
            "test",
            "--workspace",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(workspace.root())
        .stdout(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    eprintln!("$ cargo test --workspace --no-run --message-format=json-render-diagnostics");
    let output = command.output().context("running cargo test --no-run")?;
    if !output.status.success() {
        bail!("cargo test --no-run failed ({})", output.status);
    }
    let mut binaries = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let is_test =
            message["reason"] == "compiler-artifact" && message["profile"]["test"] == true;
        let (Some(executable), Some(manifest)) = (
            message["executable"].as_str(),
            message["manifest_path"].as_str(),
        ) else {
            continue;
        };
        if !is_test {
            continue;
        }
        let package_dir = Path::new(manifest)
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let name = format!(
            "{} ({})",
            message["target"]["name"].as_str().unwrap_or("?"),
            package_dir.display()
        );
        // Integration tests start servers and take longest: they go first, so the last binary
        // to finish is a short one.
        let integration = message["target"]["kind"][0] == "test";
        binaries.push((
            !integration,
            TestBinary {
                name,
                executable: PathBuf::from(executable),
                package_dir,
            },
        ));
    }
    binaries.sort_by_key(|(unit, _)| *unit);
    Ok(binaries.into_iter().map(|(_, binary)| binary).collect())
}

/// Runs every test binary of the workspace, `jobs` at a time, each in its package folder with
/// `env`; prints each binary's output whole when it ends; then the doc tests. Fails when any
/// binary failed, naming them.
pub fn run_all(workspace: &Workspace, env: &[(&str, &OsStr)], jobs: usize) -> Result<()> {
    let queue = Mutex::new(build(workspace, env)?.into_iter().collect::<VecDeque<_>>());
    let failed = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..jobs.max(1) {
            scope.spawn(|| {
                loop {
                    let next = queue.lock().map(|mut q| q.pop_front()).unwrap_or(None);
                    let Some(binary) = next else {
                        return;
                    };
                    if !run_one(&binary, env)
                        && let Ok(mut failed) = failed.lock()
                    {
                        failed.push(binary.name);
                    }
                }
            });
        }
    });
    let failed = failed.into_inner().unwrap_or_default();
    if !failed.is_empty() {
        bail!("test binaries failed: {}", failed.join(", "));
    }
    workspace.cargo(&["test", "--workspace", "--doc"], env)
}

/// Runs one binary to its end; returns whether it passed.
fn run_one(binary: &TestBinary, env: &[(&str, &OsStr)]) -> bool {
    let mut command = Command::new(&binary.executable);
    command
        .current_dir(&binary.package_dir)
        .env("CARGO_MANIFEST_DIR", &binary.package_dir);
    for (key, value) in env {
        command.env(key, value);
    }
    let output = command.output();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let _ = writeln!(out, "\n     Running {}", binary.name);
    match output {
        Ok(output) => {
            let _ = out.write_all(&output.stdout);
            let _ = out.write_all(&output.stderr);
            output.status.success()
        }
        Err(e) => {
            let _ = writeln!(out, "cannot run {}: {e}", binary.executable.display());
            false
        }
    }
}
