//! The KV cache manager: each request's block table, admission with prefix hits, growth and release.
//!
//! This is the only type the engine and the scheduler see; blocks, ref counts
//! and hashes stay behind it in the block pool.

use std::collections::HashMap;

use super::block_pool::BlockPool;
use super::hash::{self, BlockHash};
use super::{BlockId, RequestId};

#[derive(Clone, Copy, Debug)]
pub struct KvCacheConfig {
    pub num_blocks: u32,
    /// Tokens per block; must be at least 1.
    pub block_size: u32,
    pub enable_prefix_caching: bool,
}

/// A cache hit found on admission: leading full blocks whose KV a request can reuse.
///
/// Pass it back to [`KvCacheManager::allocate`] unchanged. It carries the hashes
/// it was found under, so `allocate` can tell whether its blocks were evicted
/// (and perhaps reused for other tokens) in the meantime.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComputedPrefix {
    pub blocks: Vec<BlockId>,
    /// Tokens the blocks cover: `blocks.len() * block_size`.
    pub num_tokens: u32,
    block_hashes: Vec<BlockHash>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Tokens looked up by `find_cached_prefix`.
    pub num_queries: u64,
    /// Of those, tokens found in the cache.
    pub num_hits: u64,
}

#[derive(Default)]
struct RequestBlocks {
    blocks: Vec<BlockId>,
    /// Hashes of the leading full blocks already offered to the prefix cache;
    /// never longer than `blocks`. Kept so each step hashes only new blocks.
    block_hashes: Vec<BlockHash>,
}

pub struct KvCacheManager {
    config: KvCacheConfig,
    pool: BlockPool,
    request_to_blocks: HashMap<RequestId, RequestBlocks>,
    stats: PrefixCacheStats,
    /// With KV tiers below the device: the blocks that became free and cached since the
    /// engine last took them, to be copied down before anything can evict them.
    cached_free: Option<Vec<(BlockId, BlockHash)>>,
}

impl KvCacheManager {
    pub fn new(config: KvCacheConfig) -> Self {
        assert!(config.block_size > 0, "KV block size must be at least 1");
        KvCacheManager {
            config,
            pool: BlockPool::new(config.num_blocks),
            request_to_blocks: HashMap::new(),
            stats: PrefixCacheStats::default(),
            cached_free: None,
        }
    }

    pub fn config(&self) -> KvCacheConfig {
        self.config
    }

    pub fn block_size(&self) -> u32 {
        self.config.block_size
    }

    pub fn num_blocks(&self) -> u32 {
        self.pool.num_blocks()
    }

    /// Free blocks, counting cached blocks no request holds (they are evictable).
    pub fn num_free_blocks(&self) -> u32 {
        self.pool.num_free_blocks()
    }

    /// Fraction of blocks held by requests (0.0..=1.0).
    pub fn usage(&self) -> f64 {
        match self.num_blocks() {
            0 => 0.0,
            num_blocks => f64::from(num_blocks - self.num_free_blocks()) / f64::from(num_blocks),
        }
    }

    /// Longest run of full blocks of `tokens` already in the cache. Never covers all of
    /// `tokens`: at least one token is left to compute so the step produces logits.
    /// Counts a query in the stats. Takes no references: the blocks stay evictable
    /// until [`allocate`](Self::allocate) takes them.
    pub fn find_cached_prefix(&mut self, tokens: &[u32]) -> ComputedPrefix {
        let mut prefix = ComputedPrefix::default();
        if !self.config.enable_prefix_caching {
            return prefix;
        }
        let max_cache_hit_tokens = tokens.len().saturating_sub(1);
        let block_size = self.config.block_size as usize;
        for hash in hash::block_hashes(&tokens[..max_cache_hit_tokens], block_size) {
            let Some(block) = self.pool.cached_block(&hash) else {
                break;
            };
            prefix.blocks.push(block);
            prefix.block_hashes.push(hash);
        }
        prefix.num_tokens = prefix.blocks.len() as u32 * self.config.block_size;
        self.stats.num_queries += tokens.len() as u64;
        self.stats.num_hits += u64::from(prefix.num_tokens);
        prefix
    }

    /// Whether `prefix`'s blocks are all still cached as they were when it was found.
    /// [`allocate`](Self::allocate) refuses a prefix that is not; look it up again.
    pub fn is_prefix_cached(&self, prefix: &ComputedPrefix) -> bool {
        self.pool
            .is_cached_run(&prefix.blocks, &prefix.block_hashes)
    }

    /// Makes `request` hold enough blocks for `num_tokens` tokens in total (computed +
    /// about to compute) and returns its block table.
    ///
    /// On the request's first allocation (it holds no blocks) `prefix` is taken first:
    /// its blocks gain a reference and leave the eviction LRU. Later calls ignore
    /// `prefix`. New blocks come from the free list, evicting the least recently freed
    /// cached block when needed.
    ///
    /// Returns `None` and changes nothing if there are not enough free blocks, or if
    /// `prefix` went stale since `find_cached_prefix` (see [`is_prefix_cached`](Self::is_prefix_cached)).
    pub fn allocate(
        &mut self,
        request: RequestId,
        num_tokens: u32,
        prefix: Option<&ComputedPrefix>,
    ) -> Option<&[BlockId]> {
        let num_held = self.block_table(request).len() as u32;
        let prefix = prefix.filter(|_| num_held == 0);
        let (prefix_blocks, prefix_hashes) = match prefix {
            Some(prefix) => {
                assert_eq!(
                    prefix.num_tokens,
                    prefix.blocks.len() as u32 * self.config.block_size,
                    "a ComputedPrefix must come unchanged from find_cached_prefix"
                );
                if !self.is_prefix_cached(prefix) {
                    return None;
                }
                (&prefix.blocks[..], &prefix.block_hashes[..])
            }
            None => (&[][..], &[][..]),
        };
        let num_covered = num_held.max(prefix_blocks.len() as u32);
        let num_new_blocks = self.num_blocks_for(num_tokens).saturating_sub(num_covered);
        // Prefix blocks nobody holds are counted as free, so taking them uses up free blocks too.
        let num_evictable_prefix_blocks = prefix_blocks
            .iter()
            .filter(|&&block| self.pool.ref_count(block) == 0)
            .count() as u32;
        if num_new_blocks + num_evictable_prefix_blocks > self.pool.num_free_blocks() {
            return None;
        }

        self.pool.touch(prefix_blocks);
        let entry = self.request_to_blocks.entry(request).or_default();
        entry.blocks.extend_from_slice(prefix_blocks);
        entry.block_hashes.extend_from_slice(prefix_hashes);
        let allocated = self.pool.allocate(num_new_blocks, &mut entry.blocks);
        assert!(allocated, "free block count was checked above");
        Some(&entry.blocks)
    }

    /// How many more blocks `allocate(request, num_tokens, None)` would need (0 if it
    /// holds enough).
    pub fn num_blocks_needed(&self, request: RequestId, num_tokens: u32) -> u32 {
        let num_held = self.block_table(request).len() as u32;
        self.num_blocks_for(num_tokens).saturating_sub(num_held)
    }

    fn num_blocks_for(&self, num_tokens: u32) -> u32 {
        num_tokens.div_ceil(self.config.block_size)
    }

    /// After a step, registers the request's full blocks among its first `num_computed`
    /// tokens in the prefix cache. `tokens` is every token of the request known so far
    /// (prompt + output). Idempotent; a block whose hash another block already caches
    /// stays a plain block, so there is one block per hash.
    pub fn cache_full_blocks(&mut self, request: RequestId, tokens: &[u32], num_computed: u32) {
        if !self.config.enable_prefix_caching {
            return;
        }
        let Some(entry) = self.request_to_blocks.get_mut(&request) else {
            return;
        };
        debug_assert!(
            num_computed as usize <= tokens.len(),
            "computed tokens must be known"
        );
        let block_size = self.config.block_size as usize;
        let num_full_blocks = (num_computed as usize).min(tokens.len()) / block_size;
        let num_full_blocks = num_full_blocks.min(entry.blocks.len());
        for index in entry.block_hashes.len()..num_full_blocks {
            let block_tokens = &tokens[index * block_size..(index + 1) * block_size];
            let hash = BlockHash::new(entry.block_hashes.last(), block_tokens);
            self.pool.cache_block(entry.blocks[index], hash);
            entry.block_hashes.push(hash);
        }
    }

    /// The request's blocks in order (empty if none).
    pub fn block_table(&self, request: RequestId) -> &[BlockId] {
        self.request_to_blocks
            .get(&request)
            .map_or(&[], |entry| &entry.blocks)
    }

    /// Releases the request's blocks (finish, abort or preemption). Cached blocks that
    /// no request holds any more go to the back of the eviction LRU, tail first, so a
    /// request's last blocks are evicted before its first ones (which more requests
    /// are likely to share); uncached ones go to the free list.
    pub fn free(&mut self, request: RequestId) {
        if let Some(entry) = self.request_to_blocks.remove(&request) {
            self.pool
                .free_recording(entry.blocks.into_iter().rev(), self.cached_free.as_mut());
        }
    }

    /// Keeps cached blocks from going to another request while a copy out of the device reads
    /// them: each gets a reference no request holds, so no allocation evicts it. A prefix hit
    /// may still take them, since it only reads. Every block must still cache a hash (see
    /// [`Self::caches`]).
    pub fn pin(&mut self, blocks: &[BlockId]) {
        self.pool.touch(blocks);
    }

    /// Drops the references [`Self::pin`] took. A block no request holds goes back to the
    /// eviction LRU, and is not recorded as newly cached-free: its copy is done.
    pub fn unpin(&mut self, blocks: &[BlockId]) {
        self.pool.free_recording(blocks.iter().copied(), None);
    }

    /// Whether `block` still caches `hash`, so its keys and values are those of that hash.
    pub fn caches(&self, block: BlockId, hash: &BlockHash) -> bool {
        self.pool.cached_block(hash) == Some(block)
    }

    /// From now on, remembers every block that becomes free and cached (its last user
    /// finished, was aborted or preempted), for [`Self::take_cached_free`].
    pub fn record_cached_free(&mut self) {
        self.cached_free.get_or_insert_with(Vec::new);
    }

    /// Whether blocks became free and cached since the last [`Self::take_cached_free`].
    pub fn has_cached_free(&self) -> bool {
        self.cached_free
            .as_ref()
            .is_some_and(|recorded| !recorded.is_empty())
    }

    /// Moves into `out` the blocks that became free and cached since the last call and still
    /// cache the same hash, so their keys and values are intact. Between steps nothing has
    /// evicted them yet: only allocation evicts.
    pub fn take_cached_free(&mut self, out: &mut Vec<(BlockId, BlockHash)>) {
        out.clear();
        let Some(recorded) = self.cached_free.as_mut() else {
            return;
        };
        for (block, hash) in recorded.drain(..) {
            if self.pool.cached_block(&hash) == Some(block) && !out.contains(&(block, hash)) {
                out.push((block, hash));
            }
        }
    }

    /// The hashes of the full blocks of `tokens` after the first `skip`, up to the last token
    /// (one is always left to compute, as [`Self::find_cached_prefix`] leaves it): the blocks
    /// a lower tier may supply after a device prefix of `skip` blocks.
    pub fn hashes_after(&self, tokens: &[u32], skip: usize) -> Vec<BlockHash> {
        if !self.config.enable_prefix_caching {
            return Vec::new();
        }
        let max_cache_hit_tokens = tokens.len().saturating_sub(1);
        hash::block_hashes(
            &tokens[..max_cache_hit_tokens],
            self.config.block_size as usize,
        )
        .skip(skip)
        .collect()
    }

    /// Counts `tokens` more prefix hits, found in a tier below the device.
    pub fn count_lower_tier_hits(&mut self, tokens: u32) {
        self.stats.num_hits += u64::from(tokens);
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Requests that have allocated and not been freed.
    pub fn num_requests(&self) -> usize {
        self.request_to_blocks.len()
    }
}

#[cfg(test)]
mod tests;
