//! Writing small GGUF files in memory, laid out the way llama.cpp's writer lays them out: the
//! fixtures of the reader's and the converters' tests.

use super::{DEFAULT_ALIGNMENT, MAGIC};

/// A GGUF file under construction: metadata and tensors are appended in order, `build` lays
/// them out.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<u8>,
    num_metadata: u64,
    infos: Vec<u8>,
    data: Vec<u8>,
    num_tensors: u64,
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl GgufWriter {
    pub fn u32(mut self, key: &str, v: u32) -> Self {
        put_string(&mut self.metadata, key);
        self.metadata.extend(4u32.to_le_bytes());
        self.metadata.extend(v.to_le_bytes());
        self.num_metadata += 1;
        self
    }

    pub fn f32(mut self, key: &str, v: f32) -> Self {
        put_string(&mut self.metadata, key);
        self.metadata.extend(6u32.to_le_bytes());
        self.metadata.extend(v.to_le_bytes());
        self.num_metadata += 1;
        self
    }

    pub fn bool(mut self, key: &str, v: bool) -> Self {
        put_string(&mut self.metadata, key);
        self.metadata.extend(7u32.to_le_bytes());
        self.metadata.push(v.into());
        self.num_metadata += 1;
        self
    }

    pub fn str(mut self, key: &str, v: &str) -> Self {
        put_string(&mut self.metadata, key);
        self.metadata.extend(8u32.to_le_bytes());
        put_string(&mut self.metadata, v);
        self.num_metadata += 1;
        self
    }

    pub fn strs(mut self, key: &str, items: &[&str]) -> Self {
        put_string(&mut self.metadata, key);
        self.metadata.extend(9u32.to_le_bytes());
        self.metadata.extend(8u32.to_le_bytes());
        self.metadata.extend((items.len() as u64).to_le_bytes());
        for item in items {
            put_string(&mut self.metadata, item);
        }
        self.num_metadata += 1;
        self
    }

    pub fn i32s(mut self, key: &str, items: &[i32]) -> Self {
        put_string(&mut self.metadata, key);
        self.metadata.extend(9u32.to_le_bytes());
        self.metadata.extend(5u32.to_le_bytes());
        self.metadata.extend((items.len() as u64).to_le_bytes());
        for item in items {
            self.metadata.extend(item.to_le_bytes());
        }
        self.num_metadata += 1;
        self
    }

    /// A tensor of ggml type `kind` with `dims` in ggml order and its raw bytes.
    pub fn tensor(mut self, name: &str, dims: &[u64], kind: u32, bytes: &[u8]) -> Self {
        put_string(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(kind.to_le_bytes());
        self.infos.extend((self.data.len() as u64).to_le_bytes());
        self.data.extend(bytes);
        self.data.resize(
            self.data.len().next_multiple_of(DEFAULT_ALIGNMENT as usize),
            0,
        );
        self.num_tensors += 1;
        self
    }

    pub fn build(self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(MAGIC);
        out.extend(3u32.to_le_bytes());
        out.extend(self.num_tensors.to_le_bytes());
        out.extend(self.num_metadata.to_le_bytes());
        out.extend(self.metadata);
        out.extend(self.infos);
        out.resize(out.len().next_multiple_of(DEFAULT_ALIGNMENT as usize), 0);
        out.extend(self.data);
        out
    }
}
