//! Shared by the tests that run `plughost serve`: starting it (on the mock device unless told otherwise), raw HTTP/1 over sockets, signals and exit.

#![allow(dead_code)]

pub mod deployment;
pub mod kit;

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Far beyond the second or so the tiny fixture takes to load in a debug build.
pub const LOAD_DEADLINE: Duration = Duration::from_secs(120);

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn plugins_dir() -> PathBuf {
    let dir = std::env::var_os("PLUGHOST_PLUGINS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/plugins"));
    assert!(
        dir.join("libplughost_device_mock.so").is_file(),
        "{} lacks the plugins: run `cargo xtask build-plugins`",
        dir.display()
    );
    dir
}

/// Ports [`free_port`] hands out: below Linux's ephemeral range (32768 up), from which client
/// sockets take theirs. A port the system picked from that range could go to another test's
/// connection between the check and the server's own bind ("Address already in use").
const TEST_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A port nothing listens on now and that no other test of this process was given.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = u32::from(TEST_PORTS.end - TEST_PORTS.start);
    // Spread the test binaries, which run one after another, over the span: a port an earlier
    // binary's server just closed may still have connections in TIME_WAIT.
    let first = std::process::id().wrapping_mul(7919);
    for _ in 0..span {
        let offset = first.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = TEST_PORTS.start + offset as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {TEST_PORTS:?}");
}

/// `plughost serve` on the tiny Qwen3 fixture and the mock device, ready to answer.
pub struct Server {
    pub child: Child,
    pub port: u16,
    stderr_lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Server {
    pub fn start(flags: &[&str]) -> Server {
        Server::start_on("libplughost_device_mock.so", flags)
    }

    /// `plughost serve` on `device`, a device library in the plugins folder.
    pub fn start_on(device: &str, flags: &[&str]) -> Server {
        Server::start_with_env(device, flags, &[])
    }

    /// [`Server::start_on`] with `env` added to the server's environment.
    pub fn start_with_env(device: &str, flags: &[&str], env: &[(&str, &str)]) -> Server {
        let plugins = plugins_dir();
        let port = free_port();
        let mut child = Command::new(env!("CARGO_BIN_EXE_plughost"))
            .arg("serve")
            .arg("--model")
            .arg(workspace().join("tests/fixtures/tiny-qwen3"))
            .arg("--device")
            .arg(plugins.join(device))
            .arg("--plugins-dir")
            .arg(&plugins)
            .arg("--component-cache")
            .arg(std::env::temp_dir().join("plughost-test-component-cache"))
            .args(["--port", &port.to_string()])
            .args(flags)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("plughost starts");
        let (send, stderr_lines) = std::sync::mpsc::channel();
        let stderr = Arc::new(Mutex::new(String::new()));
        let pipe = child.stderr.take().expect("stderr is piped");
        let all = stderr.clone();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(std::io::BufReader::new(pipe)) {
                let Ok(line) = line else { break };
                if let Ok(mut all) = all.lock() {
                    all.push_str(&line);
                    all.push('\n');
                }
                let _ = send.send(line);
            }
        });
        let mut server = Server {
            child,
            port,
            stderr_lines,
            stderr,
        };
        let started = Instant::now();
        loop {
            if let Some(status) = server.child.try_wait().expect("poll plughost") {
                panic!("plughost serve exited ({status}): {}", server.stderr());
            }
            if server.try_get("/health").is_some_and(|r| r.status == 200) {
                return server;
            }
            assert!(
                started.elapsed() < LOAD_DEADLINE,
                "/health never answered 200"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `http://127.0.0.1:PORT`, for HTTP clients.
    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn connect(&self) -> TcpStream {
        TcpStream::connect(("127.0.0.1", self.port)).expect("connect")
    }

    pub fn try_get(&self, path: &str) -> Option<Response> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .ok()?;
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).ok()?;
        read_response(&mut stream)
    }

    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args(["-s", name, &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -s {name} failed");
    }

    /// Waits for a line of the server's log containing `text`.
    pub fn wait_for_log(&self, text: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stderr_lines.recv_timeout(left) {
                Ok(line) if line.contains(text) => return,
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                    panic!(
                        "no log line with {text:?} within {within:?}:\n{}",
                        self.stderr()
                    )
                }
            }
        }
    }

    /// The exit status, once the process has ended; panics after `within`.
    pub fn wait_exit(&mut self, within: Duration) -> (ExitStatus, Duration) {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("poll plughost") {
                return (status, started.elapsed());
            }
            if started.elapsed() > within {
                let _ = self.child.kill();
                panic!(
                    "plughost still running {within:?} after the signal:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Response {
    pub status: u16,
    pub body: String,
}

/// Reads one response with a `Content-Length` body (every non-streaming response here).
pub fn read_response(stream: &mut TcpStream) -> Option<Response> {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = find(&data, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&data[..end]).to_string();
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .unwrap_or(0);
            if data.len() >= end + 4 + length {
                let status = head.split(' ').nth(1)?.parse().ok()?;
                let body = String::from_utf8_lossy(&data[end + 4..end + 4 + length]).to_string();
                return Some(Response { status, body });
            }
        }
        let n = stream.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        data.extend_from_slice(&buf[..n]);
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A keep-alive `GET /health` on an open connection.
pub fn get_health(stream: &mut TcpStream) -> Option<Response> {
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    read_response(stream)
}

/// Whether the server has closed `stream`: end of file or a reset, seen without blocking.
pub fn is_closed(stream: &TcpStream) -> bool {
    let _ = stream.set_nonblocking(true);
    let mut buf = [0u8; 1];
    let closed = match stream.peek(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) if e.kind() == ErrorKind::WouldBlock => false,
        Err(_) => true,
    };
    let _ = stream.set_nonblocking(false);
    closed
}

/// Polls until the server closes `stream`; false if it is still open after `within`.
pub fn closes_within(stream: &TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if is_closed(stream) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}
