//! Device memory behind one handle: zeroed, 64-byte aligned buffers by id ([`BufferTable`]), the order each one's bytes are in, and which ones an unfinished rearrangement left poisoned.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut, Range};
use std::ptr::NonNull;
use std::slice;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::abi::status;

use super::slabs;
use super::{AS_WRITTEN, DeviceFailure};

/// The bytes of one device buffer: zeroed when allocated and 64-byte aligned, so a device can
/// view them in place as f32, i32 or 16-bit elements, with rows starting on a cache line.
///
/// Buffers of [`AlignedBytes::CUT`] bytes up to [`slabs::LARGEST_CUT`] (most weight matrices)
/// are cut from slabs of huge pages ([`slabs`]); larger ones (the KV cache, an embedding
/// table) are anonymous mappings of their own, in huge pages where the kernel allows (see
/// [`crate::pages`]); either has every page mapped at once. Smaller ones come from the
/// allocator, zeroed.
pub struct AlignedBytes {
    /// The start of the allocation, or an aligned dangling pointer when `len` is 0. For a
    /// mapping, its first byte: kept here rather than asked of the mapping, so every access to
    /// the bytes (the background copy's included) goes through this one pointer.
    start: NonNull<u8>,
    len: usize,
    /// What holds the bytes of a buffer not from the allocator, held only to release them
    /// when dropped.
    backing: Option<Backing>,
}

// SAFETY: `AlignedBytes` owns its allocation exclusively, as a `Vec<u8>` does.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access only reads, as with a `Vec<u8>`.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    pub const ALIGN: usize = 64;

    /// The size from which a buffer is cut from a slab: big enough to be streamed as a
    /// matrix, small enough that the allocator's buffers (step inputs, norms' weights) do
    /// not take the slabs' room.
    const CUT: usize = 256 << 10;

    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Result<AlignedBytes, String> {
        if len == 0 {
            #[repr(align(64))]
            struct CacheLine;
            return Ok(AlignedBytes {
                start: NonNull::<CacheLine>::dangling().cast(),
                len,
                backing: None,
            });
        }
        if len > slabs::LARGEST_CUT {
            let mut mapping = crate::pages::mapped_now(len)
                .map_err(|e| format!("mapping {len} bytes failed: {e}"))?;
            // Mapped pages start on a huge page, which is 64-byte aligned.
            let start = NonNull::new(mapping.as_mut_ptr()).ok_or("a mapping at address 0")?;
            return Ok(AlignedBytes {
                start,
                len,
                backing: Some(Backing::Mapping { _pages: mapping }),
            });
        }
        if len >= Self::CUT {
            let cut = slabs::cut(len).map_err(|e| format!("mapping a slab failed: {e}"))?;
            return Ok(AlignedBytes {
                start: cut.start(),
                len,
                backing: Some(Backing::Slab { _cut: cut }),
            });
        }
        let layout = Layout::from_size_align(len, Self::ALIGN).map_err(|e| e.to_string())?;
        // SAFETY: the layout's size is not zero.
        let start = unsafe { alloc::alloc_zeroed(layout) };
        let start = NonNull::new(start).ok_or("the system allocator has no memory left")?;
        Ok(AlignedBytes {
            start,
            len,
            backing: None,
        })
    }

    pub(super) fn copy_of(bytes: &[u8]) -> Result<AlignedBytes, String> {
        let mut copy = AlignedBytes::zeroed(bytes.len())?;
        copy.copy_from_slice(bytes);
        Ok(copy)
    }

    /// The start of the allocation, without making a reference to its bytes.
    pub(super) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.start.as_ptr()
    }
}

/// What holds a buffer's bytes when the allocator does not, held only to release them.
enum Backing {
    Mapping { _pages: crate::pages::MappedPages },
    Slab { _cut: slabs::SlabCut },
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        // A mapping unmaps itself when dropped, a slab when its last cut is.
        if self.len != 0 && self.backing.is_none() {
            // SAFETY: allocated in `zeroed` with this layout, which was valid then.
            unsafe {
                let layout = Layout::from_size_align_unchecked(self.len, Self::ALIGN);
                alloc::dealloc(self.start.as_ptr(), layout);
            }
        }
    }
}

impl Deref for AlignedBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `start` is valid for `len` initialized bytes (or dangling and aligned for 0).
        unsafe { slice::from_raw_parts(self.start.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { slice::from_raw_parts_mut(self.start.as_ptr(), self.len) }
    }
}

/// Device buffers by id. Ids start at 1 and are never reused, so a stale id cannot alias a
/// newer buffer.
///
/// A buffer is poisoned while a rearrangement of its bytes runs, and stays so if that
/// rearrangement panics or fails: its bytes are then half in one order and half in another,
/// and reading them as either would give wrong numbers. Every launch or read of a poisoned
/// buffer is refused (INTERNAL) until the host writes it whole or frees it.
///
/// The tables hash with FxHash: every argument of every launch looks its buffer up in several
/// of them, the keys are ids the table gave out itself, and SipHash's resistance to chosen
/// keys bought nothing here but some 20 ns a lookup.
#[derive(Default)]
pub(super) struct BufferTable {
    last_id: u64,
    buffers: FxHashMap<u64, AlignedBytes>,
    /// The buffers a launch rearranged, with their arrangement; the rest are as written.
    arrangements: FxHashMap<u64, u64>,
    /// The buffers whose bytes are in no known order.
    poisoned: FxHashSet<u64>,
    /// The byte ranges a copy out reads in the background, by buffer (inner vectors kept, so
    /// a copy allocates nothing once warm): until it ends nothing writes them or frees their
    /// buffers.
    copying: FxHashMap<u64, Vec<Range<usize>>>,
}

impl BufferTable {
    pub(super) fn insert(&mut self, storage: AlignedBytes) -> u64 {
        self.last_id += 1;
        self.buffers.insert(self.last_id, storage);
        self.last_id
    }

    pub(super) fn remove(&mut self, id: u64) -> Result<AlignedBytes, DeviceFailure> {
        self.check_not_copied(id, None)?;
        self.copying.remove(&id);
        self.arrangements.remove(&id);
        self.poisoned.remove(&id);
        self.buffers.remove(&id).ok_or_else(|| unknown_buffer(id))
    }

    pub(super) fn arrangement(&self, id: u64) -> u64 {
        self.arrangements.get(&id).copied().unwrap_or(AS_WRITTEN)
    }

    fn set_arrangement(&mut self, id: u64, arrangement: u64) {
        if arrangement == AS_WRITTEN {
            self.arrangements.remove(&id);
        } else {
            self.arrangements.insert(id, arrangement);
        }
    }

    /// Runs `change` over the bytes of buffer `id` (one a launch already resolved) and records
    /// that they are now in `arrangement`. The buffer is poisoned until `change` returns `Ok`,
    /// so a panic or failure inside it leaves the buffer refused rather than misread.
    pub(super) fn rearrange(
        &mut self,
        id: u64,
        arrangement: u64,
        change: impl FnOnce(&mut [u8]) -> Result<(), DeviceFailure>,
    ) -> Result<(), DeviceFailure> {
        self.check_not_copied(id, None)?;
        self.poisoned.insert(id);
        change(self.storage_mut(id))?;
        self.poisoned.remove(&id);
        self.set_arrangement(id, arrangement);
        Ok(())
    }

    /// Fails with INTERNAL if buffer `id` is poisoned.
    pub(super) fn check_not_poisoned(&self, id: u64) -> Result<(), DeviceFailure> {
        if self.poisoned.contains(&id) {
            return Err(DeviceFailure::internal(format!(
                "buffer {id} is poisoned: a rearrangement of its bytes did not finish, so they \
                 are in no known order; write it whole or free it"
            )));
        }
        Ok(())
    }

    /// Forgets the order of buffer `id`'s bytes, poisoned or arranged: the host is about to
    /// overwrite all of them.
    pub(super) fn forget_order(&mut self, id: u64) {
        self.poisoned.remove(&id);
        self.arrangements.remove(&id);
    }

    /// Records that a copy out reads `range` of buffer `id` from now on.
    pub(super) fn begin_copy(&mut self, id: u64, range: Range<usize>) {
        self.copying.entry(id).or_default().push(range);
    }

    /// The copy out ended: its ranges may be written again.
    pub(super) fn end_copy(&mut self) {
        self.copying.values_mut().for_each(Vec::clear);
    }

    /// Fails with INVALID_ARGUMENT if a copy out in flight reads `range` of buffer `id`
    /// (`None`: any of its bytes).
    pub(super) fn check_not_copied(
        &self,
        id: u64,
        range: Option<&Range<usize>>,
    ) -> Result<(), DeviceFailure> {
        let Some(copied) = self.copying.get(&id) else {
            return Ok(());
        };
        let clash = copied.iter().find(|c| match range {
            Some(r) => c.start < r.end && r.start < c.end,
            None => true,
        });
        match clash {
            Some(c) => Err(DeviceFailure::invalid_argument(format!(
                "bytes {}..{} of buffer {id} are being copied out; they stay unwritten, and the \
                 buffer allocated, until copy_out_poll reports the copy done",
                c.start, c.end
            ))),
            None => Ok(()),
        }
    }

    /// Copies `bytes` into buffer `id` at byte `start` through a raw pointer, without a
    /// reference to the rest of the buffer, which a copy out may be reading.
    pub(super) fn write_at(
        &mut self,
        id: u64,
        start: usize,
        bytes: &[u8],
    ) -> Result<(), DeviceFailure> {
        let storage = self.get_mut(id)?;
        let range = checked_range(id, storage.len(), start as u64, bytes.len() as u64)?;
        let base = storage.as_mut_ptr();
        // SAFETY: `range` lies inside the buffer's allocation (checked above), `bytes` is a
        // separate borrow so cannot overlap it, and no reference to these bytes is live: the
        // buffer's bytes are reached only through raw pointers or borrows of other ranges.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(range.start), bytes.len())
        };
        Ok(())
    }

    /// Whether the table keeps an arrangement or a poisoning for any buffer.
    #[cfg(test)]
    pub(super) fn tracks_any_order(&self) -> bool {
        !self.arrangements.is_empty() || !self.poisoned.is_empty()
    }

    pub(super) fn get(&self, id: u64) -> Result<&AlignedBytes, DeviceFailure> {
        self.buffers.get(&id).ok_or_else(|| unknown_buffer(id))
    }

    pub(super) fn get_mut(&mut self, id: u64) -> Result<&mut AlignedBytes, DeviceFailure> {
        self.buffers.get_mut(&id).ok_or_else(|| unknown_buffer(id))
    }

    /// A buffer that a launch already resolved; its absence is a bug in this module.
    pub(super) fn storage(&self, id: u64) -> &[u8] {
        self.buffers.get(&id).expect("launch buffers stay alive")
    }

    pub(super) fn storage_mut(&mut self, id: u64) -> &mut [u8] {
        self.buffers
            .get_mut(&id)
            .expect("launch buffers stay alive")
    }

    /// The start of a buffer that a launch already resolved, as a raw pointer.
    pub(super) fn base_ptr(&mut self, id: u64) -> *mut u8 {
        self.buffers
            .get_mut(&id)
            .expect("launch buffers stay alive")
            .as_mut_ptr()
    }
}

fn unknown_buffer(id: u64) -> DeviceFailure {
    DeviceFailure::new(status::UNKNOWN_BUFFER, format!("unknown buffer {id}"))
}

/// The byte range `offset..offset+len` of a buffer of `buffer_len` bytes, if it fits.
pub(super) fn checked_range(
    buffer: u64,
    buffer_len: usize,
    offset: u64,
    len: u64,
) -> Result<Range<usize>, DeviceFailure> {
    let out_of_bounds = || {
        let end = offset as u128 + len as u128;
        DeviceFailure::new(
            status::OUT_OF_BOUNDS,
            format!("bytes {offset}..{end} do not fit in buffer {buffer} of {buffer_len} bytes"),
        )
    };
    let end = offset.checked_add(len).ok_or_else(out_of_bounds)?;
    let start = usize::try_from(offset).map_err(|_| out_of_bounds())?;
    let end = usize::try_from(end).map_err(|_| out_of_bounds())?;
    if end > buffer_len {
        return Err(out_of_bounds());
    }
    Ok(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_bytes_are_zeroed_and_aligned() {
        // Both sides of the sizes from which a buffer is cut from a slab and is a mapping of
        // its own.
        let (cut, largest) = (AlignedBytes::CUT, slabs::LARGEST_CUT);
        for len in [
            0,
            1,
            63,
            64,
            4097,
            cut - 1,
            cut,
            3 * cut + 5,
            largest,
            largest + 1,
        ] {
            let mut bytes = AlignedBytes::zeroed(len).unwrap();
            let backing = match bytes.backing {
                None => "allocator",
                Some(Backing::Slab { .. }) => "slab",
                Some(Backing::Mapping { .. }) => "mapping",
            };
            let expected = match len {
                _ if len < cut => "allocator",
                _ if len <= largest => "slab",
                _ => "mapping",
            };
            assert_eq!(backing, expected, "{len}");
            assert_eq!(bytes.len(), len);
            assert_eq!(bytes.as_ptr() as usize % AlignedBytes::ALIGN, 0, "{len}");
            assert!(bytes.iter().all(|&byte| byte == 0));
            for (i, byte) in bytes.iter_mut().enumerate() {
                *byte = i as u8;
            }
            let copy = AlignedBytes::copy_of(&bytes).unwrap();
            assert_eq!(&copy[..], &bytes[..]);
        }
    }
}
