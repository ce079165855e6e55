//! Paged attention at depth: time per launch of decode and prefill over a bf16 cache, GB/s of keys and values read against the machine's read bandwidth, and flops against its arithmetic rate.
//!
//! Run with `cargo bench -p plughost-device-cpu --bench attention`, optionally followed by
//! `-- [--portable] [--qwen3] [--warm] [--threads N] [--seconds S] [FILTER]`. Heads are
//! SmolLM2-135M's (9 query heads on 3 KV heads of 64; `--qwen3`: Qwen3-0.6B's, 16 on 8 of
//! 128), blocks of 16 positions. The cases: one decode token after 128 (where a launch's
//! fixed costs show), 512, 4,096 and 8,192 positions of history, 16 decode tokens after 4,096
//! each, and a 512-token prefill chunk at depth 0 and 7,168. Each runs at every
//! instruction-set level this CPU has (the portable one with `--portable`), with f32 products
//! and, at `avx512_bf16`, with bf16 products (below it `bf16_products=bf16` runs the f32
//! kernel, so it is not repeated).
//!
//! A launch's time is the median over at least five launches and `--seconds` (default 0.5)
//! in all; beside it, the mean time the launching thread spent on a CPU per launch, which
//! with `--threads 1` is the whole launch's work and which other processes on a shared
//! machine do not inflate; and, from it, the K/V GB/s and GFLOP/s per CPU-second.
//!
//! A server reads each layer's cache once per step, between the weights of the layers around
//! it, so its keys and values come from memory; to time that, launches cycle through copies
//! of the step's cache ("layers") at distinct addresses, at least 96 MiB in all, three times
//! the last-level cache of the machines this runs on. `--warm` uses one copy (the cache stays
//! in L2 or L3 where it fits). A sequence's blocks are consecutive in the cache, as on a
//! fresh server, and the caches are device buffers as the server's are (huge pages where the
//! kernel offers them).
//!
//! Figures: keys and values read (each position's row once per launch) over the time, the
//! GB/s, against the read bandwidth measured before and after with the probe `cargo xtask
//! compare` uses (`tools/src/bandwidth.rs`), their median; and the flops of the scores and
//! weighted values (`4 * D` per query head and attended position) over the time, against the
//! rate of a tight loop of independent `vdpbf16ps` (bf16 products) or f32 FMAs (f32
//! products) on as many threads, measured the same way (`attention/peak.rs`).

#[allow(dead_code, unused_imports)]
#[path = "../../../tools/src/bandwidth.rs"]
mod bandwidth;
#[path = "attention/peak.rs"]
mod peak;
// The decode-step helpers of the linear benchmarks are not used here.
#[allow(dead_code)]
mod support;

use std::hint::black_box;
use std::time::Duration;

use plughost_device_abi::export::AlignedBytes;
use plughost_device_cpu::isa::{Isa, IsaLevel};
use plughost_device_cpu::{AttentionBench, BenchHeads, BenchLayout};

use peak::Products;
use support::{CommonOptions, cpu_name, print_bandwidth, time_launch};

const SMOLLM2: BenchHeads = BenchHeads {
    num_heads: 9,
    num_kv_heads: 3,
    head_dim: 64,
    block_size: 16,
};

const QWEN3: BenchHeads = BenchHeads {
    num_heads: 16,
    num_kv_heads: 8,
    head_dim: 128,
    block_size: 16,
};

/// The cache copies of a cold run hold at least this many bytes.
const COLD_BYTES: usize = 96 << 20;

/// One bench case: its name and its sequences as (positions before the step, tokens in it).
struct Case {
    name: &'static str,
    sequences: Vec<(usize, usize)>,
}

fn cases() -> Vec<Case> {
    let case = |name, sequences| Case { name, sequences };
    vec![
        case("decode 1 at 128", vec![(128, 1)]),
        case("decode 1 at 512", vec![(512, 1)]),
        case("decode 1 at 4096", vec![(4096, 1)]),
        case("decode 1 at 8192", vec![(8192, 1)]),
        case("decode 16 at 4096", vec![(4096, 1); 16]),
        case("prefill 512 at 0", vec![(0, 512)]),
        case("prefill 512 at 7168", vec![(7168, 512)]),
    ]
}

/// The benchmark's options: the common ones, and `--warm` and `--qwen3`.
struct Options {
    common: CommonOptions,
    warm: bool,
    heads: BenchHeads,
}

fn options() -> Options {
    let (mut warm, mut heads) = (false, SMOLLM2);
    let common = CommonOptions::parse(|flag| match flag {
        "--warm" => {
            warm = true;
            true
        }
        "--qwen3" => {
            heads = QWEN3;
            true
        }
        _ => false,
    });
    Options {
        common,
        warm,
        heads,
    }
}

/// Values in about [-1, 1) from a xorshift stream: random enough that no score dominates.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `value` rounded to bf16, as bits (round to nearest even; no NaNs come here).
    fn bf16(&mut self) -> u16 {
        let bits = self.next().to_bits();
        ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
    }

    /// A cache of `elements` bf16 values in memory the device would give it (large buffers in
    /// huge pages where the kernel offers them), so its page walks are the server's.
    fn bf16_cache(&mut self, elements: usize) -> AlignedBytes {
        let mut cache = AlignedBytes::zeroed(2 * elements).expect("memory for the cache");
        for pair in cache.chunks_exact_mut(2) {
            pair.copy_from_slice(&self.bf16().to_le_bytes());
        }
        cache
    }
}

/// The bf16 bits of a cache made by [`Noise::bf16_cache`].
fn bits(cache: &AlignedBytes) -> &[u16] {
    // SAFETY: any two bytes are a u16; the buffer is 64-byte aligned, so nothing is left over
    // at its start.
    let (start, bits, _) = unsafe { cache.align_to::<u16>() };
    assert!(start.is_empty(), "a device buffer is aligned");
    bits
}

/// A case laid out for launches: queries, caches of `copies` layers and each layer's block
/// table.
struct Step {
    q: Vec<f32>,
    keys: AlignedBytes,
    values: AlignedBytes,
    block_tables: Vec<Vec<i32>>,
    seq_lens: Vec<i32>,
    query_start: Vec<i32>,
    /// Keys and values of one launch, in bytes: each attended position's rows once.
    kv_bytes: usize,
    /// Multiply-adds times two of one launch's scores and weighted values.
    flops: f64,
}

impl Step {
    fn new(case: &Case, heads: BenchHeads, warm: bool) -> Step {
        let bs = heads.block_size;
        let row = heads.num_kv_heads * heads.head_dim;
        let blocks: Vec<usize> = case
            .sequences
            .iter()
            .map(|&(cached, computed)| (cached + computed).div_ceil(bs))
            .collect();
        let layer_blocks: usize = blocks.iter().sum();
        let layer_bytes = 2 * layer_blocks * bs * row * size_of::<u16>();
        let copies = if warm {
            1
        } else {
            COLD_BYTES.div_ceil(layer_bytes)
        };
        let columns = blocks.iter().copied().max().unwrap_or(0);
        let block_tables = (0..copies)
            .map(|copy| {
                let mut table = vec![0i32; blocks.len() * columns];
                let mut next = copy * layer_blocks;
                for (seq, &count) in blocks.iter().enumerate() {
                    for entry in &mut table[seq * columns..][..count] {
                        *entry = next as i32;
                        next += 1;
                    }
                }
                table
            })
            .collect();
        let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
        let elements = copies * layer_blocks * bs * row;
        let keys = noise.bf16_cache(elements);
        let values = noise.bf16_cache(elements);
        let tokens: usize = case.sequences.iter().map(|&(_, computed)| computed).sum();
        let q_width = heads.num_heads * heads.head_dim;
        let q = (0..tokens * q_width).map(|_| noise.next()).collect();
        let mut query_start = vec![0];
        let (mut kv_bytes, mut attended) = (0, 0);
        for &(cached, computed) in &case.sequences {
            query_start.push(query_start.last().copied().unwrap_or(0) + computed as i32);
            kv_bytes += 2 * (cached + computed) * row * size_of::<u16>();
            attended += (cached + 1..=cached + computed).sum::<usize>();
        }
        Step {
            q,
            keys,
            values,
            block_tables,
            seq_lens: case
                .sequences
                .iter()
                .map(|&(cached, computed)| (cached + computed) as i32)
                .collect(),
            query_start,
            kv_bytes,
            flops: (4 * heads.head_dim * heads.num_heads * attended) as f64,
        }
    }

    fn layout(&self, copy: usize) -> BenchLayout<'_> {
        BenchLayout {
            block_table: &self.block_tables[copy % self.block_tables.len()],
            seq_lens: &self.seq_lens,
            query_start: &self.query_start,
        }
    }
}

/// One row of the report.
struct Measured {
    name: String,
    time: Duration,
    /// The calling thread's CPU time per launch.
    cpu: Option<Duration>,
    kv_gb_s: f64,
    gflop_s: f64,
    products: Products,
}

fn main() {
    let options = options();
    let heads = options.heads;
    let probe = bandwidth::Probe::new(1024, options.common.threads(), 5).expect("probe");
    let mut bandwidths = vec![probe.measure().expect("bandwidth")];
    let rate = |products: Products| products.rate(options.common.threads(), 5);
    let mut rates = [
        (Products::Bf16, rate(Products::Bf16)),
        (Products::F32, rate(Products::F32)),
    ];
    let levels: Vec<Isa> = Isa::every()
        .into_iter()
        .filter(|isa| options.common.portable() || isa.level() != IsaLevel::Portable)
        .collect();
    println!(
        "{}, {} threads, {heads:?}, levels {}, {} caches",
        cpu_name(),
        options.common.threads(),
        levels
            .iter()
            .map(|isa| isa.level().name())
            .collect::<Vec<_>>()
            .join(", "),
        if options.warm { "warm" } else { "cold" }
    );
    let mut benches: Vec<(Isa, AttentionBench)> = levels
        .iter()
        .map(|&isa| {
            (
                isa,
                AttentionBench::new(isa, options.common.threads()).expect("workers"),
            )
        })
        .collect();
    let mut measured = Vec::new();
    for case in cases() {
        let wanted = |name: &str| options.common.wants(name);
        let any_wanted = levels.iter().any(|isa| {
            ["f32", "bf16"]
                .iter()
                .any(|products| wanted(&format!("{} {} {products}", case.name, isa.level().name())))
        });
        if !any_wanted {
            continue;
        }
        let step = Step::new(&case, heads, options.warm);
        let mut out = vec![0.0f32; step.q.len()];
        for (isa, bench) in &mut benches {
            let bf16_level = isa.has(IsaLevel::Avx512Bf16);
            for bf16_products in [false, true] {
                if bf16_products && !bf16_level {
                    continue;
                }
                let products = if bf16_products { "bf16" } else { "f32" };
                let name = format!("{} {} {products}", case.name, isa.level().name());
                if !wanted(&name) {
                    continue;
                }
                let (time, cpu) = time_launch(options.common.seconds(), |i| {
                    let caches = (bits(&step.keys), bits(&step.values));
                    let kernel = (heads, bf16_products);
                    bench
                        .attend(
                            kernel,
                            black_box(&step.q),
                            caches,
                            &step.layout(i),
                            &mut out,
                        )
                        .expect("launch");
                    black_box(&out);
                });
                let seconds = time.as_secs_f64();
                let row = Measured {
                    name,
                    time,
                    cpu,
                    kv_gb_s: step.kv_bytes as f64 / seconds / 1e9,
                    gflop_s: step.flops / seconds / 1e9,
                    products: if bf16_products {
                        Products::Bf16
                    } else {
                        Products::F32
                    },
                };
                println!(
                    "{:<40} {:>9.3} ms {:>7.1} GB/s K/V {:>7.1} GFLOP/s; calling thread's CPU {:.3} ms",
                    row.name,
                    seconds * 1e3,
                    row.kv_gb_s,
                    row.gflop_s,
                    cpu.map_or(f64::NAN, |cpu| cpu.as_secs_f64() * 1e3)
                );
                measured.push(row);
            }
        }
    }
    bandwidths.push(probe.measure().expect("bandwidth"));
    for (products, rate) in &mut rates {
        // The better of the two: the loop measures a ceiling, which load elsewhere only lowers.
        *rate = match (*rate, products.rate(options.common.threads(), 5)) {
            (Some(before), Some(after)) => Some(before.max(after)),
            (before, after) => before.or(after),
        };
    }
    report(&bandwidths, &rates, &measured);
}

fn report(
    bandwidths: &[bandwidth::Bandwidth],
    rates: &[(Products, Option<f64>); 2],
    measured: &[Measured],
) {
    let bound = print_bandwidth(bandwidths);
    let gflops = |products: Products| {
        rates
            .iter()
            .find(|(p, _)| *p == products)
            .and_then(|(_, rate)| *rate)
            .map(|rate| rate / 1e9)
    };
    for (products, rate) in rates {
        match rate {
            Some(rate) => println!("{products:?} arithmetic rate {:.0} GFLOP/s", rate / 1e9),
            None => println!("{products:?} arithmetic rate: not on this CPU"),
        }
    }
    println!(
        "\n| case | ms | K/V GB/s | of bandwidth | GFLOP/s | of the arithmetic rate | calling thread's CPU ms | K/V GB/s per CPU-second | GFLOP/s per CPU-second |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for row in measured {
        let of_rate = gflops(row.products).map_or_else(
            || "–".to_string(),
            |peak| format!("{:.0}%", 100.0 * row.gflop_s / peak),
        );
        // Per CPU-second of the calling thread: with one thread, the kernel's own rate.
        let cpu = row.cpu.map_or(f64::NAN, |cpu| cpu.as_secs_f64());
        let per_cpu = row.time.as_secs_f64() / cpu;
        println!(
            "| {} | {:.3} | {:.1} | {:.0}% | {:.1} | {of_rate} | {:.3} | {:.1} | {:.1} |",
            row.name,
            row.time.as_secs_f64() * 1e3,
            row.kv_gb_s,
            100.0 * row.kv_gb_s / bound,
            row.gflop_s,
            cpu * 1e3,
            row.kv_gb_s * per_cpu,
            row.gflop_s * per_cpu
        );
    }
}
