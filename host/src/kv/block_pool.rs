//! The block pool: which KV blocks are free, cached or held, and by how many requests.
//!
//! Only the KV manager talks to the pool; it knows blocks, ref counts and
//! hashes but nothing about requests. Every block is in exactly one state:
//!
//! | state         | ref count | hash | where                    |
//! |---------------|-----------|------|--------------------------|
//! | held          | ≥ 1       | any  | some requests' tables    |
//! | free-uncached | 0         | none | `free_uncached`          |
//! | free-cached   | 0         | some | `evictable` (LRU order)  |
//!
//! New blocks come from `free_uncached` first, so a cached block is evicted
//! only when nothing else is left.

use std::collections::HashMap;

use super::BlockId;
use super::hash::BlockHash;

pub(super) struct BlockPool {
    ref_counts: Vec<u32>,
    block_to_hash: Vec<Option<BlockHash>>,
    hash_to_block: HashMap<BlockHash, BlockId>,
    /// A stack: the most recently freed block is reused first.
    free_uncached: Vec<BlockId>,
    evictable: LruList,
}

impl BlockPool {
    pub fn new(num_blocks: u32) -> Self {
        assert!(num_blocks < NIL, "block ids must fit below {NIL}");
        BlockPool {
            ref_counts: vec![0; num_blocks as usize],
            block_to_hash: vec![None; num_blocks as usize],
            hash_to_block: HashMap::new(),
            // Reversed so that a fresh pool hands out 0, 1, 2, ...
            free_uncached: (0..num_blocks).rev().collect(),
            evictable: LruList::new(num_blocks),
        }
    }

    pub fn num_blocks(&self) -> u32 {
        self.ref_counts.len() as u32
    }

    /// Blocks no request holds, cached or not.
    pub fn num_free_blocks(&self) -> u32 {
        self.free_uncached.len() as u32 + self.evictable.len
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block as usize]
    }

    pub fn cached_block(&self, hash: &BlockHash) -> Option<BlockId> {
        self.hash_to_block.get(hash).copied()
    }

    /// Whether each block still caches the hash it had when it was looked up.
    pub fn is_cached_run(&self, blocks: &[BlockId], hashes: &[BlockHash]) -> bool {
        blocks.len() == hashes.len()
            && blocks
                .iter()
                .zip(hashes)
                .all(|(&block, hash)| self.cached_block(hash) == Some(block))
    }

    /// Takes one more reference on each cached block; a block nobody held leaves the LRU.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &block in blocks {
            let ref_count = &mut self.ref_counts[block as usize];
            if *ref_count == 0 {
                assert!(
                    self.block_to_hash[block as usize].is_some(),
                    "touched block {block} is free and uncached"
                );
                self.evictable.remove(block);
            }
            *ref_count += 1;
        }
    }

    /// Appends `num_blocks` newly held blocks to `out`, or returns false and changes nothing.
    pub fn allocate(&mut self, num_blocks: u32, out: &mut Vec<BlockId>) -> bool {
        if num_blocks > self.num_free_blocks() {
            return false;
        }
        for _ in 0..num_blocks {
            let block = match self.free_uncached.pop() {
                Some(block) => block,
                None => self.evict(),
            };
            debug_assert_eq!(self.ref_counts[block as usize], 0);
            self.ref_counts[block as usize] = 1;
            out.push(block);
        }
        true
    }

    fn evict(&mut self) -> BlockId {
        let block = self
            .evictable
            .pop_front()
            .expect("free block count covers the request");
        let hash = self.block_to_hash[block as usize]
            .take()
            .expect("evictable blocks are cached");
        self.hash_to_block.remove(&hash);
        block
    }

    /// Drops one reference per block, in the given order: the first block to reach
    /// zero references is the first to be evicted among them.
    #[cfg(test)]
    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        self.free_recording(blocks, None);
    }

    /// [`BlockPool::free`], appending to `cached_free` each block that became free and
    /// cached, with its hash: the blocks the KV tiers below the device want a copy of.
    pub fn free_recording(
        &mut self,
        blocks: impl IntoIterator<Item = BlockId>,
        mut cached_free: Option<&mut Vec<(BlockId, BlockHash)>>,
    ) {
        for block in blocks {
            let ref_count = &mut self.ref_counts[block as usize];
            assert!(*ref_count > 0, "block {block} freed more often than held");
            *ref_count -= 1;
            if *ref_count == 0 {
                match self.block_to_hash[block as usize] {
                    Some(hash) => {
                        self.evictable.push_back(block);
                        if let Some(out) = cached_free.as_deref_mut() {
                            out.push((block, hash));
                        }
                    }
                    None => self.free_uncached.push(block),
                }
            }
        }
    }

    /// Registers a held, full block under `hash`. Returns false, leaving the block
    /// uncached, if another block already caches that hash: one block per hash.
    pub fn cache_block(&mut self, block: BlockId, hash: BlockHash) -> bool {
        debug_assert!(
            self.ref_counts[block as usize] > 0,
            "only held blocks are cached"
        );
        let slot = &mut self.block_to_hash[block as usize];
        if slot.is_some() || self.hash_to_block.contains_key(&hash) {
            return false;
        }
        *slot = Some(hash);
        self.hash_to_block.insert(hash, block);
        true
    }

    #[cfg(test)]
    pub fn block_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.block_to_hash[block as usize]
    }

    #[cfg(test)]
    pub fn num_cached_blocks(&self) -> usize {
        self.hash_to_block.len()
    }

    #[cfg(test)]
    pub fn evictable_in_order(&self) -> Vec<BlockId> {
        self.evictable.iter().collect()
    }

    /// Panics unless the pool is consistent and `expected_ref_counts` (one per block,
    /// counted from the requests' tables) matches its ref counts.
    #[cfg(test)]
    pub fn check_invariants(&self, expected_ref_counts: &[u32]) {
        assert_eq!(self.ref_counts, expected_ref_counts, "ref counts");
        let num_blocks = self.ref_counts.len();
        let mut seen = vec![false; num_blocks];
        for &block in &self.free_uncached {
            assert!(
                !std::mem::replace(&mut seen[block as usize], true),
                "{block} listed twice"
            );
            assert_eq!(
                self.ref_counts[block as usize], 0,
                "free block {block} is held"
            );
            assert!(
                self.block_to_hash[block as usize].is_none(),
                "free-uncached {block} has a hash"
            );
        }
        self.evictable.check_links();
        for block in self.evictable.iter() {
            assert!(
                !std::mem::replace(&mut seen[block as usize], true),
                "{block} listed twice"
            );
            assert_eq!(
                self.ref_counts[block as usize], 0,
                "evictable block {block} is held"
            );
            assert!(
                self.block_to_hash[block as usize].is_some(),
                "evictable {block} has no hash"
            );
        }
        let mut num_held = 0;
        for (block, seen) in seen.iter().enumerate() {
            let held = self.ref_counts[block] > 0;
            assert!(
                held != *seen,
                "block {block} is both held and free, or neither"
            );
            num_held += u32::from(held);
        }
        assert_eq!(self.num_free_blocks() + num_held, self.num_blocks());
        let num_hashed = self.block_to_hash.iter().flatten().count();
        assert_eq!(
            num_hashed,
            self.hash_to_block.len(),
            "hash maps differ in size"
        );
        for (hash, &block) in &self.hash_to_block {
            assert_eq!(
                self.block_to_hash[block as usize],
                Some(*hash),
                "hash maps disagree"
            );
        }
    }
}

const NIL: u32 = u32::MAX;

/// Free cached blocks, least recently freed at the front. Links live in arrays
/// indexed by block id, so a prefix hit can take a block out of the middle in O(1).
struct LruList {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: u32,
}

impl LruList {
    fn new(num_blocks: u32) -> Self {
        LruList {
            prev: vec![NIL; num_blocks as usize],
            next: vec![NIL; num_blocks as usize],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    fn push_back(&mut self, block: BlockId) {
        self.prev[block as usize] = self.tail;
        self.next[block as usize] = NIL;
        match self.tail {
            NIL => self.head = block,
            tail => self.next[tail as usize] = block,
        }
        self.tail = block;
        self.len += 1;
    }

    /// Unlinks `block`, which must be in the list.
    fn remove(&mut self, block: BlockId) {
        let (prev, next) = (self.prev[block as usize], self.next[block as usize]);
        match prev {
            NIL => self.head = next,
            prev => self.next[prev as usize] = next,
        }
        match next {
            NIL => self.tail = prev,
            next => self.prev[next as usize] = prev,
        }
        self.prev[block as usize] = NIL;
        self.next[block as usize] = NIL;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<BlockId> {
        let head = self.head;
        (head != NIL).then(|| {
            self.remove(head);
            head
        })
    }

    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        std::iter::successors((self.head != NIL).then_some(self.head), |&block| {
            let next = self.next[block as usize];
            (next != NIL).then_some(next)
        })
        .take(self.prev.len() + 1)
    }

    #[cfg(test)]
    fn check_links(&self) {
        let forward: Vec<_> = self.iter().collect();
        assert_eq!(forward.len(), self.len as usize, "LRU length");
        let mut backward = Vec::new();
        let mut block = self.tail;
        while block != NIL && backward.len() <= forward.len() {
            backward.push(block);
            block = self.prev[block as usize];
        }
        backward.reverse();
        assert_eq!(forward, backward, "LRU links");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(n: u32) -> BlockHash {
        BlockHash::new(None, &[n])
    }

    #[test]
    fn lru_unlinks_from_any_position() {
        let cases: [(&[BlockId], BlockId, &[BlockId]); 4] = [
            (&[0, 1, 2], 0, &[1, 2]),
            (&[0, 1, 2], 1, &[0, 2]),
            (&[0, 1, 2], 2, &[0, 1]),
            (&[3], 3, &[]),
        ];
        for (pushed, removed, left) in cases {
            let mut lru = LruList::new(4);
            pushed.iter().for_each(|&block| lru.push_back(block));
            lru.remove(removed);
            lru.check_links();
            assert_eq!(
                lru.iter().collect::<Vec<_>>(),
                left,
                "remove {removed} from {pushed:?}"
            );
        }
    }

    #[test]
    fn uncached_blocks_are_used_before_evicting() {
        let mut pool = BlockPool::new(3);
        let mut held = Vec::new();
        assert!(pool.allocate(3, &mut held));
        assert!(pool.cache_block(held[0], hash(0)));
        pool.free([held[0], held[1]]);
        pool.check_invariants(&[0, 0, 1]);

        let mut again = Vec::new();
        assert!(pool.allocate(1, &mut again));
        assert_eq!(again, [held[1]], "the uncached block, not the cached one");
        assert_eq!(pool.cached_block(&hash(0)), Some(held[0]));
        assert!(pool.allocate(1, &mut again));
        assert_eq!(pool.cached_block(&hash(0)), None, "evicted with its hash");
        assert!(!pool.allocate(1, &mut again), "out of blocks");
        assert_eq!(again.len(), 2);
        pool.check_invariants(&[1, 1, 1]);
    }

    #[test]
    fn one_block_per_hash() {
        let mut pool = BlockPool::new(2);
        let mut held = Vec::new();
        assert!(pool.allocate(2, &mut held));
        assert!(pool.cache_block(held[0], hash(7)));
        assert!(!pool.cache_block(held[1], hash(7)), "duplicate hash");
        assert!(!pool.cache_block(held[0], hash(8)), "block already cached");
        assert_eq!(pool.block_hash(held[1]), None);
        pool.check_invariants(&[1, 1]);
    }
}
