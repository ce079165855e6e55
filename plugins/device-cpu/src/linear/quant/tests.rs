//! The block-quantized linears against the `gguf` Python package's dequantization (`reference.json`, made by `tests/reference/gguf_blocks_reference.py`), on every path the CPU has, alone, in a batch and chunked.

use super::*;
use crate::isa::IsaLevel;
use crate::test_support::noise;

struct Case {
    dtype: DType,
    /// Two weight rows.
    rows: Vec<u8>,
    values: Vec<f32>,
    x: Vec<f32>,
    exact: Vec<f64>,
    quantized: Vec<f64>,
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

fn hex_f32(text: &str) -> Vec<f32> {
    hex(text)
        .chunks_exact(4)
        .map(|b| f32::from_bits(u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
        .collect()
}

const INNER: usize = 512;

fn cases() -> Vec<Case> {
    let json: serde_json::Value =
        serde_json::from_str(include_str!("reference.json")).expect("reference.json");
    assert_eq!(json["inner"], INNER);
    DType::BLOCK_QUANTIZED
        .iter()
        .map(|&dtype| {
            let case = &json["cases"][dtype.name()];
            let strings = |key: &str| -> Vec<String> {
                case[key]
                    .as_array()
                    .expect(key)
                    .iter()
                    .map(|v| v.as_str().expect(key).to_string())
                    .collect()
            };
            let floats = |key: &str| -> Vec<f64> {
                case[key]
                    .as_array()
                    .expect(key)
                    .iter()
                    .map(|v| v.as_f64().expect(key))
                    .collect()
            };
            Case {
                dtype,
                rows: strings("rows").iter().flat_map(|r| hex(r)).collect(),
                values: strings("values").iter().flat_map(|r| hex_f32(r)).collect(),
                x: hex_f32(case["x"].as_str().expect("x")),
                exact: floats("exact"),
                quantized: floats("quantized"),
            }
        })
        .collect()
}

/// Every level this CPU has, from the portable path up: `avx2` and `avx512` run the
/// `vpmaddubsw` tiles, `avx512_vnni` and above the `vpdpbusd` ones.
fn paths() -> Vec<Isa> {
    Isa::every()
}

#[test]
fn dequantization_matches_the_gguf_package_exactly() {
    for case in cases() {
        let values =
            plughost_device_abi::blocks::dequantize(case.dtype, &case.rows).expect("whole blocks");
        assert_eq!(values.len(), case.values.len(), "{}", case.dtype);
        for (k, (ours, theirs)) in values.iter().zip(&case.values).enumerate() {
            assert_eq!(ours.to_bits(), theirs.to_bits(), "{} value {k}", case.dtype);
        }
    }
}

#[test]
fn dot_products_match_the_reference_on_every_path() {
    for case in cases() {
        let block = dots::activation_block(case.dtype);
        let mut rows = Q8Rows::default();
        rows.quantize(&case.x, INNER, block, ActivationDigits::Two);
        let mut first_level = Q8Rows::default();
        first_level.quantize(&case.x, INNER, block, ActivationDigits::One);
        let row_bytes = case.rows.len() / 2;
        for (r, w) in case.rows.chunks_exact(row_bytes).enumerate() {
            // Scale of the sum: the error of f32 arithmetic is relative to it.
            let magnitude: f64 = case.values[r * INNER..(r + 1) * INNER]
                .iter()
                .zip(&case.x)
                .map(|(&w, &x)| f64::from(w * x).abs())
                .sum();
            let mut bits = Vec::new();
            // The hints ask for lines early and change no result.
            let kernels = paths()
                .into_iter()
                .flat_map(|isa| RowPrefetch::ALL.map(|prefetch| (isa, prefetch)));
            for (isa, prefetch) in kernels {
                let kernel = RowKernel { isa, prefetch };
                let dot = |rows: &Q8Rows| {
                    let mut out = [0.0f32];
                    let w = QuantMatrix {
                        dtype: case.dtype,
                        bytes: w,
                        rows: 1,
                        grouped: false,
                    };
                    let mut tiles = Q8Tiles::default();
                    if let Some(width) = kernel.group_tokens()
                        && interleaved::groups(case.dtype)
                    {
                        tiles.regroup(rows, 1, width);
                    }
                    kernel.group_into(w, (rows, &tiles), (0..1, 0..1), &mut out);
                    f64::from(out[0])
                };
                let (one_level, ours) = (dot(&first_level), dot(&rows));
                let name = format!("{} row {r} at {}, {prefetch:?}", case.dtype, isa.level());
                // One digit against the same int8 activations (llama.cpp's arithmetic): only
                // f32 rounding differs.
                assert!(
                    (one_level - case.quantized[r]).abs() <= 1e-5 * magnitude,
                    "{name}: {one_level} vs {} (scale {magnitude})",
                    case.quantized[r]
                );
                // Both digits against f32 activations: within the residual's rounding.
                assert!(
                    (ours - case.exact[r]).abs() <= 1e-4 * magnitude,
                    "{name}: {ours} vs exact {} (scale {magnitude})",
                    case.exact[r]
                );
                bits.push((ours.to_bits(), one_level.to_bits()));
            }
            assert!(
                bits.windows(2).all(|p| p[0] == p[1]),
                "{} row {r}: the paths disagree",
                case.dtype
            );
        }
    }
}

/// Both activation digit counts: every property below holds for each.
const DIGITS: [ActivationDigits; 2] = [ActivationDigits::One, ActivationDigits::Two];

/// A device context of `threads` threads at `isa`.
fn context(isa: Isa, threads: usize) -> Context {
    context_with(isa, ActivationDigits::Two, threads)
}

/// A device context of `threads` threads at `isa`, quantizing activations to `digits`.
fn context_with(isa: Isa, digits: ActivationDigits, threads: usize) -> Context {
    Context {
        workers: Workers::new(threads).expect("workers"),
        scratch: Vec::new(),
        isa,
        bf16_products: Default::default(),
        activation_digits: digits,
        prefetch: Default::default(),
        attention: Default::default(),
    }
}

/// `tokens` rows of activations times `w` (`rows` rows) through a whole launch's code.
fn launch_rows(
    (isa, digits): (Isa, ActivationDigits),
    w: QuantMatrix<'_>,
    x: &[f32],
    threads: usize,
) -> Vec<f32> {
    let context = context_with(isa, digits, threads);
    let tokens = x.len() / INNER;
    let mut out = vec![f32::NAN; tokens * w.rows];
    let outs = [SharedOut::new(&mut out, w.rows)];
    multiply(&context, x, (tokens, INNER), &[w], &Outputs::Each(&outs)).expect("launch");
    out
}

#[test]
fn a_row_gives_the_same_bits_alone_in_a_batch_and_chunked() {
    let tokens = 16;
    let x: Vec<f32> = (0..tokens * INNER).map(|i| noise(3, i) * 4.0).collect();
    for case in cases() {
        let w = QuantMatrix {
            dtype: case.dtype,
            bytes: &case.rows,
            rows: 2,
            grouped: false,
        };
        for (isa, digits) in paths().into_iter().flat_map(|isa| DIGITS.map(|d| (isa, d))) {
            let at = (isa, digits);
            let batch = launch_rows(at, w, &x, 2);
            for t in 0..tokens {
                let alone = launch_rows(at, w, &x[t * INNER..(t + 1) * INNER], 1);
                assert_eq!(
                    alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    batch[t * 2..t * 2 + 2]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    "{} token {t} at {}, {digits:?} digits",
                    case.dtype,
                    isa.level()
                );
            }
            // Chunks of 5, 5 and 6 tokens, as a chunked prefill runs them.
            let mut chunked = Vec::new();
            for range in [0..5, 5..10, 10..16] {
                chunked.extend(launch_rows(
                    at,
                    w,
                    &x[range.start * INNER..range.end * INNER],
                    2,
                ));
            }
            assert_eq!(
                chunked.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                batch.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{} chunked at {}, {digits:?} digits",
                case.dtype,
                isa.level()
            );
        }
    }
}

#[test]
fn the_fused_launches_match_the_plain_ones() {
    let tokens = 3;
    let x: Vec<f32> = (0..tokens * INNER).map(|i| noise(5, i)).collect();
    let all = cases();
    let (gate, up) = (&all[4], &all[3]);
    fn matrix(case: &Case) -> QuantMatrix<'_> {
        QuantMatrix {
            dtype: case.dtype,
            bytes: &case.rows,
            rows: 2,
            grouped: false,
        }
    }
    for isa in paths() {
        let context = context(isa, 2);
        let weights = [matrix(gate), matrix(up)];
        for digits in DIGITS {
            let what = "silu gate (Q6_K gate, Q4_K up)";
            check_gated((isa, digits), weights, &x, INNER, what);
        }
        // Three matrices of three types in one launch, as a Q4_K_M layer's q, k and v.
        let (q, k, v) = (matrix(&all[3]), matrix(&all[4]), matrix(&all[0]));
        let mut outs = [
            vec![0.0; tokens * 2],
            vec![0.0; tokens * 2],
            vec![0.0; tokens * 2],
        ];
        {
            let [a, b, c] = &mut outs;
            let shared = [
                SharedOut::new(a, 2),
                SharedOut::new(b, 2),
                SharedOut::new(c, 2),
            ];
            multiply(
                &context,
                &x,
                (tokens, INNER),
                &[q, k, v],
                &Outputs::Each(&shared),
            )
            .expect("launch");
        }
        for (out, w) in outs.iter().zip([q, k, v]) {
            assert_eq!(
                out,
                &launch_rows((isa, ActivationDigits::Two), w, &x, 1),
                "{} at {}",
                w.dtype,
                isa.level()
            );
        }
    }
}

#[test]
fn weights_that_are_not_whole_rows_are_an_error() {
    let case = &cases()[0];
    let w = QuantMatrix {
        dtype: case.dtype,
        bytes: &case.rows[..case.rows.len() - 1],
        rows: 2,
        grouped: false,
    };
    let context = context(Isa::at(IsaLevel::Portable).expect("portable"), 1);
    let mut out = vec![0.0; 2];
    let outs = [SharedOut::new(&mut out, 2)];
    let error = multiply(&context, &case.x, (1, INNER), &[w], &Outputs::Each(&outs)).unwrap_err();
    assert!(
        error.message().contains("do not hold 2 rows"),
        "{}",
        error.message()
    );
}

/// `rows` rows of `inner` values of `dtype` blocks: noise bytes, with every f16 scale a
/// finite value of either sign (noise scales could be infinities or NaNs, whose payloads
/// say nothing about the sums).
fn noise_blocks(dtype: DType, rows: usize, inner: usize, seed: u64) -> Vec<u8> {
    let total = dtype
        .tensor_bytes(rows as u64, inner as u64)
        .expect("whole blocks") as usize;
    let mut w: Vec<u8> = (0..total)
        .map(|i| (noise(seed, i) * 128.0 + 128.0) as u8)
        .collect();
    let offsets: &[usize] = match dtype {
        DType::Q4_1 | DType::Q4_K => &[0, 2],
        DType::Q6_K => &[208],
        _ => &[0],
    };
    for (b, block) in w.chunks_exact_mut(dots::block_bytes(dtype)).enumerate() {
        for &at in offsets {
            let scale = half::f16::from_f32(noise(seed + 1, 2 * b + at) * 0.01);
            block[at..at + 2].copy_from_slice(&scale.to_bits().to_le_bytes());
        }
    }
    w
}

#[test]
fn every_path_gives_the_portable_bits_on_odd_and_even_block_counts() {
    let portable = Isa::at(IsaLevel::Portable).expect("portable");
    for dtype in DType::BLOCK_QUANTIZED {
        let block = dots::activation_block(dtype);
        // One to five blocks: the odd counts leave a last block alone in the paired tiles.
        for blocks in 1..=5 {
            let (rows, inner, tokens) = (3, blocks * block, 7);
            let bytes = noise_blocks(dtype, rows, inner, blocks as u64);
            let w = QuantMatrix {
                dtype,
                bytes: &bytes,
                rows,
                grouped: false,
            };
            let mut x: Vec<f32> = (0..tokens * inner).map(|i| noise(11, i) * 3.0).collect();
            // A zero token and a huge value: scales of 0, and saturating activations.
            x[..inner].fill(0.0);
            x[inner] = 1e30;
            let launch = |isa: Isa, digits| {
                let context = context_with(isa, digits, 2);
                let mut out = vec![f32::NAN; tokens * rows];
                let outs = [SharedOut::new(&mut out, rows)];
                multiply(&context, &x, (tokens, inner), &[w], &Outputs::Each(&outs))
                    .expect("launch");
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            for digits in DIGITS {
                let expected = launch(portable, digits);
                for isa in paths() {
                    assert_eq!(
                        launch(isa, digits),
                        expected,
                        "{dtype}, {blocks} blocks, at {}, {digits:?} digits",
                        isa.level()
                    );
                }
            }
        }
    }
}

/// `x` (`tokens` rows of `inner`) times `w` through a whole launch's code at `isa` on
/// `threads` threads: the outputs' bits.
fn launch_bits(
    at: (Isa, ActivationDigits),
    w: QuantMatrix<'_>,
    x: &[f32],
    inner: usize,
    threads: usize,
) -> Vec<u32> {
    launch_bits_hinted(RowPrefetch::default(), at, w, x, inner, threads)
}

/// [`launch_bits`] with the tiles' hints as `prefetch` says.
fn launch_bits_hinted(
    prefetch: RowPrefetch,
    (isa, digits): (Isa, ActivationDigits),
    w: QuantMatrix<'_>,
    x: &[f32],
    inner: usize,
    threads: usize,
) -> Vec<u32> {
    let mut context = context_with(isa, digits, threads);
    context.prefetch = prefetch;
    let tokens = x.len() / inner;
    let mut out = vec![f32::NAN; tokens * w.rows];
    let outs = [SharedOut::new(&mut out, w.rows)];
    multiply(&context, x, (tokens, inner), &[w], &Outputs::Each(&outs)).expect("launch");
    out.iter().map(|v| v.to_bits()).collect()
}

/// Checks that the gated launch of `gate` and `up` at `isa` gives the bits of two plain
/// launches and `silu_mul`.
fn check_gated(
    (isa, digits): (Isa, ActivationDigits),
    [gate, up]: [QuantMatrix<'_>; 2],
    x: &[f32],
    inner: usize,
    what: &str,
) {
    let tokens = x.len() / inner;
    let float = |w| -> Vec<f32> {
        let bits = launch_bits((isa, digits), w, x, inner, 1);
        bits.into_iter().map(f32::from_bits).collect()
    };
    let (g, u) = (float(gate), float(up));
    let mut expected = vec![0.0; g.len()];
    silu_mul_span(isa, &g, &u, &mut expected);
    let mut out = vec![f32::NAN; g.len()];
    let shared = SharedOut::new(&mut out, gate.rows);
    let outputs = Outputs::SiluGate(shared);
    let context = context_with(isa, digits, 2);
    multiply(&context, x, (tokens, inner), &[gate, up], &outputs).expect("launch");
    let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let at = isa.level();
    assert_eq!(
        bits(&out),
        bits(&expected),
        "{what} at {at}, {digits:?} digits"
    );
}

/// Every type on the group tiles: weights interleaved as a launch keeps them and in the
/// host's order give the portable path's bits, for row counts that are no multiple of 16 (a
/// partial last group) and token counts that fill no whole tile, alone and in a batch, on
/// one thread and two; block counts odd (a last block alone) and even.
#[test]
fn groups_give_the_portable_bits_for_any_rows_and_tokens() {
    let portable = Isa::at(IsaLevel::Portable).expect("portable");
    let shapes = [(3, 16), (3, 17), (4, 40), (2, 5), (1, 33)];
    let cases = DType::BLOCK_QUANTIZED
        .into_iter()
        .flat_map(|t| shapes.map(|s| (t, s)));
    for (dtype, (blocks, rows)) in cases {
        let inner = dots::activation_block(dtype) * blocks;
        let bytes = noise_blocks(dtype, rows, inner, (rows + blocks) as u64);
        let mut arranged = bytes.clone();
        interleaved::arrange(dtype, &mut arranged, inner, &mut Vec::new());
        let plain = QuantMatrix {
            dtype,
            bytes: &bytes,
            rows,
            grouped: false,
        };
        let grouped = QuantMatrix {
            bytes: &arranged,
            grouped: true,
            ..plain
        };
        let runs = [1, 2, 3, 4, 5, 7, 16, 17, 70]
            .into_iter()
            .flat_map(|tokens| DIGITS.map(|digits| (tokens, digits)));
        for (tokens, digits) in runs {
            let x: Vec<f32> = (0..tokens * inner).map(|i| noise(13, i) * 2.0).collect();
            let expected = launch_bits((portable, digits), plain, &x, inner, 1);
            for isa in paths() {
                let name = format!(
                    "{dtype}: {rows} rows of {blocks} blocks, {tokens} tokens at {}, {digits:?} \
                     digits",
                    isa.level()
                );
                let isa_digits = (isa, digits);
                let groups = RowKernel {
                    isa,
                    prefetch: RowPrefetch::Hardware,
                }
                .group_tokens()
                .is_some();
                assert_eq!(
                    launch_bits(isa_digits, plain, &x, inner, 2),
                    expected,
                    "{name}"
                );
                if groups {
                    // The hints ask for lines early and change no result.
                    for prefetch in RowPrefetch::ALL {
                        assert_eq!(
                            launch_bits_hinted(prefetch, isa_digits, grouped, &x, inner, 2),
                            expected,
                            "{name}, grouped, {prefetch:?}"
                        );
                    }
                    assert_eq!(
                        launch_bits(isa_digits, grouped, &x, inner, 1),
                        expected,
                        "{name}, grouped"
                    );
                }
                // Each token alone, as decode runs it.
                let w = if groups { grouped } else { plain };
                for t in [0, tokens - 1] {
                    let x = &x[t * inner..(t + 1) * inner];
                    let alone = launch_bits(isa_digits, w, x, inner, 2);
                    assert_eq!(
                        alone,
                        expected[t * rows..(t + 1) * rows],
                        "{name}, token {t} alone"
                    );
                }
            }
        }
    }
}

/// Decode launches one after another on the same two threads, where each thread quantizes
/// the lone token for itself: every launch, over matrices of both activation block sizes at
/// once, gives the bits of a fresh one-thread launch, so no thread reuses an earlier
/// launch's activations.
#[test]
fn lone_tokens_launched_in_turn_on_shared_threads_give_fresh_bits() {
    let portable = Isa::at(IsaLevel::Portable).expect("portable");
    // Six groups of rows, so both threads take some; 512 values: whole blocks of 32 and 256.
    let (rows, inner) = (6 * GROUP, 512);
    let order = [
        DType::Q8_0,
        DType::Q4_K,
        DType::Q4_K,
        DType::Q6_K,
        DType::Q4_0,
    ];
    let matrices: Vec<(DType, Vec<u8>, Vec<u8>)> = order
        .iter()
        .enumerate()
        .map(|(seed, &dtype)| {
            let bytes = noise_blocks(dtype, rows, inner, 40 + seed as u64);
            let mut arranged = bytes.clone();
            interleaved::arrange(dtype, &mut arranged, inner, &mut Vec::new());
            (dtype, bytes, arranged)
        })
        .collect();
    for (isa, digits) in paths().into_iter().flat_map(|isa| DIGITS.map(|d| (isa, d))) {
        let grouped = RowKernel {
            isa,
            prefetch: RowPrefetch::Hardware,
        }
        .group_tokens()
        .is_some();
        let context = context_with(isa, digits, 2);
        for step in 0..matrices.len() {
            // This step's matrix beside the next one: a launch meets two block sizes.
            let pair = [&matrices[step], &matrices[(step + 1) % matrices.len()]];
            let x: Vec<f32> = (0..inner)
                .map(|i| noise(60 + step as u64, i) * 3.0)
                .collect();
            let plain = pair.map(|(dtype, bytes, _)| QuantMatrix {
                dtype: *dtype,
                bytes,
                rows,
                grouped: false,
            });
            let kept = pair.map(|(dtype, bytes, arranged)| QuantMatrix {
                dtype: *dtype,
                bytes: if grouped { arranged } else { bytes },
                rows,
                grouped,
            });
            let (mut first, mut second) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
            let outs = [
                SharedOut::new(&mut first, rows),
                SharedOut::new(&mut second, rows),
            ];
            multiply(&context, &x, (1, inner), &kept, &Outputs::Each(&outs)).expect("launch");
            for (w, out) in plain.into_iter().zip([&first, &second]) {
                assert_eq!(
                    out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    launch_bits((portable, digits), w, &x, inner, 1),
                    "step {step}, {} at {}, {digits:?} digits",
                    w.dtype,
                    isa.level()
                );
            }
        }
    }
}

/// The gated form over interleaved gate and up matrices (Q8_0 and Q4_1; Q6_K and Q4_K, a
/// Q4_K_M layer's) matches two plain launches and `silu_mul`, past a partial group.
#[test]
fn groups_serve_the_gated_launch() {
    let (rows, tokens) = (21, 9);
    for (gate_type, up_type) in [(DType::Q8_0, DType::Q4_1), (DType::Q6_K, DType::Q4_K)] {
        let inner = 2 * dots::activation_block(gate_type);
        let gate = noise_blocks(gate_type, rows, inner, 31);
        let up = noise_blocks(up_type, rows, inner, 37);
        let x: Vec<f32> = (0..tokens * inner).map(|i| noise(41, i)).collect();
        let arranged = |dtype: DType, bytes: &[u8]| {
            let mut bytes = bytes.to_vec();
            interleaved::arrange(dtype, &mut bytes, inner, &mut Vec::new());
            bytes
        };
        let (gate_arranged, up_arranged) = (arranged(gate_type, &gate), arranged(up_type, &up));
        for isa in paths() {
            let grouped = RowKernel {
                isa,
                prefetch: RowPrefetch::Hardware,
            }
            .group_tokens()
            .is_some();
            let (gate, up) = if grouped {
                (&gate_arranged, &up_arranged)
            } else {
                (&gate, &up)
            };
            let matrix = |dtype, bytes| QuantMatrix {
                dtype,
                bytes,
                rows,
                grouped,
            };
            let gate = matrix(gate_type, &gate[..]);
            let up = matrix(up_type, &up[..]);
            let what = format!("{gate_type} gate, {up_type} up");
            for digits in DIGITS {
                check_gated((isa, digits), [gate, up], &x, inner, &what);
            }
        }
    }
}
