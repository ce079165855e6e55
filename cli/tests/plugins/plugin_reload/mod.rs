//! Hot deployments on the real `plughost serve` over real sockets, on the mock device: reloads
//! under load lose nothing, failed reloads change nothing, the admin key guards `/admin`, and
//! SIGHUP, file writes and Kubernetes' symlink swap all reload.

mod admin;
mod generations;
mod startup;
mod triggers;
mod under_load;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::serve_support::deployment::{
    component, deployment_status, metric, metrics, reload, write_file,
};
use crate::serve_support::{free_port, plugins_dir, workspace};

const MODEL: &str = "tiny-qwen3";
/// Far beyond the second or so the tiny model takes to load on the mock device in a debug build.
const DEADLINE: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(100);
const ADMIN_KEY: &str = "admin-secret";
const STREAMS: usize = 16;
const STREAM_TOKENS: u32 = 480;

fn plugin(file: &str) -> String {
    plugins_dir().join(file).display().to_string()
}

/// A fresh scratch folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("plughost-reload-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch folder");
    dir
}

/// A deployment file's text naming the given scheduler and sampler components and configs.
fn deployment(scheduler: &str, scheduler_config: &str, sampler: &str) -> String {
    format!(
        "[scheduler]\ncomponent = \"{}\"\nconfig = {scheduler_config}\n\n[sampler]\ncomponent = \"{}\"\n",
        plugin(scheduler),
        plugin(sampler)
    )
}

fn fcfs() -> String {
    deployment(
        "plughost_scheduler_fcfs.wasm",
        "{}",
        "plughost_sampler_standard.wasm",
    )
}

/// The faulty test scheduler, and the standard sampler under other limits: a new sampler
/// instance, so requests in flight and new ones sample with different instances. The faulty
/// scheduler plans every request, so with more streams than seats its plans are refused, each
/// a fault; a high `max_faults` keeps it from being backed off here.
fn faulty() -> String {
    format!(
        "{}call_timeout_ms = 400\n",
        deployment(
            "plughost_scheduler_faulty.wasm",
            "{}\nmax_faults = 1000000",
            "plughost_sampler_standard.wasm",
        )
    )
}

struct Server {
    child: Child,
    base: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    fn command(port: u16, args: &[&str]) -> Command {
        let plugins = plugins_dir();
        let mut command = Command::new(env!("CARGO_BIN_EXE_plughost"));
        command
            .args(["serve", "--model"])
            .arg(workspace().join("tests/fixtures").join(MODEL));
        if !args.contains(&"--device") {
            command
                .arg("--device")
                .arg(plugins.join("libplughost_device_mock.so"));
        }
        command
            .args(["--port", &port.to_string(), "--num-kv-blocks", "1024"])
            .args(["--max-num-seqs", "16"])
            .arg("--plugins-dir")
            .arg(&plugins);
        if !args.contains(&"--component-cache") {
            command
                .arg("--component-cache")
                .arg(std::env::temp_dir().join("plughost-test-component-cache"));
        }
        command
            .args(args)
            .env_remove("PLUGHOST_API_KEY")
            .env_remove("PLUGHOST_ADMIN_KEY")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        command
    }

    fn start(args: &[&str]) -> Server {
        let port = free_port();
        let mut child = Server::command(port, args)
            .spawn()
            .expect("plughost starts");
        let log = collect_stderr(&mut child);
        let mut server = Server {
            child,
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
            if health_is_ok(&self.base) {
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

    fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `GET /health` answers 200 now.
fn health_is_ok(base: &str) -> bool {
    use std::io::Write;
    let Some(addr) = base.strip_prefix("http://") else {
        return false;
    };
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    if stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.lines().next().is_some_and(|l| l.contains(" 200 "))
}

fn collect_stderr(child: &mut Child) -> Arc<Mutex<String>> {
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
    log
}

fn prompt(i: usize) -> Vec<u32> {
    (0..8)
        .map(|t| ((t * 31 + i as u32 * 7) % 400) + 1)
        .collect()
}

fn completion_body(i: usize, stream: bool) -> Value {
    json!({
        "model": MODEL, "prompt": prompt(i), "max_tokens": STREAM_TOKENS,
        "temperature": 0, "ignore_eos": true, "stream": stream,
    })
}

/// The whole text of a non-streamed greedy completion of prompt `i`.
async fn complete(client: &reqwest::Client, base: &str, i: usize) -> String {
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&completion_body(i, false))
        .send()
        .await
        .expect("completion sent");
    assert_eq!(response.status(), StatusCode::OK);
    let body: Value = response.json().await.expect("completion JSON");
    body["choices"][0]["text"]
        .as_str()
        .expect("completion text")
        .to_string()
}

/// Streams prompt `i`; calls `started` after the first token. Returns the text, the finish
/// reason, and whether `[DONE]` ended the stream.
async fn stream(
    client: reqwest::Client,
    base: String,
    i: usize,
    started: Arc<tokio::sync::Semaphore>,
) -> (String, Option<String>, bool) {
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&completion_body(i, true))
        .send()
        .await
        .expect("stream sent");
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.bytes_stream();
    let (mut pending, mut text, mut finish, mut done) = (String::new(), String::new(), None, false);
    let mut first = true;
    while let Some(chunk) = body.next().await {
        pending.push_str(&String::from_utf8_lossy(&chunk.expect("stream chunk")));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let value: Value = serde_json::from_str(data).expect("an SSE JSON chunk");
            assert!(value.get("error").is_none(), "stream {i} failed: {value}");
            text.push_str(value["choices"][0]["text"].as_str().unwrap_or(""));
            if let Some(reason) = value["choices"][0]["finish_reason"].as_str() {
                finish = Some(reason.to_string());
            }
            if first {
                first = false;
                started.add_permits(1);
            }
        }
    }
    (text, finish, done)
}
