//! `docs/benchmarks.md`: the side-by-side table, the memory table, the project's targets with
//! PASS/FAIL against the faster peer, the concurrency and depth sweeps, and exactly how the
//! numbers were produced.

use std::fmt::Write;

use super::decode_time::{self, DecodeTime};
use super::loads::{Load, Shape, Summary};
use super::model::ModelFacts;
use plughost_device_cpu::ActivationDigits;
use plughost_device_cpu::isa::IsaLevel;

use crate::bandwidth::Bandwidth;

mod figures;
use figures::{Passes, judged, median_and_range, ratio};

/// Keys of the loads the targets are defined on.
pub const SINGLE: &str = "single";
pub const GREEDY: &str = "batched-greedy";
pub const SAMPLED: &str = "batched-sampling";

/// The machine line.
pub struct Machine {
    pub cores: usize,
    pub cpu: String,
    /// The level plughost's CPU device ran at.
    pub isa: IsaLevel,
    /// The int8 digits of its quantized activations (block-quantized weights only).
    pub activation_digits: ActivationDigits,
    /// The median of `rounds`: the bandwidth the bound is computed from.
    pub bandwidth: Bandwidth,
    /// One measurement before each round's single-stream load.
    pub rounds: Vec<Bandwidth>,
}

impl Machine {
    pub fn new(cpu: String, isa: IsaLevel, rounds: Vec<Bandwidth>) -> anyhow::Result<Self> {
        let bandwidth = crate::bandwidth::median(&rounds)
            .ok_or_else(|| anyhow::anyhow!("no read bandwidth was measured"))?;
        Ok(Machine {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu,
            isa,
            activation_digits: ActivationDigits::default(),
            bandwidth,
            rounds,
        })
    }
}

/// One server's results.
pub struct ServerResult {
    /// `plughost`, `llama.cpp` or `ik_llama.cpp`.
    pub name: &'static str,
    /// The exact command it was started with.
    pub command: String,
    /// Summaries by load key.
    pub summaries: Vec<(String, Summary)>,
    /// Each round's summary of a load, in round order, by load key.
    pub rounds: Vec<(String, Vec<Summary>)>,
    /// Decode steps' device time by callable over every round of a one-stream load, by load
    /// key; plughost's only.
    pub decode_time: Vec<(String, DecodeTime)>,
    pub peak_rss: u64,
    /// Share of the machine's CPU time other processes took while this server was measured.
    pub others_cpu: f64,
    pub weights_bytes: u64,
    pub kv_bytes: u64,
    /// How the weights and KV bytes were found.
    pub memory_note: String,
}

impl ServerResult {
    pub fn get(&self, key: &str) -> Option<&Summary> {
        self.summaries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, s)| s)
    }

    /// The summaries of load `key`'s rounds, in round order.
    pub fn rounds_of(&self, key: &str) -> &[Summary] {
        self.rounds
            .iter()
            .find(|(k, _)| k == key)
            .map_or(&[], |(_, rounds)| rounds.as_slice())
    }

    pub fn decode_time_of(&self, key: &str) -> Option<&DecodeTime> {
        self.decode_time
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, t)| t)
    }

    fn memory_ratio(&self) -> f64 {
        self.peak_rss as f64 / (self.weights_bytes + self.kv_bytes) as f64
    }
}

/// Everything the page shows.
pub struct Report<'a> {
    /// When it was written (UTC).
    pub written: String,
    pub machine: &'a Machine,
    pub model: &'a ModelFacts,
    /// Where the weights came from, one sentence.
    pub model_source: String,
    pub loads: &'a [Load],
    pub shape: &'a Shape,
    /// Concurrency levels of the sweep and the load measuring each.
    pub sweep: &'a [(usize, String)],
    /// The depth sweep: prompt tokens and the load measuring each.
    pub depths: &'a [(u32, String)],
    /// The weights' format on every server: `bf16`, `Q8_0`, `Q4_K_M`.
    pub format: &'a str,
    /// The model's name on the page and the chart: `SmolLM2-135M`.
    pub model_title: &'a str,
    pub plughost: &'a ServerResult,
    /// llama.cpp, then ik_llama.cpp when it ran.
    pub peers: &'a [ServerResult],
    /// `plughost bench` command lines, one per load, with `$URL` for the server.
    pub bench_commands: Vec<String>,
    /// plughost's engine counters after the loads, as (name, value).
    pub counters: Vec<(String, f64)>,
    pub svg_file: String,
    pub raw_dir: String,
    /// Above this share of CPU taken by other processes the page warns.
    pub disturbed: f64,
}

/// One row of the targets table.
#[derive(Debug)]
pub struct Target {
    pub name: &'static str,
    pub measured: String,
    pub goal: &'static str,
    pub pass: bool,
}

/// Decode tokens/s of a load: 1000 / TPOT p50 (ms).
pub fn decode_tok_s(s: &Summary) -> f64 {
    if s.tpot.p50_ms > 0.0 {
        1000.0 / s.tpot.p50_ms
    } else {
        f64::NAN
    }
}

/// Decoded tokens/s that memory bandwidth allows when every weight byte is read once per step.
pub fn bound_tok_s(model: &ModelFacts, bandwidth: &Bandwidth) -> f64 {
    bandwidth.bytes_per_second / model.tensor_bytes as f64
}

fn clean(summaries: &[Option<&Summary>]) -> bool {
    summaries
        .iter()
        .all(|s| s.is_some_and(|s| s.num_failed == 0 && s.num_successful > 0))
}

/// (failed, sent) requests over a server's loads.
pub fn failures(server: &ServerResult) -> (usize, usize) {
    server.summaries.iter().fold((0, 0), |(f, n), (_, s)| {
        (f + s.num_failed, n + s.num_failed + s.num_successful)
    })
}

impl Report<'_> {
    /// plughost, then the peers.
    pub fn servers(&self) -> impl Iterator<Item = &ServerResult> {
        std::iter::once(self.plughost).chain(self.peers)
    }

    /// The peer with the largest `value` of load `key`, and that value.
    fn fastest_peer(
        &self,
        key: &str,
        value: impl Fn(&Summary) -> f64,
    ) -> Option<(&ServerResult, f64)> {
        self.peers
            .iter()
            .filter_map(|peer| Some((peer, value(peer.get(key)?))))
            .filter(|(_, v)| v.is_finite())
            .max_by(|a, b| a.1.total_cmp(&b.1))
    }

    fn peer_names(&self) -> String {
        let names: Vec<&str> = self.peers.iter().map(|p| p.name).collect();
        names.join(" and ")
    }

    fn quantized(&self) -> bool {
        self.format != "bf16"
    }
}

/// plughost's round `round` of load `key` (`mine`) against that round's best peer: TTFT as
/// the peer's over plughost's, decode as the peer's TPOT over plughost's.
fn round_ratios(r: &Report, key: &str, round: usize, mine: &Summary) -> (f64, f64) {
    let best = |value: fn(&Summary) -> f64| {
        r.peers
            .iter()
            .filter_map(|peer| peer.rounds_of(key).get(round).map(value))
            .filter(|v| v.is_finite() && *v > 0.0)
            .reduce(f64::min)
            .unwrap_or(f64::NAN)
    };
    (
        ratio(best(|s| s.ttft.p50_ms), mine.ttft.p50_ms),
        ratio(best(|s| s.tpot.p50_ms), mine.tpot.p50_ms),
    )
}

/// [`round_ratios`] of every round of load `key`, in round order; empty with fewer than two
/// rounds or no peer, where they would say nothing the pooled figures do not.
fn rounds_ratios(r: &Report, key: &str) -> Vec<(f64, f64)> {
    let ours = r.plughost.rounds_of(key);
    if ours.len() < 2 || r.peers.is_empty() {
        return Vec::new();
    }
    ours.iter()
        .enumerate()
        .map(|(round, mine)| round_ratios(r, key, round, mine))
        .collect()
}

/// Every round of the single-stream and long-prompt loads: each server's TTFT p50 and TPOT
/// p50, and plughost against the round's best peer, as TTFT (the peer's over plughost's: above
/// 1, plughost answers sooner) and decode (the peer's TPOT over plughost's: above 1, plughost
/// decodes faster), then the median of the rounds' ratios. A round runs every server within
/// minutes, so a drift in the machine's speed moves both sides of its ratio; the pooled
/// figures above mix the rounds. Empty with fewer than two rounds or no peer.
pub fn rounds_section(r: &Report) -> String {
    let single = r
        .loads
        .iter()
        .find(|load| load.key == SINGLE)
        .map(|load| (load.title.clone(), SINGLE.to_string()));
    let depths = r
        .depths
        .iter()
        .map(|(tokens, key)| (format!("{tokens} prompt tokens"), key.clone()));
    let mut out = String::new();
    for (title, key) in single.into_iter().chain(depths) {
        let ratios = rounds_ratios(r, &key);
        if ratios.is_empty() {
            continue;
        }
        let _ = write!(out, "\n### {title}\n\n| Round |");
        for s in r.servers() {
            let _ = write!(out, " {} TTFT / TPOT p50 (ms) |", s.name);
        }
        let _ = writeln!(
            out,
            " TTFT, best peer over plughost | decode, plughost over best peer |"
        );
        let _ = writeln!(out, "|---:|{}---:|---:|", "---:|".repeat(r.peers.len() + 1));
        for (round, (ttft, decode)) in ratios.iter().enumerate() {
            let _ = write!(out, "| {} |", round + 1);
            for s in r.servers() {
                match s.rounds_of(&key).get(round) {
                    Some(x) => {
                        let _ = write!(
                            out,
                            " {} / {} |",
                            num(x.ttft.p50_ms, 0),
                            num(x.tpot.p50_ms, 2)
                        );
                    }
                    None => out.push_str(" — |"),
                }
            }
            let _ = writeln!(out, " {}× | {}× |", num(*ttft, 2), num(*decode, 2));
        }
        let cell = |pick: fn(&(f64, f64)) -> f64| {
            let values: Vec<f64> = ratios.iter().map(pick).collect();
            median_and_range(&values).map_or("—".to_string(), |(median, low, high)| {
                format!("**{median:.2}×** ({low:.2}–{high:.2})")
            })
        };
        let _ = writeln!(
            out,
            "| median of the rounds |{} {} | {} |",
            " |".repeat(r.peers.len() + 1),
            cell(|x| x.0),
            cell(|x| x.1)
        );
    }
    if out.is_empty() {
        return out;
    }
    format!(
        "\n## By round\n\nEach round's TTFT p50 and TPOT p50, and plughost against that round's \
         best peer: TTFT as the peer's over plughost's, decode as the peer's TPOT over plughost's \
         (above 1, plughost is ahead). The last row is the median of the rounds' ratios (the \
         lower middle of an even count) with their range: each round ran every server within \
         minutes, so a drift in the machine's speed moves both sides of its ratio.\n{out}"
    )
}

/// The project's targets, judged on the measurements, each against the peer that did best on
/// it. A target fails when plughost failed requests in its loads: its numbers would describe a
/// different workload. A peer's side is judged on the requests that succeeded (see
/// [`failures`]). Quantized weights aim higher on a single stream: reading fewer bytes, the
/// faster engine turns them into speed.
pub fn targets(r: &Report) -> Vec<Target> {
    let p = r.plughost;
    let mut out = Vec::new();

    let ps = p.get(SINGLE);
    let pd = ps.map_or(f64::NAN, decode_tok_s);
    let (single_goal, single_text) = if r.quantized() {
        (1.1, "≥ 1.10× the faster peer")
    } else {
        (1.0, "≥ 1.00× the faster peer")
    };
    let (name, ld) = r
        .fastest_peer(SINGLE, decode_tok_s)
        .map_or(("no peer", f64::NAN), |(peer, v)| (peer.name, v));
    let x = ratio(pd, ld);
    let decode_by_round: Vec<f64> = rounds_ratios(r, SINGLE).iter().map(|x| x.1).collect();
    let by_round =
        median_and_range(&decode_by_round).map_or(String::new(), |(median, low, high)| {
            format!("; {median:.2}× by the median of the rounds, {low:.2}–{high:.2}")
        });
    let shown = judged(x, single_goal, Passes::AtLeast, 2);
    out.push(Target {
        name: "Single-stream decode vs the faster peer",
        measured: format!("{pd:.1} vs {ld:.1} tok/s of {name} ({shown}×{by_round})"),
        goal: single_text,
        pass: clean(&[ps]) && Passes::AtLeast.holds(x, single_goal),
    });

    let pg = p.get(GREEDY);
    let pt = pg.map_or(f64::NAN, |s| s.output_throughput);
    let pp99 = pg.map_or(f64::NAN, |s| s.ttft.p99_ms);
    let (name, lt, lp99) = r.fastest_peer(GREEDY, |s| s.output_throughput).map_or(
        ("no peer", f64::NAN, f64::NAN),
        |(peer, v)| {
            (
                peer.name,
                v,
                peer.get(GREEDY).map_or(f64::NAN, |s| s.ttft.p99_ms),
            )
        },
    );
    let x = ratio(pt, lt);
    let shown = judged(x, 1.5, Passes::AtLeast, 2);
    out.push(Target {
        name: "Batched output tok/s vs the faster peer, with TTFT p99 no worse",
        measured: format!(
            "{pt:.1} vs {lt:.1} tok/s of {name} ({shown}×); TTFT p99 {pp99:.0} vs {lp99:.0} ms"
        ),
        goal: "≥ 1.50×, TTFT p99 ≤ that peer's",
        pass: clean(&[pg]) && Passes::AtLeast.holds(x, 1.5) && pp99 <= lp99,
    });

    let psm = p.get(SAMPLED);
    let st = psm.map_or(f64::NAN, |s| s.output_throughput);
    let percent = ratio(st, pt) * 100.0;
    out.push(Target {
        name: "Sampling vs greedy output tok/s (plughost, batched)",
        measured: format!(
            "{st:.1} vs {pt:.1} tok/s ({}%)",
            judged(percent, 90.0, Passes::AtLeast, 1)
        ),
        goal: "≥ 90%",
        pass: clean(&[psm, pg]) && Passes::AtLeast.holds(percent, 90.0),
    });

    let bound = bound_tok_s(r.model, &r.machine.bandwidth);
    let percent = ratio(pd, bound) * 100.0;
    out.push(Target {
        name: "Single-stream decode vs the bandwidth bound (plughost)",
        measured: format!(
            "{pd:.1} of {bound:.1} tok/s ({}%)",
            judged(percent, 70.0, Passes::AtLeast, 1)
        ),
        goal: "≥ 70%",
        pass: clean(&[ps]) && Passes::AtLeast.holds(percent, 70.0),
    });

    let x = p.memory_ratio();
    out.push(Target {
        name: "Peak RSS vs weights + KV cache (plughost)",
        measured: format!(
            "{} vs {} + {} ({}×)",
            mib(p.peak_rss),
            mib(p.weights_bytes),
            mib(p.kv_bytes),
            judged(x, 1.5, Passes::AtMost, 2)
        ),
        goal: "≤ 1.50×",
        pass: x.is_finite() && Passes::AtMost.holds(x, 1.5),
    });
    out
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn num(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "n/a".into()
    }
}

/// The targets as a Markdown table (also printed at the end of a run).
pub fn targets_table(targets: &[Target]) -> String {
    let mut out = String::from("| Target | Measured | Goal | Result |\n|---|---|---|---|\n");
    for t in targets {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            t.name,
            t.measured,
            t.goal,
            if t.pass { "PASS" } else { "FAIL" }
        );
    }
    out
}

/// The side-by-side table of every load.
pub fn results_table(r: &Report) -> String {
    let mut out = String::from(
        "| Load | Server | Requests ok | Output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | ITL p99 (ms) | Peak RSS |\n\
         |---|---|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for load in r.loads {
        for server in r.servers() {
            let Some(s) = server.get(&load.key) else {
                continue;
            };
            let _ = writeln!(
                out,
                "| {} | {} | {}/{} | {} | {} | {} | {} | {} | {} |",
                load.title,
                server.name,
                s.num_successful,
                s.num_successful + s.num_failed,
                num(s.output_throughput, 1),
                num(s.ttft.p50_ms, 1),
                num(s.ttft.p99_ms, 1),
                num(s.tpot.p50_ms, 2),
                num(s.itl.p99_ms, 2),
                mib(server.peak_rss),
            );
        }
    }
    out
}

/// The whole page.
pub fn markdown(r: &Report) -> String {
    let mut out = String::new();
    let m = r.machine;
    let model = r.model;
    let targets = targets(r);
    let _ = writeln!(
        out,
        "# Benchmarks: plughost, {} ({}, {})\n",
        r.peer_names(),
        r.model_title,
        r.format
    );
    let _ = writeln!(
        out,
        "Written by `cargo xtask compare` on {}; run it again to refresh this page. Every server \
         was up on the same machine for the whole run; each load went to one server after \
         another (rotating which went first), never to two at once, in {} rounds. Each figure \
         pools a server's rounds of a load: percentiles over all their requests, throughput as \
         their output tokens over their summed durations.\n",
        r.written,
        r.machine.rounds.len()
    );
    let _ = writeln!(
        out,
        "**Machine:** {} cores, {}; plughost's CPU device at `isa={}` ({}); measured read \
         bandwidth {:.1} GB/s, the median of {} measurements taken right before each round's \
         single-stream load ({} GB/s; {} MiB buffer, {} threads, best of {} passes each).\n",
        m.cores,
        m.cpu,
        m.isa,
        if r.quantized() {
            match m.activation_digits {
                ActivationDigits::One => {
                    "block-quantized weights times activations quantized to one int8 digit \
                     (`activation_digits=1`, the peers' arithmetic), integer dot products"
                }
                ActivationDigits::Two => {
                    "block-quantized weights times activations quantized to two int8 digits \
                     (`activation_digits=2`, the default: the value and its residual), integer \
                     dot products"
                }
            }
        } else if m.isa >= IsaLevel::Avx512Bf16 {
            "bf16 weights times activations rounded to bf16"
        } else {
            "bf16 weights times f32 activations"
        },
        m.bandwidth.gb_per_second(),
        m.rounds.len(),
        m.rounds
            .iter()
            .map(|b| format!("{:.1}", b.gb_per_second()))
            .collect::<Vec<_>>()
            .join(", "),
        m.bandwidth.buffer_bytes >> 20,
        m.bandwidth.threads,
        m.bandwidth.passes
    );
    let _ = writeln!(out, "**Model:** {}\n", r.model_source);
    let _ = writeln!(
        out,
        "**Loads:** random token-id prompts of {} tokens, {} output tokens each with \
         `--ignore-eos`, streamed over `/v1/completions`; every load has its own seed, so no \
         prompt repeats on a server (each caches prompt prefixes), and every server gets the \
         same prompts.\n",
        r.shape.input_len, r.shape.output_len
    );

    let _ = writeln!(out, "## Results\n");
    out.push_str(&results_table(r));
    let _ = writeln!(
        out,
        "\nTTFT: time to the first token; TPOT: time per output token after the first, per \
         request; ITL: time between consecutive streamed tokens. Peak RSS is the VmHWM after \
         all its loads of each of the server's processes (plughost's device worker included), \
         summed: memory they share counts once per process, so the sum is an upper bound.\n"
    );
    let busy = r.servers().map(|s| s.others_cpu).fold(0.0, f64::max);
    let _ = writeln!(
        out,
        "Other processes took {:.1}% of the machine's CPU time during the loads (0% on a quiet \
         machine).{}\n",
        busy * 100.0,
        if busy > r.disturbed {
            " **The machine was busy with other work while these numbers were taken, so they \
             do not compare the servers fairly. Run again when nothing else runs.**"
        } else {
            ""
        }
    );

    let _ = writeln!(out, "## Targets\n");
    out.push_str(&targets_table(&targets));
    for peer in r.peers {
        let (failed, sent) = failures(peer);
        if failed > 0 {
            let _ = writeln!(
                out,
                "\n{} failed {failed} of its {sent} requests (listed under \"How it was run\"); \
                 its numbers cover the requests that succeeded. A target fails only on \
                 plughost's own failed requests.",
                peer.name
            );
        }
    }
    let bound = bound_tok_s(model, &m.bandwidth);
    let _ = writeln!(
        out,
        "\n- Decode tok/s is 1000 / TPOT p50 (ms) of the single-stream load.\n\
         - The bandwidth bound is the weight bytes read per decoded token, {} ({} bytes: \
         every tensor of the weights once{}), divided by the measured bandwidth: {:.1} \
         tok/s. Activations and the KV cache are not counted, so the bound is a ceiling.\n\
         - Memory: peak RSS against the weights (sum of the safetensors files) plus the KV \
         cache the server allocates.",
        mib(model.tensor_bytes),
        model.tensor_bytes,
        if model.tied_embeddings {
            format!(
                "; the embeddings are tied, so the {} embedding matrix is counted once, as the \
                 output head, and the one row the input lookup reads is not counted",
                mib(model.embedding_bytes)
            )
        } else {
            String::new()
        },
        bound
    );

    let _ = writeln!(out, "\n## Memory\n");
    let _ = writeln!(
        out,
        "| Server | Peak RSS | Weights | KV cache | Peak RSS / (weights + KV) |\n|---|---:|---:|---:|---:|"
    );
    for s in r.servers() {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.2} |",
            s.name,
            mib(s.peak_rss),
            mib(s.weights_bytes),
            mib(s.kv_bytes),
            s.memory_ratio()
        );
    }
    out.push('\n');
    for s in r.servers() {
        let _ = writeln!(out, "- {}: {}", s.name, s.memory_note);
    }

    let _ = writeln!(out, "\n## Throughput against concurrency\n");
    let _ = writeln!(
        out,
        "![Output tokens/s against concurrency]({})\n",
        r.svg_file
    );
    out.push_str(&sweep_table(
        r,
        ("Streams", r.sweep),
        ("output tok/s", Better::Higher),
        |s| s.output_throughput,
    ));
    if !r.depths.is_empty() {
        let _ = writeln!(out, "\n## Long prompts\n");
        let _ = writeln!(
            out,
            "One stream; a prompt of each length, then 1000 / TPOT p50 (ms) as the decode rate \
             over that history, and TTFT p50 as the time to read the prompt.\n"
        );
        out.push_str(&sweep_table(
            r,
            ("Prompt tokens", r.depths),
            ("decode tok/s", Better::Higher),
            decode_tok_s,
        ));
        out.push('\n');
        out.push_str(&sweep_table(
            r,
            ("Prompt tokens", r.depths),
            ("TTFT p50 ms", Better::Lower),
            |s| s.ttft.p50_ms,
        ));
    }

    out.push_str(&rounds_section(r));
    out.push_str(&decode_time::section(r));

    let _ = writeln!(out, "\n## How it was run\n");
    for s in r.servers() {
        let _ = writeln!(out, "{}:\n\n```sh\n{}\n```\n", s.name, s.command);
    }
    let _ = writeln!(
        out,
        "The llama-servers keep their other defaults: f16 KV cache, flash attention `auto`, prompt \
         cache on; in the sampling load it also applies its default top-k 40 and min-p 0.05 \
         on top of the request's temperature and top-p (plughost applies only what the request \
         asks). Each server gets one warm-up request (16 output tokens, its own seed) after \
         `/health` answers, before the loads.\n"
    );
    let later_warm_up = if r.depths.is_empty() {
        ""
    } else {
        ", and the long prompts go without their warm-up request (`--warmup 0`)"
    };
    let _ = writeln!(
        out,
        "The loads of the first round, in this order against each server (`$URL` is its \
         address); every later round adds {} to each seed, so no prompt repeats{later_warm_up}:\n\n```sh",
        r.loads.len()
    );
    for c in &r.bench_commands {
        let _ = writeln!(out, "{c}");
    }
    let _ = writeln!(out, "```\n");
    if !r.counters.is_empty() {
        let list: Vec<String> = r
            .counters
            .iter()
            .map(|(name, v)| format!("{name} {v}"))
            .collect();
        let _ = writeln!(
            out,
            "plughost's `/metrics` after its loads: {}.\n",
            list.join(", ")
        );
    }
    let failed: Vec<String> = r
        .servers()
        .flat_map(|s| {
            s.summaries.iter().filter_map(move |(key, sum)| {
                sum.first_error.as_ref().map(|e| {
                    format!(
                        "- {} / {key}: {} failed; first error: {e}",
                        s.name, sum.num_failed
                    )
                })
            })
        })
        .collect();
    if !failed.is_empty() {
        let _ = writeln!(out, "Failed requests:\n\n{}\n", failed.join("\n"));
    }
    let stale_connection = r.peers.iter().flat_map(|p| &p.summaries).any(|(_, s)| {
        s.first_error
            .as_deref()
            .is_some_and(|e| e.contains("connection closed before message completed"))
    });
    if stale_connection {
        let _ = writeln!(
            out,
            "llama-server closes the connection after each streamed response although it \
             answered with `Keep-Alive`; when `plughost bench` reuses such a connection before \
             it sees the close, that request fails before reaching the server.\n"
        );
    }
    let _ = writeln!(
        out,
        "Raw `plughost bench --result-json` files and every server's log are in `{}`.",
        r.raw_dir
    );
    out
}

/// Which way a figure improves.
#[derive(Clone, Copy, PartialEq)]
enum Better {
    /// A rate.
    Higher,
    /// A time.
    Lower,
}

/// One row per level of a sweep: each server's `value` of the level's load, and how many
/// times better plughost did than the best peer.
fn sweep_table(
    r: &Report,
    (level_name, levels): (&str, &[(impl std::fmt::Display, String)]),
    (unit, better): (&str, Better),
    value: impl Fn(&Summary) -> f64,
) -> String {
    let mut out = format!("| {level_name} |");
    let mut rule = String::from("|---:|");
    for s in r.servers() {
        let _ = write!(out, " {} {unit} |", s.name);
        rule.push_str("---:|");
    }
    let _ = writeln!(out, " plughost vs the best peer |\n{rule}---:|");
    for (level, key) in levels {
        let _ = write!(out, "| {level} |");
        for s in r.servers() {
            let _ = write!(out, " {} |", num(s.get(key).map_or(f64::NAN, &value), 1));
        }
        let p = r.plughost.get(key).map_or(f64::NAN, &value);
        let best = r
            .peers
            .iter()
            .filter_map(|peer| peer.get(key).map(&value))
            .filter(|v| v.is_finite())
            .reduce(|a, b| match better {
                Better::Higher => a.max(b),
                Better::Lower => a.min(b),
            })
            .unwrap_or(f64::NAN);
        let times = match better {
            Better::Higher => ratio(p, best),
            Better::Lower => ratio(best, p),
        };
        let _ = writeln!(out, " {}× |", num(times, 2));
    }
    out
}

#[cfg(test)]
mod tests;
