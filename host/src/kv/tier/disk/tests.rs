//! The disk tier against a real directory: blocks survive a reopen, a corrupt, truncated or foreign file is never loaded, capacity evicts, and a directory that cannot be written is refused by name.

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use super::*;
use crate::kv::tier::tests::key;

const BLOCK_BYTES: u64 = 64;

/// A directory removed when the test ends.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("plughost-kv-disk-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn format(model: u8) -> BlockFormat {
    BlockFormat {
        model: NumericFingerprint::from_bytes([model; 16]),
        dtype: 0,
        block_size: 4,
        block_bytes: BLOCK_BYTES,
    }
}

fn block(seed: u8) -> Vec<u8> {
    (0..BLOCK_BYTES as u8)
        .map(|i| i.wrapping_mul(seed))
        .collect()
}

fn open(dir: &TempDir, model: u8, blocks: u64) -> DiskTier {
    DiskTier::open(&dir.0, blocks * format(model).file_bytes(), format(model)).unwrap()
}

/// A tier holding blocks 0..n of model 1, written and flushed.
fn written(dir: &TempDir, n: u32) {
    let mut tier = open(dir, 1, 16);
    for i in 0..n {
        tier.store(key(1, i), &block(i as u8 + 1)).unwrap();
    }
    tier.flush();
    assert_eq!(
        tier.counters().written.load(Ordering::Relaxed),
        u64::from(n)
    );
}

#[test]
fn blocks_survive_a_reopen_and_load_exactly() {
    let dir = TempDir::new("reopen");
    written(&dir, 3);
    let mut tier = open(&dir, 1, 16);
    assert_eq!(tier.usage().blocks, 3);
    let mut out = vec![0u8; BLOCK_BYTES as usize];
    for i in 0..3 {
        assert!(tier.lookup(&key(1, i)));
        tier.load(&key(1, i), &mut out).unwrap();
        assert_eq!(out, block(i as u8 + 1));
    }
    assert!(!tier.lookup(&key(1, 3)));
    // Another model's deployment finds none of them, and leaves them alone.
    let mut other = open(&dir, 2, 16);
    assert!(!other.lookup(&key(2, 0)) && !other.lookup(&key(1, 0)));
    assert_eq!(other.counters().corrupt.load(Ordering::Relaxed), 0);
}

#[test]
fn a_corrupt_or_truncated_file_is_skipped_counted_and_removed() {
    let dir = TempDir::new("corrupt");
    written(&dir, 3);
    let path = |i| dir.0.join(format(1).file_name(&key(1, i).block));
    // Block 0: one payload byte flipped, which only the checksum sees.
    let mut bytes = fs::read(path(0)).unwrap();
    bytes[HEADER_BYTES + 5] ^= 0x40;
    fs::write(path(0), &bytes).unwrap();
    // Block 1: cut short, refused by the scan.
    fs::write(path(1), &bytes[..100]).unwrap();
    // A leftover of a crash mid-write.
    fs::write(dir.0.join(".tmp-1-1.kvb"), b"partial").unwrap();

    let mut tier = open(&dir, 1, 16);
    assert_eq!(
        tier.counters().corrupt.load(Ordering::Relaxed),
        1,
        "the truncated file"
    );
    assert!(!path(1).exists() && !dir.0.join(".tmp-1-1.kvb").exists());
    assert!(tier.lookup(&key(1, 0)), "its header is fine until loaded");
    let mut out = vec![0u8; BLOCK_BYTES as usize];
    let error = tier.load(&key(1, 0), &mut out).unwrap_err();
    assert!(matches!(error, TierError::Corrupt { .. }), "{error}");
    assert_eq!(tier.counters().corrupt.load(Ordering::Relaxed), 2);
    assert!(!tier.lookup(&key(1, 0)) && !path(0).exists());
    tier.load(&key(1, 2), &mut out).unwrap();
    assert_eq!(out, block(3));
}

#[test]
fn a_file_whose_header_names_another_block_is_refused() {
    let dir = TempDir::new("renamed");
    written(&dir, 2);
    let path = |i| dir.0.join(format(1).file_name(&key(1, i).block));
    fs::rename(path(0), path(1)).unwrap();
    let tier = open(&dir, 1, 16);
    assert_eq!(tier.counters().corrupt.load(Ordering::Relaxed), 1);
    assert_eq!(tier.usage().blocks, 0);
}

#[test]
fn capacity_evicts_the_least_recently_used_file() {
    let dir = TempDir::new("capacity");
    let mut tier = open(&dir, 1, 2);
    for i in 0..3 {
        tier.store(key(1, i), &block(1)).unwrap();
    }
    tier.flush();
    assert_eq!(tier.usage().blocks, 2);
    assert!(!tier.lookup(&key(1, 0)));
    let files = fs::read_dir(&dir.0).unwrap().count();
    assert_eq!(files, 2);
}

#[test]
fn a_directory_that_cannot_be_written_is_refused_by_name() {
    let dir = TempDir::new("unwritable");
    fs::create_dir_all(&dir.0).unwrap();
    let file = dir.0.join("a-file");
    fs::write(&file, b"").unwrap();
    let below_a_file = file.join("kv");
    let error = DiskTier::open(&below_a_file, 1 << 20, format(1))
        .err()
        .unwrap();
    assert!(matches!(error, TierError::DirNotWritable { .. }));
    assert!(
        error
            .to_string()
            .contains(&below_a_file.display().to_string()),
        "{error}"
    );
    let error = DiskTier::open(&dir.0, 10, format(1)).err().unwrap();
    assert!(matches!(error, TierError::TooSmall { .. }), "{error}");
}
