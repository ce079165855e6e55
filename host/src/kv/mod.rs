//! The paged KV cache's host-side bookkeeping: block tables, the block pool and the prefix cache, and the tiers below the device that blocks spill to.
//!
//! The device memory is allocated once at prepare time elsewhere; here a block
//! is only an id in `0..num_blocks`. Layering follows vLLM v1: the engine and
//! the scheduler talk to [`KvCacheManager`] (requests, tokens, block tables);
//! only the manager talks to the block pool (blocks, ref counts, hashes).
//! Running out of blocks is a `None` from [`KvCacheManager::allocate`], never
//! an error or a panic; the caller preempts or waits.
//!
//! A full block that a request has computed is registered under a chained hash
//! of its tokens and every token before them (see `hash.rs`), so a later request
//! with the same prefix reuses the block instead of recomputing it. Freed cached
//! blocks stay cached until their space is needed, least recently freed first.
//!
//! Invariants (checked after every operation in the tests):
//! - every block is in exactly one of: held by ≥ 1 request, free-uncached,
//!   free-cached (in the eviction LRU);
//! - a block's ref count equals the number of requests whose table holds it,
//!   and no table holds a block twice;
//! - the hash map and the blocks' hashes are inverse: one block per hash, and
//!   that block's contents are exactly the tokens the hash was computed from;
//! - `num_free_blocks() + held == num_blocks()`;
//! - a cached block is full and is never written again while cached: a
//!   request only writes past its last full block.

mod block_pool;
mod hash;
mod manager;
pub mod offload;
pub mod tier;

pub use hash::{BlockHash, block_hashes};
pub use manager::{ComputedPrefix, KvCacheConfig, KvCacheManager, PrefixCacheStats};

/// A physical KV block, an index in `0..num_blocks`.
pub type BlockId = u32;
/// The engine's id of a request.
pub type RequestId = u64;
