//! The KV tier interface: stores of whole KV blocks below the device pool (host memory, disk; a shared networked store would be one more), keyed by the chained block hash and the deployment fingerprint's numeric part.
//!
//! A tier holds a block's keys and values as the bytes [`Runtime::read_kv_blocks`] produced
//! them: every layer's key and value rows of one block, one after another. The bytes are only
//! valid for the model, KV dtype, block size and numeric device options they were computed
//! with; the [`NumericFingerprint`] in every [`TierKey`] covers all of them, so a block is never
//! found by a deployment that would compute it differently.
//!
//! [`Runtime::read_kv_blocks`]: crate::runtime::Runtime::read_kv_blocks

pub mod disk;
pub mod memory;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::PathBuf;

use super::hash::BlockHash;

/// The numeric part of the deployment fingerprint: weights, config, KV dtype, block size, the
/// device's numeric options and the glue's version. Computed with the fingerprint itself
/// (engine/fingerprint.rs); requests' samplers and schedulers are not part of it, since they
/// never change a block's keys and values.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NumericFingerprint([u8; 16]);

impl NumericFingerprint {
    pub fn from_bytes(bytes: [u8; 16]) -> NumericFingerprint {
        NumericFingerprint(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    pub fn to_hex(self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for NumericFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NumericFingerprint({})", self.to_hex())
    }
}

/// A block's name in every tier: what was computed (the chained hash of its tokens) and by
/// what (the numeric fingerprint).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TierKey {
    pub model: NumericFingerprint,
    pub block: BlockHash,
}

/// How full a tier is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierUsage {
    pub blocks: u64,
    pub bytes: u64,
    pub capacity_bytes: u64,
}

/// Why a tier could not store or load a block.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("the KV tier does not hold the block")]
    Missing,
    #[error("the KV block file {} is unusable: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error("KV block file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the KV offload directory {} cannot be written: {source}", dir.display())]
    DirNotWritable {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "--kv-offload-memory asks for {bytes} bytes of host memory{}",
        available.map(|a| format!(", more than the {a} bytes available")).unwrap_or_else(|| ", which cannot be allocated".into())
    )]
    HostMemory { bytes: u64, available: Option<u64> },
    #[error("--kv-offload-disk is {capacity} bytes, less than one KV block of {block_bytes}")]
    TooSmall { capacity: u64, block_bytes: u64 },
}

/// A store of whole KV blocks. The engine walks the tiers in order (device, host memory, disk)
/// and loads a block from the first that holds it.
///
/// **Invariant:** a key is found (`lookup`) only once its block's bytes are completely in
/// the tier; a store cut short leaves nothing behind under the key.
pub trait KvTier: Send {
    /// The tier's name in logs and metrics: `memory`, `disk`.
    fn name(&self) -> &'static str;
    /// Whether the tier holds `key`; a hit counts as a use for its eviction order.
    fn lookup(&mut self, key: &TierKey) -> bool;
    /// Stores a block's bytes under `key`, evicting the least recently used blocks when full.
    /// A key the tier already holds (or is storing) is not written again.
    fn store(&mut self, key: TierKey, block: &[u8]) -> Result<(), TierError>;
    /// Fills `out` with the bytes stored under `key`; a block that fails its checks is
    /// dropped from the tier and reported, never returned.
    fn load(&mut self, key: &TierKey, out: &mut [u8]) -> Result<(), TierError>;
    /// Drops the least recently used block; its key, or `None` when empty.
    fn evict(&mut self) -> Option<TierKey>;
    fn usage(&self) -> TierUsage;
}

/// Keys in least-recently-used order with a value each: a use moves a key to the back.
pub(crate) struct LruIndex<V> {
    entries: HashMap<TierKey, (u64, V)>,
    order: BTreeMap<u64, TierKey>,
    next_tick: u64,
}

impl<V> Default for LruIndex<V> {
    fn default() -> Self {
        LruIndex {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next_tick: 0,
        }
    }
}

impl<V> LruIndex<V> {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn contains(&self, key: &TierKey) -> bool {
        self.entries.contains_key(key)
    }

    /// The value of `key`, marking it most recently used.
    pub(crate) fn touch(&mut self, key: &TierKey) -> Option<&mut V> {
        let tick = self.next_tick;
        let (old_tick, value) = self.entries.get_mut(key)?;
        self.order.remove(old_tick);
        self.order.insert(tick, *key);
        *old_tick = tick;
        self.next_tick += 1;
        Some(value)
    }

    /// Inserts `key` as the most recently used; a key already there keeps its old value,
    /// which is returned as an error with the new one.
    pub(crate) fn insert(&mut self, key: TierKey, value: V) -> Result<(), V> {
        if self.entries.contains_key(&key) {
            return Err(value);
        }
        let tick = self.next_tick;
        self.next_tick += 1;
        self.order.insert(tick, key);
        self.entries.insert(key, (tick, value));
        Ok(())
    }

    pub(crate) fn remove(&mut self, key: &TierKey) -> Option<V> {
        let (tick, value) = self.entries.remove(key)?;
        self.order.remove(&tick);
        Some(value)
    }

    /// Takes out the least recently used key and its value.
    pub(crate) fn pop_lru(&mut self) -> Option<(TierKey, V)> {
        let (_, key) = self.order.pop_first()?;
        let (_, value) = self.entries.remove(&key)?;
        Some((key, value))
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn key(model: u8, block: u32) -> TierKey {
        TierKey {
            model: NumericFingerprint::from_bytes([model; 16]),
            block: BlockHash::new(None, &[block]),
        }
    }

    #[test]
    fn lru_index_evicts_the_least_recently_used() {
        let mut index = LruIndex::default();
        for block in 0..3 {
            assert!(index.insert(key(1, block), block).is_ok());
        }
        assert_eq!(index.insert(key(1, 0), 9), Err(9), "kept once");
        assert_eq!(index.touch(&key(1, 0)), Some(&mut 0));
        assert_eq!(index.pop_lru(), Some((key(1, 1), 1)));
        assert_eq!(index.remove(&key(1, 2)), Some(2));
        assert_eq!(index.pop_lru(), Some((key(1, 0), 0)));
        assert_eq!(index.pop_lru(), None);
        assert_eq!(index.len(), 0);
    }
}
