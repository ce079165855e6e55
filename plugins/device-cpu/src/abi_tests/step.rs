//! One decoder step that launches every callable, with KV caches in f32, bf16 and f16, through the C ABI and with the kernels called directly: the same bits at every level, with one thread or two.

use half::{bf16, f16};
use plughost_device_abi::export::FloatSlice;
use plughost_device_abi::{DType, TensorArg};

use super::device::{Device, IN, INOUT, OUT, levels_and_products, random, to_bytes};
use crate::attention::{self, AttentionShape, KvCache, StepLayout};
use crate::isa::{Isa, IsaLevel};
use crate::kv_cache::CacheElement;
use crate::linear::{self, Bf16Bits, Bf16Products, F16Bits, LinearShape};
use crate::workers::Workers;
use crate::{elementwise, gather, kv_cache, norm, rotary, step_inputs};

// The step: sequence 0 prefills 2 fresh tokens, sequence 1 decodes its 4th token.
pub(super) const HIDDEN: usize = 8;
pub(super) const NUM_HEADS: usize = 2;
pub(super) const NUM_KV_HEADS: usize = 1;
pub(super) const HEAD_DIM: usize = 4;
pub(super) const VOCAB: usize = 5;
pub(super) const BLOCK_SIZE: usize = 2;
pub(super) const NUM_BLOCKS: usize = 4;
pub(super) const BLOCK_TABLE: [i32; 4] = [1, -1, 3, 0];
pub(super) const SEQ_LENS_BEFORE: [i32; 2] = [0, 3];
pub(super) const QUERY_START: [i32; 3] = [0, 2, 3];
pub(super) const IDS: [i32; 3] = [4, 0, 2];
pub(super) const EPS: f32 = 1e-6;
pub(super) const THETA: f32 = 10_000.0;

/// The step's weights: embeddings in bf16, the norm in f16, projections in f32 and bf16.
struct Weights {
    embedding: Vec<u16>,
    norm: Vec<u16>,
    head_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<u16>,
    wv: Vec<f32>,
}

impl Weights {
    fn new() -> Weights {
        let bf16s = |seed, len| {
            random(seed, len, 1.0)
                .iter()
                .map(|&v| bf16::from_f32(v).to_bits())
                .collect()
        };
        Weights {
            embedding: bf16s(1, VOCAB * HIDDEN),
            norm: random(2, HIDDEN, 1.0)
                .iter()
                .map(|&v| f16::from_f32(1.0 + v).to_bits())
                .collect(),
            head_norm: random(3, HEAD_DIM, 1.0),
            wq: random(4, NUM_HEADS * HEAD_DIM * HIDDEN, 0.5),
            wk: bf16s(5, NUM_KV_HEADS * HEAD_DIM * HIDDEN),
            wv: random(6, NUM_KV_HEADS * HEAD_DIM * HIDDEN, 0.5),
        }
    }
}

/// What the step produces, however it was computed.
#[derive(Debug, PartialEq)]
struct StepOutputs {
    seq_lens: Vec<i32>,
    slots: Vec<i32>,
    /// Rows 1 and 2 of `hidden + attention`, after `silu(h) * h` and doubling in place.
    gathered: Vec<f32>,
    /// The key cache after the step, widened to f32 bits.
    key_cache: Vec<u32>,
}

/// The step through the C ABI, every callable once or more, with KV caches of `cache_dtype`.
fn step_through_abi(device: &Device, weights: &Weights, cache_dtype: DType) -> StepOutputs {
    let tokens = IDS.len() as u64;
    let (h, q_width, kv_width) = (
        HIDDEN as u64,
        (NUM_HEADS * HEAD_DIM) as u64,
        (NUM_KV_HEADS * HEAD_DIM) as u64,
    );
    let cache_shape = [
        NUM_BLOCKS as u64,
        NUM_KV_HEADS as u64,
        BLOCK_SIZE as u64,
        HEAD_DIM as u64,
    ];
    let seq_lens = device.i32s(&[2], &SEQ_LENS_BEFORE);
    let query_start = device.i32s(&[3], &QUERY_START);
    let block_table = device.i32s(&[2, 2], &BLOCK_TABLE);
    let ids = device.i32s(&[tokens], &IDS);
    let positions = device.i32s(&[tokens], &[0; 3]);
    let slots = device.i32s(&[tokens], &[0; 3]);
    let embedding = device.upload(
        DType::BF16,
        &[VOCAB as u64, h],
        &to_bytes(&weights.embedding, u16::to_le_bytes),
    );
    let norm = device.upload(DType::F16, &[h], &to_bytes(&weights.norm, u16::to_le_bytes));
    let head_norm = device.f32s(&[HEAD_DIM as u64], &weights.head_norm);
    let wq = device.f32s(&[q_width, h], &weights.wq);
    let wk = device.upload(
        DType::BF16,
        &[kv_width, h],
        &to_bytes(&weights.wk, u16::to_le_bytes),
    );
    let wv = device.f32s(&[kv_width, h], &weights.wv);
    let (hidden, normed) = (device.zeros(&[tokens, h]), device.zeros(&[tokens, h]));
    let (q, k, v) = (
        device.zeros(&[tokens, q_width]),
        device.zeros(&[tokens, kv_width]),
        device.zeros(&[tokens, kv_width]),
    );
    let (key_cache, value_cache) = (
        device.zeros_of(cache_dtype, &cache_shape),
        device.zeros_of(cache_dtype, &cache_shape),
    );
    let attention = device.zeros(&[tokens, q_width]);
    let gathered = device.zeros(&[2, h]);
    let emit = device.i32s(&[2], &[1, 2]);
    let bits = |value: f32| i64::from(value.to_bits());
    let attention_params = [
        NUM_HEADS as i64,
        NUM_KV_HEADS as i64,
        HEAD_DIM as i64,
        BLOCK_SIZE as i64,
        bits(0.5),
    ];

    let launches: Vec<(&str, Vec<TensorArg>, Vec<i64>)> = vec![
        (
            "advance_seq_lens",
            vec![seq_lens.arg(INOUT), query_start.arg(IN)],
            vec![],
        ),
        (
            "derive_positions",
            vec![seq_lens.arg(IN), query_start.arg(IN), positions.arg(OUT)],
            vec![],
        ),
        (
            "derive_slot_mapping",
            vec![
                block_table.arg(IN),
                seq_lens.arg(IN),
                query_start.arg(IN),
                slots.arg(OUT),
            ],
            vec![BLOCK_SIZE as i64],
        ),
        (
            "embedding_gather",
            vec![ids.arg(IN), embedding.arg(IN), hidden.arg(OUT)],
            vec![],
        ),
        (
            "rms_norm",
            vec![hidden.arg(IN), norm.arg(IN), normed.arg(OUT)],
            vec![bits(EPS)],
        ),
        (
            "linear",
            vec![normed.arg(IN), wq.arg(IN), q.arg(OUT)],
            vec![],
        ),
        (
            "linear",
            vec![normed.arg(IN), wk.arg(IN), k.arg(OUT)],
            vec![],
        ),
        (
            "linear",
            vec![normed.arg(IN), wv.arg(IN), v.arg(OUT)],
            vec![],
        ),
        (
            "rms_norm_heads",
            vec![q.arg(INOUT), head_norm.arg(IN)],
            vec![bits(EPS), HEAD_DIM as i64],
        ),
        (
            "rotary",
            vec![q.arg(INOUT), k.arg(INOUT), positions.arg(IN)],
            crate::test_support::rotary_params(HEAD_DIM, THETA),
        ),
        (
            "kv_write",
            vec![
                k.arg(IN),
                v.arg(IN),
                key_cache.arg(OUT),
                value_cache.arg(OUT),
                slots.arg(IN),
            ],
            vec![],
        ),
        (
            "paged_attention",
            vec![
                q.arg(IN),
                key_cache.arg(IN),
                value_cache.arg(IN),
                block_table.arg(IN),
                seq_lens.arg(IN),
                query_start.arg(IN),
                attention.arg(OUT),
            ],
            attention_params.to_vec(),
        ),
        // Residual add of the attention output (Hq*D = H here), then the MLP activation with
        // gate and up both `hidden`, and `hidden` doubled by adding it to itself: reads that
        // alias the written argument.
        ("add", vec![hidden.arg(INOUT), attention.arg(IN)], vec![]),
        (
            "silu_mul",
            vec![hidden.arg(IN), hidden.arg(IN), normed.arg(OUT)],
            vec![],
        ),
        ("add", vec![normed.arg(INOUT), normed.arg(IN)], vec![]),
        (
            "gather_rows",
            vec![normed.arg(IN), emit.arg(IN), gathered.arg(OUT)],
            vec![],
        ),
    ];
    for (name, args, params) in &launches {
        device
            .launch(name, args, params)
            .unwrap_or_else(|error| panic!("{name}: {error:?}"));
    }
    StepOutputs {
        seq_lens: device.read_i32(&seq_lens),
        slots: device.read_i32(&slots),
        gathered: device.read_f32(&gathered),
        key_cache: device.read_widened_bits(&key_cache),
    }
}

/// The same step with the kernels called directly, with KV caches of `E`, at `isa` with
/// `products` for bf16 weights.
fn step_in_process<E: CacheElement>(
    weights: &Weights,
    (isa, products): (Isa, Bf16Products),
) -> StepOutputs {
    let workers = Workers::new(1).unwrap();
    let tokens = IDS.len();
    let (q_width, kv_width) = (NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM);
    let mut seq_lens = SEQ_LENS_BEFORE;
    step_inputs::advance_seq_lens(&mut seq_lens, &QUERY_START).unwrap();
    let mut positions = [0; 3];
    step_inputs::derive_positions(&seq_lens, &QUERY_START, &mut positions).unwrap();
    let mut slots = [0; 3];
    step_inputs::derive_slot_mapping(
        (&BLOCK_TABLE, 2),
        &seq_lens,
        &QUERY_START,
        BLOCK_SIZE,
        &mut slots,
    )
    .unwrap();

    let mut hidden = vec![0.0; tokens * HIDDEN];
    gather::gather(
        FloatSlice::BF16(&weights.embedding),
        HIDDEN,
        &IDS,
        &mut hidden,
        ("ids", &workers),
    )
    .unwrap();
    let norm: Vec<f32> = weights
        .norm
        .iter()
        .map(|&b| f16::from_bits(b).to_f32())
        .collect();
    let mut normed = vec![0.0; tokens * HIDDEN];
    norm::rms_norm(isa, &hidden, &norm, EPS, &mut normed, &workers);
    let project = |w: FloatSlice<'_>, outputs: usize| {
        let mut out = vec![0.0; tokens * outputs];
        let shape = LinearShape {
            tokens,
            inner: HIDDEN,
            outputs,
        };
        linear::linear((&normed, w), &mut out, shape, (isa, products), &workers);
        out
    };
    let mut q = project(FloatSlice::F32(&weights.wq), q_width);
    let mut k = project(FloatSlice::BF16(&weights.wk), kv_width);
    let v = project(FloatSlice::F32(&weights.wv), kv_width);
    norm::rms_norm_in_place(isa, &mut q, &weights.head_norm, EPS, &workers);
    let inv_freq = crate::test_support::inverse_frequencies(HEAD_DIM, THETA);
    rotary::rotate_rows(&mut q, &positions, &inv_freq, &workers);
    rotary::rotate_rows(&mut k, &positions, &inv_freq, &workers);
    let cache_len = NUM_BLOCKS * BLOCK_SIZE * kv_width;
    let zero = E::from_f32(0.0);
    let (mut key_cache, mut value_cache) = (vec![zero; cache_len], vec![zero; cache_len]);
    let rows = kv_cache::KvRows {
        keys: &k,
        values: &v,
    };
    let shape = AttentionShape {
        num_heads: NUM_HEADS,
        num_kv_heads: NUM_KV_HEADS,
        head_dim: HEAD_DIM,
        block_size: BLOCK_SIZE,
        num_blocks: NUM_BLOCKS,
        blocks_per_seq: 2,
    };
    let cache_layout = shape.cache_layout();
    let order = kv_cache::arranged(
        isa,
        products,
        E::bf16_bits(&key_cache).is_some(),
        &cache_layout,
    );
    let caches = (&mut key_cache[..], &mut value_cache[..]);
    kv_cache::kv_write(rows, caches, &slots, (cache_layout, order)).unwrap();
    let layout = StepLayout {
        block_table: &BLOCK_TABLE,
        seq_lens: &seq_lens,
        query_start: &QUERY_START,
    };
    let cache = KvCache {
        keys: &key_cache,
        values: &value_cache,
    };
    let mut attention_out = vec![0.0; tokens * q_width];
    attention::paged_attention(
        (isa, products),
        &q,
        &cache,
        &layout,
        &mut attention_out,
        (shape, 0.5, usize::MAX),
        &workers,
    )
    .unwrap();

    elementwise::add(&mut hidden, &attention_out, &workers);
    elementwise::silu_mul(isa, &hidden, &hidden, &mut normed, &workers);
    let copy = normed.clone();
    elementwise::add(&mut normed, &copy, &workers);
    let mut gathered = vec![0.0; 2 * HIDDEN];
    gather::gather(
        FloatSlice::F32(&normed),
        HIDDEN,
        &[1, 2],
        &mut gathered,
        ("indices", &workers),
    )
    .unwrap();
    StepOutputs {
        seq_lens: seq_lens.to_vec(),
        slots: slots.to_vec(),
        gathered,
        key_cache: key_cache
            .iter()
            .map(|&e| CacheElement::to_f32(e).to_bits())
            .collect(),
    }
}

#[test]
fn a_step_through_the_abi_matches_the_kernels() {
    let weights = Weights::new();
    for (kernels, level_config) in levels_and_products() {
        let expected = step_in_process::<f32>(&weights, kernels);
        assert_eq!(expected.seq_lens, [2, 4]);
        assert_eq!(expected.slots, [2, 3, 1]);
        for threads in ["threads=1", "threads=2"] {
            let config = format!("{level_config},{threads}");
            let device = Device::open(&config).unwrap();
            let outputs = step_through_abi(&device, &weights, DType::F32);
            assert_eq!(outputs, expected, "{config}");

            let stats = device.stats();
            assert_eq!(stats.launches, 16, "{config}");
            assert!(device.synchronize() > 0, "launches take time");
            assert_eq!(
                device.synchronize(),
                0,
                "nothing ran since the last synchronize"
            );
        }
    }
}

/// What the device runs with an empty config: the highest level, and bf16 products where it
/// has them.
#[test]
fn the_default_config_runs_the_highest_level() {
    let weights = Weights::new();
    let isa = Isa::detect();
    let products = if isa.has(IsaLevel::Avx512Bf16) {
        Bf16Products::Bf16
    } else {
        Bf16Products::F32
    };
    let expected = step_in_process::<f32>(&weights, (isa, products));
    for config in ["threads=1", "threads=2"] {
        let device = Device::open(config).unwrap();
        let outputs = step_through_abi(&device, &weights, DType::F32);
        assert_eq!(outputs, expected, "{config}");
    }
}

#[test]
fn a_step_with_half_width_caches_matches_the_kernels() {
    let weights = Weights::new();
    for (kernels, level_config) in levels_and_products() {
        let full = step_in_process::<f32>(&weights, kernels);
        let cases = [
            (DType::BF16, step_in_process::<Bf16Bits>(&weights, kernels)),
            (DType::F16, step_in_process::<F16Bits>(&weights, kernels)),
        ];
        for (dtype, expected) in cases {
            // The cache really holds rounded values, so the launches really took the dtype's
            // path.
            assert_ne!(expected.key_cache, full.key_cache, "{dtype}");
            if dtype == DType::BF16 {
                assert!(expected.key_cache.iter().all(|bits| bits & 0xffff == 0));
            }
            for threads in ["threads=1", "threads=2"] {
                let config = format!("{level_config},{threads}");
                let device = Device::open(&config).unwrap();
                let outputs = step_through_abi(&device, &weights, dtype);
                assert_eq!(outputs, expected, "{dtype}, {config}");
            }
        }
    }
}
