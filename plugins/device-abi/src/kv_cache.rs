//! Where a paged KV cache keeps a head's row for a slot: the `[B, Hk, bs, D]` layout every device shares.
//!
//! Slot `s` is offset `s % bs` of block `s / bs`, and inside a block each KV head's `bs` rows
//! lie together, so attention reads one head's rows of a block as one contiguous run.

/// The shape of a cache block: `Hk` heads of `bs` rows of `D` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl CacheLayout {
    /// The element offset of KV head `kv_head`'s row at `slot`.
    pub fn row(&self, slot: usize, kv_head: usize) -> usize {
        let (block, offset) = (slot / self.block_size, slot % self.block_size);
        ((block * self.num_kv_heads + kv_head) * self.block_size + offset) * self.head_dim
    }

    /// Elements per slot: one row of every KV head.
    pub fn slot_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}
