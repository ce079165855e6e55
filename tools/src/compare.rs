//! `plughost-tools compare` (run by `cargo xtask compare`): plughost, llama.cpp's `llama-server` and, when given, ik_llama.cpp's, on the same weights (SmolLM2-135M-Instruct or the Qwen3-0.6B shape; bf16, Q8_0 or Q4_K_M), one server at a time under the same `plughost bench` loads, written up in `docs/benchmarks*.md` with a throughput chart beside it.
//!
//! Every server is up for the whole run and every load goes to one after another, never to
//! two at once, in several rounds that rotate the order, so they never share the cores and a
//! drift in the machine's speed does not land on one server only. Raw results and server logs
//! go to `target/compare/`.

mod cpu;
mod decode_time;
mod llama;
mod loads;
mod model;
mod plot;
mod random_model;
mod report;
mod rounds;
mod server;
mod setup;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, ensure};
use plughost_device_cpu::ActivationDigits;
use plughost_device_cpu::isa::{Isa, IsaLevel};
use serde_json::json;

use crate::bandwidth::{self, Bandwidth};
use loads::{Load, SAMPLING, Shape, Summary};
use model::ModelFacts;
use random_model::RandomQwen3;
use report::{GREEDY, Machine, Report, SAMPLED, SINGLE, ServerResult};
use rounds::{Bench, Measured, counter};
use server::{RunningServer, ServerSpec, display_path, shell_word};
use setup::{PlughostKv, Setup};

/// What the comparison serves, built and fetched before it starts, and where the workspace is.
#[derive(Debug, clap::Args)]
pub struct CompareInputs {
    /// The workspace root: the page is written relative to it, and reports name paths below it.
    #[arg(long)]
    pub workspace_root: PathBuf,
    /// The target folder: llama.cpp is built and raw results are kept below it.
    #[arg(long)]
    pub target_dir: PathBuf,
    /// The release `plughost` binary.
    #[arg(long)]
    pub plughost_bin: PathBuf,
    /// The folder of built plugins.
    #[arg(long)]
    pub plugins_dir: PathBuf,
    /// SmolLM2-135M-Instruct in bf16, as `fetch-model smollm2-135m-instruct --dtype bf16` writes it.
    #[arg(long)]
    pub model_dir: PathBuf,
    /// Qwen3's tokenizer files, which `--model qwen3-0.6b-shape` writes into its GGUF.
    #[arg(long)]
    pub qwen3_tokenizer_dir: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct CompareArgs {
    /// A llama-server binary to use instead of target/llama-cpp/build/bin/llama-server or one on
    /// the PATH; without any, llama.cpp is built into target/llama-cpp (about 12 minutes on 2 cores).
    #[arg(long)]
    pub llama_server: Option<PathBuf>,
    /// A llama-quantize binary, needed only while the bf16 GGUF does not exist yet
    /// (default: beside llama-server, ours, or on the PATH).
    #[arg(long)]
    pub llama_quantize: Option<PathBuf>,
    #[arg(long, default_value_t = 8123)]
    pub plughost_port: u16,
    #[arg(long, default_value_t = 8124)]
    pub llama_port: u16,
    /// An ik_llama.cpp `llama-server` binary (github ikawrakow/ik_llama.cpp, built with cmake
    /// and -DGGML_NATIVE=ON). When given it runs as a third server, with `-rtr`, which repacks
    /// quantized rows into interleaved layouts at load.
    #[arg(long)]
    pub ik_llama_server: Option<PathBuf>,
    #[arg(long, default_value_t = 8125)]
    pub ik_llama_port: u16,
    /// Leave llama.cpp out and measure plughost against ik_llama.cpp alone (needs
    /// --ik-llama-server). For sweeps where llama.cpp's long prompts take most of a round and
    /// ik_llama.cpp is the faster peer.
    #[arg(
        long,
        requires = "ik_llama_server",
        conflicts_with_all = ["llama_server", "llama_port"]
    )]
    pub without_llama_cpp: bool,
    /// The model every server serves: SmolLM2-135M-Instruct, or the Qwen3-0.6B shape with
    /// random weights (one GGUF per format, written by tests/reference/random_qwen3_0_6b_gguf.py
    /// and llama-quantize, served by all three; the script needs Python's gguf and numpy).
    #[arg(long, value_enum, default_value_t = ComparedModel::Smollm2)]
    pub model: ComparedModel,
    /// The weights every server serves: bf16 (for SmolLM2 plughost the converted bf16 folder,
    /// the peers a BF16 GGUF), or q8_0 / q4_k_m (one GGUF made by llama-quantize, served by all).
    #[arg(long, value_enum, default_value_t = WeightFormat::Bf16)]
    pub format: WeightFormat,
    /// CPU threads of each server (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// The instruction-set level of plughost's CPU device, its `isa=` option (default: the
    /// highest this CPU has).
    #[arg(long)]
    pub isa: Option<IsaLevel>,
    /// The int8 digits plughost's CPU device quantizes activations to for block-quantized
    /// weights, its `activation_digits=` option: 1 is the peers' arithmetic, 2 (the device's
    /// default) keeps the residual too. Unset, the device's default.
    #[arg(long)]
    pub activation_digits: Option<ActivationDigits>,
    /// More of plughost's CPU device options, `KEY=VALUE` (e.g. `prefetch=on`), added to its
    /// `--device-config`; repeatable. The device refuses an unknown key when the server starts.
    #[arg(long = "device-option", value_name = "KEY=VALUE")]
    pub device_options: Vec<String>,
    /// Concurrent streams of the batched loads; also llama-server's -np and plughost's
    /// --max-num-seqs.
    #[arg(long, default_value_t = 16)]
    pub streams: usize,
    /// Tokens of KV cache in each server: llama-server's -c, and plughost's --kv-cache-memory
    /// sized to hold as many.
    #[arg(long, default_value_t = 8192)]
    pub context: u64,
    #[arg(long, default_value_t = 256)]
    pub input_len: u32,
    #[arg(long, default_value_t = 128)]
    pub output_len: u32,
    /// Requests of the single-stream load.
    #[arg(long, default_value_t = 6)]
    pub single_prompts: usize,
    /// Requests of each batched load (greedy, and sampling at temperature 0.8, top-p 0.95).
    #[arg(long, default_value_t = 32)]
    pub batched_prompts: usize,
    /// Concurrencies of the throughput chart. 1 and --streams reuse the loads above; any other
    /// level runs as many requests per stream as the batched loads do.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub sweep: Vec<usize>,
    /// Prompt lengths of the long-prompt sweep: one stream, `--depth-prompts` requests of each
    /// length, each generating `--depth-output-len` tokens. Each server's `-c` / KV cache must
    /// give a stream room for the longest (raise --context). Empty: no sweep.
    #[arg(long, value_delimiter = ',')]
    pub depths: Vec<u32>,
    #[arg(long, default_value_t = 32)]
    pub depth_output_len: u32,
    #[arg(long, default_value_t = 2)]
    pub depth_prompts: usize,
    /// Seed of the first load's prompts; each later load adds one.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Seconds a server may take to answer 200 on /health.
    #[arg(long, default_value_t = 180)]
    pub health_timeout: u64,
    /// MiB read by the bandwidth measurement (well beyond any last-level cache).
    #[arg(long, default_value_t = 1024)]
    pub bandwidth_mib: usize,
    /// Rounds of every load. Each round sends every load to both servers in turn; a server's
    /// figures pool its rounds, so a slow minute of the machine is spread over both.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// The page to write, relative to the workspace root; the chart goes beside it as .svg
    /// (default: docs/benchmarks.md for bf16, docs/benchmarks-q8_0.md for q8_0).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The weights' format on every server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightFormat {
    #[value(name = "bf16")]
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_k_m")]
    Q4KM,
}

impl WeightFormat {
    /// llama-quantize's name of the type.
    fn gguf_type(self) -> &'static str {
        match self {
            WeightFormat::Bf16 => "BF16",
            WeightFormat::Q8_0 => "Q8_0",
            WeightFormat::Q4KM => "Q4_K_M",
        }
    }

    /// The name the pages give the format.
    fn label(self) -> &'static str {
        match self {
            WeightFormat::Bf16 => "bf16",
            other => other.gguf_type(),
        }
    }
}

/// The model every server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ComparedModel {
    #[value(name = "smollm2-135m-instruct")]
    Smollm2,
    #[value(name = "qwen3-0.6b-shape")]
    Qwen3Shape,
}

impl ComparedModel {
    /// How the pages and the chart name it.
    fn title(self) -> &'static str {
        match self {
            ComparedModel::Smollm2 => "SmolLM2-135M",
            ComparedModel::Qwen3Shape => "Qwen3-0.6B shape",
        }
    }

    fn default_page(self, format: WeightFormat) -> String {
        match (self, format) {
            (ComparedModel::Smollm2, WeightFormat::Bf16) => "docs/benchmarks.md".to_string(),
            (ComparedModel::Smollm2, f) => {
                format!("docs/benchmarks-{}.md", f.label().to_lowercase())
            }
            (ComparedModel::Qwen3Shape, f) => {
                format!(
                    "docs/benchmarks-qwen3-shape-{}.md",
                    f.label().to_lowercase()
                )
            }
        }
    }
}

/// plughost's KV blocks hold this many tokens; passed explicitly so the KV size computed here
/// is the one the server allocates.
const BLOCK_SIZE: u64 = 16;
/// plughost's KV cache type, passed explicitly (it is also what `auto` picks for the bf16
/// checkpoint), and its element size.
const PLUGHOST_KV_DTYPE: &str = "bf16";
const PLUGHOST_KV_ELEM_BYTES: u64 = 2;
/// llama-server's default KV cache type is f16.
const LLAMA_KV_ELEM_BYTES: u64 = 2;
/// Output tokens of the warm-up request each server gets before its loads.
const WARMUP_OUTPUT_LEN: u32 = 16;
const BANDWIDTH_PASSES: usize = 5;
/// Above this share of the CPU taken by other processes, a server's numbers are called disturbed.
const DISTURBED: f64 = 0.05;

impl CompareArgs {
    fn validate(&self) -> Result<()> {
        ensure!(self.streams > 0, "--streams must be at least 1");
        ensure!(
            self.single_prompts > 0 && self.batched_prompts > 0,
            "--single-prompts and --batched-prompts must be at least 1"
        );
        ensure!(
            !self.sweep.is_empty() && self.sweep.iter().all(|&c| c > 0),
            "--sweep needs concurrencies of at least 1"
        );
        ensure!(
            self.input_len > 0 && self.output_len > 0,
            "--input-len and --output-len must be at least 1"
        );
        ensure!(self.rounds > 0, "--rounds must be at least 1");
        ensure!(
            self.bandwidth_mib >= 256,
            "--bandwidth-mib must be at least 256, well beyond any last-level cache"
        );
        let ports = [self.plughost_port, self.llama_port, self.ik_llama_port];
        ensure!(
            ports[0] != ports[1] && ports[0] != ports[2] && ports[1] != ports[2],
            "--plughost-port, --llama-port and --ik-llama-port must differ"
        );
        ensure!(
            self.depths.iter().all(|&d| d > 0)
                && self.depth_output_len > 0
                && self.depth_prompts > 0,
            "--depths, --depth-output-len and --depth-prompts must be at least 1"
        );
        // llama-server splits -c evenly over its -np slots.
        let per_slot = self.context / self.streams as u64;
        let needed = u64::from(self.input_len) + u64::from(self.output_len);
        let deepest = self
            .depths
            .iter()
            .map(|&d| u64::from(d) + u64::from(self.depth_output_len))
            .max()
            .unwrap_or(0);
        let needed = needed.max(deepest);
        ensure!(
            per_slot >= needed,
            "--context {} over {} streams gives each {per_slot} tokens, but a request needs \
             {needed}; raise --context to {}",
            self.context,
            self.streams,
            needed * self.streams as u64
        );
        Ok(())
    }

    /// The loads in the order they run: single stream, batched greedy, batched sampling, then
    /// the sweep levels not already covered.
    fn loads(&self) -> Vec<Load> {
        let mut loads = vec![
            Load {
                key: SINGLE.into(),
                title: "single stream".into(),
                concurrency: 1,
                num_prompts: self.single_prompts,
                sampling: None,
                seed: 0,
                lengths: None,
                warm_up: true,
            },
            Load {
                key: GREEDY.into(),
                title: format!("{}, greedy", streams(self.streams)),
                concurrency: self.streams,
                num_prompts: self.batched_prompts,
                sampling: None,
                seed: 0,
                lengths: None,
                warm_up: true,
            },
            Load {
                key: SAMPLED.into(),
                title: format!(
                    "{}, temperature {} top-p {}",
                    streams(self.streams),
                    SAMPLING.0,
                    SAMPLING.1
                ),
                concurrency: self.streams,
                num_prompts: self.batched_prompts,
                sampling: Some(SAMPLING),
                seed: 0,
                lengths: None,
                warm_up: true,
            },
        ];
        let per_stream = self.batched_prompts.div_ceil(self.streams).max(1);
        for &c in &self.sweep {
            if c == 1 || c == self.streams || loads.iter().any(|l| l.key == sweep_key(c)) {
                continue;
            }
            loads.push(Load {
                key: sweep_key(c),
                title: format!("{}, greedy", streams(c)),
                concurrency: c,
                num_prompts: c * per_stream,
                sampling: None,
                seed: 0,
                lengths: None,
                warm_up: true,
            });
        }
        for &depth in &self.depths {
            loads.push(Load {
                key: depth_key(depth),
                title: format!("1 stream, {depth}-token prompts"),
                concurrency: 1,
                num_prompts: self.depth_prompts,
                sampling: None,
                seed: 0,
                lengths: Some((depth, self.depth_output_len)),
                warm_up: true,
            });
        }
        for (i, load) in loads.iter_mut().enumerate() {
            load.seed = self.seed.wrapping_add(i as u64);
        }
        loads
    }

    /// (prompt tokens, key of the load that measured it) per depth.
    fn depth_levels(&self) -> Vec<(u32, String)> {
        self.depths.iter().map(|&d| (d, depth_key(d))).collect()
    }

    fn out(&self) -> PathBuf {
        self.out
            .clone()
            .unwrap_or_else(|| PathBuf::from(self.model.default_page(self.format)))
    }

    /// (concurrency, key of the load that measured it) per sweep level.
    fn sweep_levels(&self) -> Vec<(usize, String)> {
        self.sweep
            .iter()
            .map(|&c| {
                let key = if c == 1 {
                    SINGLE.to_string()
                } else if c == self.streams {
                    GREEDY.to_string()
                } else {
                    sweep_key(c)
                };
                (c, key)
            })
            .collect()
    }
}

fn streams(n: usize) -> String {
    if n == 1 {
        "1 stream".to_string()
    } else {
        format!("{n} streams")
    }
}

fn sweep_key(concurrency: usize) -> String {
    format!("greedy-c{concurrency}")
}

fn depth_key(depth: u32) -> String {
    format!("depth-{depth}")
}

/// Runs the comparison and writes the page.
pub fn run(inputs: &CompareInputs, args: &CompareArgs) -> Result<()> {
    args.validate()?;
    let root = inputs.workspace_root.as_path();
    let threads = match args.threads {
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    ensure!(threads > 0, "--threads must be at least 1");
    let isa = match args.isa {
        Some(level) => Isa::at(level).map_err(|missing| anyhow!("--isa {level}: {missing}"))?,
        None => Isa::detect(),
    }
    .level();
    // Checked again when each server starts; checking now fails before minutes of building.
    server::ensure_port_free(args.plughost_port, "plughost")?;
    if !args.without_llama_cpp {
        server::ensure_port_free(args.llama_port, "llama-server")?;
    }
    if args.ik_llama_server.is_some() {
        server::ensure_port_free(args.ik_llama_port, "ik_llama.cpp's llama-server")?;
    }

    let setup = Setup::prepare(inputs, args, threads)?;
    let raw_dir = inputs.target_dir.join("compare");
    std::fs::create_dir_all(&raw_dir).with_context(|| format!("creating {}", raw_dir.display()))?;
    let probe = bandwidth::Probe::new(args.bandwidth_mib, threads, BANDWIDTH_PASSES)?;

    let loads = args.loads();
    let shape = Shape {
        input_len: args.input_len,
        output_len: args.output_len,
        max_token_id: setup.facts().vocab_size,
    };
    let warmup = Load {
        key: "warmup".into(),
        title: "warm-up".into(),
        concurrency: 1,
        num_prompts: 1,
        sampling: None,
        // Past every round's seeds.
        seed: args.seed.wrapping_add((loads.len() * args.rounds) as u64),
        lengths: None,
        warm_up: true,
    };
    let bench = Bench {
        plughost: setup.plughost(),
        loads: &loads,
        warmup: &warmup,
        shape: &shape,
        raw_dir: &raw_dir,
        health_timeout: Duration::from_secs(args.health_timeout),
        rounds: args.rounds,
        bandwidth: &probe,
    };
    let kv = PlughostKv::new(setup.facts(), args.context);
    let plughost_spec = setup.plughost_spec(args, (threads, isa), &kv, &raw_dir);
    let peer_specs = setup.peer_specs(args, threads, &raw_dir);
    let specs: Vec<&ServerSpec> = std::iter::once(&plughost_spec).chain(&peer_specs).collect();
    let read_metrics: Vec<bool> = specs.iter().map(|s| s.name == "plughost").collect();
    let (mut measured, bandwidths) = bench.all(&specs, &read_metrics)?;
    let mut machine = Machine::new(cpu_model(), isa, bandwidths)?;
    machine.activation_digits = args.activation_digits.unwrap_or_default();

    let peers_measured = measured.split_off(1);
    let p = measured.pop().context("plughost was not measured")?;
    let counters = p.counters.clone();
    let plughost_result = setup.plughost_result(&plughost_spec, p, &kv, root);
    let peer_results: Vec<ServerResult> = peer_specs
        .iter()
        .zip(peers_measured)
        .map(|(spec, m)| setup.peer_result(spec, m, args.context, root))
        .collect();
    let sweep = args.sweep_levels();
    let depths = args.depth_levels();
    let out = root.join(args.out());
    let svg_path = out.with_extension("svg");
    let svg_file = svg_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .context("--out has no file name")?;
    let bench_commands = loads
        .iter()
        .map(|load| {
            let mut words = vec![shell_word(&display_path(setup.plughost(), root))];
            // `$URL` stays unquoted so the line reads as a template.
            words.extend(loads::bench_args(load, &shape, "$URL").iter().map(|w| {
                if w == "$URL" {
                    w.clone()
                } else {
                    shell_word(w)
                }
            }));
            words.join(" ")
        })
        .collect();
    let report = Report {
        written: utc_now(),
        machine: &machine,
        model: setup.facts(),
        model_source: setup.model_source(root),
        loads: &loads,
        shape: &shape,
        sweep: &sweep,
        depths: &depths,
        format: args.format.label(),
        model_title: args.model.title(),
        plughost: &plughost_result,
        peers: &peer_results,
        bench_commands,
        counters,
        svg_file,
        raw_dir: display_path(&raw_dir, root),
        disturbed: DISTURBED,
    };
    write_outputs(&report, &out, &svg_path, &raw_dir)
}

/// The line of the page after which sections written by other tools begin; a comparison keeps
/// it and everything after it.
const KEPT_SECTIONS: &str =
    "<!-- The sections below are not written by `cargo xtask compare`, which keeps them. -->";

/// The chart's colour of a server, the same whichever peers ran.
fn colour_of(server: &str) -> &'static str {
    match server {
        "plughost" => "#1f77b4",
        "llama.cpp" => "#d62728",
        _ => "#2ca02c",
    }
}

/// Writes the page, the chart beside it and the summary JSON; prints the tables.
fn write_outputs(report: &Report, out: &Path, svg_path: &Path, raw_dir: &Path) -> Result<()> {
    let levels: Vec<usize> = report.sweep.iter().map(|(c, _)| *c).collect();
    let series_of = |s: &ServerResult| -> Vec<Option<f64>> {
        report
            .sweep
            .iter()
            .map(|(_, key)| s.get(key).map(|x| x.output_throughput))
            .collect()
    };
    let chart = plot::svg(
        &format!(
            "{} {}, {} in / {} out, {} cores",
            report.model_title,
            report.format,
            report.shape.input_len,
            report.shape.output_len,
            report.machine.cores
        ),
        &levels,
        &report
            .servers()
            .map(|server| plot::Series {
                label: server.name,
                colour: colour_of(server.name),
                values: series_of(server),
            })
            .collect::<Vec<_>>(),
    );
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // Sections other tools write (perplexity, the quantized kernels, the KV tiers) follow the
    // marker; a comparison rewrites only what comes before it.
    let kept = std::fs::read_to_string(out)
        .ok()
        .and_then(|old| old.find(KEPT_SECTIONS).map(|at| old[at..].to_string()))
        .unwrap_or_else(|| format!("{KEPT_SECTIONS}\n"));
    std::fs::write(out, report::markdown(report) + "\n" + &kept)
        .with_context(|| format!("writing {}", out.display()))?;
    std::fs::write(svg_path, chart).with_context(|| format!("writing {}", svg_path.display()))?;
    write_summary_json(raw_dir, report)?;
    println!("{}", report::results_table(report));
    println!("{}", report::targets_table(&report::targets(report)));
    println!("wrote {} and {}", out.display(), svg_path.display());
    Ok(())
}

/// The KV cache size llama-server logs at load (`llama_kv_cache: size = 180.00 MiB (...)`),
/// when its log level shows it.
fn llama_kv_from_log(log: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(log).ok()?;
    let total: f64 = text
        .lines()
        .filter_map(|l| {
            let rest = l.split_once("llama_kv_cache:")?.1.trim_start();
            let mib = rest.strip_prefix("size =")?.split_whitespace().next()?;
            mib.parse::<f64>().ok()
        })
        .sum();
    (total > 0.0).then(|| (total * (1u64 << 20) as f64).round() as u64)
}

/// The CPU's model name from /proc/cpuinfo.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|rest| rest.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".to_string())
}

/// `YYYY-MM-DD HH:MM UTC` from the system clock.
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_utc(secs)
}

fn format_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let (h, m) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{d:02} {h:02}:{m:02} UTC")
}

/// Every number of the page in one JSON file beside the raw results.
fn write_summary_json(dir: &Path, r: &Report) -> Result<()> {
    let server = |s: &ServerResult| {
        json!({
            "command": s.command,
            "peak_rss_bytes": s.peak_rss,
            "others_cpu_share": s.others_cpu,
            "weights_bytes": s.weights_bytes,
            "kv_cache_bytes": s.kv_bytes,
            "loads": s.summaries.iter().map(|(key, sum)| json!({
                "load": key,
                "num_successful": sum.num_successful,
                "num_failed": sum.num_failed,
                "duration_s": sum.duration_s,
                "output_tok_s": sum.output_throughput,
                "ttft_p50_ms": sum.ttft.p50_ms,
                "ttft_p99_ms": sum.ttft.p99_ms,
                "tpot_p50_ms": sum.tpot.p50_ms,
                "itl_p99_ms": sum.itl.p99_ms,
            })).collect::<Vec<_>>(),
        })
    };
    let targets: Vec<_> = report::targets(r)
        .iter()
        .map(|t| json!({"target": t.name, "measured": t.measured, "goal": t.goal, "pass": t.pass}))
        .collect();
    let value = json!({
        "written": r.written,
        "cores": r.machine.cores,
        "cpu": r.machine.cpu,
        "read_bandwidth_bytes_per_s": r.machine.bandwidth.bytes_per_second,
        "read_bandwidth_rounds_bytes_per_s": r.machine.rounds.iter().map(|b| b.bytes_per_second).collect::<Vec<_>>(),
        "weight_bytes_per_token": r.model.tensor_bytes,
        "bound_tok_s": report::bound_tok_s(r.model, &r.machine.bandwidth),
        "format": r.format,
        "plughost": server(r.plughost),
        "peers": r.peers.iter().map(|p| json!({"name": p.name, "result": server(p)})).collect::<Vec<_>>(),
        "plughost_counters": r.counters.iter().map(|(k, v)| json!({"name": k, "value": v})).collect::<Vec<_>>(),
        "targets": targets,
    });
    let path = dir.join("compare.json");
    std::fs::write(&path, serde_json::to_string_pretty(&value)?)
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: CompareArgs,
    }

    fn args(extra: &[&str]) -> CompareArgs {
        Cli::try_parse_from(std::iter::once("compare").chain(extra.iter().copied()))
            .expect("the flags parse")
            .args
    }

    #[test]
    fn the_sweep_reuses_loads_and_every_load_has_its_own_seed() {
        let a = args(&[]);
        a.validate().unwrap();
        let loads = a.loads();
        let keys: Vec<&str> = loads.iter().map(|l| l.key.as_str()).collect();
        assert_eq!(keys, [SINGLE, GREEDY, SAMPLED, "greedy-c4"]);
        assert_eq!(loads[3].num_prompts, 8);
        let mut seeds: Vec<u64> = loads.iter().map(|l| l.seed).collect();
        seeds.dedup();
        assert_eq!(seeds.len(), loads.len());
        let levels: Vec<String> = a.sweep_levels().into_iter().map(|(_, k)| k).collect();
        assert_eq!(levels, [SINGLE, "greedy-c4", GREEDY]);
        let deep = args(&["--depths", "1024,2048", "--context", "65536"]);
        let loads = deep.loads();
        let depth = loads
            .iter()
            .find(|l| l.key == "depth-2048")
            .expect("a depth load");
        assert_eq!((depth.concurrency, depth.lengths), (1, Some((2048, 32))));
        assert_eq!(deep.depth_levels()[0], (1024, "depth-1024".to_string()));
        // A long prompt warms up in the first round only; the short loads in every round.
        let warm_ups = |load: &loads::Load| {
            (0..3)
                .map(|round| load.in_round(round, loads.len()).warm_up)
                .collect::<Vec<_>>()
        };
        assert_eq!(warm_ups(depth), [true, false, false]);
        assert_eq!(warm_ups(&loads[0]), [true, true, true]);
        let shape = loads::Shape {
            input_len: 256,
            output_len: 128,
            max_token_id: 1000,
        };
        let words = loads::bench_args(&depth.in_round(1, loads.len()), &shape, "$URL");
        let at = words
            .iter()
            .position(|w| w == "--warmup")
            .expect("--warmup");
        assert_eq!(words[at + 1], "0");
    }

    #[test]
    fn impossible_shapes_are_refused() {
        assert!(args(&["--context", "1024"]).validate().is_err());
        assert!(args(&["--sweep", "1,0"]).validate().is_err());
        assert!(args(&["--llama-port", "8123"]).validate().is_err());
        assert!(args(&["--ik-llama-port", "8124"]).validate().is_err());
        // A 4096-token prompt needs 4128 tokens per stream: 16 × 4128 in all.
        assert!(args(&["--depths", "4096"]).validate().is_err());
        args(&["--depths", "4096", "--context", "66048"])
            .validate()
            .unwrap();
    }

    #[test]
    fn llama_cpp_is_left_out_only_beside_ik_llama_cpp() {
        let parse = |extra: &[&str]| {
            Cli::try_parse_from(std::iter::once("compare").chain(extra.iter().copied()))
                .map(|cli| cli.args.without_llama_cpp)
        };
        assert!(parse(&["--without-llama-cpp"]).is_err());
        // llama.cpp's own flags would be ignored without it: refused instead.
        for flag in [["--llama-port", "9000"], ["--llama-server", "llama"]] {
            let mut words = vec!["--without-llama-cpp", "--ik-llama-server", "ik"];
            words.extend(flag);
            assert!(parse(&words).is_err(), "{flag:?}");
        }
        assert!(parse(&["--without-llama-cpp", "--ik-llama-server", "ik"]).unwrap());
        assert!(!parse(&[]).unwrap());
    }

    #[test]
    fn llama_kv_size_is_read_from_its_log() {
        let path =
            std::env::temp_dir().join(format!("xtask-compare-llama-{}.log", std::process::id()));
        std::fs::write(
            &path,
            "x\nllama_kv_cache:        CPU KV buffer size =   180.00 MiB\nllama_kv_cache: size =  180.00 MiB (  8192 cells,  30 layers)\n",
        )
        .unwrap();
        assert_eq!(llama_kv_from_log(&path), Some(180 << 20));
        std::fs::remove_file(&path).ok();
        assert_eq!(llama_kv_from_log(&path), None);
    }

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(format_utc(0), "1970-01-01 00:00 UTC");
        assert_eq!(format_utc(951_782_400 + 3_660), "2000-02-29 01:01 UTC");
    }
}
