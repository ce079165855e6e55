//! The linears against an f64 reference on every path and dtype, the fused launches against the plain ones, batch invariance, and a timing probe.

use super::*;
use crate::test_support::noise;
use crate::widen::widen_into;
use half::{bf16, f16};

/// The weights of one case in every dtype, and their exact f32 values for the reference.
struct Weights {
    f32s: Vec<f32>,
    f16_bits: Vec<u16>,
    bf16_bits: Vec<u16>,
}

impl Weights {
    fn new(len: usize) -> Weights {
        let raw: Vec<f32> = (0..len).map(|i| noise(7, i)).collect();
        Weights {
            f16_bits: raw.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
            bf16_bits: raw.iter().map(|&v| bf16::from_f32(v).to_bits()).collect(),
            f32s: raw,
        }
    }

    /// The weights stored in `dtype`.
    fn slice(&self, dtype: &str) -> FloatSlice<'_> {
        match dtype {
            "f32" => FloatSlice::F32(&self.f32s),
            "f16" => FloatSlice::F16(&self.f16_bits),
            "bf16" => FloatSlice::BF16(&self.bf16_bits),
            other => panic!("no dtype {other}"),
        }
    }

    /// The `dtype` weights as `order` stores them, for `K = inner`: panels hold bf16 only.
    fn stored(&self, order: WeightOrder, dtype: &str, inner: usize) -> Option<Stored<'_>> {
        match order {
            WeightOrder::Rows => Some(Stored::Rows(self.slice(dtype))),
            #[cfg(target_arch = "x86_64")]
            WeightOrder::Panels => {
                let mut bits = self.bf16_bits.clone();
                panels::arrange(&mut bits, inner, &mut Vec::new());
                (dtype == "bf16").then_some(Stored::Panels(bits))
            }
            #[cfg(not(target_arch = "x86_64"))]
            WeightOrder::Panels => {
                let _ = inner;
                None
            }
        }
    }

    /// The exact f32 values the `dtype` weights hold.
    fn exact(&self, dtype: &str) -> Vec<f32> {
        let mut values = vec![0.0; self.f32s.len()];
        widen_into(self.slice(dtype), 0, &mut values);
        values
    }
}

/// Weights as a kernel reads them.
enum Stored<'a> {
    Rows(FloatSlice<'a>),
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Panels(Vec<u16>),
}

impl Stored<'_> {
    fn slice(&self) -> FloatSlice<'_> {
        match self {
            Stored::Rows(slice) => *slice,
            Stored::Panels(bits) => FloatSlice::BF16(bits),
        }
    }
}

/// Widths for a kernel's tests: the panels need multiples of 32, the rest get widths
/// that leave partial panels.
fn width(kernel: Kernel, rows: usize) -> usize {
    match kernel.2 {
        WeightOrder::Rows => rows,
        WeightOrder::Panels => rows.div_ceil(32) * 32,
    }
}

/// Plain triple loop with f64 accumulation: each output, and the sum of its products'
/// magnitudes.
fn reference(x: &[f32], w: &[f32], shape: LinearShape) -> Vec<(f64, f64)> {
    let LinearShape {
        tokens,
        inner,
        outputs,
    } = shape;
    let mut out = vec![(0.0, 0.0); tokens * outputs];
    for t in 0..tokens {
        for n in 0..outputs {
            let (mut sum, mut magnitude) = (0.0f64, 0.0f64);
            for k in 0..inner {
                let product = f64::from(x[t * inner + k]) * f64::from(w[n * inner + k]);
                sum += product;
                magnitude += product.abs();
            }
            out[t * outputs + n] = (sum, magnitude);
        }
    }
    out
}

/// Every kernel this machine can run: at each of its levels, f32 products on weights in
/// the host's order and (from `avx2` up) in panels, and bf16 products where the level has
/// them; from `avx2` up, with and without the rows' and panels' software prefetch.
fn kernels() -> Vec<Kernel> {
    let hardware = RowPrefetch::Hardware;
    let mut kernels = Vec::new();
    for isa in Isa::every() {
        kernels.push((isa, Bf16Products::F32, WeightOrder::Rows, hardware));
        if cfg!(target_arch = "x86_64") && isa.has(IsaLevel::Avx2) {
            // The one-token FMA rows and panels with their hints, too.
            let software = RowPrefetch::Software;
            kernels.push((isa, Bf16Products::F32, WeightOrder::Rows, software));
            for prefetch in [hardware, software] {
                kernels.push((isa, Bf16Products::F32, WeightOrder::Panels, prefetch));
            }
        }
        if isa.has(IsaLevel::Avx512Bf16) {
            for prefetch in [hardware, RowPrefetch::Software] {
                kernels.push((isa, Bf16Products::Bf16, WeightOrder::Rows, prefetch));
            }
        }
    }
    kernels
}

/// The activations a kernel multiplies `dtype` weights with: rounded to bf16 on the
/// `vdpbf16ps` path, as they are otherwise.
fn activations_seen(kernel: Kernel, dtype: &str, x: &[f32]) -> Vec<f32> {
    if bf16_dot_products(kernel.0, kernel.1) && kernel.2 == WeightOrder::Rows && dtype == "bf16" {
        return x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    }
    x.to_vec()
}

#[test]
fn matches_the_reference_for_every_path_and_dtype() {
    // One token, token groups with a rest of 5, 3 and 5 tokens, a launch small enough to
    // stay on one thread, and 250 tokens (two token blocks). N is never a multiple of the
    // 6-row panels (but rounded up to 32 for weights in panels) and K never one of 8 or 16,
    // so every tail runs.
    let shapes = [
        (1, 1100, 300),
        (5, 300, 250),
        (3, 129, 53),
        (17, 515, 300),
        (64, 2000, 161),
        (250, 37, 40),
    ];
    for kernel in kernels() {
        for threads in [1, 2] {
            let workers = Workers::new(threads).unwrap();
            for (tokens, inner, outputs) in shapes {
                let outputs = width(kernel, outputs);
                let shape = LinearShape {
                    tokens,
                    inner,
                    outputs,
                };
                let x: Vec<f32> = (0..tokens * inner).map(|i| noise(3, i)).collect();
                let weights = Weights::new(outputs * inner);
                for dtype in ["f32", "f16", "bf16"] {
                    let Some(w) = weights.stored(kernel.2, dtype, inner) else {
                        continue;
                    };
                    let w_exact = weights.exact(dtype);
                    let mut out = vec![f32::NAN; tokens * outputs];
                    linear_on(kernel, &x, w.slice(), &mut out, shape, &workers).unwrap();
                    let x_seen = activations_seen(kernel, dtype, &x);
                    let expected = reference(&x_seen, &w_exact, shape);
                    for (i, (&got, &(want, magnitude))) in out.iter().zip(&expected).enumerate() {
                        // Sums of K products in f32: error ~ sqrt(K) ulp of the partial sums.
                        // The 8-lane dot products keep partial sums an eighth of the total
                        // of values below 1; weights in panels add an output in one chain,
                        // whose partial sums grow to the size of all its products.
                        let root = (inner as f64).sqrt();
                        let tolerance = match kernel.2 {
                            WeightOrder::Rows => 2e-6 * root,
                            WeightOrder::Panels => f64::from(f32::EPSILON) * root * magnitude,
                        };
                        assert!(
                            (f64::from(got) - want).abs() < tolerance,
                            "{kernel:?} {shape:?} {dtype} {threads} threads: \
                             out[{i}] = {got}, expected {want}"
                        );
                    }
                }
            }
        }
    }
}

/// `x · wᵀ` for the token rows of `x` in one launch, as f32 bits.
#[test]
fn fused_launches_give_the_bits_of_the_launches_they_replace() {
    let inner = 300;
    for kernel in kernels() {
        // Widths that leave partial panels of 6 rows: 40 = 6·6 + 4, 13 = 2·6 + 1; 103 =
        // 17·6 + 1 makes gated runs of 10 and 7 panels on one thread. In panels of 32: 64,
        // 32 and 128 (gated runs of 2, 2).
        let [q_width, kv_width, i_width] = [40, 13, 103].map(|rows| width(kernel, rows));
        let weights: Vec<Weights> = [q_width, kv_width, kv_width, i_width, i_width]
            .iter()
            .map(|n| Weights::new(n * inner))
            .collect();
        for threads in [1, 2] {
            let workers = Workers::new(threads).unwrap();
            for tokens in [1, 5, 70] {
                let x: Vec<f32> = (0..tokens * inner).map(|i| noise(17, i)).collect();
                for dtype in ["f32", "f16", "bf16"] {
                    let Some(stored) = weights
                        .iter()
                        .map(|w| w.stored(kernel.2, dtype, inner))
                        .collect::<Option<Vec<_>>>()
                    else {
                        continue;
                    };
                    let w: Vec<FloatSlice<'_>> = stored.iter().map(Stored::slice).collect();
                    let alone = |w: FloatSlice<'_>| launch_bits(kernel, &x, w, inner, &workers);
                    let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|v| v.to_bits()).collect() };
                    let case = format!("{kernel:?} {threads} threads T={tokens} {dtype}");

                    let mut q = vec![f32::NAN; tokens * q_width];
                    let mut k = vec![f32::NAN; tokens * kv_width];
                    let mut v = vec![f32::NAN; tokens * kv_width];
                    qkv_linear(
                        kernel,
                        &x,
                        [w[0], w[1], w[2]],
                        [&mut q, &mut k, &mut v],
                        (tokens, inner, [q_width, kv_width, kv_width]),
                        &workers,
                    )
                    .unwrap();
                    assert_eq!(bits(&q), alone(w[0]), "q, {case}");
                    assert_eq!(bits(&k), alone(w[1]), "k, {case}");
                    assert_eq!(bits(&v), alone(w[2]), "v, {case}");

                    let shape = LinearShape {
                        tokens,
                        inner,
                        outputs: i_width,
                    };
                    let mut fused = vec![f32::NAN; tokens * i_width];
                    silu_gate_linear(kernel, &x, [w[3], w[4]], &mut fused, shape, &workers)
                        .unwrap();
                    let as_f32 =
                        |b: Vec<u32>| -> Vec<f32> { b.into_iter().map(f32::from_bits).collect() };
                    let (gate, up) = (as_f32(alone(w[3])), as_f32(alone(w[4])));
                    let mut expected = vec![f32::NAN; tokens * i_width];
                    let isa = kernel.0;
                    crate::elementwise::silu_mul(isa, &gate, &up, &mut expected, &workers);
                    assert_eq!(bits(&fused), bits(&expected), "silu gate, {case}");
                }
            }
        }
    }
}

#[test]
fn weights_of_one_launch_in_different_dtypes_are_refused() {
    let inner = 8;
    let (a, b) = (Weights::new(6 * inner), Weights::new(6 * inner));
    let x = vec![1.0; inner];
    let mut out = vec![0.0; 6];
    let shape = LinearShape {
        tokens: 1,
        inner,
        outputs: 6,
    };
    let workers = Workers::new(1).unwrap();
    let result = silu_gate_linear(
        (
            Isa::detect(),
            Bf16Products::default(),
            WeightOrder::Rows,
            RowPrefetch::Hardware,
        ),
        &x,
        [a.slice("f32"), b.slice("bf16")],
        &mut out,
        shape,
        &workers,
    );
    assert!(result.is_err());
}

fn launch_bits(
    kernel: Kernel,
    x: &[f32],
    w: FloatSlice<'_>,
    inner: usize,
    workers: &Workers,
) -> Vec<u32> {
    let shape = LinearShape {
        tokens: x.len() / inner,
        inner,
        outputs: w.len() / inner,
    };
    let mut out = vec![f32::NAN; shape.tokens * shape.outputs];
    linear_on(kernel, x, w, &mut out, shape, workers).unwrap();
    out.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn a_tokens_output_does_not_depend_on_its_batch() {
    const BATCH: usize = 16;
    // K blocks of 256, 256 and 91 (not a multiple of 8) and N of 20 full panels and one of
    // 5 rows, big enough that even one token is split over two threads; then 250 tokens
    // (two token blocks), K blocks of 256 and 44, N of two full panels and one of 8 rows.
    // In panels, N is 11 and 2 panels of 32.
    for (tokens, inner, rows) in [(70, 603, 325), (250, 300, 40)] {
        let x: Vec<f32> = (0..tokens * inner).map(|i| noise(11, i)).collect();
        for (kernel, dtype) in kernels()
            .into_iter()
            .flat_map(|k| ["f32", "f16", "bf16"].map(|dtype| (k, dtype)))
        {
            let outputs = width(kernel, rows);
            let weights = Weights::new(outputs * inner);
            let Some(stored) = weights.stored(kernel.2, dtype, inner) else {
                continue;
            };
            let w = stored.slice();
            let mut on_one_thread = None;
            for threads in [1, 2] {
                let workers = Workers::new(threads).unwrap();
                let launch = |rows: &[f32]| launch_bits(kernel, rows, w, inner, &workers);
                let in_chunks_of =
                    |n: usize| -> Vec<u32> { x.chunks(n * inner).flat_map(launch).collect() };
                // Token `t` at position `t % BATCH` among other tokens.
                let inside_batches: Vec<u32> = (0..tokens)
                    .flat_map(|t| {
                        let position = t % BATCH;
                        let mut batch: Vec<f32> = (0..BATCH * inner)
                            .map(|i| noise(13 + t as u64, i))
                            .collect();
                        batch[position * inner..(position + 1) * inner]
                            .copy_from_slice(&x[t * inner..(t + 1) * inner]);
                        launch(&batch)[position * outputs..(position + 1) * outputs].to_vec()
                    })
                    .collect();
                let whole = launch(&x);
                let mut ways = vec![
                    ("one at a time", in_chunks_of(1)),
                    ("in pairs", in_chunks_of(2)),
                    ("in chunks of 3", in_chunks_of(3)),
                    ("inside batches of 16", inside_batches),
                ];
                if let Some(bits) = on_one_thread.take() {
                    ways.push(("on one thread", bits));
                }
                for (way, bits) in ways {
                    if let Some(i) = (0..whole.len()).find(|&i| bits[i] != whole[i]) {
                        panic!(
                            "{kernel:?} T={tokens} K={inner} N={outputs} {dtype} \
                             {threads} threads: token {} output {} is {} {way}, {} in one batch",
                            i / outputs,
                            i % outputs,
                            f32::from_bits(bits[i]),
                            f32::from_bits(whole[i])
                        );
                    }
                }
                on_one_thread = Some(whole);
            }
        }
    }
}

#[test]
fn rounding_to_bf16_matches_round_to_nearest_even() {
    #[cfg(target_arch = "x86_64")]
    if Isa::detect().has(IsaLevel::Avx512Bf16) {
        // 37 values: two full vectors and a masked tail; ties, signs and tiny values.
        let x: Vec<f32> = (0..37)
            .map(|i| match i {
                0 => f32::from_bits(0x3f80_8000), // a tie, rounds to even (down)
                1 => f32::from_bits(0x3f81_8000), // a tie, rounds to even (up)
                _ => noise(19, i) * 10f32.powi(i as i32 % 7 - 3),
            })
            .collect();
        let mut bits = vec![0u16; x.len()];
        // SAFETY: checked above.
        unsafe { avx512::round_row_to_bf16(&x, &mut bits) };
        let expected: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        assert_eq!(bits, expected);
    }
}

#[test]
fn an_empty_inner_dimension_gives_zeros() {
    let mut out = vec![f32::NAN; 6];
    let shape = LinearShape {
        tokens: 2,
        inner: 0,
        outputs: 3,
    };
    linear(
        (&[], FloatSlice::F32(&[])),
        &mut out,
        shape,
        (Isa::detect(), Bf16Products::default()),
        &Workers::new(1).unwrap(),
    );
    assert_eq!(out, vec![0.0; 6]);
}

/// Weight bandwidth (T=1), a 16-stream decode step (T=16) and arithmetic rate (T=128) of an
/// MLP-sized `linear` (SmolLM2's 576 → 1536), single- and two-thread.
/// `cargo test --release -p plughost-device-cpu -- --ignored --nocapture`
///
/// "hot" runs one weight matrix over and over (it stays in the 32 MiB L3 of the test
/// machine); "cold" cycles through copies adding up to 256 MiB, so weights come from DRAM as
/// in a real decode step.
#[test]
#[ignore = "timing, not a test"]
fn linear_timing() {
    use std::time::Instant;
    let (inner, outputs) = (576, 1536);
    let weights = Weights::new(outputs * inner);
    for threads in [1, 2] {
        let workers = Workers::new(threads).unwrap();
        let rows = WeightOrder::Rows;
        let cases = [
            ("f32", Bf16Products::F32, rows),
            ("bf16", Bf16Products::F32, rows),
            ("bf16", Bf16Products::F32, WeightOrder::Panels),
            ("bf16", Bf16Products::Bf16, rows),
            ("f16", Bf16Products::F32, rows),
        ];
        for (dtype, products, order) in cases {
            let kernel = (Isa::detect(), products, order, RowPrefetch::Hardware);
            if !kernels().contains(&kernel) {
                continue;
            }
            let element_bytes = if dtype == "f32" { 4 } else { 2 };
            let weight_bytes = (outputs * inner * element_bytes) as f64;
            let sources: Vec<Weights> = (0..(256 << 20) / (outputs * inner * element_bytes))
                .map(|_| Weights {
                    f32s: weights.f32s.clone(),
                    f16_bits: weights.f16_bits.clone(),
                    bf16_bits: weights.bf16_bits.clone(),
                })
                .collect();
            let copies: Vec<Stored> = sources
                .iter()
                .filter_map(|w| w.stored(order, dtype, inner))
                .collect();
            let Some(hot) = weights.stored(order, dtype, inner) else {
                continue;
            };
            for (tokens, temperature) in [(1, "hot"), (1, "cold"), (16, "cold"), (128, "hot")] {
                let shape = LinearShape {
                    tokens,
                    inner,
                    outputs,
                };
                let x: Vec<f32> = (0..tokens * inner).map(|i| noise(3, i)).collect();
                let mut out = vec![0.0; tokens * outputs];
                let pick = |i: usize| match temperature {
                    "hot" => hot.slice(),
                    _ => copies[i % copies.len()].slice(),
                };
                let run = |w, out: &mut [f32]| {
                    linear_on(kernel, &x, w, out, shape, &workers).unwrap();
                };
                run(pick(0), &mut out);
                let repeats = if tokens == 1 { 400 } else { 10 };
                let started = Instant::now();
                for i in 0..repeats {
                    run(pick(i + 1), &mut out);
                }
                let seconds = started.elapsed().as_secs_f64() / repeats as f64;
                let flops = 2.0 * (tokens * inner * outputs) as f64;
                println!(
                    "linear T={tokens:<3} K={inner} N={outputs} {dtype:<4} {products:?} {order:?} \
                     {temperature:<4} threads={threads}: {:8.1} us {:6.1} GB/s of weights {:6.1} GFLOP/s",
                    seconds * 1e6,
                    weight_bytes / seconds / 1e9,
                    flops / seconds / 1e9
                );
            }
        }
    }
}
