//! Anonymous memory on huge-page boundaries, in transparent huge pages where the kernel allows, its pages mapped before use: the device's large buffers and slabs, and the host's KV memory tier.
//!
//! Mapping the pages when the memory is made, not on its first write, keeps page faults off
//! the step: a KV block first written in the middle of serving would otherwise stop its
//! launch for a fault per page. Huge pages matter for memory read in runs scattered over a
//! large region, as attention reads a sequence's keys and values: with 4 KiB pages nearly
//! every run is a page of its own and a TLB miss.
//!
//! The kernel backs only whole, aligned 2 MiB stretches of a mapping with a huge page, and a
//! mapping starts on any 4 KiB page: a weight matrix of 2 to 4 MiB mapped as it came got one
//! huge page or none. So [`MappedPages`] maps a huge page more than it needs and starts its
//! bytes on the first huge-page boundary inside; the stretch before that boundary is never
//! touched and costs address space only. In [`mapped_now`]'s memory the tail past the last
//! whole huge page is not asked for one, so it holds no more than its length rounded up to
//! 4 KiB; the device's matrices of a few MiB, whose tails would be a large share, are cut one
//! after another from [`reserved`] slabs instead.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use memmap2::MmapMut;

/// A page of memory, the stride of the fallback that touches every page.
pub const PAGE_BYTES: usize = 4096;

/// A transparent huge page on x86-64 and on aarch64 with 4 KiB pages.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// `len` zero bytes of anonymous memory starting on a huge-page boundary.
pub struct MappedPages {
    mapping: MmapMut,
    /// Where the bytes start inside `mapping`.
    offset: usize,
    /// The first byte, taken when the mapping was made, so pages can be mapped through it
    /// while parts of the memory are lent out.
    start: NonNull<u8>,
    len: usize,
}

// SAFETY: `MappedPages` owns its mapping exclusively, as a `Vec<u8>` owns its bytes; `start`
// points into it.
unsafe impl Send for MappedPages {}
// SAFETY: shared access only reads, or maps pages through `map_range`, whose caller vouches
// that nothing else reaches them.
unsafe impl Sync for MappedPages {}

impl MappedPages {
    /// The first byte, without making a reference to the bytes.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.start.as_ptr()
    }

    /// The first byte, without making a reference to the bytes: for memory lent out in
    /// disjoint parts, whose owners each reach only their own.
    pub fn start(&self) -> NonNull<u8> {
        self.start
    }

    /// Maps the pages of bytes `from..from + len` now (see [`mapped_now`]).
    ///
    /// # Safety
    /// `from..from + len` lies inside the bytes, starts on a 4 KiB page, and nothing reads
    /// or writes any of its pages during the call: where the kernel cannot map them in one
    /// call, a zero is written to the first byte of each page, which must hold zero.
    pub unsafe fn map_range(&self, from: usize, len: usize) {
        debug_assert!(from + len <= self.len && from.is_multiple_of(PAGE_BYTES));
        #[cfg(target_os = "linux")]
        if self
            .mapping
            .advise_range(memmap2::Advice::PopulateWrite, self.offset + from, len)
            .is_ok()
        {
            return;
        }
        for page in (from..from + len).step_by(PAGE_BYTES) {
            // SAFETY: the caller's contract: the page lies inside the mapping and nothing
            // else reaches it now.
            unsafe { std::ptr::write_volatile(self.start.as_ptr().add(page), 0) };
        }
    }
}

impl Deref for MappedPages {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `start` begins `len` initialized bytes inside the mapping.
        unsafe { std::slice::from_raw_parts(self.start.as_ptr(), self.len) }
    }
}

impl DerefMut for MappedPages {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.start.as_ptr(), self.len) }
    }
}

/// `len` (at least 1) zero bytes of anonymous memory on a huge-page boundary, with every page
/// mapped: every whole huge page of them in a huge page where the kernel allows.
pub fn mapped_now(len: usize) -> std::io::Result<MappedPages> {
    let pages = aligned(len, len - len % HUGE_PAGE_BYTES)?;
    // SAFETY: the whole of the new memory, which nothing else reaches yet.
    unsafe { pages.map_range(0, len) };
    Ok(pages)
}

/// `len` (at least 1) zero bytes of anonymous memory on a huge-page boundary, in huge pages
/// where the kernel allows, none of them mapped yet: [`MappedPages::map_range`] maps them as
/// they come into use. The huge pages cover the tail too, so `len` is best a multiple of
/// [`HUGE_PAGE_BYTES`].
pub fn reserved(len: usize) -> std::io::Result<MappedPages> {
    aligned(len, len)
}

/// `len` bytes of a new anonymous mapping, starting on its first huge-page boundary, the
/// first `huge` of them asked to be in huge pages.
fn aligned(len: usize, huge: usize) -> std::io::Result<MappedPages> {
    let padded = len
        .checked_add(HUGE_PAGE_BYTES - PAGE_BYTES)
        .ok_or_else(|| std::io::Error::other(format!("{len} bytes do not fit in memory")))?;
    let mut mapping = MmapMut::map_anon(padded)?;
    // A mapping starts on a 4 KiB page, so the boundary is at most a huge page less a page
    // in, and `offset + len` stays inside `padded`.
    let base = mapping.as_mut_ptr();
    let offset = (base as usize).next_multiple_of(HUGE_PAGE_BYTES) - base as usize;
    #[cfg(target_os = "linux")]
    if huge > 0 {
        // Advice only: a kernel without transparent huge pages maps 4 KiB pages.
        let _ = mapping.advise_range(memmap2::Advice::HugePage, offset, huge);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = huge;
    // SAFETY: `offset < padded`, inside the mapping.
    let start = unsafe { base.add(offset) };
    Ok(MappedPages {
        start: NonNull::new(start).ok_or_else(|| std::io::Error::other("a mapping at 0"))?,
        mapping,
        offset,
        len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_start_on_a_huge_page_and_are_zero() {
        for len in [
            1,
            PAGE_BYTES + 1,
            HUGE_PAGE_BYTES,
            HUGE_PAGE_BYTES * 3 / 2 + 7,
        ] {
            let mut pages = mapped_now(len).expect("anonymous memory");
            assert_eq!(pages.as_mut_ptr() as usize % HUGE_PAGE_BYTES, 0, "{len}");
            assert_eq!(pages.len(), len);
            assert!(pages.iter().all(|&b| b == 0), "{len}");
            pages[len - 1] = 7;
            assert_eq!(pages[len - 1], 7);
        }
    }
}
