//! The background copy out of a Rust device (ABI revision 1.2): a thread of its own copies checked byte ranges of device buffers into host memory while launches go on.
//!
//! The thread is started by the first copy and lives as long as the handle; the pieces of a
//! copy travel in vectors the two sides swap, so once warm a copy allocates nothing. Dropping
//! the [`Copier`] waits for a copy in flight to end, so the buffers it reads outlive it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::DeviceFailure;

/// What a device injects into its copies out, for tests of the host's handling of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyOutFault {
    /// The copy thread waits this long before it copies (a slow device).
    pub delay: Duration,
    /// The copy thread aborts the process instead of copying (a device that crashes).
    pub abort: bool,
}

/// One contiguous run of bytes to copy: from a device buffer into the host's destination.
#[derive(Clone, Copy)]
pub(super) struct Piece {
    pub(super) src: *const u8,
    pub(super) dst: *mut u8,
    pub(super) len: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Progress {
    Idle,
    Queued,
    Copying,
    Done,
}

struct Slot {
    progress: Progress,
    /// The queued copy's pieces; swapped with the thread's own vector when it takes them.
    pieces: Vec<Piece>,
    fault: CopyOutFault,
    quit: bool,
}

// SAFETY: the raw pointers in `pieces` are only dereferenced by the copy thread, under the
// contract `Copier::start` states (live, unaliased by writers, until the copy is done); moving
// them between threads is what the slot is for.
unsafe impl Send for Slot {}

struct Shared {
    slot: Mutex<Slot>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        // Nothing panics while holding the lock, so a poisoned lock still holds a valid slot.
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The copy thread of one handle and the copy it runs, if any.
#[derive(Default)]
pub(super) struct Copier {
    running: Option<(Arc<Shared>, JoinHandle<()>)>,
    /// Bytes of the copy in flight, counted once it ends.
    in_flight: Option<u64>,
    /// Pieces being gathered for the next copy; reused.
    pieces: Vec<Piece>,
}

impl Copier {
    pub(super) fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// The vector the next copy's pieces go into (cleared).
    pub(super) fn pieces(&mut self) -> &mut Vec<Piece> {
        self.pieces.clear();
        &mut self.pieces
    }

    /// Starts copying the pieces gathered in [`Copier::pieces`], `bytes` in all.
    ///
    /// # Safety
    /// Every piece's `src` is readable and its `dst` writable for `len` bytes, the `dst`s do
    /// not overlap each other or any `src`, and until [`Copier::poll`] reports the copy done
    /// (or the copier is dropped) nothing frees, writes or takes a `&mut` to a `src` byte, and
    /// nothing else touches a `dst` byte.
    pub(super) unsafe fn start(
        &mut self,
        bytes: u64,
        fault: CopyOutFault,
    ) -> Result<(), DeviceFailure> {
        if self.in_flight.is_some() {
            return Err(DeviceFailure::invalid_argument(
                "a copy out is already in flight; poll it to its end first",
            ));
        }
        if self.running.is_none() {
            self.running = Some(spawn()?);
        }
        let Some((shared, _)) = &self.running else {
            return Err(DeviceFailure::internal("the copy thread is not running"));
        };
        let mut slot = shared.lock();
        std::mem::swap(&mut slot.pieces, &mut self.pieces);
        slot.fault = fault;
        slot.progress = Progress::Queued;
        shared.changed.notify_all();
        drop(slot);
        self.in_flight = Some(bytes);
        Ok(())
    }

    /// `Some(bytes copied)` once the copy in flight has ended (the copier forgets it then), or
    /// at once with `Some(0)` when none is; with `wait`, blocks until it ends.
    pub(super) fn poll(&mut self, wait: bool) -> Option<u64> {
        let Some(bytes) = self.in_flight else {
            return Some(0);
        };
        let (shared, _) = self.running.as_ref()?;
        let mut slot = shared.lock();
        while wait && slot.progress != Progress::Done {
            slot = shared
                .changed
                .wait(slot)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if slot.progress != Progress::Done {
            return None;
        }
        slot.progress = Progress::Idle;
        self.in_flight = None;
        Some(bytes)
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        if let Some((shared, thread)) = self.running.take() {
            shared.lock().quit = true;
            shared.changed.notify_all();
            // The thread ends its copy in flight before it looks at `quit`.
            let _ = thread.join();
        }
    }
}

fn spawn() -> Result<(Arc<Shared>, JoinHandle<()>), DeviceFailure> {
    let shared = Arc::new(Shared {
        slot: Mutex::new(Slot {
            progress: Progress::Idle,
            pieces: Vec::new(),
            fault: CopyOutFault::default(),
            quit: false,
        }),
        changed: Condvar::new(),
    });
    let theirs = Arc::clone(&shared);
    let thread = std::thread::Builder::new()
        .name("device-copy-out".into())
        .spawn(move || copy_loop(&theirs))
        .map_err(|e| DeviceFailure::internal(format!("cannot start the copy thread: {e}")))?;
    Ok((shared, thread))
}

fn copy_loop(shared: &Shared) {
    let mut pieces: Vec<Piece> = Vec::new();
    loop {
        let mut slot = shared.lock();
        while slot.progress != Progress::Queued && !slot.quit {
            slot = shared
                .changed
                .wait(slot)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if slot.progress != Progress::Queued {
            return;
        }
        std::mem::swap(&mut slot.pieces, &mut pieces);
        slot.progress = Progress::Copying;
        let fault = slot.fault;
        drop(slot);
        std::thread::sleep(fault.delay);
        if fault.abort {
            eprintln!("device: injected crash during a copy out");
            std::process::abort();
        }
        for piece in &pieces {
            // SAFETY: `Copier::start`'s contract: `src` readable and `dst` writable for `len`
            // bytes, disjoint, and neither written nor freed by anyone else until this copy is
            // reported done, which happens only after the loop below sets `Done`.
            unsafe { std::ptr::copy_nonoverlapping(piece.src, piece.dst, piece.len) };
        }
        let mut slot = shared.lock();
        slot.progress = Progress::Done;
        shared.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_in_the_background_and_reports_the_end_once() {
        let source: Vec<u8> = (0..=255).collect();
        let mut destination = vec![0u8; 64];
        let mut copier = Copier::default();
        assert_eq!(copier.poll(false), Some(0), "nothing in flight");
        copier.pieces().extend([
            Piece {
                src: source[10..].as_ptr(),
                dst: destination.as_mut_ptr(),
                len: 32,
            },
            Piece {
                src: source[200..].as_ptr(),
                // SAFETY: 32 bytes into a 64-byte vector.
                dst: unsafe { destination.as_mut_ptr().add(32) },
                len: 32,
            },
        ]);
        let slow = CopyOutFault {
            delay: Duration::from_millis(50),
            abort: false,
        };
        // SAFETY: both vectors outlive the copy, which the waiting poll below ends, and
        // neither is touched until then.
        unsafe { copier.start(64, slow) }.unwrap();
        assert!(copier.in_flight());
        // SAFETY: as above; this start is refused before it reads anything.
        let second = unsafe { copier.start(0, CopyOutFault::default()) };
        assert!(second.is_err(), "one copy at a time");
        assert_eq!(copier.poll(true), Some(64));
        assert!(!copier.in_flight());
        assert_eq!(destination[..32], source[10..42]);
        assert_eq!(destination[32..], source[200..232]);
    }
}
