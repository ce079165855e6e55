//! The shared memory region between the host and its device worker, mapped once when the worker starts: step inputs, logits and weights cross through it.
//!
//! The host creates it as an anonymous memory file (no tmpfs mount whose size could run out
//! under a write), and the worker opens the same file through `/proc/<host pid>/fd/<fd>`. The
//! protocol takes turns: the host touches the region only while the worker waits for a request
//! or after it has replied, and the worker only between a request and its reply. The copy-out
//! region (a second one, made on first use) takes turns by copy: the worker's device writes
//! it from a copy's start until a poll reply reports its end, and the host reads it only then.

use std::fs::File;
use std::io;
use std::path::PathBuf;

use memmap2::MmapMut;

/// Bytes of the region: larger transfers are cut into pieces of this size.
pub const REGION_BYTES: usize = 64 << 20;

pub struct SharedRegion {
    map: MmapMut,
    /// The memory file, kept open so the worker can open it by path.
    file: File,
}

impl SharedRegion {
    /// A new zeroed region of [`REGION_BYTES`] in the host.
    pub fn create() -> io::Result<SharedRegion> {
        Self::create_sized(REGION_BYTES)
    }

    /// A new zeroed region of `len` bytes in the host (the copy-out region).
    pub fn create_sized(len: usize) -> io::Result<SharedRegion> {
        let fd =
            rustix::fs::memfd_create("plughost-device-region", rustix::fs::MemfdFlags::CLOEXEC)?;
        let file = File::from(fd);
        file.set_len(len as u64)?;
        Self::map(file, len)
    }

    /// The host's region, opened in the worker by the path [`SharedRegion::path_for_worker`] gave.
    pub fn open(path: &std::path::Path) -> io::Result<SharedRegion> {
        Self::open_sized(path, REGION_BYTES)
    }

    /// Like [`SharedRegion::open`], for a region of `len` bytes.
    pub fn open_sized(path: &std::path::Path, len: usize) -> io::Result<SharedRegion> {
        let file = File::options().read(true).write(true).open(path)?;
        if file.metadata()?.len() < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the shared region {} is too small", path.display()),
            ));
        }
        Self::map(file, len)
    }

    fn map(file: File, len: usize) -> io::Result<SharedRegion> {
        // SAFETY: the file is an anonymous memory file private to the host and its one worker,
        // at least `len` bytes long and never truncated; the two processes take turns on it
        // (see the module comment), and a worker that may still be writing is killed and
        // reaped before the host reads the region again.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&file) }?;
        Ok(SharedRegion { map, file })
    }

    /// Where a process of the same user opens this region.
    pub fn path_for_worker(&self) -> PathBuf {
        use std::os::fd::AsRawFd;
        PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            self.file.as_raw_fd()
        ))
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// The start of the mapping, for a device's background copy to write through without a
    /// reference to the region.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
}
