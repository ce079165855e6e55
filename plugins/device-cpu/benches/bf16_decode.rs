//! Decode's bf16 linears at the bandwidth bound: one step's projections over every layer of SmolLM2-135M or the Qwen3-0.6B shape, weights streamed from memory as in serving.
//!
//! Run with `cargo bench -p plughost-device-cpu --bench bf16_decode`, optionally followed by
//! `-- [--portable] [--threads N] [--seconds S] [--prefetch auto|on|off|…] [--tokens T] [FILTER]`. For each model shape and
//! each instruction-set level this CPU has (both bf16 products at `avx512_bf16`), it runs the
//! linears of one decode step in serving order (per layer the fused q/k/v projection, the
//! output projection, the gated MLP and the down projection, then the output head) over a
//! copy of every layer's weights, so each launch reads its weights from memory as a served
//! step does, not from a cache the previous step warmed. It reports the median step time
//! over at least five steps, the weights' GB/s, that as a fraction of the machine's read
//! bandwidth (the probe `cargo xtask compare` uses), and each projection's share.

#[allow(dead_code, unused_imports)]
#[path = "../../../tools/src/bandwidth.rs"]
mod bandwidth;
// The timing helpers of the other benchmarks are not used here.
#[allow(dead_code)]
mod support;

use std::time::{Duration, Instant};

use plughost_device_cpu::isa::{Isa, IsaLevel};
use plughost_device_cpu::{Bf16Bench, Bf16Products};
use support::{CommonOptions, SHAPES, cpu_name, print_bandwidth, print_step_table, time_steps};

/// One layer's weights, row-major bf16.
struct Layer {
    qkv: [Aligned; 3],
    o: Aligned,
    gate_up: [Aligned; 2],
    down: Aligned,
}

/// bf16 values starting on a cache line, as the device's buffers do.
struct Aligned {
    storage: Vec<u16>,
    start: usize,
    len: usize,
}

impl std::ops::Deref for Aligned {
    type Target = [u16];
    fn deref(&self) -> &[u16] {
        &self.storage[self.start..self.start + self.len]
    }
}

/// `len` bf16 values in ±[0.5, 1) · 2^-4 from a splitmix64 stream: no overflow in any sum.
fn weights(seed: u64, len: usize) -> Aligned {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let storage: Vec<u16> = (0..len + 32)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            let sign = ((z >> 63) as u16) << 15;
            // Exponent of 2^-5 (122), random mantissa.
            sign | (122 << 7) | (z as u16 & 0x7f)
        })
        .collect();
    let start = storage.as_ptr().align_offset(64);
    Aligned {
        storage,
        start,
        len,
    }
}

fn main() {
    let mut tokens = 1usize;
    let mut want_tokens = false;
    let options = CommonOptions::parse(|flag| {
        if want_tokens {
            want_tokens = false;
            tokens = flag.parse().unwrap_or_else(|_| {
                eprintln!("--tokens takes a number");
                std::process::exit(2)
            });
            return true;
        }
        want_tokens = flag == "--tokens";
        want_tokens
    });
    let threads = options.threads();
    let probe = bandwidth::Probe::new(1024, threads, 5).expect("probe");
    let mut bandwidths = vec![probe.measure().expect("bandwidth")];
    let mut kernels: Vec<(Isa, Bf16Products, String)> = Vec::new();
    for isa in Isa::every() {
        if isa.level() == IsaLevel::Portable && !options.portable() {
            continue;
        }
        let name = isa.level().name().to_string();
        if isa.has(IsaLevel::Avx512Bf16) {
            kernels.push((isa, Bf16Products::Bf16, format!("{name} bf16 products")));
        }
        kernels.push((isa, Bf16Products::F32, format!("{name} f32 products")));
    }
    println!(
        "{}, {threads} threads, {tokens} token(s) per step",
        cpu_name()
    );
    let mut table = Vec::new();
    for shape in &SHAPES {
        let h = shape.hidden;
        let layers: Vec<Layer> = (0..shape.layers as u64)
            .map(|l| Layer {
                qkv: [
                    weights(l * 8 + 1, shape.query * h),
                    weights(l * 8 + 2, shape.key_value * h),
                    weights(l * 8 + 3, shape.key_value * h),
                ],
                o: weights(l * 8 + 4, h * shape.query),
                gate_up: [
                    weights(l * 8 + 5, shape.intermediate * h),
                    weights(l * 8 + 6, shape.intermediate * h),
                ],
                down: weights(l * 8 + 7, h * shape.intermediate),
            })
            .collect();
        let head = weights(999, shape.vocab * h);
        let bytes_per_layer =
            2 * h * (shape.query + 2 * shape.key_value + shape.query + 3 * shape.intermediate);
        let bytes = (bytes_per_layer * shape.layers + 2 * head.len()) as f64;
        let x: Vec<f32> = (0..tokens * shape.intermediate.max(shape.query))
            .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let mut q = vec![0.0f32; tokens * shape.query];
        let mut k = vec![0.0f32; tokens * shape.key_value];
        let mut v = vec![0.0f32; tokens * shape.key_value];
        let mut hidden = vec![0.0f32; tokens * h];
        let mut mlp = vec![0.0f32; tokens * shape.intermediate];
        let mut logits = vec![0.0f32; tokens * shape.vocab];
        for (isa, products, kernel_name) in &kernels {
            let name = format!("{} {kernel_name}", shape.name);
            if !options.wants(&name) {
                continue;
            }
            let bench =
                Bf16Bench::new(*isa, *products, options.prefetch(), threads).expect("workers");
            let step = |parts: &mut [Duration; 5]| {
                let mut timed = |part: usize, run: &mut dyn FnMut()| {
                    let start = Instant::now();
                    run();
                    parts[part] += start.elapsed();
                };
                for layer in &layers {
                    let [wq, wk, wv] = &layer.qkv;
                    timed(0, &mut || {
                        bench
                            .qkv(
                                [wq, wk, wv],
                                &x[..tokens * h],
                                [&mut q, &mut k, &mut v],
                                tokens,
                            )
                            .expect("qkv")
                    });
                    timed(1, &mut || {
                        bench
                            .linear(&layer.o, &x[..tokens * shape.query], &mut hidden, tokens)
                            .expect("o")
                    });
                    let [gate, up] = &layer.gate_up;
                    timed(2, &mut || {
                        bench
                            .silu_gate([gate, up], &x[..tokens * h], &mut mlp, tokens)
                            .expect("gate/up")
                    });
                    timed(3, &mut || {
                        bench
                            .linear(
                                &layer.down,
                                &x[..tokens * shape.intermediate],
                                &mut hidden,
                                tokens,
                            )
                            .expect("down")
                    });
                }
                timed(4, &mut || {
                    bench
                        .linear(&head, &x[..tokens * h], &mut logits, tokens)
                        .expect("head")
                });
            };
            let (median, shares) = time_steps(options.seconds(), step);
            let gb_s = bytes / median.as_secs_f64() / 1e9;
            println!(
                "{name:<44} {:>8.3} ms/step {gb_s:>6.1} GB/s; {}",
                median.as_secs_f64() * 1e3,
                shares
            );
            table.push((name, median, gb_s));
        }
    }
    bandwidths.push(probe.measure().expect("bandwidth"));
    let bound = print_bandwidth(&bandwidths);
    print_step_table("model, level, products", &table, bound);
}
