//! The HTTP layer's guards on the real `plughost serve` over real sockets, on the mock device:
//! API keys, JSON-only bodies, CORS, an OpenAI error body on every error, the body limit,
//! admission with 429, OpenAI's `max_tokens` defaults, and request ids.

mod access;
mod admission;
mod errors;
mod requests;

use crate::serve_support::{free_port, plugins_dir, workspace};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

const MODEL: &str = "tiny-qwen3";
/// Far beyond the second or so the tiny model takes to load on the mock device in a debug build.
const DEADLINE: Duration = Duration::from_secs(120);
/// How long a test waits for a freed admission slot: the permit comes back within milliseconds
/// of the response's end.
const SLOT_DEADLINE: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(100);

/// `plughost serve` on the tiny model and the mock device, with its stderr collected.
struct Server {
    child: Child,
    port: u16,
    base: String,
    log: Arc<Mutex<String>>,
}

#[derive(Default)]
struct Launch<'a> {
    args: &'a [&'a str],
    env: &'a [(&'a str, &'a str)],
    device_config: &'a str,
}

fn serve_command(port: u16, launch: &Launch<'_>) -> Command {
    let plugins = plugins_dir();
    let mut command = Command::new(env!("CARGO_BIN_EXE_plughost"));
    command
        .args(["serve", "--model"])
        .arg(workspace().join("tests/fixtures").join(MODEL))
        .arg("--device")
        .arg(plugins.join("libplughost_device_mock.so"))
        .args(["--device-config", launch.device_config])
        .args(["--port", &port.to_string(), "--num-kv-blocks", "64"])
        .arg("--plugins-dir")
        .arg(&plugins)
        .arg("--component-cache")
        .arg(std::env::temp_dir().join("plughost-test-component-cache"))
        .args(launch.args)
        .env_remove("PLUGHOST_API_KEY")
        .env("RUST_LOG", "info,plughost=debug")
        .envs(launch.env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    command
}

impl Server {
    fn start(args: &[&str]) -> Server {
        Server::launch(Launch {
            args,
            ..Launch::default()
        })
    }

    fn launch(launch: Launch<'_>) -> Server {
        let port = free_port();
        let mut child = serve_command(port, &launch)
            .spawn()
            .expect("plughost starts");
        let log = Arc::new(Mutex::new(String::new()));
        if let Some(mut stderr) = child.stderr.take() {
            let log = log.clone();
            std::thread::spawn(move || {
                let mut buffer = [0u8; 8192];
                while let Ok(n) = stderr.read(&mut buffer) {
                    if n == 0 {
                        break;
                    }
                    if let Ok(mut log) = log.lock() {
                        log.push_str(&String::from_utf8_lossy(&buffer[..n]));
                    }
                }
            });
        }
        let mut server = Server {
            child,
            port,
            base: format!("http://127.0.0.1:{port}"),
            log,
        };
        server.wait_healthy();
        server
    }

    fn wait_healthy(&mut self) {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("poll plughost") {
                panic!("plughost serve exited ({status}):\n{}", self.log());
            }
            if health_status(self.port).is_some_and(|line| line.contains(" 200 ")) {
                return;
            }
            assert!(
                started.elapsed() < DEADLINE,
                "/health never answered 200:\n{}",
                self.log()
            );
            std::thread::sleep(POLL);
        }
    }

    /// Everything the server logged so far, without colours.
    fn log(&self) -> String {
        let text = self.log.lock().map(|l| l.clone()).unwrap_or_default();
        strip_ansi(&text)
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The status line of `GET /health`, or `None` while nothing listens.
fn health_status(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(DEADLINE)).ok()?;
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response.lines().next().map(str::to_string)
}

/// Runs `plughost serve` with flags it must refuse; its exit status and stderr.
fn run_to_exit(args: &[&str]) -> (ExitStatus, String) {
    let mut child = serve_command(
        free_port(),
        &Launch {
            args,
            ..Launch::default()
        },
    )
    .spawn()
    .expect("plughost starts");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll plughost") {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("plughost serve {args:?} kept running");
        }
        std::thread::sleep(POLL);
    };
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    (status, strip_ansi(&stderr))
}

/// Writes `request` on a fresh connection and reads until the server closes it or `DEADLINE`.
fn raw_exchange(port: u16, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream.set_read_timeout(Some(DEADLINE)).expect("timeout");
    // The server may answer and close before taking everything (an oversize body).
    let _ = stream.write_all(request);
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    String::from_utf8_lossy(&response).into_owned()
}

fn header<'a>(response: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    response.headers().get(name).and_then(|v| v.to_str().ok())
}

/// What is wrong with an error response: not the status, not JSON, or not OpenAI's shape.
async fn error_problems(
    response: reqwest::Response,
    status: u16,
    code: Option<&str>,
) -> (Vec<String>, Value) {
    let mut problems = Vec::new();
    if response.status().as_u16() != status {
        problems.push(format!("status {}, expected {status}", response.status()));
    }
    let content_type = header(&response, "content-type").unwrap_or("").to_string();
    if !content_type.starts_with("application/json") {
        problems.push(format!("content type {content_type:?}"));
    }
    if header(&response, "x-request-id").is_none() {
        problems.push("no x-request-id".into());
    }
    let text = response.text().await.unwrap_or_default();
    let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let error = &body["error"];
    if error["message"].as_str().is_none_or(str::is_empty) {
        problems.push(format!("no error.message in {text:?}"));
    }
    if !error["type"].is_string() {
        problems.push("no error.type".into());
    }
    if !error
        .as_object()
        .is_some_and(|e| e.contains_key("param") && e.contains_key("code"))
    {
        problems.push("error.param or error.code missing".into());
    }
    if let Some(code) = code
        && error["code"].as_str() != Some(code)
    {
        problems.push(format!("code {:?}, expected {code:?}", error["code"]));
    }
    (problems, body)
}

async fn assert_error(response: reqwest::Response, status: u16, code: Option<&str>) -> Value {
    let (problems, body) = error_problems(response, status, code).await;
    assert!(problems.is_empty(), "{problems:?}: {body}");
    body
}

fn completion_body(max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": "Hello, the", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

fn chat_body() -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0})
}
