//! A warm launch reaches no allocator: the launches of a one-token step (quantized and bf16 linears, the gated MLP, the rotary) and a 64-token linear, counted through the C ABI at every instruction-set level this CPU has, on two threads.
//!
//! A decode step is hundreds of launches; an allocation in each (or in each range a thread
//! claims) costs more than the arithmetic of the small ones. This binary holds one test, so
//! the counting allocator sees only the device's threads and this one.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::CString;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use plughost_device_abi::callables;
use plughost_device_abi::{ArgTag, DType, DeviceHandle, PlughostDeviceV1, TensorArg, status};
use plughost_device_cpu::isa::Isa;

/// Counts allocations while armed, on every thread.
struct Counting;

static ARMED: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

fn count() {
    if ARMED.load(Ordering::Relaxed) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: forwards to the system allocator unchanged; the counter is only atomics.
unsafe impl GlobalAlloc for Counting {
    /// # Safety
    /// As [`GlobalAlloc::alloc`].
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    /// # Safety
    /// As [`GlobalAlloc::alloc_zeroed`].
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }

    /// # Safety
    /// As [`GlobalAlloc::realloc`].
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    /// # Safety
    /// As [`GlobalAlloc::dealloc`].
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn table() -> &'static PlughostDeviceV1 {
    // SAFETY: the entry point returns a pointer to a static table.
    unsafe { &*plughost_device_cpu::plughost_device_v1() }
}

/// A device opened through its table, as the host opens it.
struct Device(*mut DeviceHandle);

impl Device {
    fn open(config: &str) -> Device {
        let config = CString::new(config).unwrap();
        let mut handle = ptr::null_mut();
        // SAFETY: a NUL-terminated config and a writable out pointer.
        let code = unsafe { (table().open.unwrap())(config.as_ptr(), &mut handle) };
        assert_eq!(code, status::OK, "open {config:?}");
        Device(handle)
    }

    /// A buffer holding `bytes`, as the tensor `dtype[shape]`.
    fn upload(&self, dtype: DType, shape: &[u64], bytes: &[u8]) -> (u64, DType, Vec<u64>) {
        let mut buffer = 0;
        // SAFETY: a live handle; `bytes` is readable for its length.
        unsafe {
            let code = (table().alloc.unwrap())(self.0, bytes.len() as u64, &mut buffer);
            assert_eq!(code, status::OK);
            let code =
                (table().write.unwrap())(self.0, buffer, 0, bytes.as_ptr(), bytes.len() as u64);
            assert_eq!(code, status::OK);
        }
        (buffer, dtype, shape.to_vec())
    }

    fn launch(&self, name: &str, args: &[TensorArg], params: &[i64]) {
        let (index, _) = callables::by_name(name).unwrap();
        // SAFETY: a live handle; `args` and `params` hold the counts passed.
        let code = unsafe {
            (table().launch.unwrap())(
                self.0,
                index as u32,
                args.as_ptr(),
                args.len() as u32,
                params.as_ptr(),
                params.len() as u32,
            )
        };
        assert_eq!(code, status::OK, "launch {name}");
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: a live handle, closed once.
        unsafe { (table().close.unwrap())(self.0) };
    }
}

fn arg(tensor: &(u64, DType, Vec<u64>), tag: ArgTag) -> TensorArg {
    TensorArg::new(tensor.0, 0, tensor.1, &tensor.2, tag).unwrap()
}

/// Deterministic bytes; `f16_at` puts a small f16 scale at that byte of each `block`-byte
/// block, so quantized weights stay finite.
fn bytes(len: usize, seed: u32, block: Option<(usize, usize)>) -> Vec<u8> {
    let mut state = seed.wrapping_mul(2_654_435_761).max(1);
    let mut out: Vec<u8> = (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state >> 24) as u8
        })
        .collect();
    if let Some((size, at)) = block {
        for chunk in out.chunks_exact_mut(size) {
            chunk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
    }
    out
}

fn f32_bytes(len: usize, seed: u32) -> Vec<u8> {
    bytes(len, seed, None)
        .chunks_exact(1)
        .flat_map(|b| (f32::from(b[0]) / 255.0 - 0.5).to_le_bytes())
        .collect()
}

#[test]
fn warm_decode_launches_allocate_nothing() {
    const K: u64 = 256;
    const N: u64 = 512;
    const HEAD_DIM: u64 = 64;
    for isa in Isa::every() {
        let level = isa.level();
        let device = Device::open(&format!("isa={level},threads=2"));
        let x = device.upload(DType::F32, &[1, K], &f32_bytes(K as usize, 1));
        let out = device.upload(DType::F32, &[1, N], &vec![0; 4 * N as usize]);
        // A batch, whose activations the threads quantize in spans.
        const BATCH: u64 = 64;
        let xs = device.upload(DType::F32, &[BATCH, K], &f32_bytes((BATCH * K) as usize, 8));
        let outs = device.upload(DType::F32, &[BATCH, N], &vec![0; (4 * BATCH * N) as usize]);
        let q8 = |seed| {
            let len = (N * K / 32 * 34) as usize;
            device.upload(DType::Q8_0, &[N, K], &bytes(len, seed, Some((34, 0))))
        };
        let (w, gate, up) = (q8(2), q8(3), q8(4));
        let bf16 = device.upload(DType::BF16, &[N, K], &bytes(2 * (N * K) as usize, 5, None));
        let heads = |seed| device.upload(DType::F32, &[1, 4 * HEAD_DIM], &f32_bytes(256, seed));
        let (q, k) = (heads(6), heads(7));
        let positions = device.upload(DType::I32, &[1], &7i32.to_le_bytes());
        let mut rotary_params = vec![HEAD_DIM as i64];
        rotary_params.extend(
            (0..HEAD_DIM / 2)
                .map(|i| i64::from(10_000f32.powf(-((2 * i) as f32) / 64.0).to_bits())),
        );
        let step = || {
            device.launch(
                "linear",
                &[
                    arg(&xs, ArgTag::Input),
                    arg(&w, ArgTag::Input),
                    arg(&outs, ArgTag::Output),
                ],
                &[],
            );
            device.launch(
                "linear",
                &[
                    arg(&x, ArgTag::Input),
                    arg(&w, ArgTag::Input),
                    arg(&out, ArgTag::Output),
                ],
                &[],
            );
            device.launch(
                "silu_gate_linear",
                &[
                    arg(&x, ArgTag::Input),
                    arg(&gate, ArgTag::Input),
                    arg(&up, ArgTag::Input),
                    arg(&out, ArgTag::Output),
                ],
                &[],
            );
            device.launch(
                "linear",
                &[
                    arg(&x, ArgTag::Input),
                    arg(&bf16, ArgTag::Input),
                    arg(&out, ArgTag::Output),
                ],
                &[],
            );
            device.launch(
                "rotary",
                &[
                    arg(&q, ArgTag::Inout),
                    arg(&k, ArgTag::Inout),
                    arg(&positions, ArgTag::Input),
                ],
                &rotary_params,
            );
        };
        // The first launches arrange the weights and grow the threads' scratch.
        for _ in 0..3 {
            step();
        }
        ALLOCATIONS.store(0, Ordering::SeqCst);
        ARMED.store(true, Ordering::SeqCst);
        for _ in 0..20 {
            step();
        }
        ARMED.store(false, Ordering::SeqCst);
        let allocations = ALLOCATIONS.load(Ordering::SeqCst);
        assert_eq!(
            allocations, 0,
            "20 warm steps at {level} allocated {allocations} times"
        );
    }
}
