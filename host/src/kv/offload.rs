//! The KV offload: the tiers below the device pool (host memory, then disk), what the engine copies into them when blocks become cached-free, and the runs of blocks it loads back, the disk's on a loader thread.
//!
//! The blocks of a background copy out go into the tiers on a store thread ([`store`]), read
//! from the copy's own memory, which no later copy reuses until the store is done.
//!
//! The disk tier is written through: every block stored in host memory is also queued for
//! disk, in the background, so a block evicted from host memory is already on disk and a
//! restart finds every block written before it.

mod store;

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};

use store::{StoreJob, StoreThread};

use super::RequestId;
use super::hash::BlockHash;
use super::tier::disk::{BlockFormat, DiskReader, DiskTier};
use super::tier::memory::MemoryTier;
use super::tier::{KvTier, TierError, TierKey, TierUsage};
use crate::device::CopiedOut;

/// Blocks one batched copy out of the device moves at most; the staging buffer holds as many.
const STAGING_BLOCKS: usize = 64;

/// Which tiers to keep, from the `--kv-offload-*` flags. Neither: no offload at all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvOffloadOptions {
    /// `--kv-offload-memory`: bytes of host memory for blocks.
    pub memory_bytes: Option<u64>,
    /// `--kv-offload-dir` and `--kv-offload-disk`: where block files go, and how many bytes.
    pub disk: Option<(PathBuf, u64)>,
}

impl KvOffloadOptions {
    pub fn is_enabled(&self) -> bool {
        self.memory_bytes.is_some() || self.disk.is_some()
    }
}

/// The tier a block was found in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierName {
    Memory,
    Disk,
}

impl TierName {
    pub fn label(self) -> &'static str {
        match self {
            TierName::Memory => "memory",
            TierName::Disk => "disk",
        }
    }
}

/// A run of blocks loaded from the tiers for one request, ready to go into device blocks.
pub struct LoadedRun {
    pub request: RequestId,
    /// The blocks' bytes, one after another; `blocks` of them are valid.
    pub bytes: Vec<u8>,
    pub blocks: usize,
    /// The tier each block of the run came from (or was to come from, past `blocks`).
    tiers: Vec<TierName>,
    pub started: Instant,
}

impl LoadedRun {
    /// The valid blocks that came from `tier`.
    pub fn blocks_from(&self, tier: TierName) -> usize {
        self.tiers[..self.blocks]
            .iter()
            .filter(|&&t| t == tier)
            .count()
    }
}

struct LoadJob {
    run: LoadedRun,
    /// (index in the run, key) of the blocks still to read from disk, in order.
    disk: Vec<(usize, TierKey)>,
}

pub struct KvOffload {
    format: BlockFormat,
    tiers: SharedTiers,
    /// Stores the blocks of background copies; `None` when it could not start (they are then
    /// stored on the engine thread).
    store: Option<StoreThread>,
    /// Blocks copied out of the device land here, pooled once.
    staging: Vec<u8>,
    loads: Option<Sender<LoadJob>>,
    loaded: Receiver<LoadedRun>,
    /// Runs finished by the loader thread while nothing polled, or loaded at once.
    ready: Vec<LoadedRun>,
}

impl KvOffload {
    /// The tiers `options` ask for, for blocks of `format`; `None` when it asks for none. A
    /// disk directory that cannot be written is an error naming it.
    pub fn open(
        options: &KvOffloadOptions,
        format: BlockFormat,
    ) -> Result<Option<KvOffload>, TierError> {
        if !options.is_enabled() {
            return Ok(None);
        }
        let memory = match options.memory_bytes {
            Some(bytes) => Some(MemoryTier::new(bytes, format.block_bytes)?),
            None => None,
        };
        let disk = match &options.disk {
            Some((dir, bytes)) => Some(DiskTier::open(dir, *bytes, format)?),
            None => None,
        };
        let (loads, jobs) = channel::<LoadJob>();
        let (done, loaded) = channel();
        let reader = disk.as_ref().map(DiskTier::reader);
        let tiers = Arc::new(Mutex::new(Tiers { memory, disk }));
        let store = match StoreThread::start(Arc::clone(&tiers)) {
            Ok(store) => Some(store),
            Err(e) => {
                tracing::warn!(
                    "cannot start the KV store thread; blocks are stored between steps: {e}"
                );
                None
            }
        };
        let loader = std::thread::Builder::new()
            .name("kv-loader".into())
            .spawn(move || load_from_disk(reader, jobs, done));
        let loads = match loader {
            Ok(_) => Some(loads),
            Err(e) => {
                tracing::warn!("cannot start the KV loader thread; blocks on disk stay there: {e}");
                None
            }
        };
        Ok(Some(KvOffload {
            format,
            tiers,
            store,
            // Sized by the first synchronous copy: a device that copies out in the background
            // lands its copies in staging memory of its own.
            staging: Vec::new(),
            loads,
            loaded,
            ready: Vec::new(),
        }))
    }

    fn key(&self, block: BlockHash) -> TierKey {
        TierKey {
            model: self.format.model,
            block,
        }
    }

    pub fn block_bytes(&self) -> usize {
        self.format.block_bytes as usize
    }

    /// Blocks one copy out of the device moves at most.
    pub fn staging_blocks(&self) -> usize {
        STAGING_BLOCKS
    }

    /// Whether some tier lacks the block, so copying it out is worth it: a block is stored
    /// once per tier. While the store thread holds the tiers the answer is yes without
    /// waiting: the engine asks again before it copies, and a store of a block held is a no-op.
    pub fn wants(&mut self, hash: BlockHash) -> bool {
        let key = self.key(hash);
        let mut tiers = match self.tiers.try_lock() {
            Ok(tiers) => tiers,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return true,
        };
        let memory_lacks = tiers.memory.as_mut().is_some_and(|m| !m.lookup(&key));
        let disk_lacks = tiers
            .disk
            .as_ref()
            .is_some_and(|d| !d.holds_or_pending(&key));
        memory_lacks || disk_lacks
    }

    /// The staging buffer for `blocks` blocks (at most [`Self::staging_blocks`]).
    pub fn staging_mut(&mut self, blocks: usize) -> &mut [u8] {
        let bytes = blocks.min(STAGING_BLOCKS) * self.block_bytes();
        if self.staging.len() < bytes {
            self.staging.resize(STAGING_BLOCKS * self.block_bytes(), 0);
        }
        &mut self.staging[..bytes]
    }

    /// Stores the blocks the last copy put in the staging buffer, `hashes[i]` in its `i`-th
    /// block, into every tier that lacks them. Called only after the copy completed.
    pub fn store_staged(&mut self, hashes: &[BlockHash]) {
        let staging = std::mem::take(&mut self.staging);
        self.store_copied(hashes, &staging);
        self.staging = staging;
    }

    /// Stores `bytes`, blocks one after another with `hashes[i]` in the `i`-th, into every tier
    /// that lacks them, on this thread. Called only after the copy that filled `bytes` completed.
    pub fn store_copied(&mut self, hashes: &[BlockHash], bytes: &[u8]) {
        let block_bytes = self.block_bytes();
        for (i, &hash) in hashes.iter().enumerate() {
            let key = self.key(hash);
            let Some(block) = bytes.get(i * block_bytes..(i + 1) * block_bytes) else {
                break;
            };
            lock(&self.tiers).store(key, block);
        }
    }

    /// Stores the blocks of a background copy that ended, as [`Self::store_copied`] does, on
    /// the store thread: they enter the tiers once [`Self::storing`] says the job ended. Until
    /// then `bytes` (the copy's own memory) is read there, and no copy out can reuse it.
    pub fn store_in_background(&mut self, hashes: &[BlockHash], bytes: CopiedOut) {
        let job = StoreJob {
            keys: hashes.iter().map(|&hash| self.key(hash)).collect(),
            bytes,
            block_bytes: self.block_bytes(),
        };
        let refused = match self.store.as_mut() {
            Some(store) => store.submit(job).err(),
            None => Some(job),
        };
        if let Some(job) = refused {
            self.store_copied(hashes, &job.bytes);
        }
    }

    /// Whether the store thread is still storing a copy's blocks; with `wait`, waits for it to
    /// finish first.
    pub fn storing(&mut self, wait: bool) -> bool {
        self.store.as_mut().is_some_and(|store| store.busy(wait))
    }

    /// The tiers holding each of the leading blocks of `hashes`, up to the first block none
    /// holds. With `memory_only`, the disk is not looked at.
    pub fn find_run(&mut self, hashes: &[BlockHash], memory_only: bool) -> Vec<TierName> {
        let mut run = Vec::new();
        let mut tiers = lock(&self.tiers);
        for &hash in hashes {
            let key = self.key(hash);
            if tiers.memory.as_mut().is_some_and(|m| m.lookup(&key)) {
                run.push(TierName::Memory);
            } else if !memory_only && tiers.disk.as_mut().is_some_and(|d| d.lookup(&key)) {
                run.push(TierName::Disk);
            } else {
                break;
            }
        }
        run
    }

    /// Loads a run [`Self::find_run`] found. Blocks in host memory are copied now; when
    /// none is on disk the run is ready at once, otherwise the loader thread reads the disk's.
    /// Either way it comes back from [`Self::finished_loads`].
    pub fn start_load(&mut self, request: RequestId, hashes: &[BlockHash], run: &[TierName]) {
        let mut job = self.copy_from_memory(request, hashes, run);
        if job.disk.is_empty() {
            self.ready.push(job.run);
            return;
        }
        let Some(loads) = &self.loads else {
            job.run.blocks = job.disk[0].0;
            self.ready.push(job.run);
            return;
        };
        if let Err(returned) = loads.send(job) {
            let mut job = returned.0;
            job.run.blocks = job.disk[0].0;
            self.ready.push(job.run);
        }
    }

    /// Loads the leading blocks of a run found in host memory alone, at once.
    pub fn load_from_memory(
        &mut self,
        request: RequestId,
        hashes: &[BlockHash],
        run: &[TierName],
    ) -> LoadedRun {
        let mut job = self.copy_from_memory(request, hashes, run);
        if let Some(&(first_on_disk, _)) = job.disk.first() {
            job.run.blocks = first_on_disk;
        }
        job.run
    }

    /// A load of `run` with its host-memory blocks copied, and the disk's still to read.
    fn copy_from_memory(
        &mut self,
        request: RequestId,
        hashes: &[BlockHash],
        run: &[TierName],
    ) -> LoadJob {
        let block_bytes = self.block_bytes();
        let mut loaded = LoadedRun {
            request,
            bytes: vec![0; run.len() * block_bytes],
            blocks: run.len(),
            tiers: run.to_vec(),
            started: Instant::now(),
        };
        let mut disk = Vec::new();
        let mut tiers = lock(&self.tiers);
        for (i, (&hash, &tier)) in hashes.iter().zip(run).enumerate() {
            let key = self.key(hash);
            let out = &mut loaded.bytes[i * block_bytes..(i + 1) * block_bytes];
            let usable = match (tier, tiers.memory.as_mut()) {
                (TierName::Memory, Some(memory)) => memory.load(&key, out).is_ok(),
                (TierName::Memory, None) => false,
                (TierName::Disk, _) => {
                    disk.push((i, key));
                    true
                }
            };
            if !usable {
                loaded.blocks = i;
                break;
            }
        }
        disk.retain(|&(i, _)| i < loaded.blocks);
        LoadJob { run: loaded, disk }
    }

    /// The runs whose loads completed since the last call.
    pub fn finished_loads(&mut self) -> Vec<LoadedRun> {
        let mut done = std::mem::take(&mut self.ready);
        done.extend(self.loaded.try_iter());
        done
    }

    /// Waits up to `timeout` for a load to complete (it is kept for [`Self::finished_loads`]).
    pub fn wait_for_load(&mut self, timeout: Duration) {
        if !self.ready.is_empty() {
            return;
        }
        match self.loaded.recv_timeout(timeout) {
            Ok(run) => self.ready.push(run),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
        }
    }

    pub fn usage(&self, tier: TierName) -> Option<TierUsage> {
        let tiers = lock(&self.tiers);
        match tier {
            TierName::Memory => tiers.memory.as_ref().map(KvTier::usage),
            TierName::Disk => tiers.disk.as_ref().map(KvTier::usage),
        }
    }

    /// Files the disk tier skipped because they failed a check, and blocks it did not write.
    pub fn disk_faults(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        lock(&self.tiers).disk.as_ref().map_or((0, 0), |d| {
            let counters = d.counters();
            (
                counters.corrupt.load(Relaxed),
                counters.dropped.load(Relaxed),
            )
        })
    }

    /// Waits for the disk writes queued so far; at shutdown, so a restart finds them.
    pub fn flush(&mut self) {
        if let Some(disk) = lock(&self.tiers).disk.as_mut() {
            disk.flush();
        }
    }
}

/// The tiers, shared by the engine thread (lookups, loads, usage) and the store thread
/// (stores); each takes the lock for one block, or one lookup, at a time.
struct Tiers {
    memory: Option<MemoryTier>,
    disk: Option<DiskTier>,
}

type SharedTiers = Arc<Mutex<Tiers>>;

/// The tiers, whatever a thread that panicked while holding them left: every tier's state is
/// consistent between two of its calls.
fn lock(tiers: &SharedTiers) -> MutexGuard<'_, Tiers> {
    tiers.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Tiers {
    /// Stores one block in every tier that lacks it.
    fn store(&mut self, key: TierKey, block: &[u8]) {
        let each: [Option<&mut dyn KvTier>; 2] = [
            self.memory.as_mut().map(|m| m as &mut dyn KvTier),
            self.disk.as_mut().map(|d| d as &mut dyn KvTier),
        ];
        for tier in each.into_iter().flatten() {
            if let Err(e) = tier.store(key, block) {
                tracing::warn!(tier = tier.name(), "cannot store a KV block: {e}");
            }
        }
    }
}

/// The loader thread: reads each job's disk blocks in order; a block that cannot be read ends
/// the run there, since a prefix is only usable up to its first gap.
fn load_from_disk(reader: Option<DiskReader>, jobs: Receiver<LoadJob>, done: Sender<LoadedRun>) {
    for mut job in jobs {
        let block_bytes = job
            .run
            .bytes
            .len()
            .checked_div(job.run.tiers.len())
            .unwrap_or(0);
        for &(i, key) in &job.disk {
            let out = &mut job.run.bytes[i * block_bytes..(i + 1) * block_bytes];
            let read = match &reader {
                Some(reader) => reader.load(&key, out),
                None => Err(TierError::Missing),
            };
            match read {
                Ok(()) => {}
                Err(e) => {
                    if !matches!(e, TierError::Missing | TierError::Corrupt { .. }) {
                        tracing::warn!("cannot load a KV block from disk: {e}");
                    }
                    job.run.blocks = i;
                    break;
                }
            }
        }
        if done.send(job.run).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tier::tests::key;
    use super::*;

    fn offload(block_bytes: u64) -> KvOffload {
        let options = KvOffloadOptions {
            memory_bytes: Some(8 * block_bytes),
            disk: None,
        };
        let format = BlockFormat {
            model: key(1, 0).model,
            dtype: 0,
            block_size: 4,
            block_bytes,
        };
        KvOffload::open(&options, format)
            .unwrap()
            .expect("a memory tier")
    }

    #[test]
    fn a_background_store_enters_the_tiers_when_its_job_ends_and_lets_go_of_the_bytes() {
        let mut offload = offload(64);
        let hashes: Vec<BlockHash> = (0..3).map(|b| key(1, b).block).collect();
        let bytes: Vec<u8> = (0..3 * 64).map(|i| (i % 251) as u8).collect();
        let copied = CopiedOut::from(bytes.clone());
        let reader = copied.clone();
        offload.store_in_background(&hashes, copied);
        assert!(!offload.storing(true), "waited for the job");
        let run = offload.find_run(&hashes, true);
        assert_eq!(run, [TierName::Memory; 3]);
        let loaded = offload.load_from_memory(7, &hashes, &run);
        assert_eq!((loaded.blocks, &loaded.bytes[..]), (3, &bytes[..]));
        // Only this test's clone is left: the device could copy into that memory again.
        assert_eq!(reader.holders(), 1);
        // Stored once: the same blocks again change nothing.
        offload.store_in_background(&hashes, CopiedOut::from(vec![0; 3 * 64]));
        assert!(!offload.storing(true));
        let again = offload.load_from_memory(8, &hashes, &run);
        assert_eq!(&again.bytes[..], &bytes[..]);
    }

    #[test]
    fn asking_whether_a_block_is_wanted_never_waits_for_the_store_thread() {
        let mut offload = offload(64);
        let hash = key(1, 0).block;
        offload.store_copied(&[hash], &[5; 64]);
        assert!(!offload.wants(hash), "held by the memory tier");
        let tiers = Arc::clone(&offload.tiers);
        let held = lock(&tiers);
        assert!(offload.wants(hash), "the tiers are busy: asked again later");
        drop(held);
        assert!(!offload.wants(hash));
    }
}
