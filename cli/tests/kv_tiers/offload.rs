//! `plughost serve` with KV tiers below the device, on the mock and CPU devices with the tiny fixture: a prefix evicted from the device comes back from host memory, a restarted server finds it on disk, and a corrupt block file is recomputed — each time with exactly the greedy tokens of a fresh run.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::serve_support::Server;
use super::serve_support::kit::TempDir;

/// Far beyond the second or so a tiny request takes in a debug build.
pub(super) const DEADLINE: Duration = Duration::from_secs(120);
const BLOCK_SIZE: u32 = 4;

/// A small device pool: one prompt and its output fit, a second evicts the first's blocks.
pub(super) const POOL: &[&str] = &[
    "--block-size",
    "4",
    "--num-kv-blocks",
    "24",
    "--max-num-seqs",
    "1",
];

/// Prompt A and prompt B share no block; B and its output take the whole pool, so running
/// it evicts every block of A from the device.
pub(super) fn prompt_a() -> Vec<u32> {
    (1..=60).collect()
}

pub(super) fn prompt_b() -> Vec<u32> {
    (200..288).collect()
}

pub(super) struct Answer {
    pub(super) text: String,
    pub(super) cached_tokens: u64,
}

pub(super) async fn complete(server: &Server, prompt: &[u32]) -> Answer {
    let body = json!({
        "model": "tiny-qwen3",
        "prompt": prompt,
        "max_tokens": 8,
        "ignore_eos": true,
        "temperature": 0,
    });
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.base()))
        .json(&body)
        .timeout(DEADLINE)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", server.stderr()));
    let status = response.status();
    let body: Value = response.json().await.expect("a JSON body");
    assert_eq!(status, 200, "{body}\n{}", server.stderr());
    assert_eq!(body["usage"]["completion_tokens"], 8, "{body}");
    let text = body["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text: {body}"))
        .to_string();
    let cached_tokens = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    Answer {
        text,
        cached_tokens,
    }
}

pub(super) async fn metric(server: &Server, series: &str) -> f64 {
    let text = reqwest::Client::new()
        .get(format!("{}/metrics", server.base()))
        .timeout(DEADLINE)
        .send()
        .await
        .expect("/metrics answers")
        .text()
        .await
        .expect("/metrics text");
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
}

/// The text of a greedy completion of `max_tokens` tokens past end-of-sequence.
pub(super) async fn complete_text(server: &Server, prompt: &[u32], max_tokens: u32) -> String {
    let mut texts = complete_texts(server, &[prompt.to_vec()], max_tokens).await;
    texts.remove(0)
}

/// The greedy texts of several prompts sent in one completions request, in prompt order.
async fn complete_texts(server: &Server, prompts: &[Vec<u32>], max_tokens: u32) -> Vec<String> {
    let body = json!({
        "model": "tiny-qwen3",
        "prompt": prompts,
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "temperature": 0,
    });
    let answer: Value = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.base()))
        .json(&body)
        .timeout(DEADLINE)
        .send()
        .await
        .expect("an answer")
        .json()
        .await
        .expect("JSON");
    let choices = answer["choices"]
        .as_array()
        .unwrap_or_else(|| panic!("{answer}"));
    assert_eq!(choices.len(), prompts.len(), "{answer}");
    (0..prompts.len())
        .map(|index| {
            let choice = choices
                .iter()
                .find(|choice| choice["index"] == index)
                .unwrap_or_else(|| panic!("no choice {index}: {answer}"));
            choice["text"]
                .as_str()
                .unwrap_or_else(|| panic!("{answer}"))
                .to_string()
        })
        .collect()
}

pub(super) fn stop(mut server: Server) {
    server.signal("TERM");
    let (status, _) = server.wait_exit(DEADLINE);
    assert!(status.success(), "{status}: {}", server.stderr());
}

/// The file of the `index`-th block of `prompt`, named by its chained hash.
fn block_file(dir: &Path, prompt: &[u32], index: usize) -> std::path::PathBuf {
    let mut parent = [0u8; 32];
    for block in prompt.chunks_exact(BLOCK_SIZE as usize).take(index + 1) {
        let mut hasher = Sha256::new();
        hasher.update(parent);
        for token in block {
            hasher.update(token.to_le_bytes());
        }
        parent = hasher.finalize().into();
    }
    let hex: String = parent.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::read_dir(dir)
        .expect("the offload directory")
        .flatten()
        .map(|entry| entry.path())
        .find(|path| path.to_string_lossy().ends_with(&format!("-{hex}.kvb")))
        .unwrap_or_else(|| panic!("no file for block {index} in {}", dir.display()))
}

async fn tiers_give_the_fresh_tokens(device: &str, tiered_flags: &[&str]) {
    let dir = TempDir::new(&format!("kv-offload-{device}"));
    let offload_dir = dir.0.join("kv");
    let offload = offload_dir.to_str().expect("a UTF-8 path");
    let (a, b) = (prompt_a(), prompt_b());

    let fresh = Server::start_on(device, POOL);
    let fresh_a = complete(&fresh, &a).await.text;
    let fresh_b = complete(&fresh, &b).await.text;
    stop(fresh);

    // Evict and reload: B evicts A's device blocks, which come back from host memory.
    let memory_and_disk = [
        POOL,
        tiered_flags,
        &[
            "--kv-offload-memory",
            "1MiB",
            "--kv-offload-dir",
            offload,
            "--kv-offload-disk",
            "4MiB",
        ],
    ]
    .concat();
    let tiered = Server::start_on(device, &memory_and_disk);
    assert_eq!(complete(&tiered, &a).await.text, fresh_a);
    assert_eq!(complete(&tiered, &b).await.text, fresh_b);
    let again = complete(&tiered, &a).await;
    assert_eq!(again.text, fresh_a, "A from host memory");
    assert_eq!(
        again.cached_tokens, 56,
        "every full block but the last token's"
    );
    let memory_hits = metric(
        &tiered,
        "plughost_kv_tier_hit_tokens_total{tier=\"memory\"}",
    )
    .await;
    assert_eq!(memory_hits, 56.0, "A's blocks all came from host memory");
    assert!(
        metric(
            &tiered,
            "plughost_kv_tier_blocks_moved_total{direction=\"host_to_device\"}"
        )
        .await
            >= 14.0
    );
    stop(tiered);

    // Restart on the same directory, without host memory: A is a disk hit.
    let disk_only = [
        POOL,
        tiered_flags,
        &["--kv-offload-dir", offload, "--kv-offload-disk", "4MiB"],
    ]
    .concat();
    let restarted = Server::start_on(device, &disk_only);
    let first = complete(&restarted, &a).await;
    assert_eq!(first.text, fresh_a, "A from disk after a restart");
    assert_eq!(first.cached_tokens, 56);
    assert!(
        metric(
            &restarted,
            "plughost_kv_tier_hit_tokens_total{tier=\"disk\"}"
        )
        .await
            >= 56.0
    );
    stop(restarted);

    // Corrupt A's third block file: two blocks load, the rest is recomputed.
    let third = block_file(&offload_dir, &a, 2);
    let mut bytes = std::fs::read(&third).expect("the block file");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&third, &bytes).expect("rewrite the block file");
    let corrupted = Server::start_on(device, &disk_only);
    let answer = complete(&corrupted, &a).await;
    assert_eq!(answer.text, fresh_a, "A with one corrupt block file");
    assert_eq!(
        answer.cached_tokens, 8,
        "the two blocks before the corrupt one"
    );
    assert_eq!(
        metric(
            &corrupted,
            "plughost_kv_tier_disk_faults{fault=\"corrupt\"}"
        )
        .await,
        1.0
    );
    assert!(
        corrupted.stderr().contains("skipping a KV block file"),
        "{}",
        corrupted.stderr()
    );
    stop(corrupted);
}

#[tokio::test]
async fn mock_device_in_a_worker_gives_the_fresh_tokens_from_every_tier() {
    tiers_give_the_fresh_tokens(
        "libplughost_device_mock.so",
        &["--device-isolation", "process"],
    )
    .await;
}

#[tokio::test]
async fn cpu_device_gives_the_fresh_tokens_from_every_tier() {
    tiers_give_the_fresh_tokens("libplughost_device_cpu.so", &[]).await;
}

/// `plughost serve` on the mock device with `flags`, expected to refuse to start: its stderr.
fn refused_start(flags: &[&str]) -> String {
    use super::serve_support::{kit, plugins_dir, workspace};
    let model = workspace().join("tests/fixtures/tiny-qwen3");
    let device = plugins_dir().join("libplughost_device_mock.so");
    let plugins = plugins_dir();
    let mut args = vec![
        "serve",
        "--model",
        model.to_str().expect("a UTF-8 path"),
        "--device",
        device.to_str().expect("a UTF-8 path"),
        "--plugins-dir",
        plugins.to_str().expect("a UTF-8 path"),
        "--port",
        "0",
    ];
    args.extend_from_slice(flags);
    let output = kit::run(kit::plughost(&args));
    let stderr = kit::text(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    stderr
}

#[test]
fn an_offload_directory_that_cannot_be_written_stops_the_start_naming_it() {
    let dir = TempDir::new("kv-offload-unwritable");
    let file = dir.0.join("a-file");
    std::fs::write(&file, b"").expect("a file");
    let below = file.join("kv");
    let below = below.to_str().expect("a UTF-8 path");
    let stderr = refused_start(&["--kv-offload-dir", below, "--kv-offload-disk", "1MiB"]);
    assert!(
        stderr.contains(below) && stderr.contains("cannot be written"),
        "{stderr}"
    );
}

#[test]
fn offload_flags_without_prefix_caching_or_half_a_disk_tier_are_refused() {
    let stderr = refused_start(&["--kv-offload-memory", "1MiB", "--no-enable-prefix-caching"]);
    assert!(stderr.contains("need prefix"), "{stderr}");
    let stderr = refused_start(&["--kv-offload-dir", "/tmp"]);
    assert!(stderr.contains("--kv-offload-disk"), "{stderr}");
    let stderr = refused_start(&["--kv-offload-disk", "1MiB"]);
    assert!(stderr.contains("--kv-offload-dir"), "{stderr}");
    // Host memory is mapped at start: more than the host has is refused, not an abort later.
    let stderr = refused_start(&["--kv-offload-memory", "4000000GiB"]);
    assert!(stderr.contains("--kv-offload-memory asks for"), "{stderr}");
}

#[tokio::test]
async fn a_preempted_request_swaps_back_from_host_memory_with_the_fresh_tokens() {
    // Two sequences that together outgrow the pool: one is preempted, its blocks go to host
    // memory, the other's growth evicts them from the device, and they come back from there.
    // Both prompts come in one request, so they reach the engine back to back, not at the
    // mercy of two connections; a prompt takes two blocks, so the later one is admitted at
    // any point of the earlier one's 80 steps, and 88 tokens each (22 blocks) cannot both
    // stay in 24.
    let pool = [
        "--block-size",
        "4",
        "--num-kv-blocks",
        "24",
        "--max-num-seqs",
        "2",
    ];
    let prompts: [Vec<u32>; 2] = [(1..=8).collect(), (300..308).collect()];
    const OUTPUT: u32 = 80;
    let device = "libplughost_device_cpu.so";
    let fresh = Server::start_on(device, &pool);
    let alone = [
        complete_text(&fresh, &prompts[0], OUTPUT).await,
        complete_text(&fresh, &prompts[1], OUTPUT).await,
    ];
    stop(fresh);

    let tiered = Server::start_on(
        device,
        &[&pool[..], &["--kv-offload-memory", "1MiB"]].concat(),
    );
    assert_eq!(complete_texts(&tiered, &prompts, OUTPUT).await, alone);
    assert!(metric(&tiered, "plughost_num_preemptions_total").await >= 1.0);
    assert!(
        metric(
            &tiered,
            "plughost_kv_tier_hit_tokens_total{tier=\"memory\"}"
        )
        .await
            > 0.0,
        "the preempted request resumed from host memory"
    );
    stop(tiered);
}
