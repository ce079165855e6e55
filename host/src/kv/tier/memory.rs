//! The host-memory KV tier (`--kv-offload-memory`): whole blocks in slots of one allocation mapped at start, least recently used evicted first.

use plughost_device_abi::pages::{self, MappedPages};

use super::{KvTier, LruIndex, TierError, TierKey, TierUsage};

pub struct MemoryTier {
    block_bytes: usize,
    capacity_blocks: usize,
    /// Every block's bytes, `block_bytes` per slot, allocated and touched once at start: a
    /// store is then a copy into memory already mapped, never a page fault per page on the
    /// engine thread.
    slab: MappedPages,
    /// The slot of each block held.
    index: LruIndex<usize>,
    /// Slots no block holds.
    free_slots: Vec<usize>,
}

impl MemoryTier {
    /// A tier of `capacity_bytes`, holding whole blocks of `block_bytes` (at least one). Its
    /// memory is allocated and mapped now; memory the host cannot give is an error naming
    /// the size asked for.
    pub fn new(capacity_bytes: u64, block_bytes: u64) -> Result<MemoryTier, TierError> {
        let block_bytes = block_bytes.max(1) as usize;
        let capacity_blocks = usize::try_from(capacity_bytes)
            .unwrap_or(usize::MAX)
            .checked_div(block_bytes)
            .unwrap_or(0)
            .max(1);
        let refused = |available| TierError::HostMemory {
            bytes: capacity_bytes,
            available,
        };
        let slab_bytes = capacity_blocks
            .checked_mul(block_bytes)
            .ok_or(refused(None))?;
        // Touching more than the host has would end the process, not refuse the flag.
        if let Some(available) = available_host_memory()
            && slab_bytes as u64 > available
        {
            return Err(refused(Some(available)));
        }
        let slab = pages::mapped_now(slab_bytes).map_err(|_| refused(None))?;
        Ok(MemoryTier {
            block_bytes,
            capacity_blocks,
            slab,
            index: LruIndex::default(),
            free_slots: (0..capacity_blocks).rev().collect(),
        })
    }

    fn slot(&self, slot: usize) -> &[u8] {
        &self.slab[slot * self.block_bytes..(slot + 1) * self.block_bytes]
    }

    fn slot_mut(&mut self, slot: usize) -> &mut [u8] {
        &mut self.slab[slot * self.block_bytes..(slot + 1) * self.block_bytes]
    }
}

/// The memory the host can still give, from `/proc/meminfo`'s `MemAvailable`; `None` where
/// that is not known.
fn available_host_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
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
        let slot = loop {
            if let Some(slot) = self.free_slots.pop() {
                break slot;
            }
            if self.evict().is_none() {
                return Err(TierError::Missing);
            }
        };
        self.slot_mut(slot).copy_from_slice(block);
        // The key is not held: checked above.
        let _ = self.index.insert(key, slot);
        Ok(())
    }

    fn load(&mut self, key: &TierKey, out: &mut [u8]) -> Result<(), TierError> {
        let slot = *self.index.touch(key).ok_or(TierError::Missing)?;
        out.copy_from_slice(self.slot(slot));
        Ok(())
    }

    fn evict(&mut self) -> Option<TierKey> {
        let (key, slot) = self.index.pop_lru()?;
        self.free_slots.push(slot);
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
        let mut tier = MemoryTier::new(3 * 8, 8).unwrap();
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

    #[test]
    fn a_tier_larger_than_the_host_can_give_is_refused_naming_the_flag() {
        let refused = MemoryTier::new(u64::MAX, 8).err().expect("refused");
        assert!(matches!(refused, TierError::HostMemory { .. }), "{refused}");
        assert!(
            refused.to_string().contains("--kv-offload-memory"),
            "{refused}"
        );
    }

    #[test]
    fn a_block_evicted_gives_its_slot_to_the_next_without_touching_the_others() {
        let mut tier = MemoryTier::new(2 * 8, 8).unwrap();
        tier.store(key(1, 0), &[10; 8]).unwrap();
        tier.store(key(1, 1), &[11; 8]).unwrap();
        tier.store(key(1, 2), &[12; 8]).unwrap();
        let mut out = [0u8; 8];
        assert!(tier.load(&key(1, 0), &mut out).is_err(), "evicted first");
        tier.load(&key(1, 1), &mut out).unwrap();
        assert_eq!(out, [11; 8]);
        tier.load(&key(1, 2), &mut out).unwrap();
        assert_eq!(out, [12; 8]);
        assert_eq!(tier.usage().blocks, 2);
    }
}
