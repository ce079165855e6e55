//! `system_fingerprint` on `plughost serve`: on every response and chunk, in `/v1/models` and `/admin/deployment`; the same after a restart with the same inputs (with the same tokens), different when a numeric device option or a component changes, never for the thread count.

use crate::serve_support::deployment::{deployment_status, reload, sampler_deployment, write_file};
use crate::serve_support::{Server, plugins_dir};
use reqwest::StatusCode;
use serde_json::{Value, json};

const ADMIN_KEY: &str = "fingerprint-admin";

/// A greedy completion: its fingerprint, the streamed chunks' fingerprints and its text.
async fn complete(client: &reqwest::Client, base: &str) -> (String, Vec<String>, String) {
    let body = json!({"model": "tiny-qwen3", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let whole: Value = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("sent")
        .json()
        .await
        .expect("JSON");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let text = client
        .post(format!("{base}/v1/completions"))
        .json(&streamed)
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("stream");
    let chunks: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| {
            serde_json::from_str::<Value>(d).expect("a JSON chunk")["system_fingerprint"]
                .as_str()
                .unwrap_or("missing")
                .to_string()
        })
        .collect();
    (
        whole["system_fingerprint"]
            .as_str()
            .expect("system_fingerprint")
            .to_string(),
        chunks,
        whole["choices"][0]["text"]
            .as_str()
            .expect("text")
            .to_string(),
    )
}

async fn models_fingerprint(client: &reqwest::Client, base: &str) -> String {
    let models: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .expect("sent")
        .json()
        .await
        .expect("JSON");
    models["data"][0]["system_fingerprint"]
        .as_str()
        .expect("in /v1/models")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fingerprint_is_stable_across_restarts_and_follows_what_changes_tokens() {
    let client = reqwest::Client::new();
    let run = |flags: Vec<String>| {
        let client = client.clone();
        async move {
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            let server = Server::start_on("libplughost_device_cpu.so", &flags);
            let (fingerprint, chunks, text) = complete(&client, &server.base()).await;
            assert!(
                fingerprint.starts_with("fp_") && fingerprint.len() == 19,
                "{fingerprint}"
            );
            assert!(
                !chunks.is_empty() && chunks.iter().all(|c| *c == fingerprint),
                "{chunks:?} vs {fingerprint}"
            );
            assert_eq!(
                models_fingerprint(&client, &server.base()).await,
                fingerprint
            );
            (fingerprint, text)
        }
    };
    let base_flags = |extra: &str| -> Vec<String> {
        let mut flags = vec!["--num-kv-blocks".to_string(), "128".to_string()];
        if !extra.is_empty() {
            flags.extend(["--device-config".to_string(), extra.to_string()]);
        }
        flags
    };
    let (first, first_text) = run(base_flags("threads=1")).await;
    let (again, again_text) = run(base_flags("threads=1")).await;
    assert_eq!(
        (&again, &again_text),
        (&first, &first_text),
        "a restart with the same inputs"
    );
    let (threads, threads_text) = run(base_flags("threads=2")).await;
    assert_eq!(
        threads, first,
        "the thread count never changes tokens, nor the fingerprint"
    );
    assert_eq!(threads_text, first_text);
    let (portable, _) = run(base_flags("threads=1,isa=portable")).await;
    assert_ne!(
        portable, first,
        "another kernel path is another fingerprint"
    );
    // Valid on every x86-64 level; on AVX-512 BF16 machines it also changes the products
    // bf16 weights are multiplied with.
    let (f32_products, _) = run(base_flags("threads=1,bf16_products=f32")).await;
    assert_ne!(
        f32_products, first,
        "a numeric option of the device is part of the fingerprint"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_a_component_changes_the_fingerprint() {
    let dir = std::env::temp_dir().join(format!(
        "plughost-fingerprint-reload-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch folder");
    let config = dir.join("deploy.toml");
    let standard = plugins_dir().join("plughost_sampler_standard.wasm");
    let banned = plugins_dir().join("plughost_sampler_banned.wasm");
    write_file(&config, &sampler_deployment(&standard, "{}"));
    let config_arg = config.display().to_string();
    let server = Server::start(&["--config", &config_arg, "--admin-key", ADMIN_KEY]);
    let client = reqwest::Client::new();
    let base = server.base();
    let (before, _, _) = complete(&client, &base).await;
    assert_eq!(
        deployment_status(&client, &base, ADMIN_KEY).await["system_fingerprint"],
        before
    );

    write_file(
        &config,
        &sampler_deployment(&banned, "{ banned_token_ids = [3] }"),
    );
    let (status, report) = reload(&client, &base, ADMIN_KEY).await;
    assert_eq!(status, StatusCode::OK, "{report}");
    let (changed, _, _) = complete(&client, &base).await;
    assert_ne!(changed, before);
    assert_eq!(
        deployment_status(&client, &base, ADMIN_KEY).await["system_fingerprint"],
        changed
    );

    // Back to the first deployment: the first fingerprint again.
    write_file(&config, &sampler_deployment(&standard, "{}"));
    let (status, report) = reload(&client, &base, ADMIN_KEY).await;
    assert_eq!(status, StatusCode::OK, "{report}");
    assert_eq!(complete(&client, &base).await.0, before);
}
