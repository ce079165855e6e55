//! Throughput of the quantized linear at the Qwen3-0.6B shapes: GB/s of weights streamed, next to the machine's read bandwidth.
//!
//! Run with `cargo bench -p plughost-device-cpu --bench quantized_linear`, optionally followed
//! by `-- [--portable] [--all-types] [--one-digit] [--decode-step] [--threads N] [--seconds S]
//! [--prefetch CHOICE] [--against-prefetch CHOICE] [FILTER]`, a `CHOICE` being one of the
//! device's `prefetch=` values (`auto`, `on`, `groups`, `groups_batched`, `off`).
//! `--one-digit` quantizes the activations to one int8 digit (the device's
//! `activation_digits=1`) instead of the default two. For each weight type
//! (Q8_0, Q4_K and Q6_K; with `--all-types` also Q4_0 and Q4_1), each shape (the MLP's gate or
//! up projection, its down projection and the output head), 1 token (decode), 16 (a batch
//! of 16 streams, or a prefill chunk) and 256 (a prompt; not for the head, which meets only
//! a prompt's last token), and each instruction-set level this CPU has, it times
//! the whole launch (activations quantized, outputs written) and reports the median over
//! at least five runs of at least `--seconds` (default 0.5) in all: the weights' bytes over
//! that time is the GB/s (and times the tokens, what batching gains), the multiply-adds over it
//! the GMAC/s. The read bandwidth is measured before and after with the probe
//! `cargo xtask compare` uses (`tools/src/bandwidth.rs`); the fraction is against their median.
//! The portable level is slow and left out unless `--portable` asks for it. On a shared
//! machine, `--threads 1` adds a figure other processes do not move: GB/s per second the
//! launching thread spent on a CPU, what one core's kernels reach.
//!
//! `--decode-step` times whole decode steps instead: the linears of one token in serving order
//! (per layer the fused q/k/v launch, the output projection, the gated MLP launch and the down
//! projection, then the output head) over a copy of every layer's weights of SmolLM2-135M and
//! the Qwen3-0.6B shape in each type whose blocks divide the shape, so every launch streams
//! its weights from memory as in serving, as `bf16_decode` does for bf16. With
//! `--against-prefetch CHOICE` each case's steps alternate, one by one in the same process,
//! between `--prefetch`'s choice and this one, and both medians and their ratio are reported:
//! how to tell which hints suit a CPU (`RowPrefetch::for_this_cpu`) on a machine whose
//! bandwidth moves more between two runs than the hints move a step. The weights lie in
//! device buffers, as a server's do (huge pages where the kernel allows);
//! `--against-allocator-pages` alternates them the same way with a copy in the allocator's
//! 4 KiB pages.

#[allow(dead_code, unused_imports)]
#[path = "../../../tools/src/bandwidth.rs"]
mod bandwidth;
mod support;

use std::cell::Cell;
use std::hint::black_box;
use std::ops::Deref;
use std::time::{Duration, Instant};

use plughost_device_abi::DType;
use plughost_device_abi::export::AlignedBytes;
use plughost_device_cpu::isa::{Isa, IsaLevel};
use plughost_device_cpu::{ActivationDigits, QuantizedBench, RowPrefetch};
use support::{
    CommonOptions, Shape, cpu_name, print_bandwidth, print_step_table, time_launch, time_steps,
    time_steps_alternating,
};

/// Rows (`N`) and reduced dimension (`K`) of Qwen3-0.6B's quantized matrices.
const SHAPES: [(&str, usize, usize); 3] = [
    ("gate/up 3072x1024", 3072, 1024),
    ("down 1024x3072", 1024, 3072),
    ("head 151936x1024", 151_936, 1024),
];
/// Token counts: decode, 16 streams (or a prefill chunk), and a 256-token prefill.
const TOKENS: [usize; 3] = [1, 16, 256];

/// Whether a case runs: the output head meets one token per sequence (only the last position
/// of a prompt needs logits), so it is timed for decode and 16 streams only.
fn timed(rows: usize, tokens: usize) -> bool {
    rows != SHAPES[2].1 || tokens <= 16
}

/// The benchmark's options: the common ones, `--all-types`, `--one-digit`, `--decode-step`,
/// `--against-prefetch` and `--against-allocator-pages`.
struct Options {
    common: CommonOptions,
    all_types: bool,
    digits: ActivationDigits,
    decode_step: bool,
    against_prefetch: Option<RowPrefetch>,
    against_allocator_pages: bool,
}

fn options() -> Options {
    let (mut all_types, mut digits, mut decode_step) = (false, ActivationDigits::Two, false);
    let (mut against_prefetch, mut wants_against) = (None, false);
    let mut against_allocator_pages = false;
    let common = CommonOptions::parse(|flag| match flag {
        value if wants_against => {
            wants_against = false;
            against_prefetch = Some(value.parse().unwrap_or_else(|error| {
                eprintln!("--against-prefetch: {error}");
                std::process::exit(2)
            }));
            true
        }
        "--against-prefetch" => {
            wants_against = true;
            true
        }
        "--all-types" => {
            all_types = true;
            true
        }
        "--one-digit" => {
            digits = ActivationDigits::One;
            true
        }
        "--decode-step" => {
            decode_step = true;
            true
        }
        "--against-allocator-pages" => {
            against_allocator_pages = true;
            true
        }
        _ => false,
    });
    if (against_prefetch.is_some() || against_allocator_pages) && !decode_step {
        eprintln!(
            "--against-prefetch and --against-allocator-pages compare whole steps: they need --decode-step"
        );
        std::process::exit(2)
    }
    if against_prefetch.is_some() && against_allocator_pages {
        eprintln!(
            "--against-prefetch and --against-allocator-pages each alternate two steps: give one"
        );
        std::process::exit(2)
    }
    Options {
        common,
        all_types,
        digits,
        decode_step,
        against_prefetch,
        against_allocator_pages,
    }
}

/// A deterministic pseudo-random byte stream (splitmix64).
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// `rows` rows of `inner` random values of `dtype`, with every f16 scale a small finite value.
fn weights(dtype: DType, rows: usize, inner: usize) -> Vec<u8> {
    let total = dtype
        .tensor_bytes(rows as u64, inner as u64)
        .expect("whole blocks") as usize;
    let mut w = bytes(dtype as u64 + 1, total);
    // Where each block keeps its f16 scales: d (and the minimum, or dmin).
    let (block_bytes, scale_offsets): (usize, &[usize]) = match dtype {
        DType::Q8_0 => (34, &[0]),
        DType::Q4_0 => (18, &[0]),
        DType::Q4_1 => (20, &[0, 2]),
        DType::Q4_K => (144, &[0, 2]),
        DType::Q6_K => (210, &[208]),
        other => unreachable!("{other} is not block-quantized"),
    };
    // 2^-10: far from overflow in any sum.
    let scale = 0x1400u16.to_le_bytes();
    for block in w.chunks_exact_mut(block_bytes) {
        for &at in scale_offsets {
            block[at..at + 2].copy_from_slice(&scale);
        }
    }
    w
}

fn activations(len: usize) -> Vec<f32> {
    bytes(99, len * 2)
        .chunks_exact(2)
        .map(|b| f32::from(i16::from_le_bytes([b[0], b[1]])) / 8192.0)
        .collect()
}

fn main() {
    let options = options();
    let probe = bandwidth::Probe::new(1024, options.common.threads(), 5).expect("probe");
    let mut bandwidths = vec![probe.measure().expect("bandwidth")];
    let types: &[DType] = if options.all_types {
        &[
            DType::Q8_0,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q4_K,
            DType::Q6_K,
        ]
    } else {
        &[DType::Q8_0, DType::Q4_K, DType::Q6_K]
    };
    let levels: Vec<Isa> = Isa::every()
        .into_iter()
        .filter(|isa| options.common.portable() || isa.level() != IsaLevel::Portable)
        .collect();
    let cpu = cpu_name();
    println!(
        "{cpu}, {} threads, activations in {:?} int8 digits, levels {}",
        options.common.threads(),
        options.digits,
        levels
            .iter()
            .map(|isa| isa.level().name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let benches: Vec<QuantizedBench> = levels
        .iter()
        .map(|&isa| {
            QuantizedBench::new(
                isa,
                options.digits,
                options.common.prefetch(),
                options.common.threads(),
            )
            .expect("workers")
        })
        .collect();
    if options.decode_step {
        let table = decode_steps(&options, &levels, &benches, types);
        bandwidths.push(probe.measure().expect("bandwidth"));
        let bound = print_bandwidth(&bandwidths);
        print_step_table("model, type, level", &table, bound);
        return;
    }
    let mut rows_out = Vec::new();
    for &dtype in types {
        for (shape, rows, inner) in SHAPES {
            let w = weights(dtype, rows, inner);
            // As the launches of the levels from `avx2` up keep every type: in groups.
            let grouped = match benches.iter().find(|bench| bench.reads_groups(dtype)) {
                Some(bench) => {
                    let mut grouped = w.clone();
                    bench
                        .arrange(dtype, &mut grouped, rows)
                        .expect("whole rows");
                    Some(grouped)
                }
                None => None,
            };
            for tokens in TOKENS.into_iter().filter(|&t| timed(rows, t)) {
                let x = activations(tokens * inner);
                let mut out = vec![0.0f32; tokens * rows];
                for (isa, bench) in levels.iter().zip(&benches) {
                    let name = format!("{dtype} {shape} T={tokens} {}", isa.level().name());
                    if !options.common.wants(&name) {
                        continue;
                    }
                    let weights = match &grouped {
                        Some(grouped) if bench.reads_groups(dtype) => (&grouped[..], true),
                        _ => (&w[..], false),
                    };
                    let (time, cpu) = time_launch(options.common.seconds(), |_| {
                        bench
                            .linear(dtype, black_box(weights), rows, black_box(&x), &mut out)
                            .expect("launch");
                        black_box(&out);
                    });
                    let gb_s = w.len() as f64 / time.as_secs_f64() / 1e9;
                    let cpu_gb_s = cpu.map_or(0.0, |cpu| w.len() as f64 / cpu.as_secs_f64() / 1e9);
                    let gmac = (tokens * rows * inner) as f64 / 1e9;
                    let gmac_s = gmac / time.as_secs_f64();
                    let cpu_gmac_s = cpu.map_or(0.0, |cpu| gmac / cpu.as_secs_f64());
                    println!(
                        "{name:<44} {:>9.3} ms {gb_s:>7.1} GB/s {:>8.1} GB/s × tokens \
                         {gmac_s:>7.1} GMAC/s; calling thread's CPU: {cpu_gb_s:.1} GB/s, \
                         {cpu_gmac_s:.1} GMAC/s",
                        time.as_secs_f64() * 1e3,
                        gb_s * tokens as f64
                    );
                    rows_out.push((name, time, gb_s, tokens, (gmac_s, cpu_gmac_s), cpu_gb_s));
                }
            }
        }
    }
    bandwidths.push(probe.measure().expect("bandwidth"));
    let bound = print_bandwidth(&bandwidths);
    println!();
    println!(
        "| case | ms | weights GB/s | of bandwidth | weights × tokens GB/s | GMAC/s | \
         per CPU-second of the calling thread: GB/s | GMAC/s |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (name, time, gb_s, tokens, (gmac_s, cpu_gmac_s), cpu_gb_s) in rows_out {
        println!(
            "| {name} | {:.3} | {gb_s:.1} | {:.0}% | {:.1} | {gmac_s:.1} | {cpu_gb_s:.1} | \
             {cpu_gmac_s:.1} |",
            time.as_secs_f64() * 1e3,
            100.0 * gb_s / bound,
            gb_s * tokens as f64
        );
    }
}

/// One matrix's weights, in a device buffer or the allocator's pages.
struct Weights(Box<dyn Deref<Target = [u8]>>);

impl Deref for Weights {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

/// `bytes` in a device buffer, as a server keeps weights.
fn in_device_buffer(bytes: Vec<u8>) -> Weights {
    let mut buffer = AlignedBytes::zeroed(bytes.len()).expect("memory for the weights");
    buffer.copy_from_slice(&bytes);
    Weights(Box::new(buffer))
}

/// `bytes` where the allocator put them: 4 KiB pages, as the kernel does not offer huge pages
/// to memory that does not ask.
fn in_allocator_pages(bytes: Vec<u8>) -> Weights {
    Weights(Box::new(bytes))
}

/// One layer's weights of one type, each matrix in groups as the launches keep them.
struct Layer {
    qkv: [Weights; 3],
    o: Weights,
    gate_up: [Weights; 2],
    down: Weights,
}

/// Whether `dtype`'s blocks divide every reduced dimension of `shape`.
fn fits(dtype: DType, shape: &Shape) -> bool {
    let block = if matches!(dtype, DType::Q4_K | DType::Q6_K) {
        256
    } else {
        32
    };
    [shape.hidden, shape.query, shape.intermediate]
        .iter()
        .all(|d| d % block == 0)
}

/// The median decode step of every shape, type and level (name, time, weights' GB/s).
fn decode_steps(
    options: &Options,
    levels: &[Isa],
    benches: &[QuantizedBench],
    types: &[DType],
) -> Vec<(String, Duration, f64)> {
    let mut table = Vec::new();
    for shape in &support::SHAPES {
        for &dtype in types.iter().filter(|&&dtype| fits(dtype, shape)) {
            // Only the levels that keep weights in groups: the portable one reads them as
            // stored and is far from the bandwidth bound.
            let Some(arranger) = benches.iter().find(|bench| bench.reads_groups(dtype)) else {
                continue;
            };
            let h = shape.hidden;
            let weight_set = |place: fn(Vec<u8>) -> Weights| {
                let matrix = |rows: usize, inner: usize| {
                    let mut w = weights(dtype, rows, inner);
                    arranger.arrange(dtype, &mut w, rows).expect("whole rows");
                    place(w)
                };
                let layers: Vec<Layer> = (0..shape.layers)
                    .map(|_| Layer {
                        qkv: [
                            matrix(shape.query, h),
                            matrix(shape.key_value, h),
                            matrix(shape.key_value, h),
                        ],
                        o: matrix(h, shape.query),
                        gate_up: [matrix(shape.intermediate, h), matrix(shape.intermediate, h)],
                        down: matrix(h, shape.intermediate),
                    })
                    .collect();
                (layers, matrix(shape.vocab, h))
            };
            let mut sets = vec![weight_set(in_device_buffer)];
            if options.against_allocator_pages {
                sets.push(weight_set(in_allocator_pages));
            }
            let set_in_use = Cell::new(0);
            let layer_bytes = |l: &Layer| {
                l.qkv
                    .iter()
                    .chain(&l.gate_up)
                    .map(|w| w.len())
                    .sum::<usize>()
                    + l.o.len()
                    + l.down.len()
            };
            let (layers, head) = &sets[0];
            let bytes = (layers.iter().map(layer_bytes).sum::<usize>() + head.len()) as f64;
            let x = activations(shape.intermediate.max(shape.query));
            let (mut q, mut k, mut v) = (
                vec![0.0f32; shape.query],
                vec![0.0f32; shape.key_value],
                vec![0.0f32; shape.key_value],
            );
            let (mut hidden, mut mlp) = (vec![0.0f32; h], vec![0.0f32; shape.intermediate]);
            let mut logits = vec![0.0f32; shape.vocab];
            for (isa, bench) in levels.iter().zip(benches) {
                let name = format!("{} {dtype} {}", shape.name, isa.level().name());
                if !bench.reads_groups(dtype) || !options.common.wants(&name) {
                    continue;
                }
                let step = |parts: &mut [Duration; 5]| {
                    let mut timed = |part: usize, run: &mut dyn FnMut() -> Result<(), String>| {
                        let start = Instant::now();
                        run().expect("launch");
                        parts[part] += start.elapsed();
                    };
                    let (layers, head) = &sets[set_in_use.get()];
                    for l in layers {
                        let (kv, inter) = (shape.key_value, shape.intermediate);
                        timed(0, &mut || {
                            let w = [
                                (&l.qkv[0][..], shape.query),
                                (&l.qkv[1], kv),
                                (&l.qkv[2], kv),
                            ];
                            bench.fused(dtype, &w, &x[..h], &mut [&mut q, &mut k, &mut v], false)
                        });
                        timed(1, &mut || {
                            let w = [(&l.o[..], h)];
                            bench.fused(dtype, &w, &x[..shape.query], &mut [&mut hidden], false)
                        });
                        timed(2, &mut || {
                            let w = [(&l.gate_up[0][..], inter), (&l.gate_up[1], inter)];
                            bench.fused(dtype, &w, &x[..h], &mut [&mut mlp], true)
                        });
                        timed(3, &mut || {
                            let w = [(&l.down[..], h)];
                            bench.fused(dtype, &w, &x[..inter], &mut [&mut hidden], false)
                        });
                    }
                    timed(4, &mut || {
                        let w = [(&head[..], shape.vocab)];
                        bench.fused(dtype, &w, &x[..h], &mut [&mut logits], false)
                    });
                };
                if options.against_allocator_pages {
                    let medians = time_steps_alternating(
                        options.common.seconds(),
                        |i| set_in_use.set(i),
                        step,
                    );
                    set_in_use.set(0);
                    let ms = medians.map(|m| m.as_secs_f64() * 1e3);
                    println!(
                        "{name:<36} {:>8.3} ms/step in device buffers, {:.3} in the allocator's \
                         pages: {:.3}×",
                        ms[0],
                        ms[1],
                        ms[1] / ms[0]
                    );
                    for (place, median) in ["device buffers", "allocator pages"].iter().zip(medians)
                    {
                        let gb_s = bytes / median.as_secs_f64() / 1e9;
                        table.push((format!("{name}, {place}"), median, gb_s));
                    }
                    continue;
                }
                if let Some(against) = options.against_prefetch {
                    let choices = [options.common.prefetch(), against];
                    let set = |i: usize| bench.set_prefetch(choices[i]);
                    let medians = time_steps_alternating(options.common.seconds(), set, step);
                    bench.set_prefetch(choices[0]);
                    let ms = medians.map(|m| m.as_secs_f64() * 1e3);
                    println!(
                        "{name:<36} {:>8.3} ms/step at {:?}, {:.3} at {:?}: {:.3}×",
                        ms[0],
                        choices[0],
                        ms[1],
                        choices[1],
                        ms[1] / ms[0]
                    );
                    for (choice, median) in choices.iter().zip(medians) {
                        let gb_s = bytes / median.as_secs_f64() / 1e9;
                        table.push((format!("{name}, {choice:?}"), median, gb_s));
                    }
                    continue;
                }
                let (median, shares) = time_steps(options.common.seconds(), step);
                let gb_s = bytes / median.as_secs_f64() / 1e9;
                println!(
                    "{name:<36} {:>8.3} ms/step {gb_s:>6.1} GB/s; {shares}",
                    median.as_secs_f64() * 1e3
                );
                table.push((name, median, gb_s));
            }
        }
    }
    table
}
