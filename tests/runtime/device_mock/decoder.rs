//! Whole programs on the mock device: a tiny decoder step that runs every callable deterministically, and each fused callable against the sequence it replaces.

use plughost::device::{ArgTag, BufferId, DType, Device, TensorArg};

use super::{arg, download_f32, launch, open_mock, upload, upload_f32, upload_i32};

/// The buffers of one tiny decoder step: T=3 tokens in S=2 sequences, hidden 8, vocab 10,
/// 2 query heads and 1 KV head of dim 4, 4 blocks of 4 slots, MLP width 6.
fn run_decoder_step(device: &mut Device) -> Vec<u8> {
    const T: u64 = 3;
    const S: u64 = 2;
    const H: u64 = 8;
    const V: u64 = 10;
    const HQ: u64 = 2;
    const HK: u64 = 1;
    const D: u64 = 4;
    const B: u64 = 4;
    const BS: u64 = 4;
    const M: u64 = 2;
    const I: u64 = 6;
    const E: u64 = 2;
    let eps = i64::from(1e-6f32.to_bits());
    // The rotary table for D = 4 and theta 10000: 1/10000^(0/4) and 1/10000^(2/4).
    let inv_freq = [1.0f32, 0.01].map(|f| i64::from(f.to_bits()));
    let scale = i64::from(0.5f32.to_bits());

    let ramp = |count: u64, step: f32| -> Vec<f32> {
        (0..count).map(|i| (i as f32 * step).sin()).collect()
    };
    // Weights in every precision a weight may have: bf16 embedding, f16 norm, f32 projections.
    let bf16_of = |values: &[f32]| -> Vec<u8> {
        values
            .iter()
            .flat_map(|value| ((value.to_bits() >> 16) as u16).to_le_bytes())
            .collect()
    };
    let f16_one = 0x3c00u16.to_le_bytes();

    let embedding = upload(device, &bf16_of(&ramp(V * H, 0.3)));
    let norm_weight = upload(device, &f16_one.repeat(H as usize));
    let head_norm_weight = upload_f32(device, &[1.0; D as usize]);
    let wq = upload_f32(device, &ramp(HQ * D * H, 0.7));
    // A bias on q, as Qwen2's projections have, in a checkpoint's half precision.
    let bq = upload(device, &bf16_of(&ramp(HQ * D, 0.2)));
    let wk = upload_f32(device, &ramp(HK * D * H, 1.1));
    let wv = upload_f32(device, &ramp(HK * D * H, 1.3));
    let wo = upload_f32(device, &ramp(H * HQ * D, 0.9));
    let w_gate = upload_f32(device, &ramp(I * H, 0.5));
    let w_up = upload_f32(device, &ramp(I * H, 0.6));
    let w_down = upload_f32(device, &ramp(H * I, 0.4));

    let ids = upload_i32(device, &[4, 7, 2]);
    let seq_lens = upload_i32(device, &[3, 5]);
    let query_start = upload_i32(device, &[0, 2, 3]);
    let block_table = upload_i32(device, &[0, 1, 2, 3]);
    let emitting_rows = upload_i32(device, &[1, 2]);
    let positions = device.alloc(T * 4).unwrap();
    let slot_mapping = device.alloc(T * 4).unwrap();

    let mut scratch = |elements: u64| device.alloc(elements * 4).unwrap();
    let hidden = scratch(T * H);
    let normed = scratch(T * H);
    let q = scratch(T * HQ * D);
    let k = scratch(T * HK * D);
    let v = scratch(T * HK * D);
    let key_cache = scratch(B * BS * HK * D);
    let value_cache = scratch(B * BS * HK * D);
    let attention = scratch(T * HQ * D);
    let projected = scratch(T * H);
    let gate = scratch(T * I);
    let up = scratch(T * I);
    let activated = scratch(T * I);
    let emitted = scratch(E * H);
    let logits = scratch(E * V);

    use ArgTag::{Inout, Input, Output, OutputExisting};
    use DType::{BF16, F16, F32, I32};
    let cache_shape = [B, HK, BS, D];
    let step_layout = [
        arg(block_table, I32, &[S, M], Input),
        arg(seq_lens, I32, &[S], Input),
        arg(query_start, I32, &[S + 1], Input),
    ];
    let attention_args = vec![
        arg(q, F32, &[T, HQ * D], Input),
        arg(key_cache, F32, &cache_shape, Input),
        arg(value_cache, F32, &cache_shape, Input),
        step_layout[0],
        step_layout[1],
        step_layout[2],
        arg(attention, F32, &[T, HQ * D], Output),
    ];
    let program: Vec<(&str, Vec<TensorArg>, Vec<i64>)> = vec![
        (
            "advance_seq_lens",
            vec![
                arg(seq_lens, I32, &[S], Inout),
                arg(query_start, I32, &[S + 1], Input),
            ],
            vec![],
        ),
        (
            "derive_positions",
            vec![
                step_layout[1],
                step_layout[2],
                arg(positions, I32, &[T], Output),
            ],
            vec![],
        ),
        (
            "derive_slot_mapping",
            vec![
                step_layout[0],
                step_layout[1],
                step_layout[2],
                arg(slot_mapping, I32, &[T], Output),
            ],
            vec![BS as i64],
        ),
        (
            "embedding_gather",
            vec![
                arg(ids, I32, &[T], Input),
                arg(embedding, BF16, &[V, H], Input),
                arg(hidden, F32, &[T, H], Output),
            ],
            vec![],
        ),
        (
            "rms_norm",
            vec![
                arg(hidden, F32, &[T, H], Input),
                arg(norm_weight, F16, &[H], Input),
                arg(normed, F32, &[T, H], Output),
            ],
            vec![eps],
        ),
        (
            "linear",
            vec![
                arg(normed, F32, &[T, H], Input),
                arg(wq, F32, &[HQ * D, H], Input),
                arg(q, F32, &[T, HQ * D], Output),
            ],
            vec![],
        ),
        (
            "bias_add",
            vec![
                arg(q, F32, &[T, HQ * D], Inout),
                arg(bq, BF16, &[HQ * D], Input),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(normed, F32, &[T, H], Input),
                arg(wk, F32, &[HK * D, H], Input),
                arg(k, F32, &[T, HK * D], Output),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(normed, F32, &[T, H], Input),
                arg(wv, F32, &[HK * D, H], Input),
                arg(v, F32, &[T, HK * D], Output),
            ],
            vec![],
        ),
        (
            "rms_norm_heads",
            vec![
                arg(q, F32, &[T, HQ * D], Inout),
                arg(head_norm_weight, F32, &[D], Input),
            ],
            vec![eps, D as i64],
        ),
        (
            "rotary",
            vec![
                arg(q, F32, &[T, HQ * D], Inout),
                arg(k, F32, &[T, HK * D], Inout),
                arg(positions, I32, &[T], Input),
            ],
            vec![D as i64, inv_freq[0], inv_freq[1]],
        ),
        (
            "kv_write",
            vec![
                arg(k, F32, &[T, HK * D], Input),
                arg(v, F32, &[T, HK * D], Input),
                arg(key_cache, F32, &cache_shape, OutputExisting),
                arg(value_cache, F32, &cache_shape, OutputExisting),
                arg(slot_mapping, I32, &[T], Input),
            ],
            vec![],
        ),
        (
            "paged_attention",
            attention_args.clone(),
            vec![HQ as i64, HK as i64, D as i64, BS as i64, scale],
        ),
        // The same attention within a window of 4 positions, into the same output.
        (
            "paged_attention_window",
            attention_args,
            vec![HQ as i64, HK as i64, D as i64, BS as i64, scale, 4],
        ),
        (
            "linear",
            vec![
                arg(attention, F32, &[T, HQ * D], Input),
                arg(wo, F32, &[H, HQ * D], Input),
                arg(projected, F32, &[T, H], Output),
            ],
            vec![],
        ),
        (
            "add",
            vec![
                arg(hidden, F32, &[T, H], Inout),
                arg(projected, F32, &[T, H], Input),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(hidden, F32, &[T, H], Input),
                arg(w_gate, F32, &[I, H], Input),
                arg(gate, F32, &[T, I], Output),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(hidden, F32, &[T, H], Input),
                arg(w_up, F32, &[I, H], Input),
                arg(up, F32, &[T, I], Output),
            ],
            vec![],
        ),
        (
            "silu_mul",
            vec![
                arg(gate, F32, &[T, I], Input),
                arg(up, F32, &[T, I], Input),
                arg(activated, F32, &[T, I], Output),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(activated, F32, &[T, I], Input),
                arg(w_down, F32, &[H, I], Input),
                arg(projected, F32, &[T, H], Output),
            ],
            vec![],
        ),
        (
            "add",
            vec![
                arg(hidden, F32, &[T, H], Inout),
                arg(projected, F32, &[T, H], Input),
            ],
            vec![],
        ),
        (
            "gather_rows",
            vec![
                arg(hidden, F32, &[T, H], Input),
                arg(emitting_rows, I32, &[E], Input),
                arg(emitted, F32, &[E, H], Output),
            ],
            vec![],
        ),
        (
            "linear",
            vec![
                arg(emitted, F32, &[E, H], Input),
                arg(embedding, BF16, &[V, H], Input),
                arg(logits, F32, &[E, V], Output),
            ],
            vec![],
        ),
    ];
    for (name, args, params) in &program {
        launch(device, name, args, params);
    }
    device.synchronize().unwrap();

    let mut logits_bytes = vec![0; (E * V * 4) as usize];
    device.read(logits, 0, &mut logits_bytes).unwrap();
    logits_bytes
}

/// Runs each fused callable and the sequence of callables it replaces on the same inputs;
/// returns (fused, sequence) outputs: q, k, v, the gated activation, the residual and the norm.
fn run_fused_and_sequences(device: &mut Device) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    use ArgTag::{Inout, Input, Output};
    use DType::{BF16, F32};
    const T: u64 = 3;
    const K: u64 = 8;
    const Q: u64 = 6;
    const R: u64 = 4;
    const I: u64 = 5;
    let ramp = |count: u64, step: f32| -> Vec<f32> {
        (0..count).map(|i| (i as f32 * step).cos()).collect()
    };
    let bf16_of = |values: &[f32]| -> Vec<u8> {
        values
            .iter()
            .flat_map(|value| ((value.to_bits() >> 16) as u16).to_le_bytes())
            .collect()
    };
    let x = upload_f32(device, &ramp(T * K, 0.3));
    let [wq, wk, wv, w_gate, w_up] = [(Q, 0.7), (R, 1.1), (R, 1.3), (I, 0.5), (I, 0.6)]
        .map(|(rows, step)| upload(device, &bf16_of(&ramp(rows * K, step))));
    let norm_weight = upload_f32(device, &ramp(K, 0.2));
    let eps = i64::from(1e-6f32.to_bits());
    let mut scratch = |elements: u64| device.alloc(elements * 4).unwrap();
    let [q1, q2] = [scratch(T * Q), scratch(T * Q)];
    let [k1, k2, v1, v2] = [0; 4].map(|_| scratch(T * R));
    let [act1, act2, gate, up] = [0; 4].map(|_| scratch(T * I));
    let [out1, out2] = [scratch(T * K), scratch(T * K)];
    let residual = ramp(T * K, 0.9);
    let [res1, res2] = [0; 2].map(|_| upload_f32(device, &residual));

    launch(
        device,
        "qkv_linear",
        &[
            arg(x, F32, &[T, K], Input),
            arg(wq, BF16, &[Q, K], Input),
            arg(wk, BF16, &[R, K], Input),
            arg(wv, BF16, &[R, K], Input),
            arg(q1, F32, &[T, Q], Output),
            arg(k1, F32, &[T, R], Output),
            arg(v1, F32, &[T, R], Output),
        ],
        &[],
    );
    for (w, out, n) in [(wq, q2, Q), (wk, k2, R), (wv, v2, R)] {
        let args = [
            arg(x, F32, &[T, K], Input),
            arg(w, BF16, &[n, K], Input),
            arg(out, F32, &[T, n], Output),
        ];
        launch(device, "linear", &args, &[]);
    }
    launch(
        device,
        "silu_gate_linear",
        &[
            arg(x, F32, &[T, K], Input),
            arg(w_gate, BF16, &[I, K], Input),
            arg(w_up, BF16, &[I, K], Input),
            arg(act1, F32, &[T, I], Output),
        ],
        &[],
    );
    for (w, out) in [(w_gate, gate), (w_up, up)] {
        let args = [
            arg(x, F32, &[T, K], Input),
            arg(w, BF16, &[I, K], Input),
            arg(out, F32, &[T, I], Output),
        ];
        launch(device, "linear", &args, &[]);
    }
    let silu_args = [
        arg(gate, F32, &[T, I], Input),
        arg(up, F32, &[T, I], Input),
        arg(act2, F32, &[T, I], Output),
    ];
    launch(device, "silu_mul", &silu_args, &[]);
    launch(
        device,
        "add_rms_norm",
        &[
            arg(res1, F32, &[T, K], Inout),
            arg(x, F32, &[T, K], Input),
            arg(norm_weight, F32, &[K], Input),
            arg(out1, F32, &[T, K], Output),
        ],
        &[eps],
    );
    let add_args = [arg(res2, F32, &[T, K], Inout), arg(x, F32, &[T, K], Input)];
    launch(device, "add", &add_args, &[]);
    let norm_args = [
        arg(res2, F32, &[T, K], Input),
        arg(norm_weight, F32, &[K], Input),
        arg(out2, F32, &[T, K], Output),
    ];
    launch(device, "rms_norm", &norm_args, &[eps]);
    device.synchronize().unwrap();

    let mut read = |buffers: [(BufferId, u64); 6]| {
        buffers
            .map(|(b, n)| download_f32(device, b, n as usize))
            .to_vec()
    };
    let fused = read([
        (q1, T * Q),
        (k1, T * R),
        (v1, T * R),
        (act1, T * I),
        (res1, T * K),
        (out1, T * K),
    ]);
    let sequences = read([
        (q2, T * Q),
        (k2, T * R),
        (v2, T * R),
        (act2, T * I),
        (res2, T * K),
        (out2, T * K),
    ]);
    (fused, sequences)
}

#[test]
fn fused_callables_equal_the_sequences_they_replace() {
    let (fused, sequences) = run_fused_and_sequences(&mut open_mock(""));
    assert_eq!(fused, sequences);
    // The inputs reached every output: no output is left as allocated.
    for values in &fused {
        assert!(values.iter().any(|v| *v != 0.0), "{values:?}");
        assert!(values.iter().all(|v| v.is_finite()), "{values:?}");
    }
}

#[test]
fn a_whole_decoder_step_runs_every_callable_deterministically() {
    let mut first_device = open_mock("");
    let first = run_decoder_step(&mut first_device);
    // The fused callables, which the step above does not use.
    run_fused_and_sequences(&mut first_device);
    let second = run_decoder_step(&mut open_mock(""));
    assert_eq!(first, second, "the mock device is not deterministic");
    let logits: Vec<f32> = first
        .chunks_exact(4)
        .map(|chunk| f32::from_le_bytes(chunk.try_into().unwrap()))
        .collect();
    assert!(logits.iter().all(|value| value.is_finite()), "{logits:?}");

    for name in first_device.callables().to_vec() {
        let index = first_device.callable_index(&name).unwrap();
        assert!(
            first_device.callable_launches(index) >= 1,
            "{name} never ran"
        );
    }
}
