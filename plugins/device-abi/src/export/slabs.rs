//! Slabs of huge pages that mid-sized device buffers are cut from, so a weight matrix of a few MiB lies wholly in huge pages without rounding it up to whole huge pages of its own.
//!
//! A decode step streams every weight matrix once, and a model's matrices are mostly 1 to
//! 16 MiB. In a mapping of its own, a matrix gets huge pages only for its whole 2 MiB
//! stretches, and its tail (a third of a 3.3 MiB matrix) stays in 4 KiB pages, each a TLB miss
//! and a stop for the hardware's stream prefetcher. Asking for a huge page over the tail too
//! would hold up to 2 MiB more per matrix. Cut one after another from a slab, the matrices fill
//! its huge pages; only the slab's last one is part empty.
//!
//! A slab's pages are mapped as buffers are cut, not when the slab is made, so a process holds
//! at most its used bytes plus one huge page of the slab being cut. Space is never reused
//! within a slab: a freed buffer's bytes return when every buffer of its slab is freed (a
//! model's weights, KV cache and scratch are made at prepare and freed together; the slab
//! being cut goes too), and no buffer is ever handed bytes another one wrote, so every buffer
//! starts zeroed.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::pages::{MappedPages, PAGE_BYTES};

/// Bytes of address space a slab reserves: room for several of a model's largest mid-sized
/// matrices.
const SLAB_BYTES: usize = 64 << 20;

/// The largest buffer cut from a slab: larger ones are mappings of their own, whose tails
/// are a small share of them.
pub(super) const LARGEST_CUT: usize = 16 << 20;

/// Where each buffer cut from a slab starts: a cache line, so rows start on one.
const CUT_ALIGN: usize = 64;

/// The slab being cut and how far. A slab is one reserved stretch of huge pages, alive while
/// any buffer cut from it is.
struct Cutting {
    slab: Arc<MappedPages>,
    used: usize,
}

/// Where buffers are cut: the slab being cut, if any.
#[derive(Default)]
struct Slabs {
    cutting: Mutex<Option<Cutting>>,
}

/// The process's slabs: every device of a process cuts from the same ones.
static SLABS: Slabs = Slabs {
    cutting: Mutex::new(None),
};

/// Zeroed bytes cut from a slab, keeping it alive.
pub(super) struct SlabCut {
    slabs: &'static Slabs,
    /// Keeps the slab mapped while the bytes are in use.
    slab: Arc<MappedPages>,
    start: NonNull<u8>,
}

impl SlabCut {
    pub(super) fn start(&self) -> NonNull<u8> {
        self.start
    }
}

impl Drop for SlabCut {
    /// The last cut of the slab being cut lets it go too, so a closed device leaves no slab's
    /// pages mapped; the next cut maps a new one.
    fn drop(&mut self) {
        let mut cutting = self.slabs.lock();
        // Cuts are made only under the lock, so with it held the count can only fall: two
        // means this cut and the cutting state are all that hold the slab.
        let last =
            |c: &Cutting| Arc::ptr_eq(&c.slab, &self.slab) && Arc::strong_count(&self.slab) == 2;
        if cutting.as_ref().is_some_and(last) {
            *cutting = None;
        }
    }
}

/// `len` zeroed bytes (`1..=LARGEST_CUT`), 64-byte aligned, from the slab being cut or a
/// new one, their pages mapped now.
pub(super) fn cut(len: usize) -> std::io::Result<SlabCut> {
    SLABS.cut(len)
}

impl Slabs {
    fn lock(&self) -> MutexGuard<'_, Option<Cutting>> {
        self.cutting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn cut(&'static self, len: usize) -> std::io::Result<SlabCut> {
        debug_assert!((1..=LARGEST_CUT).contains(&len));
        let mut cutting = self.lock();
        let c = match &mut *cutting {
            Some(c) if c.used.next_multiple_of(CUT_ALIGN) + len <= SLAB_BYTES => c,
            slot => slot.insert(Cutting {
                slab: Arc::new(crate::pages::reserved(SLAB_BYTES)?),
                used: 0,
            }),
        };
        let offset = c.used.next_multiple_of(CUT_ALIGN);
        let end = offset + len;
        // The earlier cuts mapped every page they touch, so the pages to map start at the
        // first page boundary at or past their end.
        let mapped_to = c.used.next_multiple_of(PAGE_BYTES);
        if end > mapped_to {
            // SAFETY: `mapped_to..end` lies inside the slab, on a page boundary at or past
            // the end of every earlier cut, so no buffer reaches it yet and its bytes are
            // zero.
            unsafe { c.slab.map_range(mapped_to, end - mapped_to) };
        }
        c.used = end;
        // SAFETY: `offset + len <= SLAB_BYTES`, inside the slab's mapping.
        let start = unsafe { NonNull::new_unchecked(c.slab.start().as_ptr().add(offset)) };
        Ok(SlabCut {
            slabs: self,
            slab: Arc::clone(&c.slab),
            start,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slab_goes_with_its_last_cut() {
        let slabs: &'static Slabs = Box::leak(Box::default());
        let (first, second) = (slabs.cut(5000).unwrap(), slabs.cut(3 << 20).unwrap());
        assert!(Arc::ptr_eq(&first.slab, &second.slab));
        let slab = Arc::downgrade(&first.slab);
        drop(first);
        assert!(slab.upgrade().is_some(), "a cut is still in use");
        drop(second);
        assert!(slab.upgrade().is_none(), "the slab outlived its cuts");
        let third = slabs.cut(100).unwrap();
        assert_eq!(
            third.start().as_ptr() as usize % crate::pages::HUGE_PAGE_BYTES,
            0
        );
        // A slab that does not hold the next cut stays while its own cuts do.
        let full = slabs.cut(LARGEST_CUT).unwrap();
        let more: Vec<SlabCut> = (0..4).map(|_| slabs.cut(LARGEST_CUT).unwrap()).collect();
        assert!(!Arc::ptr_eq(&full.slab, &more[3].slab));
        let old = Arc::downgrade(&full.slab);
        drop((third, full, more));
        assert!(old.upgrade().is_none());
    }

    #[test]
    fn cuts_are_aligned_zeroed_and_disjoint() {
        let lens = [1, 100, 3 << 20, LARGEST_CUT, 5000, 2 << 20];
        let cuts: Vec<(SlabCut, usize)> = lens
            .iter()
            .map(|&len| (cut(len).expect("memory"), len))
            .collect();
        for (i, (c, len)) in cuts.iter().enumerate() {
            assert_eq!(c.start().as_ptr() as usize % CUT_ALIGN, 0);
            // SAFETY: the cut owns `len` bytes from its start, and no other reference exists.
            let bytes = unsafe { std::slice::from_raw_parts_mut(c.start().as_ptr(), *len) };
            assert!(bytes.iter().all(|&b| b == 0), "cut {i} of {len} bytes");
            bytes.fill(i as u8 + 1);
        }
        for (i, (c, len)) in cuts.iter().enumerate() {
            // SAFETY: as above.
            let bytes = unsafe { std::slice::from_raw_parts(c.start().as_ptr(), *len) };
            assert!(
                bytes.iter().all(|&b| b == i as u8 + 1),
                "cut {i} was overwritten"
            );
        }
    }
}
