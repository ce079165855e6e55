//! Where a KV block lies in the prepared caches, and the batched copies of whole blocks between the device and host memory that the KV tiers use.
//!
//! In the `[B, Hk, bs, D]` layout a block is one contiguous run of bytes in each layer's key
//! cache and value cache, so a list of blocks is a list of byte ranges and one batched device
//! call moves them all.

use crate::device::{BufferId, BufferRange};

use super::{Runtime, RuntimeError};

/// The KV caches (key and value per layer) and the bytes one block takes in each.
pub(super) struct KvBlockLayout {
    caches: Vec<BufferId>,
    bytes_per_cache: u64,
    /// The ranges of the blocks being copied, reused from copy to copy.
    ranges: Vec<BufferRange>,
}

impl KvBlockLayout {
    pub(super) fn new(layers: Vec<(BufferId, BufferId)>, bytes_per_cache: u64) -> KvBlockLayout {
        let caches = layers.into_iter().flat_map(|(k, v)| [k, v]).collect();
        KvBlockLayout {
            caches,
            bytes_per_cache,
            ranges: Vec::new(),
        }
    }

    /// Bytes of one block across every cache: the size of a block in a lower tier.
    fn block_bytes(&self) -> u64 {
        self.caches.len() as u64 * self.bytes_per_cache
    }

    /// The byte ranges of `blocks`, block by block, each block cache by cache.
    fn fill_ranges(&mut self, blocks: &[u32]) {
        self.ranges.clear();
        for &block in blocks {
            let offset = u64::from(block) * self.bytes_per_cache;
            self.ranges
                .extend(self.caches.iter().map(|&buffer| BufferRange {
                    buffer,
                    offset,
                    len: self.bytes_per_cache,
                }));
        }
    }
}

impl Runtime {
    /// Bytes one KV block holds across every layer's key and value cache.
    pub fn kv_block_bytes(&self) -> u64 {
        self.kv_blocks.block_bytes()
    }

    /// Copies `blocks`' keys and values, one after another, into `dst` (exactly
    /// `blocks.len() * kv_block_bytes()` long), as one device call.
    pub fn read_kv_blocks(&mut self, blocks: &[u32], dst: &mut [u8]) -> Result<(), RuntimeError> {
        self.kv_blocks.fill_ranges(blocks);
        Ok(self.device.read_ranges(&self.kv_blocks.ranges, dst)?)
    }

    /// Copies `src`, blocks one after another as [`Runtime::read_kv_blocks`] wrote them, into
    /// `blocks`, as one device call.
    pub fn write_kv_blocks(&mut self, blocks: &[u32], src: &[u8]) -> Result<(), RuntimeError> {
        self.kv_blocks.fill_ranges(blocks);
        Ok(self.device.write_ranges(&self.kv_blocks.ranges, src)?)
    }
}
