//! Runtime guarantees on the mock device's counters: no device allocation after prepare, minimal step-input writes, full release.

use std::path::Path;

use plughost::device::{DType, DeviceStats};
use plughost::runtime::{Runtime, RuntimeConfig, StepSequence, load_model};

use crate::common;

const BLOCK_SIZE: u32 = 4;

fn mock_runtime() -> Runtime {
    let (device, mut glue) = common::device_and_glue("libplughost_device_mock.so", "");
    let config = RuntimeConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 128,
        block_size: BLOCK_SIZE,
        num_kv_blocks: 512,
        max_model_len: 256,
        kv_cache_dtype: DType::F32,
    };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-qwen3");
    load_model(device, &mut glue, &dir, config).expect("model loads on the mock device")
}

struct Seq {
    id: u64,
    tokens: Vec<u32>,
    computed: usize,
    blocks: Vec<u32>,
}

fn stats(runtime: &Runtime) -> DeviceStats {
    runtime.device().stats().expect("device stats")
}

/// Runs one step in which every sequence computes `chunk` (or its remaining) tokens and emits.
fn step(runtime: &mut Runtime, seqs: &mut [Seq], next_block: &mut u32) {
    let mut spans = Vec::new();
    for s in seqs.iter_mut() {
        let end = s.tokens.len();
        while (s.blocks.len() as u32) * BLOCK_SIZE < end as u32 {
            s.blocks.push(*next_block);
            *next_block += 1;
        }
        spans.push((s.computed, end));
    }
    let batch: Vec<StepSequence<'_>> = seqs
        .iter()
        .zip(&spans)
        .map(|(s, &(start, end))| StepSequence {
            id: s.id,
            tokens: &s.tokens[start..end],
            computed_len: start as u32,
            block_table: &s.blocks,
            emit: true,
        })
        .collect();
    let mut logits = Vec::new();
    runtime.execute(&batch, &mut logits).expect("step runs");
    for (s, &(_, end)) in seqs.iter_mut().zip(&spans) {
        s.computed = end;
    }
}

#[test]
fn decode_steps_allocate_nothing_and_write_only_token_ids_and_new_block_entries() {
    let mut runtime = mock_runtime();
    let mut next_block = 0;
    let mut seqs: Vec<Seq> = (0..8u64)
        .map(|id| Seq {
            id,
            tokens: (0..(3 + id as u32 * 2))
                .map(|t| (t * 7 + id as u32) % 400)
                .collect(),
            computed: 0,
            blocks: Vec::new(),
        })
        .collect();
    step(&mut runtime, &mut seqs, &mut next_block); // prefill all eight
    // The first decode step changes the query offsets and logits indices from the prefill's.
    for s in seqs.iter_mut() {
        s.tokens.push(1);
    }
    step(&mut runtime, &mut seqs, &mut next_block);
    let after_prefill = stats(&runtime);
    for n in 0..200u32 {
        let before = stats(&runtime);
        let mut crossing = 0;
        for s in seqs.iter_mut() {
            // The new token lands at position len; a new block is needed when that position starts one.
            if (s.tokens.len() as u32).is_multiple_of(BLOCK_SIZE) {
                crossing += 1;
            }
            s.tokens.push((n + s.id as u32) % 400);
        }
        step(&mut runtime, &mut seqs, &mut next_block);
        let after = stats(&runtime);
        let token_ids = 8 * 4;
        let block_entries = crossing * 4;
        assert_eq!(
            after.h2d_bytes - before.h2d_bytes,
            token_ids + block_entries,
            "decode step {n}: H2D bytes"
        );
    }
    let end = stats(&runtime);
    assert_eq!(
        end.allocations, after_prefill.allocations,
        "no device allocation in 200 decode steps"
    );
    assert_eq!(
        end.frees, after_prefill.frees,
        "no device free in 200 decode steps"
    );
    runtime.close().expect("runtime closes");
}

#[test]
fn a_changed_batch_rewrites_only_the_affected_rows() {
    let mut runtime = mock_runtime();
    let mut next_block = 0;
    let mut seqs: Vec<Seq> = (0..3u64)
        .map(|id| Seq {
            id,
            tokens: vec![1, 2, 3, 4, 5],
            computed: 0,
            blocks: Vec::new(),
        })
        .collect();
    step(&mut runtime, &mut seqs, &mut next_block); // prefill
    for s in seqs.iter_mut() {
        s.tokens.push(8);
    }
    step(&mut runtime, &mut seqs, &mut next_block); // one steady decode step
    // The middle sequence finishes; the last moves into its slot.
    seqs.remove(1);
    for s in seqs.iter_mut() {
        s.tokens.push(9);
    }
    let before = stats(&runtime);
    step(&mut runtime, &mut seqs, &mut next_block);
    let written = stats(&runtime).h2d_bytes - before.h2d_bytes;
    // Token ids (2), slot 1's block row (its 2 blocks) and its sequence length (1). Slot 0 is
    // untouched, and the query offsets and logits indices of two decodes are a prefix of what
    // the device holds.
    assert_eq!(written, (2 + 2 + 1) * 4);
}

#[test]
fn releasing_the_runtime_frees_every_device_buffer() {
    let mut runtime = mock_runtime();
    let live = stats(&runtime).live_allocations;
    assert!(
        live > 20,
        "weights, KV cache and step buffers are allocated: {live}"
    );
    let mut next_block = 0;
    let mut seqs = vec![Seq {
        id: 1,
        tokens: vec![5, 6, 7],
        computed: 0,
        blocks: Vec::new(),
    }];
    step(&mut runtime, &mut seqs, &mut next_block);
    let device = runtime.into_device().expect("runtime releases its buffers");
    let after = device.stats().expect("device stats");
    assert_eq!(after.live_allocations, 0);
    assert_eq!(after.live_bytes, 0);
    assert_eq!(after.frees, after.allocations);
    device.close();
}

#[test]
fn the_program_graph_lets_the_qkv_projections_run_together() {
    let runtime = mock_runtime();
    let graph = runtime.task_graph();
    // Deriving positions waits for the advanced lengths; the embedding gather reads only token ids.
    assert_eq!(graph.dependencies[1], vec![0]);
    assert!(graph.dependencies[3].is_empty());
    // q, k and v read the same normed rows and write different buffers.
    assert!(graph.widest_wave() >= 3, "waves: {:?}", graph.waves);
    runtime.close().expect("runtime closes");
}
