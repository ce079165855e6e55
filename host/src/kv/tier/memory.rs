//! The host-memory KV tier (`--kv-offload-memory`): whole blocks in buffers allocated once each and reused, least recently used evicted first.

use super::{KvTier, LruIndex, TierError, TierKey, TierUsage};

pub struct MemoryTier {
    block_bytes: usize,
    capacity_blocks: usize,
    index: LruIndex<Box<[u8]>>,
    /// Buffers of evicted blocks, reused by the next stores.
    spare: Vec<Box<[u8]>>,
}

impl MemoryTier {
    /// A tier of `capacity_bytes`, holding whole blocks of `block_bytes` (at least one).
    pub fn new(capacity_bytes: u64, block_bytes: u64) -> MemoryTier {
        let capacity_blocks = (capacity_bytes / block_bytes.max(1)).max(1) as usize;
        MemoryTier {
            block_bytes: block_bytes as usize,
            capacity_blocks,
            index: LruIndex::default(),
            spare: Vec::new(),
        }
    }
}

impl KvTier for MemoryTier {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn lookup(&mut self, key: &TierKey) -> bool {
        self.index.touch(key).is_some()
    }

    fn store(&mut self, key: TierKey, block: &[u8]) -> Result<(), TierError> {
        if self.index.contains(&key) {
            return Ok(());
        }
        while self.index.len() >= self.capacity_blocks {
            self.evict();
        }
        let mut buffer = self
            .spare
            .pop()
            .unwrap_or_else(|| vec![0; self.block_bytes].into_boxed_slice());
        buffer.copy_from_slice(block);
        // The key is not held: checked above.
        let _ = self.index.insert(key, buffer);
        Ok(())
    }

    fn load(&mut self, key: &TierKey, out: &mut [u8]) -> Result<(), TierError> {
        let block = self.index.touch(key).ok_or(TierError::Missing)?;
        out.copy_from_slice(block);
        Ok(())
    }

    fn evict(&mut self) -> Option<TierKey> {
        let (key, buffer) = self.index.pop_lru()?;
        self.spare.push(buffer);
        Some(key)
    }

    fn usage(&self) -> TierUsage {
        let blocks = self.index.len() as u64;
        TierUsage {
            blocks,
            bytes: blocks * self.block_bytes as u64,
            capacity_bytes: (self.capacity_blocks * self.block_bytes) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::key;
    use super::*;

    #[test]
    fn stores_loads_and_evicts_least_recently_used_first() {
        let mut tier = MemoryTier::new(3 * 8, 8);
        for block in 0..3u8 {
            tier.store(key(1, block.into()), &[block; 8]).unwrap();
        }
        assert!(tier.lookup(&key(1, 0)), "block 0 is now the most recent");
        tier.store(key(1, 3), &[3; 8]).unwrap();
        assert!(
            !tier.lookup(&key(1, 1)),
            "block 1 was the least recently used"
        );
        let mut out = [0u8; 8];
        tier.load(&key(1, 0), &mut out).unwrap();
        assert_eq!(out, [0; 8]);
        assert!(
            matches!(tier.load(&key(2, 0), &mut out), Err(TierError::Missing)),
            "another model's key"
        );
        assert_eq!(tier.usage().blocks, 3);
        assert_eq!(tier.usage().capacity_bytes, 24);
    }
}
