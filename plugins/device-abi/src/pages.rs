//! Anonymous memory with every page mapped up front, in transparent huge pages where the kernel allows: the device's large buffers and the host's KV memory tier.
//!
//! Mapping the pages when the memory is made, not on its first write, keeps page faults off
//! the step: a KV block first written in the middle of serving would otherwise stop its
//! launch for a fault per page. Huge pages matter for memory read in runs scattered over a
//! large region, as attention reads a sequence's keys and values: with 4 KiB pages nearly
//! every run is a page of its own and a TLB miss.

use memmap2::MmapMut;

/// A page of memory, the stride of the fallback that touches every page.
const PAGE_BYTES: usize = 4096;

/// `len` (at least 1) zero bytes of anonymous memory, page-aligned, with every page mapped.
pub fn mapped_now(len: usize) -> std::io::Result<MmapMut> {
    let mut memory = MmapMut::map_anon(len)?;
    map_now(&mut memory);
    Ok(memory)
}

/// Maps every page of `memory` now: in huge pages where the kernel allows, in one call where
/// it can (`MADV_POPULATE_WRITE`, Linux 5.14), else by writing one byte of every page.
fn map_now(memory: &mut MmapMut) {
    #[cfg(target_os = "linux")]
    {
        // Advice only: a kernel without transparent huge pages maps 4 KiB pages.
        let _ = memory.advise(memmap2::Advice::HugePage);
        if memory.advise(memmap2::Advice::PopulateWrite).is_ok() {
            return;
        }
    }
    for page in memory.chunks_mut(PAGE_BYTES) {
        // SAFETY: `page` is a valid, exclusively borrowed, non-empty slice of the mapping.
        unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) };
    }
}
