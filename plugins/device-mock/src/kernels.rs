//! The mock device's callables: real math where it is linear-time, deterministic stand-ins for `linear` and `paged_attention`.
//!
//! Every callable reads all of its inputs and writes every element of its outputs, so a
//! wiring mistake in a program changes the results. The stand-ins:
//! * `linear`: `out[t,n] = x[t, n % K] * w[n, n % K] + mean(x[t,:]) + mean(w[n,:])`;
//! * `paged_attention`: each token attends only to its own slot:
//!   `out = 0.5 * q + 0.25 * k[slot] + 0.25 * v[slot]` per head (GQA head mapping), `scale` unused.

use plughost_device_abi::callables::CallableId;
use plughost_device_abi::export::{DeviceFailure, Launch};
use plughost_device_abi::kv_cache::CacheLayout;

use crate::step_inputs;

pub fn run(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    match launch.spec().id {
        CallableId::EmbeddingGather => embedding_gather(launch),
        CallableId::RmsNorm => rms_norm(launch),
        CallableId::RmsNormHeads => rms_norm_heads(launch),
        CallableId::Linear => linear(launch),
        CallableId::Rotary => rotary(launch),
        CallableId::KvWrite => kv_write(launch),
        // The mock's attention reads a token's own position only, inside any window.
        CallableId::PagedAttention | CallableId::PagedAttentionWindow => paged_attention(launch),
        CallableId::SiluMul => silu_mul(launch),
        CallableId::Add => add(launch),
        CallableId::GatherRows => gather_rows(launch),
        CallableId::AdvanceSeqLens => advance_seq_lens(launch),
        CallableId::DerivePositions => derive_positions(launch),
        CallableId::DeriveSlotMapping => derive_slot_mapping(launch),
        CallableId::QkvLinear => qkv_linear(launch),
        CallableId::SiluGateLinear => silu_gate_linear(launch),
        CallableId::AddRmsNorm => add_rms_norm(launch),
        CallableId::BiasAdd => bias_add(launch),
    }
}

/// `value` as an index below `len`.
fn index_below(value: i32, len: usize) -> Option<usize> {
    usize::try_from(value).ok().filter(|index| *index < len)
}

fn mean(values: &[f32]) -> f32 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f32>() / values.len() as f32
    }
}

/// Gathers `rows` of a `[_, width]` row-major matrix; an index out of range names `what`.
fn gather(
    matrix: &[f32],
    width: usize,
    num_rows: usize,
    indices: &[i32],
    what: &str,
) -> Result<Vec<f32>, DeviceFailure> {
    let mut out = Vec::with_capacity(indices.len() * width);
    for (position, &index) in indices.iter().enumerate() {
        let row = index_below(index, num_rows).ok_or_else(|| {
            DeviceFailure::launch_failed(format!(
                "{what}[{position}] = {index} is outside 0..{num_rows}"
            ))
        })?;
        out.extend_from_slice(&matrix[row * width..(row + 1) * width]);
    }
    Ok(out)
}

fn embedding_gather(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let ids = launch.read_i32("ids");
    let table = launch.read_f32("table");
    let out = gather(&table, launch.dim("H"), launch.dim("V"), &ids, "ids")?;
    launch.write_f32("out", &out);
    Ok(())
}

/// `x / sqrt(mean(x²) + eps) * weight` for each `weight.len()`-wide chunk of `values`, in place.
fn rms_normalize_chunks(values: &mut [f32], weight: &[f32], eps: f32) {
    if weight.is_empty() {
        return;
    }
    for chunk in values.chunks_exact_mut(weight.len()) {
        let mean_square = chunk.iter().map(|v| v * v).sum::<f32>() / chunk.len() as f32;
        let inverse_rms = 1.0 / (mean_square + eps).sqrt();
        for (value, scale) in chunk.iter_mut().zip(weight) {
            *value *= inverse_rms * scale;
        }
    }
}

fn rms_norm(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let mut x = launch.read_f32("x");
    rms_normalize_chunks(&mut x, &launch.read_f32("weight"), launch.param_f32("eps"));
    launch.write_f32("out", &x);
    Ok(())
}

fn rms_norm_heads(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let mut x = launch.read_f32("x");
    rms_normalize_chunks(&mut x, &launch.read_f32("weight"), launch.param_f32("eps"));
    launch.write_f32("x", &x);
    Ok(())
}

fn linear(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let shape = (launch.dim("T"), launch.dim("K"), launch.dim("N"));
    let out = linear_stand_in(&launch.read_f32("x"), &launch.read_f32("w"), shape);
    launch.write_f32("out", &out);
    Ok(())
}

/// The `linear` stand-in over `x[T,K]` and `w[N,K]`, returning `out[T,N]`.
fn linear_stand_in(
    x: &[f32],
    w: &[f32],
    (num_tokens, inner, num_outputs): (usize, usize, usize),
) -> Vec<f32> {
    let mut out = vec![0.0; num_tokens * num_outputs];
    if inner > 0 {
        let x_rows: Vec<&[f32]> = x.chunks_exact(inner).collect();
        let w_rows: Vec<&[f32]> = w.chunks_exact(inner).collect();
        let w_means: Vec<f32> = w_rows.iter().map(|row| mean(row)).collect();
        for (x_row, out_row) in x_rows.iter().zip(out.chunks_exact_mut(num_outputs)) {
            let x_mean = mean(x_row);
            for (n, value) in out_row.iter_mut().enumerate() {
                let column = n % inner;
                *value = x_row[column] * w_rows[n][column] + x_mean + w_means[n];
            }
        }
    }
    out
}

/// Rotate-half (NeoX) rotary embedding of every `head_dim`-wide head of `row`, in place.
fn rotate_heads(row: &mut [f32], position: f32, inv_freq: &[f32]) {
    let half = inv_freq.len();
    for head in row.chunks_exact_mut(2 * half) {
        for (i, &inverse_frequency) in inv_freq.iter().enumerate() {
            let (sin, cos) = (position * inverse_frequency).sin_cos();
            let (first, second) = (head[i], head[i + half]);
            head[i] = first * cos - second * sin;
            head[i + half] = second * cos + first * sin;
        }
    }
}

fn rotary(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let head_dim = launch.dim("D");
    let inv_freq = launch.param_f32_table("inv_freq");
    let positions = launch.read_i32("positions");
    let mut q = launch.read_f32("q");
    let mut k = launch.read_f32("k");
    let q_width = launch.dim("Hq") * head_dim;
    let k_width = launch.dim("Hk") * head_dim;
    for (row, &position) in positions.iter().enumerate() {
        let position = position as f32;
        rotate_heads(
            &mut q[row * q_width..(row + 1) * q_width],
            position,
            &inv_freq,
        );
        rotate_heads(
            &mut k[row * k_width..(row + 1) * k_width],
            position,
            &inv_freq,
        );
    }
    launch.write_f32("q", &q);
    launch.write_f32("k", &k);
    Ok(())
}

/// The launch's KV cache layout.
fn cache_layout(launch: &Launch<'_>) -> CacheLayout {
    CacheLayout {
        block_size: launch.dim("bs"),
        num_kv_heads: launch.dim("Hk"),
        head_dim: launch.dim("D"),
    }
}

fn kv_write(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let num_slots = launch.dim("B") * launch.dim("bs");
    let layout = cache_layout(launch);
    let (head_dim, width) = (layout.head_dim, layout.slot_width());
    let k = launch.read_f32("k");
    let v = launch.read_f32("v");
    let slot_mapping = launch.read_i32("slot_mapping");
    // Check every slot before writing any, so a failed launch leaves the caches untouched.
    let mut targets = Vec::with_capacity(slot_mapping.len());
    for (row, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue; // padding row
        }
        let slot = index_below(slot, num_slots).ok_or_else(|| {
            DeviceFailure::launch_failed(format!(
                "slot_mapping[{row}] = {slot} is outside the {num_slots} cache slots"
            ))
        })?;
        targets.push((row, slot));
    }
    for (row, slot) in targets {
        for kv_head in 0..layout.num_kv_heads {
            let source = row * width + kv_head * head_dim;
            let source = source..source + head_dim;
            let target = layout.row(slot, kv_head);
            launch.write_float_at("key_cache", target, &k[source.clone()]);
            launch.write_float_at("value_cache", target, &v[source]);
        }
    }
    Ok(())
}

fn paged_attention(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let num_tokens = launch.dim("T");
    let (num_heads, num_kv_heads, head_dim) = (launch.dim("Hq"), launch.dim("Hk"), launch.dim("D"));
    let (block_size, num_blocks, blocks_per_seq) =
        (launch.dim("bs"), launch.dim("B"), launch.dim("M"));
    let heads_per_kv_head = num_heads / num_kv_heads;
    let layout = cache_layout(launch);
    let q = launch.read_f32("q");
    let block_table = launch.read_i32("block_table");
    let spans = step_inputs::sequence_spans(
        &launch.read_i32("seq_lens"),
        &launch.read_i32("query_start"),
        num_tokens,
    )
    .map_err(DeviceFailure::launch_failed)?;

    let q_width = num_heads * head_dim;
    let mut out = vec![0.0; num_tokens * q_width];
    for (seq, span) in spans.iter().enumerate() {
        let block_row = &block_table[seq * blocks_per_seq..(seq + 1) * blocks_per_seq];
        for (row, position) in span.rows_and_positions() {
            let slot = step_inputs::slot_of(block_row, block_size, position)
                .ok()
                .filter(|slot| slot / block_size < num_blocks)
                .ok_or_else(|| {
                    DeviceFailure::launch_failed(format!(
                        "sequence {seq}: position {position} maps to no slot of the {num_blocks} cache blocks"
                    ))
                })?;
            for head in 0..num_heads {
                let kv_head = head / heads_per_kv_head;
                let at = layout.row(slot, kv_head);
                let keys = launch.read_f32_at("key_cache", at, head_dim);
                let values = launch.read_f32_at("value_cache", at, head_dim);
                for d in 0..head_dim {
                    let q_index = row * q_width + head * head_dim + d;
                    out[q_index] = 0.5 * q[q_index] + 0.25 * keys[d] + 0.25 * values[d];
                }
            }
        }
    }
    launch.write_f32("out", &out);
    Ok(())
}

fn silu_mul(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let out = silu_times(&launch.read_f32("gate"), &launch.read_f32("up"));
    launch.write_f32("out", &out);
    Ok(())
}

fn silu_times(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect()
}

fn add(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let y = launch.read_f32("y");
    let mut x = launch.read_f32("x");
    for (x, y) in x.iter_mut().zip(&y) {
        *x += y;
    }
    launch.write_f32("x", &x);
    Ok(())
}

fn bias_add(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let bias = launch.read_f32("bias");
    let mut x = launch.read_f32("x");
    for row in x.chunks_exact_mut(bias.len().max(1)) {
        for (x, b) in row.iter_mut().zip(&bias) {
            *x += b;
        }
    }
    launch.write_f32("x", &x);
    Ok(())
}

/// The fused callables are exactly the sequences they replace, so a program may use either.
fn qkv_linear(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let (num_tokens, inner) = (launch.dim("T"), launch.dim("K"));
    let x = launch.read_f32("x");
    for (w, out, width) in [("wq", "q", "Q"), ("wk", "k", "R"), ("wv", "v", "R")] {
        let shape = (num_tokens, inner, launch.dim(width));
        let values = linear_stand_in(&x, &launch.read_f32(w), shape);
        launch.write_f32(out, &values);
    }
    Ok(())
}

fn silu_gate_linear(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let shape = (launch.dim("T"), launch.dim("K"), launch.dim("I"));
    let x = launch.read_f32("x");
    let gate = linear_stand_in(&x, &launch.read_f32("w_gate"), shape);
    let up = linear_stand_in(&x, &launch.read_f32("w_up"), shape);
    launch.write_f32("out", &silu_times(&gate, &up));
    Ok(())
}

fn add_rms_norm(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let y = launch.read_f32("y");
    let mut x = launch.read_f32("x");
    for (x, y) in x.iter_mut().zip(&y) {
        *x += y;
    }
    launch.write_f32("x", &x);
    rms_normalize_chunks(&mut x, &launch.read_f32("weight"), launch.param_f32("eps"));
    launch.write_f32("out", &x);
    Ok(())
}

fn gather_rows(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let x = launch.read_f32("x");
    let indices = launch.read_i32("indices");
    let out = gather(&x, launch.dim("H"), launch.dim("T"), &indices, "indices")?;
    launch.write_f32("out", &out);
    Ok(())
}

fn advance_seq_lens(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let mut seq_lens = launch.read_i32("seq_lens");
    step_inputs::advance_seq_lens(&mut seq_lens, &launch.read_i32("query_start"))
        .map_err(DeviceFailure::launch_failed)?;
    launch.write_i32("seq_lens", &seq_lens);
    Ok(())
}

fn derive_positions(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let positions = step_inputs::derive_positions(
        &launch.read_i32("seq_lens"),
        &launch.read_i32("query_start"),
        launch.dim("T"),
    )
    .map_err(DeviceFailure::launch_failed)?;
    launch.write_i32("positions", &positions);
    Ok(())
}

fn derive_slot_mapping(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let slots = step_inputs::derive_slot_mapping(
        &launch.read_i32("block_table"),
        launch.dim("M"),
        &launch.read_i32("seq_lens"),
        &launch.read_i32("query_start"),
        launch.dim("bs"),
        launch.dim("T"),
    )
    .map_err(DeviceFailure::launch_failed)?;
    launch.write_i32("slot_mapping", &slots);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_normalize_matches_the_definition() {
        let mut values = [3.0, 4.0, 0.0, 2.0];
        rms_normalize_chunks(&mut values, &[1.0, 2.0], 0.0);
        // Row rms: sqrt((9 + 16) / 2) and sqrt(4 / 2).
        let rms = (12.5f32).sqrt();
        assert_eq!(values, [3.0 / rms, 8.0 / rms, 0.0, 2.0 * 2.0 / 2f32.sqrt()]);
    }

    #[test]
    fn rotate_heads_at_position_zero_is_identity_and_preserves_norm() {
        let original = [1.0, 2.0, 3.0, 4.0];
        let mut row = original;
        rotate_heads(&mut row, 0.0, &[1.0, 0.01]);
        assert_eq!(row, original);
        rotate_heads(&mut row, 7.0, &[1.0, 0.01]);
        let norm = |values: &[f32]| values.iter().map(|v| v * v).sum::<f32>();
        assert!((norm(&row) - norm(&original)).abs() < 1e-4);
        // The first pair (i = 0) rotates by exactly `position` radians.
        let (sin, cos) = 7f32.sin_cos();
        assert!((row[0] - (1.0 * cos - 3.0 * sin)).abs() < 1e-5);
    }

    #[test]
    fn gather_names_the_bad_index() {
        let error = gather(&[1.0, 2.0], 1, 2, &[1, 2], "ids").unwrap_err();
        assert_eq!(error.message(), "ids[1] = 2 is outside 0..2");
        assert_eq!(
            gather(&[1.0, 2.0], 1, 2, &[1, 0], "ids").unwrap(),
            vec![2.0, 1.0]
        );
    }
}
