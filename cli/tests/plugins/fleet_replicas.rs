//! Several replicas on one machine, as an InferencePool runs them: a round-robin client loads them, every replica's router gauges move and return to zero, and a replica SIGTERMed mid-load drains without losing a request while clients that find it closed retry another.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::serve_support::{LOAD_DEADLINE, Server};
use serde_json::{Value, json};

const REPLICAS: usize = 3;
/// Twice each replica's `--max-num-seqs` per replica, so requests also wait.
const CLIENTS: usize = 12;
const REQUESTS: usize = 96;
const MAX_TOKENS: u64 = 96;
const MAX_NUM_SEQS: &str = "2";
/// Far beyond the load's few seconds on the mock device in a debug build.
const LOAD_LIVENESS: Duration = Duration::from_secs(600);
/// Attempts of one request across replicas before it counts as lost.
const MAX_ATTEMPTS: usize = 3 * REPLICAS;
const MODEL: &str = "tiny-qwen3";

/// The three gauges the endpoint picker routes on, as one scrape reads them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Gauges {
    waiting: f64,
    running: f64,
    kv_usage: f64,
}

impl Gauges {
    /// The gauges under plughost's names and under vLLM's, which the EPP reads by default.
    fn parse(metrics: &str) -> Option<(Gauges, Gauges)> {
        let value = |name: &str| -> Option<f64> {
            let series = format!("{name}{{model_name=\"{MODEL}\"}} ");
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(series.as_str()))
                .and_then(|v| v.trim().parse().ok())
        };
        let gauges = Gauges {
            waiting: value("plughost_num_requests_waiting")?,
            running: value("plughost_num_requests_running")?,
            kv_usage: value("plughost_kv_cache_usage_perc")?,
        };
        let mirrored = Gauges {
            waiting: value("vllm:num_requests_waiting")?,
            running: value("vllm:num_requests_running")?,
            kv_usage: value("vllm:kv_cache_usage_perc")?,
        };
        Some((gauges, mirrored))
    }

    fn max(self, other: Gauges) -> Gauges {
        Gauges {
            waiting: self.waiting.max(other.waiting),
            running: self.running.max(other.running),
            kv_usage: self.kv_usage.max(other.kv_usage),
        }
    }

    fn is_idle(self) -> bool {
        self == Gauges::default()
    }
}

/// The gauges under plughost's names. The vLLM-named copies are set right after them, so under
/// load one scrape may fall between the two; they are compared when idle.
async fn scrape(client: &reqwest::Client, base: &str) -> Option<Gauges> {
    scrape_both(client, base).await.map(|(gauges, _)| gauges)
}

async fn scrape_both(client: &reqwest::Client, base: &str) -> Option<(Gauges, Gauges)> {
    let response = client.get(format!("{base}/metrics")).send().await.ok()?;
    Gauges::parse(&response.text().await.ok()?)
}

/// How one request of the load ended.
#[derive(Debug)]
struct Served {
    replica: usize,
    finished: Instant,
    attempts: usize,
}

/// Sends request `index` round robin from `cursor`, moving to the next replica when one refuses
/// or closes the connection before answering: a draining replica has stopped accepting, and a
/// request it never read is safe to send elsewhere. Any answer other than a full completion is
/// a lost request.
async fn send_one(
    client: &reqwest::Client,
    bases: &[String],
    cursor: &AtomicUsize,
    index: usize,
) -> Result<Served, String> {
    let body = json!({
        "model": MODEL,
        "prompt": format!("Request {index} of the fleet:"),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": true,
    });
    for attempt in 1..=MAX_ATTEMPTS {
        let replica = cursor.fetch_add(1, Ordering::Relaxed) % bases.len();
        let sent = client
            .post(format!("{}/v1/completions", bases[replica]))
            .json(&body)
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(_) => continue,
        };
        let status = response.status();
        let answer: Value = response
            .json()
            .await
            .map_err(|e| format!("request {index}: replica {replica} cut the answer: {e}"))?;
        if status != reqwest::StatusCode::OK {
            return Err(format!(
                "request {index}: replica {replica} answered {status}: {answer}"
            ));
        }
        let tokens = answer["usage"]["completion_tokens"].as_u64();
        if tokens != Some(MAX_TOKENS) {
            return Err(format!(
                "request {index}: replica {replica} gave {tokens:?} tokens: {answer}"
            ));
        }
        return Ok(Served {
            replica,
            finished: Instant::now(),
            attempts: attempt,
        });
    }
    Err(format!(
        "request {index}: no replica took it in {MAX_ATTEMPTS} attempts"
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_share_the_load_report_it_and_one_drains_on_sigterm_without_losing_a_request() {
    let flags = [
        "--max-num-seqs",
        MAX_NUM_SEQS,
        "--metrics-names",
        "vllm",
        // Longer than the load: the drain must finish every accepted request, not cut it.
        "--shutdown-timeout",
        "300",
    ];
    let mut servers: Vec<Server> = (0..REPLICAS).map(|_| Server::start(&flags)).collect();
    let bases: Arc<Vec<String>> = Arc::new(servers.iter().map(Server::base).collect());
    // Keep-alive connections to the drained replica are closed by it on SIGTERM; a request sent
    // on one as it closes fails to send and is retried on another replica.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(CLIENTS)
        .timeout(LOAD_LIVENESS)
        .build()
        .expect("an HTTP client");

    for base in bases.iter() {
        let idle = scrape_both(&client, base).await.expect("gauges at start");
        assert!(
            idle.0.is_idle() && idle.1.is_idle(),
            "{base} is not idle at start under both names: {idle:?}"
        );
    }

    // Every replica's highest gauges, scraped every 10 ms while the load runs.
    let peaks = Arc::new(Mutex::new(vec![Gauges::default(); REPLICAS]));
    let load_done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (client, bases, peaks, load_done) = (
            client.clone(),
            bases.clone(),
            peaks.clone(),
            load_done.clone(),
        );
        tokio::spawn(async move {
            while !load_done.load(Ordering::Relaxed) {
                for (i, base) in bases.iter().enumerate() {
                    if let Some(gauges) = scrape(&client, base).await
                        && let Ok(mut peaks) = peaks.lock()
                    {
                        peaks[i] = peaks[i].max(gauges);
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };

    let next = Arc::new(AtomicUsize::new(0));
    let cursor = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::new()));
    let completed = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (client, bases, next, cursor, results, completed) = (
                client.clone(),
                bases.clone(),
                next.clone(),
                cursor.clone(),
                results.clone(),
                completed.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    if index >= REQUESTS {
                        break;
                    }
                    let outcome = send_one(&client, &bases, &cursor, index).await;
                    completed.fetch_add(1, Ordering::Relaxed);
                    if let Ok(mut results) = results.lock() {
                        results.push(outcome);
                    }
                }
            })
        })
        .collect();

    // SIGTERM replica 0 mid-load: after a quarter of the requests, while it runs some.
    let drained = 0;
    let signalled_at = loop {
        assert!(
            started.elapsed() < LOAD_LIVENESS,
            "the load never reached a quarter"
        );
        let busy = scrape(&client, &bases[drained])
            .await
            .is_some_and(|g| g.running >= 1.0);
        if busy && completed.load(Ordering::Relaxed) >= REQUESTS / 4 {
            servers[drained].signal("TERM");
            break Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let in_flight_at_signal = REQUESTS.saturating_sub(completed.load(Ordering::Relaxed));

    for client in clients {
        tokio::time::timeout(LOAD_LIVENESS, client)
            .await
            .expect("the load finishes")
            .expect("a client task");
    }
    load_done.store(true, Ordering::Relaxed);
    sampler.await.expect("the sampler");
    let elapsed = started.elapsed();

    let results = std::mem::take(&mut *results.lock().expect("results"));
    let lost: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        lost.is_empty(),
        "lost requests: {lost:#?}\ndrained replica's log:\n{}",
        servers[drained].stderr()
    );
    assert_eq!(results.len(), REQUESTS);
    let served: Vec<&Served> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let mut per_replica = [0usize; REPLICAS];
    for s in &served {
        per_replica[s.replica] += 1;
    }
    let drained_after_signal = served
        .iter()
        .filter(|s| s.replica == drained && s.finished > signalled_at)
        .count();
    let retried = served.iter().filter(|s| s.attempts > 1).count();
    assert!(
        drained_after_signal >= 1,
        "replica {drained} finished nothing after its SIGTERM: the signal did not land mid-load"
    );
    assert!(
        per_replica.iter().all(|&n| n > 0),
        "round robin left a replica out: {per_replica:?}"
    );

    // The drained replica is gone, as a replica that finished its work exits: 0, in time.
    let (status, after) = servers[drained].wait_exit(LOAD_DEADLINE);
    assert!(
        status.success(),
        "the drained replica exited {status}:\n{}",
        servers[drained].stderr()
    );
    assert!(
        reqwest::get(format!("{}/health", bases[drained]))
            .await
            .is_err(),
        "the drained replica still answers"
    );

    let peaks = peaks.lock().expect("peaks").clone();
    for (i, peak) in peaks.iter().enumerate() {
        assert!(
            peak.running >= 1.0 && peak.waiting >= 1.0 && peak.kv_usage > 0.0,
            "replica {i}'s gauges did not move under load: {peak:?}"
        );
    }
    // The others go back to zero once the load ends, under both names.
    for (i, base) in bases.iter().enumerate().filter(|(i, _)| *i != drained) {
        let deadline = Instant::now() + LOAD_DEADLINE;
        loop {
            let gauges = scrape_both(&client, base)
                .await
                .expect("gauges after the load");
            if gauges.0.is_idle() && gauges.1.is_idle() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "replica {i} stays at {gauges:?} after the load"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    eprintln!(
        "{REPLICAS} replicas, {CLIENTS} clients, {REQUESTS} requests of {MAX_TOKENS} tokens in {elapsed:?}: \
         served {per_replica:?}; replica {drained} SIGTERMed with {in_flight_at_signal} requests unfinished \
         fleet-wide, finished {drained_after_signal} after the signal and exited 0 ({after:?} after the load ended); \
         {retried} requests retried on another replica; peaks {peaks:?}"
    );
}
