//! Reloads while 16 streams run, on the mock and the CPU device, and the timings of reloads under load (a measurement, ignored by default).

use super::*;

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
        "plughost_plugin_info{{component=\"{}\",sha256={},slot=\"scheduler\",wit_version=\"0.2.0\"}}",
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
/// `cargo test --release -p plughost-cli --test plugins -- --ignored --nocapture reload_timings`
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
