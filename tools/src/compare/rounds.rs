//! Running the loads: every server up, every load to one server after another in rotating
//! order over the rounds, and the counters read from plughost's `/metrics` afterwards.

use super::decode_time::DecodeTime;
use super::*;

/// What one server run needs besides the server.
pub(super) struct Bench<'a> {
    pub(super) plughost: &'a Path,
    pub(super) loads: &'a [Load],
    pub(super) warmup: &'a Load,
    pub(super) shape: &'a Shape,
    pub(super) raw_dir: &'a Path,
    pub(super) health_timeout: Duration,
    pub(super) rounds: usize,
    pub(super) bandwidth: &'a bandwidth::Probe,
}

/// One server's measurements.
pub(super) struct Measured {
    pub(super) summaries: Vec<(String, Summary)>,
    /// Each load's summary of every round, in round order, by load key.
    pub(super) rounds: Vec<(String, Vec<Summary>)>,
    /// Decode steps' device time by callable, over every round of each one-stream load, by
    /// load key (servers with `read_metrics` only).
    pub(super) decode_time: Vec<(String, DecodeTime)>,
    pub(super) peak_rss: u64,
    pub(super) counters: Vec<(String, f64)>,
    /// The same counters read once the server answered `/health`, before any request: the
    /// KV pool is all free then, while after the loads the prefix cache holds blocks.
    pub(super) idle_counters: Vec<(String, f64)>,
    /// Share of the machine's CPU time other processes took during the loads.
    pub(super) others_cpu: f64,
}

impl Bench<'_> {
    /// Starts every server, warms each up, then runs the rounds: every load against one server
    /// after another, rotating which goes first, with the read bandwidth measured before each
    /// single-stream load. Pools each server's rounds per load, reads their peak RSS (and the
    /// counters of those with `read_metrics`) and stops them. The guards stop them on any
    /// error too. Interleaving keeps a drift in the machine's speed (a shared host) from
    /// landing on one server only; the idle servers sleep while one is measured.
    pub(super) fn all(
        &self,
        specs: &[&ServerSpec],
        read_metrics: &[bool],
    ) -> Result<(Vec<Measured>, Vec<Bandwidth>)> {
        let mut running = specs
            .iter()
            .map(|spec| RunningServer::start(spec))
            .collect::<Result<Vec<_>>>()?;
        for server in &mut running {
            server.wait_healthy(self.health_timeout)?;
        }
        let idle_counters: Vec<Vec<(String, f64)>> = specs
            .iter()
            .zip(read_metrics)
            .map(|(spec, &read)| {
                if read {
                    read_counters(spec.port)
                } else {
                    Vec::new()
                }
            })
            .collect();
        // With their device workers, which plughost starts before it answers /health.
        let pids: Vec<u32> = running.iter().flat_map(RunningServer::pids).collect();
        let cpu_before = cpu::Snapshot::take(&pids)?;
        let warmup_shape = Shape {
            output_len: WARMUP_OUTPUT_LEN,
            ..*self.shape
        };
        for (server, spec) in running.iter_mut().zip(specs) {
            let path = loads::json_path(self.raw_dir, spec.name, self.warmup);
            loads::run(
                self.plughost,
                self.warmup,
                &warmup_shape,
                &server.base_url(),
                &path,
            )
            .with_context(|| format!("warming up {}", spec.name))?;
            server.ensure_running("the warm-up")?;
        }
        // Runs by server, then by load index.
        let mut runs: Vec<Vec<Vec<loads::Run>>> =
            vec![vec![Vec::new(); self.loads.len()]; specs.len()];
        let mut decode_times = vec![vec![DecodeTime::default(); self.loads.len()]; specs.len()];
        let mut bandwidths = Vec::with_capacity(self.rounds);
        for round in 0..self.rounds {
            for (index, load) in self.loads.iter().enumerate() {
                if load.key == SINGLE {
                    // Every server is idle here; the bound is taken next to the decode it
                    // bounds, not minutes away from it.
                    bandwidths.push(self.bandwidth.measure()?);
                }
                let load = load.in_round(round, self.loads.len());
                for which in rotation(specs.len(), index + round) {
                    let (server, spec) = (&mut running[which], specs[which]);
                    let path = loads::round_json_path(self.raw_dir, spec.name, &load, round);
                    // One stream's steps are decode steps of this load alone.
                    let timed = read_metrics[which] && load.concurrency == 1;
                    let before = timed.then(|| read_decode_time(spec.port)).flatten();
                    let run =
                        loads::run(self.plughost, &load, self.shape, &server.base_url(), &path)
                            .with_context(|| format!("{} against {}", load.title, spec.name))?;
                    server.ensure_running(&load.title)?;
                    if let Some(before) = before
                        && let Some(after) = read_decode_time(spec.port)
                    {
                        decode_times[which][index].add(&after.since(&before));
                    }
                    let s = &run.summary;
                    if s.num_failed > 0 {
                        eprintln!(
                            "warning: {} of {} requests failed against {}: {}",
                            s.num_failed,
                            s.num_failed + s.num_successful,
                            spec.name,
                            s.first_error.as_deref().unwrap_or("no message")
                        );
                    }
                    runs[which][index].push(run);
                }
            }
        }
        let others_cpu = cpu_before.others_share(&cpu::Snapshot::take(&pids)?);
        if others_cpu > DISTURBED {
            eprintln!(
                "warning: other processes took {:.0}% of the CPU during the loads; the numbers \
                 are disturbed",
                others_cpu * 100.0,
            );
        }
        let mut measured = Vec::with_capacity(specs.len());
        for (((((server, spec), per_load), &read_metrics), idle_counters), decode_times) in running
            .into_iter()
            .zip(specs)
            .zip(runs)
            .zip(read_metrics)
            .zip(idle_counters)
            .zip(decode_times)
        {
            let decode_time = self
                .loads
                .iter()
                .zip(decode_times)
                .filter(|(_, time)| *time != DecodeTime::default())
                .map(|(load, time)| (load.key.clone(), time))
                .collect();
            let rounds = self
                .loads
                .iter()
                .zip(&per_load)
                .map(|(load, runs)| {
                    let summaries = runs.iter().map(|run| run.summary.clone()).collect();
                    (load.key.clone(), summaries)
                })
                .collect();
            let summaries = self
                .loads
                .iter()
                .zip(per_load)
                .filter_map(|(load, runs)| Some((load.key.clone(), loads::pool(&runs)?)))
                .collect();
            let counters = if read_metrics {
                read_counters(spec.port)
            } else {
                Vec::new()
            };
            // Read right before stopping: VmHWM covers the whole life of the process.
            let peak_rss = server.peak_rss()?;
            server.stop();
            measured.push(Measured {
                summaries,
                rounds,
                decode_time,
                peak_rss,
                counters,
                idle_counters,
                others_cpu,
            });
        }
        Ok((measured, bandwidths))
    }
}

/// The order `servers` servers take a load in: rotated by `turn`, so over the loads and the
/// rounds each goes first, in the middle and last equally often.
fn rotation(servers: usize, turn: usize) -> impl Iterator<Item = usize> {
    (0..servers).map(move |i| (i + turn) % servers.max(1))
}

/// plughost's decode counters now; `None` (with a warning) when `/metrics` cannot be read or
/// lacks them.
fn read_decode_time(port: u16) -> Option<DecodeTime> {
    let time = match server::http_get(port, "/metrics") {
        Ok((200, body)) => DecodeTime::parse(&body),
        _ => None,
    };
    if time.is_none() {
        eprintln!("warning: no decode counters in /metrics; the decode time split is left out");
    }
    time
}

/// plughost's counters that tell whether the runs were what they claim: no prompt reuse, no
/// preemption, no plugin fallbacks; plus the KV pool and the device's allocated bytes.
fn read_counters(port: u16) -> Vec<(String, f64)> {
    let body = match server::http_get(port, "/metrics") {
        Ok((200, body)) => body,
        Ok((status, _)) => {
            eprintln!("warning: /metrics answered {status}; its counters are left out");
            return Vec::new();
        }
        Err(e) => {
            eprintln!("warning: cannot read /metrics ({e}); its counters are left out");
            return Vec::new();
        }
    };
    let wanted = [
        ("kv_cache_free_blocks", None),
        ("prefix_cache_hits_total", None),
        ("num_preemptions_total", None),
        ("scheduler_fallbacks_total", None),
        ("sampler_fallbacks_total", None),
        ("device", Some("live_bytes")),
    ];
    let mut out = Vec::new();
    for (name, labels, value) in samples(&body) {
        for (suffix, label) in wanted {
            let name_matches = name == suffix
                || name
                    .strip_suffix(suffix)
                    .is_some_and(|p| p.ends_with('_') || p.ends_with(':'));
            let label_matches = label.is_none_or(|l| labels.contains(&format!("\"{l}\"")));
            if name_matches && label_matches {
                let short = match label {
                    Some(l) => format!("{suffix}_{l}"),
                    None => suffix.to_string(),
                };
                out.push((short, value));
            }
        }
    }
    out
}

/// The samples of a Prometheus text body: name, labels (the text between the braces) and
/// value; comments and lines without a number are skipped.
pub(super) fn samples(body: &str) -> impl Iterator<Item = (&str, &str, f64)> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let value = value.parse::<f64>().ok()?;
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            Some((name, labels, value))
        })
}

pub(super) fn counter(counters: &[(String, f64)], name: &str) -> Option<f64> {
    counters.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_server_takes_every_place_in_turn() {
        let orders: Vec<Vec<usize>> = (0..3).map(|t| rotation(3, t).collect()).collect();
        assert_eq!(orders, [[0, 1, 2], [1, 2, 0], [2, 0, 1]]);
        let two: Vec<Vec<usize>> = (0..2).map(|t| rotation(2, t).collect()).collect();
        assert_eq!(two, [[0, 1], [1, 0]]);
    }

    #[test]
    fn prometheus_counters_are_found_by_suffix_and_label() {
        let body = "# HELP x\nplughost_kv_cache_free_blocks 512\nplughost_device{counter=\"live_bytes\"} 1048576\n\
                    plughost_device{counter=\"frees\"} 3\nprefix_cache_hits_total 0\n";
        // A one-shot local server stands in for plughost's /metrics.
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let body_owned = body.to_string();
        let handle = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut stream, _) = listener.accept().unwrap();
            // Read the whole request: closing with unread bytes would reset the connection.
            let mut request = Vec::new();
            let mut buf = [0u8; 256];
            while !request.ends_with(b"\r\n\r\n") {
                let n = stream.read(&mut buf).unwrap();
                assert!(n > 0, "the request ended early");
                request.extend_from_slice(&buf[..n]);
            }
            write!(stream, "HTTP/1.0 200 OK\r\n\r\n{body_owned}").unwrap();
        });
        let counters = read_counters(port);
        handle.join().unwrap();
        assert_eq!(counter(&counters, "kv_cache_free_blocks"), Some(512.0));
        assert_eq!(counter(&counters, "device_live_bytes"), Some(1048576.0));
        assert_eq!(counter(&counters, "prefix_cache_hits_total"), Some(0.0));
        assert_eq!(counter(&counters, "num_preemptions_total"), None);
    }
}
