//! A sampler written outside this repository, hot-loaded into a serving `plughost` on the CPU device: `plugin new`, a policy change, `plugin build`, then `POST /admin/reload` under 16 streams; and reloads that cannot work leave it serving.
//!
//! The first run compiles the new crate's dependencies for wasm32-wasip2 (about 40 s on two
//! cores) into `target/plugin-kit-test`, which later runs reuse.

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::serve_support::deployment::{
    Streamed, component, deployment_status, metric, metrics, reload, sampler_deployment, stream,
    write_file,
};
use crate::serve_support::kit::{Built, TempDir, make_greedy_take_the_second_best, new_plugin};
use crate::serve_support::{Server, plugins_dir};

const MODEL: &str = "tiny-qwen3";
const ADMIN_KEY: &str = "admin-secret";
const STREAMS: usize = 16;
/// Long enough that the streams are still running when the reload lands.
const STREAM_TOKENS: u32 = 480;
/// Far beyond the few seconds 16 streams of 480 tokens take on the CPU device in a debug build.
const DEADLINE: Duration = Duration::from_secs(300);

fn prompt(i: usize) -> Vec<u32> {
    (0..8)
        .map(|t| ((t * 31 + i as u32 * 7) % 400) + 1)
        .collect()
}

/// A greedy streamed completion of prompt `i` that lists each token and its top two
/// alternatives.
fn greedy(i: usize, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true, "stream": true, "logprobs": 2})
}

/// Starts one stream per body; returns their tasks once every one has its first token.
async fn start_streams(
    client: &reqwest::Client,
    base: &str,
    bodies: Vec<Value>,
) -> Vec<tokio::task::JoinHandle<Streamed>> {
    let started = Arc::new(tokio::sync::Semaphore::new(0));
    let count = bodies.len() as u32;
    let tasks = bodies
        .into_iter()
        .map(|body| {
            tokio::spawn(stream(
                client.clone(),
                base.to_string(),
                body,
                started.clone(),
            ))
        })
        .collect();
    tokio::time::timeout(DEADLINE, started.acquire_many(count))
        .await
        .expect("every stream starts")
        .expect("the semaphore stays open")
        .forget();
    tasks
}

/// Waits for each stream and checks it ended whole: `[DONE]`, no error event, all its tokens.
async fn finish(tasks: Vec<tokio::task::JoinHandle<Streamed>>, tokens: usize) -> Vec<Streamed> {
    let mut all = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        let streamed = tokio::time::timeout(DEADLINE, task)
            .await
            .expect("the stream ends")
            .expect("the stream task");
        assert!(streamed.error.is_none(), "stream {i}: {:?}", streamed.error);
        assert!(streamed.done, "stream {i} ended without [DONE]");
        assert_eq!(
            streamed.finish_reason.as_deref(),
            Some("length"),
            "stream {i}"
        );
        assert_eq!(streamed.tokens.len(), tokens, "stream {i}");
        all.push(streamed);
    }
    all
}

/// The default sampler's second choice for prompt `i`'s first token.
fn second_choice(reference: &[Streamed], i: usize) -> &str {
    let choices = &reference[i].first_choices;
    assert_eq!(choices.len(), 2, "two distinct alternatives: {choices:?}");
    assert_eq!(choices[0], reference[i].tokens[0], "greedy took the best");
    &choices[1]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_out_of_tree_sampler_hot_loads_under_load_and_bad_reloads_change_nothing() {
    let began = Instant::now();
    // 1. The author's sampler, made, changed and built outside the workspace.
    let temp = TempDir::new("hot-load");
    let crate_dir = new_plugin("sampler", "hot-second-best", &temp.0);
    make_greedy_take_the_second_best(&crate_dir);
    let built = Built::build(&crate_dir);
    let (wasm, sha256) = (built.component(), built.sha256());
    eprintln!("plugin build: {:.1} s", began.elapsed().as_secs_f64());

    // 2. Serving with the standard sampler.
    let config = temp.0.join("deploy.toml");
    let standard = plugins_dir().join("plughost_sampler_standard.wasm");
    write_file(&config, &sampler_deployment(&standard, "{}"));
    let config_arg = config.display().to_string();
    let server = Server::start_on(
        "libplughost_device_cpu.so",
        &[
            "--config",
            &config_arg,
            "--admin-key",
            ADMIN_KEY,
            "--max-num-seqs",
            "16",
            "--num-kv-blocks",
            "1024",
        ],
    );
    let (client, base) = (reqwest::Client::new(), server.base());
    let before = deployment_status(&client, &base, ADMIN_KEY).await;
    assert_eq!(before["generation"], 1, "{before}");
    let standard_hash = component(&before, "sampler")["sha256"].clone();

    // 3. The same 16 streams without a reload, then with one while they run.
    let bodies = || (0..STREAMS).map(|i| greedy(i, STREAM_TOKENS)).collect();
    let tokens = STREAM_TOKENS as usize;
    let reference = finish(start_streams(&client, &base, bodies()).await, tokens).await;
    let served = Instant::now();
    let streams = start_streams(&client, &base, bodies()).await;
    write_file(&config, &sampler_deployment(&wasm, "{ top_k = 40 }"));
    let (status, report) = reload(&client, &base, ADMIN_KEY).await;
    assert_eq!(status, StatusCode::OK, "{report}\n{}", server.stderr());
    assert_eq!(report["generation"], 2, "{report}");
    let still_running = streams.iter().filter(|s| !s.is_finished()).count();
    eprintln!(
        "reload: {} ms; {still_running} of {STREAMS} streams still running",
        report["reload_ms"]
    );
    assert!(
        still_running > 0,
        "every stream had ended before the reload: nothing ran across it"
    );
    // New requests while the old ones run sample with the new sampler.
    let fresh = start_streams(&client, &base, (0..4).map(|i| greedy(i, 4)).collect()).await;
    let across = finish(streams, tokens).await;
    for (i, (streamed, reference)) in across.iter().zip(&reference).enumerate() {
        assert_eq!(
            streamed.tokens, reference.tokens,
            "stream {i} differs from the run without a reload"
        );
    }
    for (i, streamed) in finish(fresh, 4).await.iter().enumerate() {
        assert_eq!(
            streamed.tokens[0],
            second_choice(&reference, i),
            "new stream {i} under the new sampler"
        );
    }
    eprintln!(
        "16 streams across the reload: {:.1} s",
        served.elapsed().as_secs_f64()
    );

    // The listing and the metrics name the new generation and the hash `plugin build` printed.
    let listing = deployment_status(&client, &base, ADMIN_KEY).await;
    assert_eq!(listing["generation"], 2, "{listing}");
    let sampler = component(&listing, "sampler");
    assert_eq!(sampler["sha256"], sha256.as_str(), "{listing}");
    assert_eq!(sampler["generation"], 2, "{listing}");
    assert_eq!(sampler["file"], wasm.display().to_string(), "{listing}");
    let text = metrics(&client, &base).await;
    assert_eq!(
        metric(&text, "plughost_deployment_generation"),
        Some(2.0),
        "{text}"
    );
    let info = format!(
        "plughost_plugin_info{{component=\"{}\",sha256=\"{sha256}\",slot=\"sampler\",wit_version=\"{}\"}}",
        wasm.display(),
        plughost_sdk::CONTRACT_VERSION
    );
    assert_eq!(metric(&text, &info), Some(1.0), "{info} in\n{text}");
    assert!(
        !text.contains(standard_hash.as_str().unwrap_or("-")),
        "the standard sampler's hash is gone:\n{text}"
    );

    // 4. Reloads that cannot work: 422 with the cause; the out-of-tree sampler still serves.
    let faulty = plugins_dir().join("plughost_scheduler_faulty.wasm");
    let fcfs = plugins_dir().join("plughost_scheduler_fcfs.wasm");
    let cases = [
        (
            "init trap",
            format!(
                "[scheduler]\ncomponent = {:?}\nconfig = {{ trap_in_init = true }}\n\n{}",
                faulty.display().to_string(),
                sampler_deployment(&wasm, "{ top_k = 40 }")
            ),
            ["[scheduler]", "plughost_scheduler_faulty.wasm", "trap"],
        ),
        (
            "wrong world",
            sampler_deployment(&fcfs, "{}"),
            [
                "[sampler]",
                "plughost_scheduler_fcfs.wasm",
                "the [sampler] slot needs sampler",
            ],
        ),
    ];
    for (name, text, needles) in cases {
        write_file(&config, &text);
        let (status, body) = reload(&client, &base, ADMIN_KEY).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{name}: {body}");
        assert_eq!(body["error"]["code"], "component_failed", "{name}: {body}");
        let message = body["error"]["message"].as_str().unwrap_or("");
        for needle in needles {
            assert!(
                message.contains(needle),
                "{name}: {needle:?} not in {message:?}"
            );
        }
        let listing = deployment_status(&client, &base, ADMIN_KEY).await;
        assert_eq!(listing["generation"], 2, "{name}: {listing}");
        assert_eq!(component(&listing, "sampler")["sha256"], sha256.as_str());
        let after = finish(start_streams(&client, &base, vec![greedy(5, 4)]).await, 4).await;
        assert_eq!(
            after[0].tokens[0],
            second_choice(&reference, 5),
            "{name}: the out-of-tree sampler still serves"
        );
    }
    let text = metrics(&client, &base).await;
    assert_eq!(
        metric(&text, "plughost_deployment_reloads_total{result=\"error\"}"),
        Some(2.0),
        "{text}"
    );
    eprintln!("whole test: {:.1} s", began.elapsed().as_secs_f64());
}
