//! Where a KV block lies in the prepared caches, and the batched copies of whole blocks between the device and host memory that the KV tiers use: synchronous, or out of the device in the background.
//!
//! In the `[B, Hk, bs, D]` layout a block is one contiguous run of bytes in each layer's key
//! cache and value cache, so a list of blocks is a list of byte ranges and one batched device
//! call moves them all.

use crate::device::{BufferId, BufferRange, CopiedOut};

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

    /// Whether [`Runtime::start_kv_copy_out`] is available: the device copies out in the
    /// background (device table revision 1.2).
    pub fn copies_kv_out_in_background(&self) -> bool {
        self.device.copies_out_in_background()
    }

    /// Makes the device side's staging memory hold `blocks` blocks' copies out now (a no-op
    /// without background copies), so copies of up to that many allocate nothing.
    pub fn reserve_kv_copy_out(&mut self, blocks: usize) -> Result<(), RuntimeError> {
        let bytes = blocks as u64 * self.kv_blocks.block_bytes();
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        Ok(self.device.reserve_copy_out(bytes)?)
    }

    /// Starts copying `blocks`' keys and values out of the device in the background, laid out
    /// as [`Runtime::read_kv_blocks`] lays them, and returns at once. Until
    /// [`Runtime::poll_kv_copy_out`] returns them, no step may write these blocks: the caller
    /// keeps them from being allocated (reading them, as a prefix hit does, is fine).
    pub fn start_kv_copy_out(&mut self, blocks: &[u32]) -> Result<(), RuntimeError> {
        self.kv_blocks.fill_ranges(blocks);
        Ok(self.device.start_copy_out(&self.kv_blocks.ranges)?)
    }

    /// The bytes of the copy out in flight once it ended, `None` while it runs (or when none
    /// is in flight); with `wait`, waits for its end. An error ends it with no bytes.
    pub fn poll_kv_copy_out(&mut self, wait: bool) -> Result<Option<&[u8]>, RuntimeError> {
        Ok(self.device.poll_copy_out(wait)?)
    }

    /// The bytes of the last copy out that ended, shared for reading on another thread; no
    /// copy out starts while any clone of them is alive. `None` while one runs.
    pub fn kv_copied_out(&self) -> Option<CopiedOut> {
        self.device.copied_out_shared()
    }

    /// Copies `src`, blocks one after another as [`Runtime::read_kv_blocks`] wrote them, into
    /// `blocks`, as one device call.
    pub fn write_kv_blocks(&mut self, blocks: &[u32], src: &[u8]) -> Result<(), RuntimeError> {
        self.kv_blocks.fill_ranges(blocks);
        Ok(self.device.write_ranges(&self.kv_blocks.ranges, src)?)
    }
}
