//! A server process started for a benchmark: its log, waiting for `/health`, its peak memory,
//! and stopping it, also when the benchmark fails halfway (the guard stops it on drop).

use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// How to start one server.
pub struct ServerSpec {
    /// Short name for messages and file names.
    pub name: &'static str,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub port: u16,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
    /// The directory it runs in, when not this one: llama.cpp's servers write a `llama.log`
    /// of their own into theirs, which belongs with the run's other files.
    pub dir: Option<PathBuf>,
}

impl ServerSpec {
    /// The command as a shell line, for the report.
    pub fn command_line(&self, root: &Path) -> String {
        std::iter::once(self.program.as_os_str())
            .chain(self.args.iter().map(OsString::as_os_str))
            .map(|a| shell_word(&display_path(Path::new(a), root)))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// A started server; stopped when dropped.
pub struct RunningServer {
    name: &'static str,
    child: Child,
    port: u16,
    log: PathBuf,
}

impl RunningServer {
    /// Starts the server after checking that its port is free.
    pub fn start(spec: &ServerSpec) -> Result<Self> {
        ensure_port_free(spec.port, spec.name)?;
        let log =
            File::create(&spec.log).with_context(|| format!("creating {}", spec.log.display()))?;
        let log_err = log
            .try_clone()
            .with_context(|| format!("opening {} twice", spec.log.display()))?;
        eprintln!(
            "starting {} on port {} (log: {})",
            spec.name,
            spec.port,
            spec.log.display()
        );
        let mut command = Command::new(&spec.program);
        if let Some(dir) = &spec.dir {
            command.current_dir(dir);
        }
        let child = command
            .args(&spec.args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .with_context(|| format!("starting {}", spec.program.display()))?;
        Ok(RunningServer {
            name: spec.name,
            child,
            port: spec.port,
            log: spec.log.clone(),
        })
    }

    /// The server's process and every process under it (plughost's device worker): what the
    /// server's CPU time and memory are counted over.
    pub fn pids(&self) -> Vec<u32> {
        process_tree(self.child.id())
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Waits until `/health` answers 200; fails when the process exits or the time runs out.
    pub fn wait_healthy(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().context("polling the server")? {
                bail!(
                    "{} exited ({status}) before it became healthy; the end of {}:\n{}",
                    self.name,
                    self.log.display(),
                    log_tail(&self.log, 30)
                );
            }
            if matches!(http_get(self.port, "/health"), Ok((200, _))) {
                eprintln!(
                    "{} is healthy after {:.1} s",
                    self.name,
                    start.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!(
                    "{} did not answer 200 on http://127.0.0.1:{}/health within {} s; the end of {}:\n{}",
                    self.name,
                    self.port,
                    timeout.as_secs(),
                    self.log.display(),
                    log_tail(&self.log, 30)
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Fails when the server has exited, e.g. between two loads.
    pub fn ensure_running(&mut self, during: &str) -> Result<()> {
        let Some(status) = self.child.try_wait().context("polling the server")? else {
            return Ok(());
        };
        let hint = if status.success() {
            " (a clean exit in the middle of a run means something else sent it SIGTERM or \
             SIGINT)"
        } else {
            ""
        };
        bail!(
            "{} exited ({status}) during {during}{hint}; the end of {}:\n{}",
            self.name,
            self.log.display(),
            log_tail(&self.log, 30)
        )
    }

    /// The process's peak resident set (VmHWM), in bytes.
    /// The peak resident memory of the server's processes, summed: plughost's weights and KV
    /// cache live in its device worker, not in the process it was started as.
    pub fn peak_rss(&self) -> Result<u64> {
        self.pids().into_iter().map(peak_rss_of).sum()
    }

    /// Stops the server: SIGTERM, then SIGKILL if it has not exited within a few seconds.
    pub fn stop(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        // A polite stop first, so the server can close its device and sockets itself; std only
        // offers SIGKILL, so the signal goes through kill(1).
        let asked = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if asked {
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if matches!(self.child.try_wait(), Ok(Some(_))) {
                    eprintln!("stopped {}", self.name);
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        eprintln!("killed {}", self.name);
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.shut_down();
    }
}

pub fn ensure_port_free(port: u16, name: &str) -> Result<()> {
    match TcpListener::bind(("127.0.0.1", port)) {
        Ok(listener) => {
            drop(listener);
            Ok(())
        }
        Err(e) => bail!(
            "port {port} for {name} is in use ({e}): stop whatever listens there, or pick \
             another port with --plughost-port / --llama-port / --ik-llama-port"
        ),
    }
}

/// A plain HTTP/1.0 GET on localhost: (status, body). The servers are local and the requests
/// are two (health, metrics), so a client library is not worth it.
pub fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let timeout = Duration::from_secs(5);
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("not an HTTP response from {path}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    Ok((status, body))
}

/// The last `lines` lines of a log, for error messages.
pub fn log_tail(path: &Path, lines: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// `path` relative to the workspace root when it is inside it, so reports carry no machine paths.
pub fn display_path(path: &Path, root: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .to_string_lossy()
        .into_owned()
}

/// Quotes a word for a POSIX shell when it needs it.
pub fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// `pid` and its descendants, parents first; processes that ended meanwhile are left out.
fn process_tree(pid: u32) -> Vec<u32> {
    let mut tree = vec![pid];
    let mut next = 0;
    while next < tree.len() {
        let parent = tree[next];
        next += 1;
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{parent}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            tree.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            );
        }
    }
    tree
}

/// The peak resident memory (VmHWM) of one process.
fn peak_rss_of(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .with_context(|| format!("{path} has no VmHWM line"))?;
    let kib: u64 = line
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .with_context(|| format!("cannot read VmHWM {line:?} in {path}"))?;
    Ok(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_servers_tree_holds_its_children_and_their_memory() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep starts");
        let tree = process_tree(std::process::id());
        assert_eq!(tree[0], std::process::id());
        assert!(tree.contains(&child.id()), "{tree:?} lacks {}", child.id());
        let own = peak_rss_of(std::process::id()).unwrap();
        let both = peak_rss_of(std::process::id()).unwrap() + peak_rss_of(child.id()).unwrap();
        assert!(own > 0 && both > own);
        child.kill().ok();
        child.wait().ok();
    }

    #[test]
    fn words_are_quoted_only_when_needed() {
        assert_eq!(shell_word("--port"), "--port");
        assert_eq!(shell_word("threads=2"), "threads=2");
        assert_eq!(shell_word("a b"), "'a b'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
    }

    #[test]
    fn a_busy_port_is_a_clear_error() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let err = ensure_port_free(port, "test").unwrap_err().to_string();
        assert!(err.contains("is in use"), "{err}");
    }

    #[test]
    fn the_log_tail_keeps_the_last_lines() {
        let path = std::env::temp_dir().join(format!("xtask-compare-tail-{}", std::process::id()));
        std::fs::write(&path, "a\nb\nc\n").unwrap();
        assert_eq!(log_tail(&path, 2), "b\nc");
        std::fs::remove_file(&path).ok();
        assert!(log_tail(&path, 2).contains("cannot read"));
    }
}
