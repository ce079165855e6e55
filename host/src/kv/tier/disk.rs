//! The disk KV tier (`--kv-offload-dir`, `--kv-offload-disk`): one file per block, written in the background to a temporary file and renamed, checked against its header and checksum on every load, and indexed again by scanning the directory at start.
//!
//! A block file (all integers little-endian):
//!
//! ```text
//! 0   magic            8 bytes  "PHKVBLK\0"
//! 8   format version   u32      1
//! 12  KV dtype         u32      the device ABI's dtype code
//! 16  block size       u32      tokens per block
//! 20  reserved         u32      0
//! 24  model            16 bytes the deployment fingerprint's numeric part
//! 40  block hash       32 bytes the chained hash of the block's tokens
//! 72  payload length   u64
//! 80  payload          the block's keys and values
//! ..  checksum         32 bytes BLAKE3 of everything before it
//! ```
//!
//! Its name is `<model hex>-<hash hex>.kvb`. A crash mid-write leaves a `.tmp-*` file, never
//! a `.kvb` one, and the scan removes it; files are not synced, so a crash of the machine may
//! leave a renamed file with lost content, which its length or checksum refuses. A file that
//! fails any check is skipped, counted, logged and removed, and the prefix is recomputed.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::SystemTime;

use super::{KvTier, LruIndex, NumericFingerprint, TierError, TierKey, TierUsage, hex};
use crate::kv::hash::BlockHash;

const MAGIC: &[u8; 8] = b"PHKVBLK\0";
const FORMAT_VERSION: u32 = 1;
const HEADER_BYTES: usize = 80;
const CHECKSUM_BYTES: usize = 32;
/// Writes waiting for the writer thread; past this, stores are dropped rather than queued,
/// so a slow disk never holds the engine up.
const QUEUED_WRITES: usize = 256;
/// A scan of more files than this shows a progress bar.
const PROGRESS_AFTER_FILES: u64 = 2000;

/// What every block file of this deployment must say, besides its hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockFormat {
    pub model: NumericFingerprint,
    /// The device ABI's code of the KV cache's element type.
    pub dtype: u32,
    pub block_size: u32,
    pub block_bytes: u64,
}

impl BlockFormat {
    fn file_bytes(&self) -> u64 {
        (HEADER_BYTES + CHECKSUM_BYTES) as u64 + self.block_bytes
    }

    fn header(&self, hash: &BlockHash) -> [u8; HEADER_BYTES] {
        let mut header = [0u8; HEADER_BYTES];
        header[..8].copy_from_slice(MAGIC);
        header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&self.dtype.to_le_bytes());
        header[16..20].copy_from_slice(&self.block_size.to_le_bytes());
        header[24..40].copy_from_slice(self.model.as_bytes());
        header[40..72].copy_from_slice(hash.as_bytes());
        header[72..80].copy_from_slice(&self.block_bytes.to_le_bytes());
        header
    }

    /// Why `header` is not this format's header for `hash`, if it is not.
    fn check_header(&self, header: &[u8], hash: &BlockHash) -> Result<(), String> {
        if header.len() < HEADER_BYTES || &header[..8] != MAGIC {
            return Err("not a KV block file (bad magic)".into());
        }
        let word =
            |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().unwrap_or_default());
        if word(8) != FORMAT_VERSION {
            return Err(format!(
                "format version {} (this server reads {FORMAT_VERSION})",
                word(8)
            ));
        }
        if word(12) != self.dtype || word(16) != self.block_size {
            return Err(format!(
                "dtype {} and block size {} where the cache has {} and {}",
                word(12),
                word(16),
                self.dtype,
                self.block_size
            ));
        }
        if header[24..40] != self.model.as_bytes()[..] {
            return Err("written by another model or device configuration".into());
        }
        if header[40..72] != hash.as_bytes()[..] {
            return Err("its header names another block".into());
        }
        let len = u64::from_le_bytes(header[72..80].try_into().unwrap_or_default());
        if len != self.block_bytes {
            return Err(format!(
                "a payload of {len} bytes, blocks are {}",
                self.block_bytes
            ));
        }
        Ok(())
    }

    fn file_name(&self, hash: &BlockHash) -> String {
        format!("{}-{}.kvb", self.model.to_hex(), hex(hash.as_bytes()))
    }

    /// The hash a file name of this model names, or `None` for any other file.
    fn parse_file_name(&self, name: &str) -> Option<BlockHash> {
        let rest = name.strip_suffix(".kvb")?;
        let (model, hash) = rest.split_once('-')?;
        if model != self.model.to_hex() || hash.len() != 64 {
            return None;
        }
        let mut bytes = [0u8; 32];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(hash.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(BlockHash::from_bytes(bytes))
    }
}

/// Counters of the disk tier, read by the metrics.
#[derive(Debug, Default)]
pub struct DiskCounters {
    /// Files skipped because they failed a check (at the scan or at a load).
    pub corrupt: AtomicU64,
    /// Blocks written.
    pub written: AtomicU64,
    /// Stores not written: the queue was full, a write failed, or the disk is full.
    pub dropped: AtomicU64,
}

struct DiskState {
    index: LruIndex<()>,
    /// Blocks queued for the writer and not yet renamed into place.
    pending: HashSet<TierKey>,
}

struct Shared {
    dir: PathBuf,
    format: BlockFormat,
    capacity_blocks: usize,
    state: Mutex<DiskState>,
    counters: DiskCounters,
    /// Set when the disk ran out of space: writes stop, serving goes on.
    full: AtomicBool,
}

/// The disk tier. Loads run on the calling thread ([`DiskReader`] is a handle for another
/// thread); writes run on the tier's writer thread.
pub struct DiskTier {
    shared: Arc<Shared>,
    writes: Option<SyncSender<(TierKey, Vec<u8>)>>,
    writer: Option<JoinHandle<()>>,
}

/// Reads blocks of a disk tier from any thread.
#[derive(Clone)]
pub struct DiskReader {
    shared: Arc<Shared>,
}

impl DiskReader {
    pub fn load(&self, key: &TierKey, out: &mut [u8]) -> Result<(), TierError> {
        self.shared.load(key, out)
    }
}

impl DiskTier {
    /// Opens `dir` (created if missing) with room for `capacity_bytes` of block files, and
    /// indexes the blocks of this `format` it already holds. A directory that cannot be
    /// written is an error naming it.
    pub fn open(
        dir: &Path,
        capacity_bytes: u64,
        format: BlockFormat,
    ) -> Result<DiskTier, TierError> {
        let not_writable = |source| TierError::DirNotWritable {
            dir: dir.to_path_buf(),
            source,
        };
        if capacity_bytes < format.file_bytes() {
            return Err(TierError::TooSmall {
                capacity: capacity_bytes,
                block_bytes: format.file_bytes(),
            });
        }
        fs::create_dir_all(dir).map_err(not_writable)?;
        let probe = dir.join(format!(".tmp-probe-{}", std::process::id()));
        File::create(&probe)
            .and_then(|mut file| file.write_all(b"probe"))
            .map_err(not_writable)?;
        let _ = fs::remove_file(&probe);
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            format,
            capacity_blocks: (capacity_bytes / format.file_bytes()) as usize,
            state: Mutex::new(DiskState {
                index: LruIndex::default(),
                pending: HashSet::new(),
            }),
            counters: DiskCounters::default(),
            full: AtomicBool::new(false),
        });
        shared.scan().map_err(not_writable)?;
        let (writes, jobs) = sync_channel(QUEUED_WRITES);
        let writer_shared = shared.clone();
        let writer = std::thread::Builder::new()
            .name("kv-disk-writer".into())
            .spawn(move || writer_shared.write_all(jobs))
            .map_err(not_writable)?;
        Ok(DiskTier {
            shared,
            writes: Some(writes),
            writer: Some(writer),
        })
    }

    pub fn reader(&self) -> DiskReader {
        DiskReader {
            shared: self.shared.clone(),
        }
    }

    pub fn counters(&self) -> &DiskCounters {
        &self.shared.counters
    }

    /// Whether `key` is on disk or on its way there.
    pub fn holds_or_pending(&self, key: &TierKey) -> bool {
        let state = self.shared.lock();
        state.index.contains(key) || state.pending.contains(key)
    }

    /// Waits until every write queued so far is on disk (or dropped). Used at shutdown.
    pub fn flush(&mut self) {
        drop(self.writes.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        self.flush();
    }
}

impl KvTier for DiskTier {
    fn name(&self) -> &'static str {
        "disk"
    }

    fn lookup(&mut self, key: &TierKey) -> bool {
        self.shared.lock().index.touch(key).is_some()
    }

    /// Queues the block for the writer thread; it enters the index once renamed into place.
    fn store(&mut self, key: TierKey, block: &[u8]) -> Result<(), TierError> {
        if self.shared.full.load(Ordering::Relaxed) {
            self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        {
            let mut state = self.shared.lock();
            if state.index.contains(&key) || !state.pending.insert(key) {
                return Ok(());
            }
        }
        let Some(writes) = &self.writes else {
            return Ok(());
        };
        match writes.try_send((key, block.to_vec())) {
            Ok(()) => {}
            Err(TrySendError::Full((key, _)) | TrySendError::Disconnected((key, _))) => {
                self.shared.lock().pending.remove(&key);
                self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn load(&mut self, key: &TierKey, out: &mut [u8]) -> Result<(), TierError> {
        self.shared.load(key, out)
    }

    fn evict(&mut self) -> Option<TierKey> {
        self.shared.evict_one()
    }

    fn usage(&self) -> TierUsage {
        let blocks = self.shared.lock().index.len() as u64;
        let file_bytes = self.shared.format.file_bytes();
        TierUsage {
            blocks,
            bytes: blocks * file_bytes,
            capacity_bytes: self.shared.capacity_blocks as u64 * file_bytes,
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, DiskState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn path(&self, hash: &BlockHash) -> PathBuf {
        self.dir.join(self.format.file_name(hash))
    }

    /// Skips, counts, logs and removes a file that failed a check.
    fn reject(&self, path: &Path, reason: &str) {
        self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(path = %path.display(), "skipping a KV block file: {reason}");
        let _ = fs::remove_file(path);
    }

    /// Indexes this model's block files, oldest first, up to the capacity; removes leftover
    /// temporary files and refuses files that fail their header checks.
    fn scan(&self) -> io::Result<()> {
        let mut found: Vec<(SystemTime, BlockHash)> = Vec::new();
        let entries: Vec<fs::DirEntry> = fs::read_dir(&self.dir)?.flatten().collect();
        let progress = (entries.len() as u64 > PROGRESS_AFTER_FILES).then(|| {
            let bar = indicatif::ProgressBar::new(entries.len() as u64);
            bar.set_message(format!("indexing KV blocks in {}", self.dir.display()));
            bar
        });
        for entry in &entries {
            if let Some(bar) = &progress {
                bar.inc(1);
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if name.starts_with(".tmp-") {
                let _ = fs::remove_file(&path);
                continue;
            }
            let Some(hash) = self.format.parse_file_name(&name) else {
                continue;
            };
            match self.check_file(&path, &hash) {
                Ok(modified) => found.push((modified, hash)),
                Err(reason) => self.reject(&path, &reason),
            }
        }
        if let Some(bar) = progress {
            bar.finish_and_clear();
        }
        found.sort_by_key(|&(modified, _)| modified);
        let overflow = found.len().saturating_sub(self.capacity_blocks);
        for (_, hash) in found.drain(..overflow) {
            let _ = fs::remove_file(self.path(&hash));
        }
        let mut state = self.lock();
        for (_, hash) in found {
            let key = TierKey {
                model: self.format.model,
                block: hash,
            };
            let _ = state.index.insert(key, ());
        }
        if state.index.len() > 0 || overflow > 0 {
            tracing::info!(
                dir = %self.dir.display(),
                blocks = state.index.len(),
                removed_over_capacity = overflow,
                "KV disk tier indexed"
            );
        }
        Ok(())
    }

    /// Checks a file's length and header; its modification time.
    fn check_file(&self, path: &Path, hash: &BlockHash) -> Result<SystemTime, String> {
        let mut file = File::open(path).map_err(|e| e.to_string())?;
        let metadata = file.metadata().map_err(|e| e.to_string())?;
        if metadata.len() != self.format.file_bytes() {
            return Err(format!(
                "{} bytes where a block file has {}",
                metadata.len(),
                self.format.file_bytes()
            ));
        }
        let mut header = [0u8; HEADER_BYTES];
        file.read_exact(&mut header).map_err(|e| e.to_string())?;
        self.format.check_header(&header, hash)?;
        Ok(metadata.modified().unwrap_or(SystemTime::UNIX_EPOCH))
    }

    fn load(&self, key: &TierKey, out: &mut [u8]) -> Result<(), TierError> {
        if key.model != self.format.model || !self.lock().index.contains(key) {
            return Err(TierError::Missing);
        }
        let path = self.path(&key.block);
        let corrupt = |reason: String| {
            self.reject(&path, &reason);
            self.lock().index.remove(key);
            TierError::Corrupt {
                path: path.clone(),
                reason,
            }
        };
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.lock().index.remove(key);
                return Err(TierError::Missing);
            }
            Err(source) => return Err(TierError::Io { path, source }),
        };
        if bytes.len() as u64 != self.format.file_bytes()
            || out.len() as u64 != self.format.block_bytes
        {
            return Err(corrupt(format!(
                "{} bytes where a block file has {}",
                bytes.len(),
                self.format.file_bytes()
            )));
        }
        self.format
            .check_header(&bytes, &key.block)
            .map_err(&corrupt)?;
        let (body, checksum) = bytes.split_at(bytes.len() - CHECKSUM_BYTES);
        if blake3::hash(body).as_bytes()[..] != checksum[..] {
            return Err(corrupt("its checksum does not match its contents".into()));
        }
        out.copy_from_slice(&body[HEADER_BYTES..]);
        Ok(())
    }

    fn evict_one(&self) -> Option<TierKey> {
        let (key, ()) = self.lock().index.pop_lru()?;
        let _ = fs::remove_file(self.path(&key.block));
        Some(key)
    }

    /// The writer thread: each block to a temporary file, renamed into place, then indexed.
    fn write_all(&self, jobs: Receiver<(TierKey, Vec<u8>)>) {
        let mut sequence = 0u64;
        for (key, block) in jobs {
            sequence += 1;
            let written = if self.full.load(Ordering::Relaxed) {
                Err(None)
            } else {
                self.write_one(&key, &block, sequence)
            };
            let mut state = self.lock();
            state.pending.remove(&key);
            match written {
                Ok(()) => {
                    self.counters.written.fetch_add(1, Ordering::Relaxed);
                    while state.index.len() >= self.capacity_blocks {
                        let Some((old, ())) = state.index.pop_lru() else {
                            break;
                        };
                        let _ = fs::remove_file(self.path(&old.block));
                    }
                    let _ = state.index.insert(key, ());
                }
                Err(error) => {
                    drop(state);
                    self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                    if let Some(error) = error {
                        self.write_failed(&error);
                    }
                }
            }
        }
    }

    fn write_one(
        &self,
        key: &TierKey,
        block: &[u8],
        sequence: u64,
    ) -> Result<(), Option<io::Error>> {
        let header = self.format.header(&key.block);
        let mut checksum = blake3::Hasher::new();
        checksum.update(&header);
        checksum.update(block);
        let temp = self
            .dir
            .join(format!(".tmp-{}-{sequence}.kvb", std::process::id()));
        let result = File::create(&temp)
            .and_then(|mut file| {
                file.write_all(&header)?;
                file.write_all(block)?;
                file.write_all(checksum.finalize().as_bytes())
            })
            .and_then(|()| fs::rename(&temp, self.path(&key.block)));
        if result.is_err() {
            let _ = fs::remove_file(&temp);
        }
        result.map_err(Some)
    }

    /// A full disk stops every later write; any other failure is logged and the block skipped.
    fn write_failed(&self, error: &io::Error) {
        let full = error.kind() == io::ErrorKind::StorageFull
            || error.kind() == io::ErrorKind::QuotaExceeded;
        if full {
            if !self.full.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    dir = %self.dir.display(),
                    "the KV offload disk is full: no more blocks are written to it; serving goes on"
                );
            }
        } else {
            tracing::warn!(dir = %self.dir.display(), "cannot write a KV block file: {error}");
        }
    }
}

#[cfg(test)]
mod tests;
