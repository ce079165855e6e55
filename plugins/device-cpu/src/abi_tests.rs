//! Tests through the C ABI table: one decoder step that launches every callable (with KV caches in f32, bf16 and f16), checked against the kernels called directly, plus open and launch failures.

use std::ffi::CString;
use std::ptr;

use half::{bf16, f16};
use plughost_device_abi::callables;
use plughost_device_abi::{
    ArgTag, DType, DeviceHandle, DeviceStats, PlughostDeviceV1, TensorArg, status,
};

use crate::attention::{self, AttentionShape, KvCache, StepLayout};
use crate::isa::{Isa, IsaLevel};
use crate::kv_cache::CacheElement;
use crate::linear::{self, Bf16Bits, Bf16Products, F16Bits, LinearShape};
use crate::test_support::noise;
use crate::workers::Workers;
use crate::{elementwise, gather, kv_cache, norm, rotary, step_inputs};
use plughost_device_abi::export::FloatSlice;

fn table() -> &'static PlughostDeviceV1 {
    // SAFETY: the entry point returns a pointer to a static table.
    unsafe { &*crate::plughost_device_v1() }
}

/// A device opened through the table, the way the host drives it.
struct Device {
    handle: *mut DeviceHandle,
}

/// A buffer and the tensor it holds.
#[derive(Clone, Copy)]
struct Tensor {
    buffer: u64,
    dtype: DType,
    shape: [u64; 4],
    rank: usize,
}

impl Tensor {
    fn arg(&self, tag: ArgTag) -> TensorArg {
        TensorArg::new(self.buffer, 0, self.dtype, &self.shape[..self.rank], tag).unwrap()
    }
}

impl Device {
    fn open(config: &str) -> Result<Device, (i32, String)> {
        let config = CString::new(config).unwrap();
        let mut handle = ptr::null_mut();
        // SAFETY: a NUL-terminated config and a writable out pointer.
        let code = unsafe { (table().open.unwrap())(config.as_ptr(), &mut handle) };
        if code != status::OK {
            return Err((code, last_error(ptr::null_mut())));
        }
        Ok(Device { handle })
    }

    fn check(&self, code: i32) -> Result<(), (i32, String)> {
        if code == status::OK {
            Ok(())
        } else {
            Err((code, last_error(self.handle)))
        }
    }

    fn upload(&self, dtype: DType, shape: &[u64], bytes: &[u8]) -> Tensor {
        let mut buffer = 0;
        // SAFETY: a live handle; `bytes` is readable for its length.
        unsafe {
            let alloc = table().alloc.unwrap();
            self.check(alloc(self.handle, bytes.len() as u64, &mut buffer))
                .unwrap();
            if !bytes.is_empty() {
                let write = table().write.unwrap();
                self.check(write(
                    self.handle,
                    buffer,
                    0,
                    bytes.as_ptr(),
                    bytes.len() as u64,
                ))
                .unwrap();
            }
        }
        let mut padded = [0; 4];
        padded[..shape.len()].copy_from_slice(shape);
        Tensor {
            buffer,
            dtype,
            shape: padded,
            rank: shape.len(),
        }
    }

    fn f32s(&self, shape: &[u64], values: &[f32]) -> Tensor {
        self.upload(DType::F32, shape, &to_bytes(values, f32::to_le_bytes))
    }

    fn i32s(&self, shape: &[u64], values: &[i32]) -> Tensor {
        self.upload(DType::I32, shape, &to_bytes(values, i32::to_le_bytes))
    }

    fn zeros(&self, shape: &[u64]) -> Tensor {
        self.zeros_of(DType::F32, shape)
    }

    /// Zero bits are zero in every float dtype.
    fn zeros_of(&self, dtype: DType, shape: &[u64]) -> Tensor {
        let len: u64 = shape.iter().product();
        self.upload(dtype, shape, &vec![0; (len * dtype.size_bytes()) as usize])
    }

    /// A float tensor widened to f32, as bits, so a -0 or a NaN counts as itself.
    fn read_widened_bits(&self, tensor: &Tensor) -> Vec<u32> {
        let size = tensor.dtype.size_bytes() as usize;
        let bytes = self.read_bytes(tensor, size);
        let half_bits = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
        bytes
            .chunks_exact(size)
            .map(|b| match tensor.dtype {
                DType::F32 => u32::from_le_bytes(b.try_into().unwrap()),
                DType::BF16 => bf16::from_bits(half_bits(b)).to_f32().to_bits(),
                DType::F16 => f16::from_bits(half_bits(b)).to_f32().to_bits(),
                other => panic!("{other} is not a float dtype"),
            })
            .collect()
    }

    fn read_bytes(&self, tensor: &Tensor, size: usize) -> Vec<u8> {
        let len = tensor.shape[..tensor.rank].iter().product::<u64>() as usize * size;
        let mut bytes = vec![0u8; len];
        // SAFETY: a live handle; `bytes` is writable for its length.
        unsafe {
            let read = table().read.unwrap();
            self.check(read(
                self.handle,
                tensor.buffer,
                0,
                bytes.as_mut_ptr(),
                len as u64,
            ))
            .unwrap();
        }
        bytes
    }

    fn read_f32(&self, tensor: &Tensor) -> Vec<f32> {
        let bytes = self.read_bytes(tensor, 4);
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    fn read_i32(&self, tensor: &Tensor) -> Vec<i32> {
        let bytes = self.read_bytes(tensor, 4);
        bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    fn launch(&self, name: &str, args: &[TensorArg], params: &[i64]) -> Result<(), (i32, String)> {
        let (index, _) = callables::by_name(name).unwrap();
        // SAFETY: a live handle; `args` and `params` hold the counts passed.
        self.check(unsafe {
            (table().launch.unwrap())(
                self.handle,
                index as u32,
                args.as_ptr(),
                args.len() as u32,
                params.as_ptr(),
                params.len() as u32,
            )
        })
    }

    fn synchronize(&self) -> u64 {
        let mut nanos = 0;
        // SAFETY: a live handle and a writable out pointer.
        self.check(unsafe { (table().synchronize.unwrap())(self.handle, &mut nanos) })
            .unwrap();
        nanos
    }

    fn stats(&self) -> DeviceStats {
        let mut stats = DeviceStats::default();
        // SAFETY: a live handle and a writable out pointer.
        self.check(unsafe { (table().stats.unwrap())(self.handle, &mut stats) })
            .unwrap();
        stats
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: the handle came from `open` and is closed once.
        unsafe { (table().close.unwrap())(self.handle) };
    }
}

fn last_error(handle: *mut DeviceHandle) -> String {
    let last_error = table().last_error.unwrap();
    // SAFETY: a null buffer asks for the length; then a buffer of that length plus the NUL.
    unsafe {
        let len = last_error(handle, ptr::null_mut(), 0);
        let mut buf = vec![0u8; len + 1];
        last_error(handle, buf.as_mut_ptr().cast(), buf.len());
        String::from_utf8(buf[..len].to_vec()).unwrap()
    }
}

fn to_bytes<T: Copy, const N: usize>(values: &[T], encode: fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&value| encode(value)).collect()
}

fn random(seed: u64, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|i| scale * noise(seed, i)).collect()
}

const IN: ArgTag = ArgTag::Input;
const OUT: ArgTag = ArgTag::Output;
const INOUT: ArgTag = ArgTag::Inout;

// The step: sequence 0 prefills 2 fresh tokens, sequence 1 decodes its 4th token.
const HIDDEN: usize = 8;
const NUM_HEADS: usize = 2;
const NUM_KV_HEADS: usize = 1;
const HEAD_DIM: usize = 4;
const VOCAB: usize = 5;
const BLOCK_SIZE: usize = 2;
const NUM_BLOCKS: usize = 4;
const BLOCK_TABLE: [i32; 4] = [1, -1, 3, 0];
const SEQ_LENS_BEFORE: [i32; 2] = [0, 3];
const QUERY_START: [i32; 3] = [0, 2, 3];
const IDS: [i32; 3] = [4, 0, 2];
const EPS: f32 = 1e-6;
const THETA: f32 = 10_000.0;

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
            vec![HEAD_DIM as i64, bits(THETA)],
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
    let inv_freq = rotary::inverse_frequencies(HEAD_DIM, THETA);
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
    let caches = (&mut key_cache[..], &mut value_cache[..]);
    kv_cache::kv_write(rows, caches, &slots, shape.cache_layout()).unwrap();
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
        isa,
        &q,
        &cache,
        &layout,
        &mut attention_out,
        (shape, 0.5),
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

/// Every level this CPU has, with each of its bf16 products, as the kernels take them and as
/// the device's config names them.
fn levels_and_products() -> Vec<((Isa, Bf16Products), String)> {
    let mut cases = Vec::new();
    for isa in Isa::every() {
        let mut products = vec![(Bf16Products::F32, "f32")];
        if isa.has(IsaLevel::Avx512Bf16) {
            products.push((Bf16Products::Bf16, "bf16"));
        }
        for (product, name) in products {
            let config = format!("isa={},bf16_products={name}", isa.level());
            cases.push(((isa, product), config));
        }
    }
    cases
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

#[test]
fn failures_come_back_as_codes_and_messages() {
    let (code, message) = Device::open("threads=0").err().unwrap();
    assert_eq!(code, status::INVALID_ARGUMENT);
    assert_eq!(
        message,
        "open: cpu device option `threads` must be a positive integer, got `0`"
    );

    let device = Device::open("").unwrap();
    let ids = device.i32s(&[2], &[1, 7]);
    let table = device.f32s(&[3, 2], &[0.0; 6]);
    let out = device.f32s(&[2, 2], &[9.0; 4]);
    let (code, message) = device
        .launch(
            "embedding_gather",
            &[ids.arg(IN), table.arg(IN), out.arg(OUT)],
            &[],
        )
        .unwrap_err();
    assert_eq!(code, status::LAUNCH_FAILED);
    assert_eq!(
        message,
        "launch `embedding_gather`: ids[1] = 7 is outside 0..3"
    );
    assert_eq!(
        device.read_f32(&out),
        [9.0; 4],
        "a failed launch writes nothing"
    );
    assert_eq!(device.stats().launches, 0);

    // Written arguments that overlap are refused rather than computed in some order.
    let qk = device.f32s(&[1, 8], &[0.0; 8]);
    let positions = device.i32s(&[1], &[0]);
    let (code, message) = device
        .launch(
            "rotary",
            &[qk.arg(INOUT), qk.arg(INOUT), positions.arg(IN)],
            &[8, i64::from(THETA.to_bits())],
        )
        .unwrap_err();
    assert_eq!(code, status::INVALID_ARGUMENT);
    assert!(
        message.contains("arguments `q` and `k` overlap"),
        "{message}"
    );

    // A layer's key and value caches share one dtype; the ABI refuses a launch that mixes them
    // before the kernel sees it.
    let rows = device.f32s(&[1, 4], &[1.0; 4]);
    let cache_shape = [2, 1, 1, 4];
    let key_cache = device.zeros_of(DType::F32, &cache_shape);
    let value_cache = device.zeros_of(DType::BF16, &cache_shape);
    let slots = device.i32s(&[1], &[0]);
    let (code, message) = device
        .launch(
            "kv_write",
            &[
                rows.arg(IN),
                rows.arg(IN),
                key_cache.arg(OUT),
                value_cache.arg(OUT),
                slots.arg(IN),
            ],
            &[],
        )
        .unwrap_err();
    assert_eq!(code, status::INVALID_ARGUMENT);
    assert!(
        message.contains(
            "arguments `key_cache` (f32) and `value_cache` (bf16) must have the same dtype"
        ),
        "{message}"
    );
    assert_eq!(device.read_widened_bits(&key_cache), [0; 8]);
    assert_eq!(device.stats().launches, 0);
}

/// A tied embedding: the output projection (a `linear` over the table) may keep the table in
/// the device's own arrangement; gathers from it, later projections and the host's reads and
/// writes see the table as written. At every level and with each bf16 product: the panels of
/// `avx2` and up, and the rows of `vdpbf16ps`, which meets the activations rounded to bf16.
#[test]
fn a_table_the_linears_rearrange_reads_and_gathers_as_written() {
    for ((_, products), level_config) in levels_and_products() {
        let device = Device::open(&format!("{level_config},threads=2")).unwrap();
        let seen = |x: f32| match products {
            Bf16Products::Bf16 => bf16::from_f32(x).to_f32(),
            Bf16Products::F32 => x,
        };
        check_tied_table(&device, seen, &level_config);
    }
}

/// The checks of the test above on one device, whose linears multiply the bf16 table by the
/// activations as `seen` rounds them.
fn check_tied_table(device: &Device, seen: impl Fn(f32) -> f32, what: &str) {
    // 64 rows fill two panels of 32; 40 columns are no multiple of any vector width.
    let (rows, width, tokens) = (64usize, 40usize, 3usize);
    let values = random(31, rows * width, 1.0);
    let bits: Vec<u16> = values
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect();
    let table_bytes = to_bytes(&bits, u16::to_le_bytes);
    let embedding = device.upload(DType::BF16, &[rows as u64, width as u64], &table_bytes);
    let x_values = random(32, tokens * width, 1.0);
    let x_seen: Vec<f64> = x_values.iter().map(|&x| f64::from(seen(x))).collect();
    let x = device.f32s(&[tokens as u64, width as u64], &x_values);
    let ids = device.i32s(&[tokens as u64], &[63, 0, 33]);
    let hidden = device.zeros(&[tokens as u64, width as u64]);
    let logits = device.zeros(&[tokens as u64, rows as u64]);
    let gather = || {
        device
            .launch(
                "embedding_gather",
                &[ids.arg(IN), embedding.arg(IN), hidden.arg(OUT)],
                &[],
            )
            .unwrap();
        device.read_f32(&hidden)
    };
    let project = || {
        device
            .launch(
                "linear",
                &[x.arg(IN), embedding.arg(IN), logits.arg(OUT)],
                &[],
            )
            .unwrap();
        device.read_f32(&logits)
    };
    let exact: Vec<f32> = bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
    let expected_rows: Vec<f32> = [63, 0, 33]
        .iter()
        .flat_map(|&r| exact[r * width..(r + 1) * width].to_vec())
        .collect();
    // Each product rounds at most once in f32, and `width` f32 additions in any order are off
    // by at most `width · ε` of the sum of the magnitudes.
    let check_row = |got: f32, t: usize, weights: &[f32], case: &str| {
        let terms = (0..width).map(|k| x_seen[t * width + k] * f64::from(weights[k]));
        let (want, magnitude) = terms.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
        let bound = width as f64 * f64::from(f32::EPSILON) * magnitude;
        assert!(
            (f64::from(got) - want).abs() <= bound,
            "{what}: {case}: {got} vs {want} (bound {bound:e})"
        );
    };

    assert_eq!(gather(), expected_rows, "{what}");
    let first = project();
    for (i, &got) in first.iter().enumerate() {
        let (t, n) = (i / rows, i % rows);
        check_row(
            got,
            t,
            &exact[n * width..(n + 1) * width],
            &format!("logit {i}"),
        );
    }
    assert_eq!(
        gather(),
        expected_rows,
        "{what}: gathered after the projection"
    );
    assert_eq!(project(), first, "{what}: a second projection");
    assert_eq!(
        device.read_bytes(&embedding, 2),
        table_bytes,
        "{what}: the host's read"
    );
    assert_eq!(
        project(),
        first,
        "{what}: a projection after the host's read"
    );

    // A host write into part of the table lands on the row it names.
    let row_five: Vec<u16> = vec![bf16::from_f32(0.5).to_bits(); width];
    // SAFETY: a live handle; the bytes are readable for their length.
    unsafe {
        let bytes = to_bytes(&row_five, u16::to_le_bytes);
        device
            .check((table().write.unwrap())(
                device.handle,
                embedding.buffer,
                (5 * width * 2) as u64,
                bytes.as_ptr(),
                bytes.len() as u64,
            ))
            .unwrap();
    }
    let after = project();
    for t in 0..tokens {
        check_row(
            after[t * rows + 5],
            t,
            &vec![0.5; width],
            "row 5 after the write",
        );
        assert_eq!(after[t * rows + 6], first[t * rows + 6], "{what}");
    }
}
