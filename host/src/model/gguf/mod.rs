//! Reading a GGUF file (llama.cpp's format), memory-mapped or in memory: header, metadata and tensor descriptors.
//!
//! [`llama`] maps a Llama or Qwen3 GGUF's metadata and names to a Hugging Face config and names,
//! [`tokenizer`] builds `tokenizer.json` from its vocabulary, and [`folder`] puts both beside
//! the file so the host serves a GGUF as it serves a model folder, weights as stored.
//!
//! Layout (little-endian, versions 2 and 3): magic `GGUF`, u32 version, u64 tensor count,
//! u64 metadata count, the metadata key/value pairs, the tensor descriptors (name, dims with the
//! fastest-varying first, ggml type, offset), padding to `general.alignment` (default 32), then
//! the tensor bytes. Every length and offset is checked against the buffer before it is used, so
//! a truncated or corrupt file is an error naming what was being read, never a panic or a huge
//! allocation.

use std::collections::BTreeMap;
use std::path::Path;

pub use writer::GgufWriter;

mod writer;

/// Why a GGUF file could not be read, or a metadata value is missing or not of the type asked for.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufError {
    /// The bytes do not follow the format: truncated, corrupt, or a type this reader does not know.
    #[error("{0}")]
    Malformed(String),
    #[error("GGUF metadata has no {0}")]
    MissingKey(String),
    /// A well-formed file of a kind the host does not serve (architecture, tokenizer, rope).
    #[error("{0}")]
    Unsupported(String),
    #[error("reading {path}: {message}")]
    Io { path: String, message: String },
    /// A metadata value of another type or range than the one asked for.
    #[error("{0}")]
    Metadata(String),
    /// What was being read when the inner error happened.
    #[error("{context}: {source}")]
    While {
        context: String,
        source: Box<GgufError>,
    },
}

type Result<T, E = GgufError> = std::result::Result<T, E>;

/// Returns a [`GgufError::Malformed`] built from a format string.
macro_rules! bail {
    ($($message:tt)*) => {
        return Err(GgufError::Malformed(format!($($message)*)))
    };
}

/// Returns a [`GgufError::Malformed`] unless the condition holds.
macro_rules! ensure {
    ($condition:expr, $($message:tt)*) => {
        if !$condition {
            bail!($($message)*);
        }
    };
}

/// Returns a [`GgufError::Unsupported`] built from a format string.
macro_rules! unsupported {
    ($($message:tt)*) => {
        return Err(GgufError::Unsupported(format!($($message)*)))
    };
}

pub mod folder;
pub mod llama;
pub mod rope;
pub mod tokenizer;
pub mod weights;

/// Names what was being read when a step fails, as the error's outer layer.
trait Context<T> {
    fn with_context(self, context: impl FnOnce() -> String) -> Result<T>;

    fn context(self, context: &str) -> Result<T>
    where
        Self: Sized,
    {
        self.with_context(|| context.to_string())
    }
}

impl<T> Context<T> for Result<T> {
    fn with_context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| GgufError::While {
            context: context(),
            source: Box::new(source),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn with_context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.ok_or_else(|| GgufError::Malformed(context()))
    }
}

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml supports at most four dimensions.
const MAX_DIMS: u32 = 4;

/// A metadata value. Integers of every width are widened; arrays keep their element order.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Uint(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

/// The ggml element types this reader can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)] // ggml's names: Q4_K, Q6_K
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4_K,
    Q6_K,
}

impl GgmlType {
    /// The names of the types this reader reads, for errors.
    const NAMES: &str = "F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K and Q6_K";

    fn from_id(id: u32) -> Option<Self> {
        match id {
            0 => Some(GgmlType::F32),
            1 => Some(GgmlType::F16),
            2 => Some(GgmlType::Q4_0),
            3 => Some(GgmlType::Q4_1),
            8 => Some(GgmlType::Q8_0),
            12 => Some(GgmlType::Q4_K),
            14 => Some(GgmlType::Q6_K),
            30 => Some(GgmlType::BF16),
            _ => None,
        }
    }

    /// (elements per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        let dtype = self.device_dtype();
        (dtype.block_elements() as usize, dtype.size_bytes() as usize)
    }

    /// The device dtype that holds this type's bytes as they are.
    pub fn device_dtype(self) -> plughost_device_abi::DType {
        use plughost_device_abi::DType;
        match self {
            GgmlType::F32 => DType::F32,
            GgmlType::F16 => DType::F16,
            GgmlType::BF16 => DType::BF16,
            GgmlType::Q4_0 => DType::Q4_0,
            GgmlType::Q4_1 => DType::Q4_1,
            GgmlType::Q8_0 => DType::Q8_0,
            GgmlType::Q4_K => DType::Q4_K,
            GgmlType::Q6_K => DType::Q6_K,
        }
    }
}

/// One tensor's descriptor; `range` is its validated byte range in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row length (the fastest-varying index).
    pub dims: Vec<usize>,
    pub kind: GgmlType,
    range: std::ops::Range<usize>,
}

impl TensorInfo {
    pub fn num_elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// The shape in PyTorch order (slowest-varying first).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// Where a file's bytes are: read into memory, or mapped.
enum Bytes {
    Owned(Vec<u8>),
    Mapped(memmap2::Mmap),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Owned(bytes) => bytes,
            Bytes::Mapped(map) => map,
        }
    }
}

/// A parsed GGUF file and its bytes.
pub struct Gguf {
    bytes: Bytes,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("bytes", &self.bytes.len())
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Gguf {
    /// Maps the file at `path` and parses it; the tensors' bytes stay in the file's pages.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |e: std::io::Error| GgufError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: a read-only private mapping; every range is checked against its length
        // before use, and like every mmap loader this relies on nobody truncating the file
        // while it is open.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse_bytes(Bytes::Mapped(map))
    }

    pub fn parse(bytes: Vec<u8>) -> Result<Self> {
        Self::parse_bytes(Bytes::Owned(bytes))
    }

    fn parse_bytes(bytes: Bytes) -> Result<Self> {
        let mut cursor = Cursor {
            bytes: &bytes,
            pos: 0,
        };
        let magic = cursor.take(4).context("reading the magic number")?;
        ensure!(
            magic == MAGIC,
            "not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"
        );
        let version = cursor.u32().context("reading the version")?;
        ensure!(
            version == 2 || version == 3,
            "GGUF version {version} is not supported (2 and 3 are)"
        );
        let num_tensors = cursor.u64().context("reading the tensor count")?;
        let num_metadata = cursor.u64().context("reading the metadata count")?;

        let mut metadata = BTreeMap::new();
        for index in 0..num_metadata {
            let key = cursor
                .string()
                .with_context(|| format!("reading metadata key {index}"))?;
            let kind = cursor.u32()?;
            let value = cursor
                .value(kind, 0)
                .with_context(|| format!("reading metadata {key:?}"))?;
            metadata.insert(key, value);
        }

        let mut raw_tensors = Vec::new();
        for index in 0..num_tensors {
            let raw = cursor
                .tensor_info()
                .with_context(|| format!("reading tensor descriptor {index}"))?;
            raw_tensors.push(raw);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(Value::Uint(a)) if *a > 0 && a.is_power_of_two() => *a,
            Some(other) => bail!("general.alignment {other:?} is not a power of two"),
        };
        let data_start = (cursor.pos as u64).next_multiple_of(alignment);
        let tensors = raw_tensors
            .into_iter()
            .map(|raw| raw.validate(data_start, bytes.len()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Gguf {
            bytes,
            metadata,
            tensors,
        })
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor_data(&self, tensor: &TensorInfo) -> &[u8] {
        &self.bytes[tensor.range.clone()]
    }

    /// Drops this process's resident pages of `tensor` when the file is mapped (a later read
    /// maps them again from the file): once a weight is in device memory, its mapped copy
    /// would only count twice against the process's memory.
    pub fn release(&self, tensor: &TensorInfo) {
        let Bytes::Mapped(map) = &self.bytes else {
            return;
        };
        // SAFETY: a read-only private mapping that is never written, so dropping its pages
        // loses nothing: a later access reads the same bytes from the file again.
        let outcome = unsafe {
            map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                tensor.range.start,
                tensor.range.len(),
            )
        };
        if let Err(error) = outcome {
            tracing::debug!(tensor = tensor.name, %error, "could not release the pages of a tensor");
        }
    }

    /// Lets go of the metadata once it has been read, keeping the tensors: a served model
    /// needs only those, and the tokenizer's arrays (one string per token and per merge) are
    /// most of the metadata's memory.
    pub fn drop_metadata(&mut self) {
        self.metadata = BTreeMap::new();
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn u64(&self, key: &str) -> Result<u64> {
        match self.required(key)? {
            Value::Uint(v) => Ok(*v),
            Value::Int(v) if *v >= 0 => Ok(*v as u64),
            other => Err(GgufError::Metadata(format!(
                "GGUF metadata {key} is {other:?}, expected an unsigned integer"
            ))),
        }
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        usize::try_from(self.u64(key)?)
            .map_err(|_| GgufError::Metadata(format!("GGUF metadata {key} is too large")))
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        match self.required(key)? {
            Value::Float(v) => Ok(*v),
            other => Err(GgufError::Metadata(format!(
                "GGUF metadata {key} is {other:?}, expected a float"
            ))),
        }
    }

    pub fn bool(&self, key: &str) -> Result<bool> {
        match self.required(key)? {
            Value::Bool(v) => Ok(*v),
            other => Err(GgufError::Metadata(format!(
                "GGUF metadata {key} is {other:?}, expected a bool"
            ))),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        match self.required(key)? {
            Value::Str(v) => Ok(v),
            other => Err(GgufError::Metadata(format!(
                "GGUF metadata {key} is {other:?}, expected a string"
            ))),
        }
    }

    pub fn array(&self, key: &str) -> Result<&[Value]> {
        match self.required(key)? {
            Value::Array(v) => Ok(v),
            other => Err(GgufError::Metadata(format!(
                "GGUF metadata {key} is {other:?}, expected an array"
            ))),
        }
    }

    pub fn str_array(&self, key: &str) -> Result<Vec<&str>> {
        self.array(key)?
            .iter()
            .map(|v| match v {
                Value::Str(s) => Ok(s.as_str()),
                other => Err(GgufError::Metadata(format!(
                    "GGUF metadata {key} holds {other:?}, expected strings"
                ))),
            })
            .collect()
    }

    pub fn int_array(&self, key: &str) -> Result<Vec<i64>> {
        self.array(key)?
            .iter()
            .map(|v| match v {
                Value::Int(i) => Ok(*i),
                Value::Uint(u) => i64::try_from(*u).map_err(|_| {
                    GgufError::Metadata(format!("GGUF metadata {key} holds {u}, out of range"))
                }),
                other => Err(GgufError::Metadata(format!(
                    "GGUF metadata {key} holds {other:?}, expected integers"
                ))),
            })
            .collect()
    }

    fn required(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }
}

/// ggml's name of a type id, for messages about the types this reader does not read.
fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 43] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
        "NVFP4",
        "Q1_0",
        "Q2_0",
    ];
    NAMES.get(id as usize).copied().unwrap_or("unknown to ggml")
}

struct RawTensor {
    name: String,
    dims: Vec<u64>,
    kind: u32,
    offset: u64,
}

impl RawTensor {
    fn validate(self, data_start: u64, file_len: usize) -> Result<TensorInfo> {
        let name = self.name;
        let kind = GgmlType::from_id(self.kind).with_context(|| {
            format!(
                "tensor {name} has ggml type {} ({}), which this reader cannot read (it reads {})",
                self.kind,
                ggml_type_name(self.kind),
                GgmlType::NAMES
            )
        })?;
        let dims = self
            .dims
            .iter()
            .map(|&d| usize::try_from(d).ok().filter(|&d| d > 0))
            .collect::<Option<Vec<usize>>>()
            .with_context(|| format!("tensor {name} has dims {:?}", self.dims))?;
        let (block_elements, block_bytes) = kind.block();
        ensure!(
            dims[0] % block_elements == 0,
            "tensor {name}: row length {} is not a multiple of the {kind:?} block ({block_elements})",
            dims[0]
        );
        let num_bytes = dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .map(|n| n / block_elements * block_bytes)
            .with_context(|| format!("tensor {name}: dims {dims:?} overflow"))?;
        let start = data_start
            .checked_add(self.offset)
            .and_then(|s| usize::try_from(s).ok())
            .with_context(|| format!("tensor {name}: offset {} overflows", self.offset))?;
        let end = start
            .checked_add(num_bytes)
            .filter(|&end| end <= file_len)
            .with_context(|| {
                format!(
                    "tensor {name}: bytes {start}..{} lie past the end of the file ({file_len} bytes): \
                     the file is truncated or corrupt",
                    start as u128 + num_bytes as u128
                )
            })?;
        Ok(TensorInfo {
            name,
            dims,
            kind,
            range: start..end,
        })
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

/// Arrays nest only one level in practice; a deeper nesting means a corrupt file.
const MAX_NESTING: u32 = 4;

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .with_context(|| {
                format!(
                    "unexpected end of file at byte {} (wanted {n} more bytes of {}): \
                     the file is truncated or corrupt",
                    self.pos,
                    self.bytes.len()
                )
            })?;
        let slice = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A length that must fit in what is left of the file, `unit` bytes per item.
    fn length(&mut self, unit: usize) -> Result<usize> {
        let len = self.u64()?;
        let remaining = (self.bytes.len() - self.pos) as u64;
        ensure!(
            len.saturating_mul(unit as u64) <= remaining,
            "length {len} at byte {} exceeds the {remaining} bytes left: the file is corrupt",
            self.pos - 8
        );
        Ok(len as usize)
    }

    fn string(&mut self) -> Result<String> {
        let len = self.length(1)?;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| {
            GgufError::Malformed(format!("string at byte {} is not UTF-8", self.pos - len))
        })
    }

    fn value(&mut self, kind: u32, depth: u32) -> Result<Value> {
        Ok(match kind {
            0 => Value::Uint(u8::from_le_bytes(self.array()?).into()),
            1 => Value::Int(i8::from_le_bytes(self.array()?).into()),
            2 => Value::Uint(u16::from_le_bytes(self.array()?).into()),
            3 => Value::Int(i16::from_le_bytes(self.array()?).into()),
            4 => Value::Uint(self.u32()?.into()),
            5 => Value::Int(i32::from_le_bytes(self.array()?).into()),
            6 => Value::Float(f32::from_le_bytes(self.array()?).into()),
            7 => match self.take(1)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => bail!("bool byte {b} at byte {}", self.pos - 1),
            },
            8 => Value::Str(self.string()?),
            9 => {
                ensure!(depth < MAX_NESTING, "arrays nested too deeply");
                let item_kind = self.u32()?;
                // Every item takes at least one byte, which bounds the allocation.
                let len = self.length(1)?;
                let mut items = Vec::with_capacity(len);
                for _ in 0..len {
                    items.push(self.value(item_kind, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::Uint(self.u64()?),
            11 => Value::Int(i64::from_le_bytes(self.array()?)),
            12 => Value::Float(f64::from_le_bytes(self.array()?)),
            other => bail!("unknown metadata value type {other}"),
        })
    }

    fn tensor_info(&mut self) -> Result<RawTensor> {
        let name = self.string()?;
        let num_dims = self.u32()?;
        ensure!(
            (1..=MAX_DIMS).contains(&num_dims),
            "tensor {name} has {num_dims} dimensions"
        );
        let dims = (0..num_dims)
            .map(|_| self.u64())
            .collect::<Result<Vec<_>>>()?;
        let kind = self.u32()?;
        let offset = self.u64()?;
        Ok(RawTensor {
            name,
            dims,
            kind,
            offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let f32_bytes: Vec<u8> = [1.0f32, -2.0, 3.5, 0.25, 5.0, 6.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        GgufWriter::default()
            .str("general.architecture", "llama")
            .u32("llama.block_count", 2)
            .f32("llama.rope.freq_base", 10000.0)
            .bool("tokenizer.ggml.add_bos_token", false)
            .strs("tokenizer.ggml.tokens", &["a", "b"])
            .i32s("tokenizer.ggml.token_type", &[1, 3])
            .tensor("w", &[2, 3], 0, &f32_bytes)
            .tensor("v", &[32], 8, &[0u8; 34])
            .build()
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let gguf = Gguf::parse(sample()).expect("parses");
        assert_eq!(gguf.str("general.architecture").unwrap(), "llama");
        assert_eq!(gguf.usize("llama.block_count").unwrap(), 2);
        assert_eq!(gguf.f64("llama.rope.freq_base").unwrap(), 10000.0);
        assert!(!gguf.bool("tokenizer.ggml.add_bos_token").unwrap());
        assert_eq!(gguf.str_array("tokenizer.ggml.tokens").unwrap(), ["a", "b"]);
        assert_eq!(gguf.int_array("tokenizer.ggml.token_type").unwrap(), [1, 3]);
        let w = &gguf.tensors()[0];
        assert_eq!(
            (w.name.as_str(), w.kind, w.shape()),
            ("w", GgmlType::F32, vec![3, 2])
        );
        assert_eq!(&gguf.tensor_data(w)[8..12], &3.5f32.to_le_bytes());
        assert_eq!(gguf.tensor_data(&gguf.tensors()[1]).len(), 34);
    }

    #[test]
    fn corrupt_files_are_errors_not_panics() {
        let good = sample();
        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        let mut bad_type = good.clone();
        // The first metadata value type follows magic, version, counts and the key.
        let type_at = 4 + 4 + 8 + 8 + 8 + "general.architecture".len();
        bad_type[type_at] = 42;
        let mut huge_string = good.clone();
        huge_string[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("magic", bad_magic, "not a GGUF file"),
            (
                "truncated data",
                good[..good.len() - 40].to_vec(),
                "past the end",
            ),
            ("truncated header", good[..40].to_vec(), "corrupt"),
            ("value type", bad_type, "unknown metadata value type 42"),
            ("huge length", huge_string, "exceeds"),
            ("empty", Vec::new(), "magic"),
        ];
        for (name, bytes, message) in cases {
            let err = format!("{:#}", Gguf::parse(bytes).expect_err(name));
            assert!(err.contains(message), "{name}: {err}");
        }
    }

    #[test]
    fn unsupported_tensor_types_are_named() {
        let bytes = GgufWriter::default()
            .tensor("blk.0.attn_q.weight", &[32], 6, &[0u8; 22])
            .build();
        let err = format!("{:#}", Gguf::parse(bytes).unwrap_err());
        assert!(
            err.contains("blk.0.attn_q.weight has ggml type 6 (Q5_0)"),
            "{err}"
        );
    }
}
