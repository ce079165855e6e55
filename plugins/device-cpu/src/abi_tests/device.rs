//! The harness of the tests through the C ABI: a device opened through the table the way the host drives it, its tensors, and the configs of every level this CPU has.

use std::ffi::CString;
use std::ptr;

use half::{bf16, f16};
use plughost_device_abi::callables;
use plughost_device_abi::{
    ArgTag, DType, DeviceHandle, DeviceStats, PlughostDeviceV1, TensorArg, status,
};

use crate::isa::{Isa, IsaLevel};
use crate::linear::Bf16Products;
use crate::test_support::noise;

pub(super) fn table() -> &'static PlughostDeviceV1 {
    // SAFETY: the entry point returns a pointer to a static table.
    unsafe { &*crate::plughost_device_v1() }
}

/// A device opened through the table, the way the host drives it.
pub(super) struct Device {
    handle: *mut DeviceHandle,
}

/// A buffer and the tensor it holds.
#[derive(Clone, Copy)]
pub(super) struct Tensor {
    buffer: u64,
    dtype: DType,
    shape: [u64; 4],
    rank: usize,
}

impl Tensor {
    pub(super) fn arg(&self, tag: ArgTag) -> TensorArg {
        TensorArg::new(self.buffer, 0, self.dtype, &self.shape[..self.rank], tag).unwrap()
    }
}

impl Device {
    pub(super) fn open(config: &str) -> Result<Device, (i32, String)> {
        let config = CString::new(config).unwrap();
        let mut handle = ptr::null_mut();
        // SAFETY: a NUL-terminated config and a writable out pointer.
        let code = unsafe { (table().open.unwrap())(config.as_ptr(), &mut handle) };
        if code != status::OK {
            return Err((code, last_error(ptr::null_mut())));
        }
        Ok(Device { handle })
    }

    pub(super) fn check(&self, code: i32) -> Result<(), (i32, String)> {
        if code == status::OK {
            Ok(())
        } else {
            Err((code, last_error(self.handle)))
        }
    }

    pub(super) fn upload(&self, dtype: DType, shape: &[u64], bytes: &[u8]) -> Tensor {
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

    /// Overwrites `bytes.len()` bytes of `tensor`'s buffer from byte `offset` on.
    pub(super) fn write_at(
        &self,
        tensor: &Tensor,
        offset: u64,
        bytes: &[u8],
    ) -> Result<(), (i32, String)> {
        // SAFETY: a live handle; `bytes` is readable for its length.
        self.check(unsafe {
            (table().write.unwrap())(
                self.handle,
                tensor.buffer,
                offset,
                bytes.as_ptr(),
                bytes.len() as u64,
            )
        })
    }

    pub(super) fn f32s(&self, shape: &[u64], values: &[f32]) -> Tensor {
        self.upload(DType::F32, shape, &to_bytes(values, f32::to_le_bytes))
    }

    pub(super) fn i32s(&self, shape: &[u64], values: &[i32]) -> Tensor {
        self.upload(DType::I32, shape, &to_bytes(values, i32::to_le_bytes))
    }

    pub(super) fn zeros(&self, shape: &[u64]) -> Tensor {
        self.zeros_of(DType::F32, shape)
    }

    /// Zero bits are zero in every float dtype.
    pub(super) fn zeros_of(&self, dtype: DType, shape: &[u64]) -> Tensor {
        let len: u64 = shape.iter().product();
        self.upload(dtype, shape, &vec![0; (len * dtype.size_bytes()) as usize])
    }

    /// A float tensor widened to f32, as bits, so a -0 or a NaN counts as itself.
    pub(super) fn read_widened_bits(&self, tensor: &Tensor) -> Vec<u32> {
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

    pub(super) fn read_bytes(&self, tensor: &Tensor, size: usize) -> Vec<u8> {
        self.try_read_bytes(tensor, size).unwrap()
    }

    /// The bytes of `tensor`, whose elements are `size` bytes, or the failure of the read.
    pub(super) fn try_read_bytes(
        &self,
        tensor: &Tensor,
        size: usize,
    ) -> Result<Vec<u8>, (i32, String)> {
        let len = tensor.shape[..tensor.rank].iter().product::<u64>() as usize * size;
        let mut bytes = vec![0u8; len];
        let read = table().read.unwrap();
        // SAFETY: a live handle; `bytes` is writable for its length.
        self.check(unsafe {
            read(
                self.handle,
                tensor.buffer,
                0,
                bytes.as_mut_ptr(),
                len as u64,
            )
        })?;
        Ok(bytes)
    }

    /// The bytes of a block-quantized `tensor`.
    pub(super) fn read_blocks(&self, tensor: &Tensor) -> Vec<u8> {
        let (rows, width) = (tensor.shape[0], tensor.shape[tensor.rank - 1]);
        let rows = if tensor.rank == 1 { 1 } else { rows };
        let len = tensor.dtype.tensor_bytes(rows, width).unwrap() as usize;
        // One byte per element of a view of `len` elements.
        let view = Tensor {
            shape: [len as u64, 1, 1, 1],
            rank: 1,
            ..*tensor
        };
        self.read_bytes(&view, 1)
    }

    pub(super) fn read_f32(&self, tensor: &Tensor) -> Vec<f32> {
        let bytes = self.read_bytes(tensor, 4);
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    pub(super) fn read_i32(&self, tensor: &Tensor) -> Vec<i32> {
        let bytes = self.read_bytes(tensor, 4);
        bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    pub(super) fn launch(
        &self,
        name: &str,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<(), (i32, String)> {
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

    pub(super) fn synchronize(&self) -> u64 {
        let mut nanos = 0;
        // SAFETY: a live handle and a writable out pointer.
        self.check(unsafe { (table().synchronize.unwrap())(self.handle, &mut nanos) })
            .unwrap();
        nanos
    }

    pub(super) fn stats(&self) -> DeviceStats {
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

pub(super) fn last_error(handle: *mut DeviceHandle) -> String {
    let last_error = table().last_error.unwrap();
    // SAFETY: a null buffer asks for the length; then a buffer of that length plus the NUL.
    unsafe {
        let len = last_error(handle, ptr::null_mut(), 0);
        let mut buf = vec![0u8; len + 1];
        last_error(handle, buf.as_mut_ptr().cast(), buf.len());
        String::from_utf8(buf[..len].to_vec()).unwrap()
    }
}

pub(super) fn to_bytes<T: Copy, const N: usize>(values: &[T], encode: fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&value| encode(value)).collect()
}

pub(super) fn random(seed: u64, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|i| scale * noise(seed, i)).collect()
}

pub(super) const IN: ArgTag = ArgTag::Input;
pub(super) const OUT: ArgTag = ArgTag::Output;
pub(super) const INOUT: ArgTag = ArgTag::Inout;

/// Every level this CPU has, with each of its bf16 products, as the kernels take them and as
/// the device's config names them.
pub(super) fn levels_and_products() -> Vec<((Isa, Bf16Products), String)> {
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
