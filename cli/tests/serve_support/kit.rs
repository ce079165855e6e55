//! The plugin kit as an author outside this repository uses it: `plugin new` in a temporary folder, a policy change, `plugin build` and what it reports.
//!
//! Builds share one target dir, `target/plugin-kit-test`, kept between runs so only the new
//! crate rebuilds (the first run compiles its dependencies for wasm32-wasip2, about 40 s).
//! Cargo keys a crate that is its own workspace by name and version, not by folder, so the
//! tests that build at the same time name their crates differently: two crates of one name
//! would each find the other's build fresh.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::workspace;

pub fn plughost(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_plughost"));
    command.args(args);
    command
}

pub fn run(mut command: impl std::borrow::BorrowMut<Command>) -> Output {
    command.borrow_mut().output().expect("plughost runs")
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A fresh folder outside the workspace, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(test: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("plughost-kit-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp folder");
        assert!(!dir.starts_with(workspace().canonicalize().expect("workspace path")));
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `plughost plugin new KIND NAME --path DIR`; returns the new crate's folder.
pub fn new_plugin(kind: &str, name: &str, dir: &Path) -> PathBuf {
    let created = run(plughost(&["plugin", "new", kind, name, "--path"]).arg(dir));
    assert!(created.status.success(), "{}", text(&created.stderr));
    dir.join(name)
}

/// `plughost plugin build DIR` with the kit tests' own target dir.
pub fn build(dir: &Path) -> Output {
    let target = workspace().join("target/plugin-kit-test");
    run(plughost(&["plugin", "build"])
        .arg(dir)
        .env("CARGO_TARGET_DIR", target))
}

/// The author's change to a sampler made by `plugin new`: greedy takes the second most likely
/// token.
pub fn make_greedy_take_the_second_best(crate_dir: &Path) {
    let lib = crate_dir.join("src/lib.rs");
    let source = std::fs::read_to_string(&lib).expect("src/lib.rs");
    let greedy = "row.argmax()";
    assert!(source.contains(greedy), "the template's greedy path moved");
    let changed = source.replace(greedy, "row.top_k(2).last().map_or(row.argmax(), |c| c.id)");
    std::fs::write(&lib, changed).expect("write src/lib.rs");
}

/// What a successful `plugin build` printed.
pub struct Built {
    pub stdout: String,
}

impl Built {
    /// Builds `dir`, panicking with cargo's output if the build fails.
    pub fn build(dir: &Path) -> Built {
        let output = build(dir);
        let stdout = text(&output.stdout);
        assert!(
            output.status.success(),
            "{}\n{}",
            stdout,
            text(&output.stderr)
        );
        Built { stdout }
    }

    /// The value of the report line that starts with `name`.
    pub fn field(&self, name: &str) -> String {
        self.stdout
            .lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
            .unwrap_or_else(|| panic!("no `{name}` line in:\n{}", self.stdout))
    }

    pub fn component(&self) -> PathBuf {
        PathBuf::from(self.field("component"))
    }

    pub fn sha256(&self) -> String {
        self.field("sha256")
    }
}
