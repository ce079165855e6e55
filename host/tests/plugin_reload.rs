//! Hot deployments on the real `plughost serve` over real sockets, on the mock device: reloads
//! under load lose nothing, failed reloads change nothing, the admin key guards `/admin`, and
//! SIGHUP, file writes and Kubernetes' symlink swap all reload.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};

mod serve_support;

use serve_support::deployment::{
    component, deployment_status, metric, metrics, reload, write_file,
};
use serve_support::{free_port, plugins_dir, workspace};

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

/// 16 greedy streams run while the deployment is reloaded from FCFS to another scheduler:
/// every stream finishes whole, token-identical to a run without the reload; the new
/// scheduler decides what follows; the listing and the metrics show its hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_under_load_cuts_no_stream_and_the_new_scheduler_takes_over() {
    reload_under_load("libplughost_device_mock.so").await;
}

/// The same on the CPU device, whose greedy tokens are the same alone and in any batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_under_load_on_the_cpu_device_cuts_no_stream() {
    reload_under_load("libplughost_device_cpu.so").await;
}

async fn reload_under_load(device: &str) {
    let dir = scratch(&format!("under-load-{device}"));
    let config = dir.join("deploy.toml");
    write_file(&config, &fcfs());
    let config_arg = config.display().to_string();
    let device_arg = plugin(device);
    let server = Server::start(&[
        "--config",
        &config_arg,
        "--admin-key",
        ADMIN_KEY,
        "--device",
        &device_arg,
    ]);
    let client = reqwest::Client::new();
    let base = server.base.clone();

    let mut reference = Vec::new();
    for i in 0..STREAMS {
        reference.push(complete(&client, &base, i).await);
    }
    let before = deployment_status(&client, &base, ADMIN_KEY).await;
    assert_eq!(before["generation"], 1);
    let fcfs_hash = component(&before, "scheduler")["sha256"].clone();

    // A request the faulty scheduler refuses to plan (priority -1004): FCFS runs it as any other.
    let idle = json!({"model": MODEL, "prompt": prompt(0), "max_tokens": 2, "priority": -1004, "temperature": 0});
    let fallbacks = |text: &str| metric(text, "plughost_scheduler_fallbacks_total").unwrap_or(0.0);
    let before_idle = fallbacks(&metrics(&client, &base).await);
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&idle)
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        fallbacks(&metrics(&client, &base).await),
        before_idle,
        "FCFS plans it"
    );

    let started = Arc::new(tokio::sync::Semaphore::new(0));
    let streams: Vec<_> = (0..STREAMS)
        .map(|i| tokio::spawn(stream(client.clone(), base.clone(), i, started.clone())))
        .collect();
    // Every stream has its first token before the reload begins.
    let all_started = started.acquire_many(STREAMS as u32);
    tokio::time::timeout(DEADLINE, all_started)
        .await
        .expect("every stream starts")
        .expect("the semaphore stays open")
        .forget();
    write_file(&config, &faulty());
    let (status, report) = reload(&client, &base, ADMIN_KEY).await;
    assert_eq!(status, StatusCode::OK, "{report}\n{}", server.log());
    assert_eq!(report["generation"], 2, "{report}");
    let still_running = streams.iter().filter(|s| !s.is_finished()).count();
    eprintln!(
        "reload: {} ms ({} ms building); {still_running} of {STREAMS} streams were still running",
        report["reload_ms"], report["build_ms"]
    );
    // Requests that started under generation 1 hold it, and keep sampling with its sampler.
    let during = deployment_status(&client, &base, ADMIN_KEY).await;
    let draining = during["draining"].as_array().cloned().unwrap_or_default();
    eprintln!("draining right after the reload: {}", draining.len());
    if let Some(old) = draining.first() {
        assert_eq!(old["generation"], 1, "{during}");
        assert_eq!(component(old, "sampler")["generation"], 1, "{during}");
    }
    // New streams while the old ones run: steps sample rows of both generations, each with
    // its own sampler instance.
    let after_reload = Arc::new(tokio::sync::Semaphore::new(0));
    let new_streams: Vec<_> = (0..4)
        .map(|i| {
            tokio::spawn(stream(
                client.clone(),
                base.clone(),
                i,
                after_reload.clone(),
            ))
        })
        .collect();

    for (i, handle) in streams.into_iter().enumerate() {
        let (text, finish, done) = tokio::time::timeout(DEADLINE, handle)
            .await
            .expect("the stream ends")
            .expect("the stream task");
        assert!(done, "stream {i} ended without [DONE]");
        assert_eq!(finish.as_deref(), Some("length"), "stream {i}");
        assert_eq!(
            text, reference[i],
            "stream {i} differs from the run without a reload"
        );
    }
    for (i, handle) in new_streams.into_iter().enumerate() {
        let (text, finish, done) = tokio::time::timeout(DEADLINE, handle)
            .await
            .expect("the stream ends")
            .expect("the stream task");
        assert!(
            done && finish.as_deref() == Some("length"),
            "new stream {i}"
        );
        assert_eq!(
            text, reference[i],
            "new stream {i} under the new deployment"
        );
    }

    // Generation 1 is freed once its last request has ended.
    let started_waiting = Instant::now();
    let after = loop {
        let listing = deployment_status(&client, &base, ADMIN_KEY).await;
        if listing["draining"].as_array().is_some_and(|d| d.is_empty()) {
            break listing;
        }
        assert!(
            started_waiting.elapsed() < DEADLINE,
            "generation 1 outlived its requests: {listing}"
        );
        tokio::time::sleep(POLL).await;
    };
    assert_eq!(after["generation"], 2);
    let scheduler = component(&after, "scheduler");
    assert_ne!(scheduler["sha256"], fcfs_hash);
    assert_eq!(scheduler["generation"], 2);
    assert_eq!(scheduler["state"], "active");
    assert!(
        scheduler["file"]
            .as_str()
            .is_some_and(|f| f.ends_with("plughost_scheduler_faulty.wasm"))
    );
    let sampler = component(&after, "sampler");
    assert_eq!(
        sampler["generation"], 2,
        "new limits make a new sampler instance"
    );
    assert!(
        sampler["calls"].as_u64() > Some(0),
        "the new sampler sampled: {after}"
    );
    assert_eq!(sampler["faults"], 0);

    // New requests meet the new scheduler: it plans nothing for this one, the host falls back.
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&idle)
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), StatusCode::OK);
    let text = metrics(&client, &base).await;
    assert!(
        fallbacks(&text) > before_idle,
        "the faulty scheduler decided:\n{text}"
    );
    assert_eq!(metric(&text, "plughost_deployment_generation"), Some(2.0));
    assert_eq!(
        metric(&text, "plughost_sampler_fallbacks_total"),
        Some(0.0),
        "no row lost its sampler"
    );
    assert_eq!(
        metric(&text, "plughost_deployment_reloads_total{result=\"ok\"}"),
        Some(1.0)
    );
    let info = format!(
        "plughost_plugin_info{{component=\"{}\",sha256={},slot=\"scheduler\",wit_version=\"0.1.0\"}}",
        scheduler["file"].as_str().unwrap_or(""),
        scheduler["sha256"]
    );
    assert_eq!(metric(&text, &info), Some(1.0), "{info} in\n{text}");
    assert!(
        !text.contains(fcfs_hash.as_str().unwrap_or("-")),
        "the old hash is gone:\n{text}"
    );
    // The greedy outputs of new requests are unchanged under the new scheduler.
    assert_eq!(complete(&client, &base, 3).await, reference[3]);
}

/// Reloads that cannot work answer 422 naming the component and the cause, and the running
/// deployment goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_reload_answers_422_and_changes_nothing() {
    let dir = scratch("failures");
    let config = dir.join("deploy.toml");
    write_file(&config, &fcfs());
    let config_arg = config.display().to_string();
    let server = Server::start(&["--config", &config_arg, "--admin-key", ADMIN_KEY]);
    let client = reqwest::Client::new();
    let base = server.base.clone();
    let before = deployment_status(&client, &base, ADMIN_KEY).await;

    let cases: [(&str, String, &str, &[&str]); 6] = [
        (
            "init trap",
            deployment(
                "plughost_scheduler_faulty.wasm",
                "{ trap_in_init = true }",
                "plughost_sampler_standard.wasm",
            ),
            "component_failed",
            &["[scheduler]", "plughost_scheduler_faulty.wasm", "trap"],
        ),
        (
            "wrong world",
            deployment(
                "plughost_scheduler_fcfs.wasm",
                "{}",
                "plughost_scheduler_fcfs.wasm",
            ),
            "component_failed",
            &[
                "[sampler]",
                "plughost_scheduler_fcfs.wasm exports the scheduler world; \
                 the [sampler] slot needs sampler",
            ],
        ),
        (
            "other contract version",
            other_version_deployment(&dir),
            "component_failed",
            &[
                "[sampler]",
                "was built for plughost:plugin@0.2.0; this host speaks 0.1.x",
            ],
        ),
        (
            "missing file",
            deployment(
                "plughost_scheduler_nowhere.wasm",
                "{}",
                "plughost_sampler_standard.wasm",
            ),
            "component_failed",
            &[
                "[scheduler]",
                "plughost_scheduler_nowhere.wasm",
                "cannot read",
            ],
        ),
        (
            "TOML error",
            "[scheduler\ncomponent = 1".to_string(),
            "invalid_deployment_file",
            &["deploy.toml"],
        ),
        (
            "glue change",
            format!(
                "{}\n[glue]\ncomponent = \"{}\"\n",
                fcfs(),
                plugin("plughost_sampler_standard.wasm")
            ),
            "glue_changed",
            &["model glue", "restart"],
        ),
    ];
    for (n, (name, text, code, needles)) in cases.iter().enumerate() {
        write_file(&config, text);
        let (status, body) = reload(&client, &base, ADMIN_KEY).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{name}: {body}");
        assert_eq!(body["error"]["code"], *code, "{name}: {body}");
        let message = body["error"]["message"].as_str().unwrap_or("");
        for needle in *needles {
            assert!(
                message.contains(needle),
                "{name}: {needle:?} not in {message:?}"
            );
        }
        let text = metrics(&client, &base).await;
        assert_eq!(
            metric(&text, "plughost_deployment_reloads_total{result=\"error\"}"),
            Some((n + 1) as f64),
            "{name}"
        );
        let now = deployment_status(&client, &base, ADMIN_KEY).await;
        assert_eq!(now["generation"], 1, "{name}");
        assert_eq!(
            component(&now, "scheduler")["sha256"],
            component(&before, "scheduler")["sha256"]
        );
        assert!(
            !complete(&client, &base, n).await.is_empty(),
            "{name}: still serving"
        );
    }
    assert!(
        server.log().contains("deployment reload failed"),
        "{}",
        server.log()
    );
}

/// `/admin` is closed (403, saying how to open it) without an admin key, and needs that key,
/// not an API key, with one; a reload without `--config` says how to enable it.
/// A completion that names `sampler`: the status and the JSON body.
async fn complete_with_sampler(
    client: &reqwest::Client,
    base: &str,
    sampler: &str,
) -> (StatusCode, Value) {
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt(0), "max_tokens": 4, "sampler": sampler}))
        .send()
        .await
        .expect("completion sent");
    let status = response.status();
    (status, response.json().await.expect("a JSON body"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_samplers_are_listed_chosen_by_requests_and_reloaded() {
    let dir = scratch("named-samplers");
    let config = dir.join("deploy.toml");
    let banned = format!(
        "[samplers.no-repeat]\ncomponent = \"{}\"\nconfig = {{ banned_token_ids = [1] }}\n",
        plugin("plughost_sampler_banned.wasm")
    );
    write_file(&config, &format!("{}\n{banned}", fcfs()));
    let config_arg = config.display().to_string();
    let server = Server::start(&["--config", &config_arg, "--admin-key", ADMIN_KEY]);
    let client = reqwest::Client::new();
    let base = server.base.clone();

    let listing = deployment_status(&client, &base, ADMIN_KEY).await;
    assert_eq!(
        listing["samplers"],
        json!(["default", "no-repeat"]),
        "{listing}"
    );
    assert_eq!(listing["default_sampler"], "default");
    let named: Vec<&Value> = listing["components"]
        .as_array()
        .expect("components")
        .iter()
        .filter(|c| c["slot"] == "sampler")
        .collect();
    assert_eq!(named.len(), 2, "{listing}");
    assert_eq!(named[0]["name"], "default");
    assert_eq!(named[0]["default"], true);
    assert_eq!(named[1]["name"], "no-repeat");
    assert!(
        named[1]["file"]
            .as_str()
            .is_some_and(|f| f.ends_with("plughost_sampler_banned.wasm"))
    );

    for name in ["default", "no-repeat"] {
        let (status, body) = complete_with_sampler(&client, &base, name).await;
        assert_eq!(status, StatusCode::OK, "{name}: {body}");
    }
    let (status, body) = complete_with_sampler(&client, &base, "creative").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["code"], "unknown_sampler");
    assert_eq!(body["error"]["param"], "sampler");
    assert_eq!(
        body["error"]["message"],
        "unknown sampler `creative`; this deployment has: default, no-repeat"
    );

    // A reload adds a sampler and makes it the default; requests may name it at once.
    let creative = banned.replace("no-repeat", "creative");
    write_file(
        &config,
        &format!(
            "default_sampler = \"creative\"\n{}\n{banned}\n{creative}",
            fcfs()
        ),
    );
    let (status, report) = reload(&client, &base, ADMIN_KEY).await;
    assert_eq!(status, StatusCode::OK, "{report}");
    let listing = deployment_status(&client, &base, ADMIN_KEY).await;
    assert_eq!(
        listing["samplers"],
        json!(["default", "creative", "no-repeat"]),
        "{listing}"
    );
    assert_eq!(listing["default_sampler"], "creative");
    let (status, body) = complete_with_sampler(&client, &base, "creative").await;
    assert_eq!(status, StatusCode::OK, "{body}");

    // A file whose default names no sampler is refused, naming it; nothing changes.
    write_file(&config, &format!("default_sampler = \"bold\"\n{}", fcfs()));
    let (status, error) = reload(&client, &base, ADMIN_KEY).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{error}");
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("default_sampler = \"bold\" names no sampler"),
        "{message}"
    );
    let after = deployment_status(&client, &base, ADMIN_KEY).await;
    assert_eq!(after["default_sampler"], "creative");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_routes_need_the_admin_key() {
    let client = reqwest::Client::new();
    {
        let server = Server::start(&[]);
        for (method, path) in [
            (reqwest::Method::GET, "/admin/deployment"),
            (reqwest::Method::POST, "/admin/reload"),
        ] {
            let response = client
                .request(method, format!("{}{path}", server.base))
                .bearer_auth(ADMIN_KEY)
                .send()
                .await
                .expect("sent");
            assert_eq!(response.status(), StatusCode::FORBIDDEN, "{path}");
            let body: Value = response.json().await.expect("JSON");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("--admin-key")),
                "{body}"
            );
        }
    }
    let server = Server::start(&["--admin-key", ADMIN_KEY, "--api-key", "sk-api"]);
    let url = format!("{}/admin/deployment", server.base);
    for key in [None, Some("wrong"), Some("sk-api")] {
        let mut request = client.get(&url);
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.expect("sent");
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{key:?}");
        let body: Value = response.json().await.expect("JSON");
        assert_eq!(body["error"]["type"], "authentication_error");
    }
    let listing = deployment_status(&client, &server.base, ADMIN_KEY).await;
    assert_eq!(listing["generation"], 1);
    for slot in ["scheduler", "sampler"] {
        let c = component(&listing, slot);
        assert_eq!(c["world"], slot);
        assert_eq!(c["wit_version"], "0.1.0");
        assert_eq!(c["sha256"].as_str().map(str::len), Some(64));
        assert_eq!(c["state"], "active");
    }
    // The admin key does not open the API.
    let response = client
        .get(format!("{}/v1/models", server.base))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let (status, body) = reload(&client, &server.base, ADMIN_KEY).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--config")),
        "{body}"
    );
    assert!(
        server.log().contains("loaded plugin component"),
        "{}",
        server.log()
    );
}

async fn wait_for_generation(client: &reqwest::Client, server: &Server, generation: u64) -> Value {
    let started = Instant::now();
    loop {
        let listing = deployment_status(client, &server.base, ADMIN_KEY).await;
        if listing["generation"].as_u64() >= Some(generation) {
            return listing;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "generation {generation} never came: {listing}\n{}",
            server.log()
        );
        tokio::time::sleep(POLL).await;
    }
}

/// SIGHUP reloads (and no longer kills the server); with `--watch-config` a rewritten file
/// reloads by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_and_a_rewritten_file_reload() {
    let dir = scratch("sighup");
    let config = dir.join("deploy.toml");
    write_file(&config, &fcfs());
    let config_arg = config.display().to_string();
    let server = Server::start(&[
        "--config",
        &config_arg,
        "--admin-key",
        ADMIN_KEY,
        "--watch-config",
    ]);
    let client = reqwest::Client::new();
    let status = Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let listing = wait_for_generation(&client, &server, 2).await;
    for slot in ["scheduler", "sampler"] {
        assert_eq!(
            component(&listing, slot)["generation"],
            1,
            "unchanged {slot} is kept: {listing}"
        );
    }
    write_file(&config, &faulty());
    let listing = wait_for_generation(&client, &server, 3).await;
    let scheduler = component(&listing, "scheduler");
    assert!(
        scheduler["file"]
            .as_str()
            .is_some_and(|f| f.ends_with("plughost_scheduler_faulty.wasm")),
        "{listing}"
    );
    assert!(!complete(&client, &server.base, 1).await.is_empty());
}

/// A Kubernetes ConfigMap volume: the file is a symlink through `..data`, which is swapped to
/// a new folder in one rename. The watch sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_symlink_swap_reloads() {
    let dir = scratch("configmap");
    let first = dir.join("..2026_01_01_first");
    std::fs::create_dir_all(&first).expect("first folder");
    std::fs::write(first.join("deploy.toml"), fcfs()).expect("first file");
    std::os::unix::fs::symlink("..2026_01_01_first", dir.join("..data")).expect("..data link");
    std::os::unix::fs::symlink("..data/deploy.toml", dir.join("deploy.toml")).expect("file link");
    let config_arg = dir.join("deploy.toml").display().to_string();
    let server = Server::start(&[
        "--config",
        &config_arg,
        "--admin-key",
        ADMIN_KEY,
        "--watch-config",
    ]);
    let client = reqwest::Client::new();

    let second = dir.join("..2026_01_02_second");
    std::fs::create_dir_all(&second).expect("second folder");
    std::fs::write(second.join("deploy.toml"), faulty()).expect("second file");
    std::os::unix::fs::symlink("..2026_01_02_second", dir.join("..data_tmp")).expect("tmp link");
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).expect("swap ..data");
    let listing = wait_for_generation(&client, &server, 2).await;
    let scheduler = component(&listing, "scheduler");
    assert!(
        scheduler["file"]
            .as_str()
            .is_some_and(|f| f.ends_with("plughost_scheduler_faulty.wasm")),
        "{listing}"
    );
}

/// A deployment that cannot start makes `serve` exit non-zero with the cause, not serve 503:
/// a trap in `init`, a component of the wrong world, one built for another contract version.
#[test]
fn serve_with_a_broken_deployment_exits_with_the_cause() {
    let dir = scratch("broken");
    let other_version = other_version_component(&dir);
    let cases = [
        (
            deployment(
                "plughost_scheduler_faulty.wasm",
                "{ trap_in_init = true }",
                "plughost_sampler_standard.wasm",
            ),
            vec!["[scheduler]".to_string(), "trap".to_string()],
        ),
        (
            deployment(
                "plughost_scheduler_fcfs.wasm",
                "{}",
                "plughost_scheduler_fcfs.wasm",
            ),
            vec![format!(
                "{} exports the scheduler world; the [sampler] slot needs sampler",
                plugin("plughost_scheduler_fcfs.wasm")
            )],
        ),
        (
            other_version_deployment(&dir),
            vec![format!(
                "component {} was built for plughost:plugin@0.2.0; this host speaks 0.1.x",
                other_version.display()
            )],
        ),
        (
            format!(
                "[sampler]\ncomponent = \"{}\"\n",
                renamed_field_component(&dir).display()
            ),
            vec![
                "[sampler]".to_string(),
                "record `sampling-params` of plughost:plugin/sampling@0.1.0 differs: field 4 is \
                 `min-p` in this host and `max-p` in the component"
                    .to_string(),
            ],
        ),
    ];
    for (n, (text, needles)) in cases.iter().enumerate() {
        let config = dir.join(format!("deploy-{n}.toml"));
        write_file(&config, text);
        let log = serve_until_exit(&["--config", &config.display().to_string()]);
        for needle in needles {
            assert!(
                log.contains("error:") && log.contains(needle.as_str()),
                "{needle:?} not in {log}"
            );
        }
    }
}

/// A device library of another ABI version makes `serve` exit non-zero naming both versions.
#[test]
fn serve_with_a_device_of_another_abi_exits_with_both_versions() {
    let device = plugin("libplughost_device_wrong_abi.so");
    let log = serve_until_exit(&["--device", &device]);
    let needle = format!("device library `{device}` speaks device ABI 999; this host speaks 1");
    assert!(log.contains(&needle), "{needle:?} not in {log}");
}

/// Runs `serve` with `args`, which must make it exit non-zero, and returns its stderr.
fn serve_until_exit(args: &[&str]) -> String {
    let started = Instant::now();
    let mut child = Server::command(free_port(), args)
        .spawn()
        .expect("plughost starts");
    let log = collect_stderr(&mut child);
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll plughost") {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("serve kept running with {args:?}");
        }
        std::thread::sleep(POLL);
    };
    eprintln!(
        "serve exited after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    std::thread::sleep(Duration::from_millis(200));
    let log = log.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(!status.success(), "{log}");
    log
}

/// A copy of the standard sampler whose import and export names say `plughost:plugin@0.2.0`:
/// the version string has the same length, so the rewritten component stays well formed.
fn other_version_component(dir: &Path) -> PathBuf {
    rewritten_sampler(
        dir,
        "sampler-0.2.0.wasm",
        b"plughost:plugin/sampling@0.1.0",
        b"plughost:plugin/sampling@0.2.0",
    )
}

/// A copy of the standard sampler whose `sampling-params` record names its fourth field
/// `max-p` where the contract says `min-p`: a record of another shape under the same version.
fn renamed_field_component(dir: &Path) -> PathBuf {
    rewritten_sampler(dir, "sampler-max-p.wasm", b"min-p", b"max-p")
}

/// The standard sampler with every `from` replaced by `to`, of the same length, in `dir`.
fn rewritten_sampler(dir: &Path, file: &str, from: &[u8], to: &[u8]) -> PathBuf {
    assert_eq!(from.len(), to.len());
    let bytes = std::fs::read(plugin("plughost_sampler_standard.wasm")).expect("the sampler");
    let mut out = bytes.clone();
    let mut replaced = 0;
    for start in 0..bytes.len().saturating_sub(from.len()) {
        if &bytes[start..start + from.len()] == from {
            out[start..start + to.len()].copy_from_slice(to);
            replaced += 1;
        }
    }
    assert!(
        replaced > 0,
        "the sampler holds {:?}",
        String::from_utf8_lossy(from)
    );
    let path = dir.join(file);
    std::fs::write(&path, out).expect("write the rewritten sampler");
    path
}

/// The fcfs scheduler with the sampler of `other_version_component`.
fn other_version_deployment(dir: &Path) -> String {
    format!(
        "[scheduler]\ncomponent = \"{}\"\n\n[sampler]\ncomponent = \"{}\"\n",
        plugin("plughost_scheduler_fcfs.wasm"),
        other_version_component(dir).display()
    )
}

/// `bytes` with a custom section appended: the same component under another hash, so the host
/// must compile it anew.
fn variant(bytes: &[u8], n: u32) -> Vec<u8> {
    let name = b"plughost-measure";
    let payload = n.to_le_bytes();
    let size = 1 + name.len() + payload.len();
    let mut out = bytes.to_vec();
    out.push(0);
    out.push(size as u8);
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(&payload);
    out
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * p).round() as usize]
}

fn median(mut values: Vec<f64>) -> f64 {
    percentile(&mut values, 0.5)
}

/// Reload timings under 16 streams, for docs/plugins.md: a reload that compiles a new
/// component, one that only instantiates an already compiled one, the swap, and the gap between
/// tokens (one engine step) at p99 outside and during reloads. Five alternating rounds, medians.
/// Run it on a release build:
/// `cargo test --release -p plughost --test plugin_reload -- --ignored --nocapture reload_timings`
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a measurement, not a check; run it on a release build"]
async fn reload_timings() {
    const ROUNDS: u32 = 5;
    const WINDOW: Duration = Duration::from_millis(1500);
    let dir = scratch("timings");
    let fcfs_bytes =
        std::fs::read(plugins_dir().join("plughost_scheduler_fcfs.wasm")).expect("fcfs component");
    let config = dir.join("deploy.toml");
    let with_scheduler = |path: &Path, threshold: u32| {
        format!(
            "[scheduler]\ncomponent = \"{}\"\nconfig = {{ long_prefill_token_threshold = {threshold} }}\n\n[sampler]\ncomponent = \"{}\"\n",
            path.display(),
            plugin("plughost_sampler_standard.wasm")
        )
    };
    let first = dir.join("variant-0.wasm");
    std::fs::write(&first, variant(&fcfs_bytes, 0)).expect("variant");
    write_file(&config, &with_scheduler(&first, 512));
    let cache = dir.join("cache").display().to_string();
    let config_arg = config.display().to_string();
    let server = Server::start(&[
        "--config",
        &config_arg,
        "--admin-key",
        ADMIN_KEY,
        "--component-cache",
        &cache,
    ]);
    let client = reqwest::Client::new();
    let base = server.base.clone();

    // Per stream, the time between consecutive tokens (one engine step) and when it ended.
    let arrivals: Arc<Mutex<Vec<(Instant, f64)>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load: Vec<_> = (0..STREAMS)
        .map(|i| {
            let (client, base, arrivals, stop) =
                (client.clone(), base.clone(), arrivals.clone(), stop.clone());
            tokio::spawn(async move {
                let mut requests = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && requests < 10_000 {
                    requests += 1;
                    let body = json!({"model": MODEL, "prompt": prompt(i), "max_tokens": 400,
                        "temperature": 0, "ignore_eos": true, "stream": true});
                    let Ok(response) = client
                        .post(format!("{base}/v1/completions"))
                        .json(&body)
                        .send()
                        .await
                    else {
                        continue;
                    };
                    let mut body = response.bytes_stream();
                    let mut last: Option<Instant> = None;
                    while let Some(Ok(_)) = body.next().await {
                        let now = Instant::now();
                        if let Some(last) = last
                            && let Ok(mut a) = arrivals.lock()
                        {
                            a.push((now, (now - last).as_secs_f64() * 1e3));
                        }
                        last = Some(now);
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;

    let step_p99 = |from: Instant, to: Instant| -> f64 {
        let mut gaps: Vec<f64> = arrivals
            .lock()
            .map(|a| {
                a.iter()
                    .filter(|(t, _)| *t >= from && *t <= to)
                    .map(|(_, gap)| *gap)
                    .collect()
            })
            .unwrap_or_default();
        percentile(&mut gaps, 0.99)
    };

    let (mut compile, mut cached, mut kept, mut swap, mut quiet, mut busy) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for round in 1..=ROUNDS {
        let quiet_from = Instant::now();
        tokio::time::sleep(WINDOW).await;
        quiet.push(step_p99(quiet_from, Instant::now()));

        // A component never compiled: compile, instantiate, init, dry run.
        let fresh = dir.join(format!("variant-{round}.wasm"));
        std::fs::write(&fresh, variant(&fcfs_bytes, round)).expect("variant");
        write_file(&config, &with_scheduler(&fresh, 512));
        let busy_from = Instant::now();
        let (status, report) = reload(&client, &base, ADMIN_KEY).await;
        assert_eq!(status, StatusCode::OK, "{report}");
        busy.push(step_p99(busy_from, Instant::now()));
        compile.push(report["reload_ms"].as_f64().unwrap_or(f64::NAN));
        swap.push(report["swap_ms"].as_f64().unwrap_or(f64::NAN));

        // The first variant again, compiled before: instantiate, init and dry run only.
        write_file(&config, &with_scheduler(&first, 256 + round));
        let (status, report) = reload(&client, &base, ADMIN_KEY).await;
        assert_eq!(status, StatusCode::OK, "{report}");
        cached.push(report["reload_ms"].as_f64().unwrap_or(f64::NAN));

        // Nothing changed: the components are shared with the running generation.
        let (status, report) = reload(&client, &base, ADMIN_KEY).await;
        assert_eq!(status, StatusCode::OK, "{report}");
        kept.push(report["reload_ms"].as_f64().unwrap_or(f64::NAN));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in load {
        task.abort();
    }
    println!("reload timings, {ROUNDS} rounds, medians (ms):");
    println!(
        "  new component (compile + instantiate + init + dry run + swap): {:.1}  {compile:.1?}",
        median(compile.clone())
    );
    println!(
        "  compiled component, new config (instantiate + init + dry run + swap): {:.1}  {cached:.1?}",
        median(cached.clone())
    );
    println!(
        "  unchanged deployment (shared components + swap): {:.1}  {kept:.1?}",
        median(kept.clone())
    );
    println!(
        "  swap (handing to the engine until it took it): {:.2}  {swap:.2?}",
        median(swap.clone())
    );
    println!(
        "  step p99 without a reload: {:.2}  {quiet:.2?}",
        median(quiet.clone())
    );
    println!(
        "  step p99 during a compiling reload: {:.2}  {busy:.2?}",
        median(busy.clone())
    );
}

/// A spec of `file` whose config is the TOML table `config`.
fn spec(file: &str, config: &str) -> plughost::plugins::PluginSpec {
    plughost::plugins::PluginSpec {
        component: plugins_dir().join(file),
        config: toml::from_str(config).expect("a TOML table"),
        memory_mib: None,
        call_timeout_ms: None,
        failure: Default::default(),
    }
}

/// A generation shares the components the previous one has unchanged (same instance), makes
/// new ones for what changed, and fails whole, naming the slot, when a component cannot start.
#[test]
fn a_generation_shares_what_is_unchanged_and_fails_whole() {
    use plughost::plugins::{
        Generation, GenerationError, NamedSamplers, PluginRuntime, RuntimeOptions, Slot,
    };
    let runtime = PluginRuntime::new(RuntimeOptions {
        cache_dir: Some(std::env::temp_dir().join("plughost-test-component-cache")),
    })
    .expect("the plugin runtime");
    let fcfs = spec("plughost_scheduler_fcfs.wasm", "");
    let standard = spec("plughost_sampler_standard.wasm", "");
    let first = Generation::build(
        &runtime,
        1,
        Some(&fcfs),
        Some(&standard),
        &NamedSamplers::default(),
        None,
    )
    .expect("generation 1");
    let same = Generation::build(
        &runtime,
        2,
        Some(&fcfs),
        Some(&standard),
        &NamedSamplers::default(),
        Some(&first),
    )
    .expect("generation 2");
    let (a, b) = (
        first.sampler().expect("sampler"),
        same.sampler().expect("sampler"),
    );
    assert!(
        Arc::ptr_eq(a, b),
        "an unchanged sampler is the same instance"
    );
    assert!(!same.loaded_anew(Slot::Scheduler) && !same.loaded_anew(Slot::Sampler));

    let tuned = spec(
        "plughost_scheduler_fcfs.wasm",
        "long_prefill_token_threshold = 64",
    );
    let third = Generation::build(
        &runtime,
        3,
        Some(&tuned),
        Some(&standard),
        &NamedSamplers::default(),
        Some(&same),
    )
    .expect("generation 3");
    assert!(
        third.loaded_anew(Slot::Scheduler),
        "a new config makes a new scheduler"
    );
    assert!(!third.loaded_anew(Slot::Sampler));
    let statuses = third.components();
    assert_eq!(statuses[0].generation, 3);
    assert_eq!(statuses[1].generation, 1);

    let trap = spec("plughost_scheduler_faulty.wasm", "trap_in_init = true");
    let error = Generation::build(
        &runtime,
        4,
        Some(&trap),
        Some(&standard),
        &NamedSamplers::default(),
        Some(&third),
    )
    .err()
    .expect("a scheduler that traps in init fails the generation");
    assert!(
        matches!(
            error,
            GenerationError::Load {
                slot: Slot::Scheduler,
                ..
            }
        ),
        "{error}"
    );
    let wrong_world = Generation::build(
        &runtime,
        4,
        Some(&fcfs),
        Some(&fcfs),
        &NamedSamplers::default(),
        Some(&third),
    )
    .err()
    .expect("a scheduler in the sampler slot fails the generation");
    assert_eq!(wrong_world.slot(), Slot::Sampler, "{wrong_world}");
    assert!(
        wrong_world
            .to_string()
            .contains("exports the scheduler world; the [sampler] slot needs sampler"),
        "{wrong_world}"
    );
}
