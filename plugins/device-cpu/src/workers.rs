//! The device's worker threads: spreading one launch over them, and per-thread scratch memory.
//!
//! A decode step is hundreds of small launches, each a few tens of microseconds of work, so
//! handing a launch to the workers must cost far less than waking a sleeping thread. The
//! calling thread takes tasks itself, `threads - 1` workers spin on a job counter between
//! launches and only park after [`PARK_AFTER`] without work (an idle server), so within a
//! step no launch waits on the kernel. Each device owns its workers, so `threads=N` holds per
//! device. Dropping [`Workers`] (closing the device) joins them, so nothing of the device
//! outlives `close`.

use std::any::Any;
use std::cell::{Cell, RefCell, UnsafeCell};
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

/// The fewest elements a task of [`Workers::rows_per_task`] gets, so launches smaller than
/// two tasks run on the calling thread.
const MIN_ELEMENTS_PER_TASK: usize = 16 * 1024;

/// Claims that [`Workers::for_each_range`] cuts what is left of a thread's share into.
const GUIDED_SHARES: usize = 2;

/// The items of one thread's share of [`Workers::for_each_range`] not yet claimed,
/// `next..end`; a cache line of its own, so claims on different shares do not contend.
#[repr(align(64))]
struct Share {
    next: AtomicUsize,
    end: usize,
}

/// Busy-wait iterations before a waiting worker starts yielding its core: covers the gap
/// between two launches of a step.
const SPIN_ITERATIONS: u32 = 4_000;

/// How long a worker without work keeps checking (yielding the core between checks) before it
/// parks: longer than the host's work between two steps, short enough that an idle server
/// does not burn a core.
const PARK_AFTER: Duration = Duration::from_millis(5);

pub struct Workers {
    /// `None` with one thread: everything runs on the calling thread.
    pool: Option<Pool>,
    threads: usize,
}

/// The shared job slot and the worker threads that serve it.
struct Pool {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    /// One launch at a time owns the job slot.
    dispatch: Mutex<()>,
}

/// A job's tasks, as the workers see it: a `&dyn Fn(usize)` whose lifetime the dispatching
/// thread guarantees by waiting until every worker has left the job.
type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Odd while a job is open to workers, even otherwise: bumped when a job opens, when it
    /// closes (its tasks are all taken) and at shutdown.
    generation: AtomicU64,
    /// The current job; written only while no job is open and no worker is inside one.
    job: UnsafeCell<Option<Job>>,
    next_task: AtomicUsize,
    num_tasks: AtomicUsize,
    /// Workers inside the current job. A worker joins only while the job is open, so a worker
    /// that was not running when the job came (a busy machine) never holds up its end.
    active: AtomicUsize,
    /// The first panic of a task, re-raised on the dispatching thread.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    shutdown: AtomicBool,
    /// Parked workers; a dispatch only takes the lock to wake them when this is non-zero.
    parked: AtomicUsize,
    park_lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written by the dispatching thread before it opens the job (an increment of
// `generation`) and cleared only after closing it and seeing `active` at zero; a worker reads
// it only after joining (`active`) and then seeing the job still open (see `worker_loop`).
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer inside is only dereferenced while the job it points to is
// alive.
unsafe impl Send for Shared {}

thread_local! {
    /// Whether this thread is running a task: a launch inside a task runs serially.
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

impl Shared {
    /// Takes tasks of the current job until none are left.
    fn run_tasks(&self, job: &(dyn Fn(usize) + Sync)) {
        let num_tasks = self.num_tasks.load(Ordering::Acquire);
        loop {
            let task = self.next_task.fetch_add(1, Ordering::Relaxed);
            if task >= num_tasks {
                return;
            }
            IN_TASK.with(|flag| flag.set(true));
            let outcome = catch_unwind(AssertUnwindSafe(|| job(task)));
            IN_TASK.with(|flag| flag.set(false));
            if let Err(payload) = outcome {
                let mut slot = self.panic.lock().unwrap_or_else(PoisonError::into_inner);
                slot.get_or_insert(payload);
            }
        }
    }

    /// Waits until `generation` moves past `seen`: spinning, then yielding, then parked.
    fn wait_for_job(&self, seen: u64) -> u64 {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            let generation = self.generation.load(Ordering::SeqCst);
            if generation != seen {
                return generation;
            }
            if spins < SPIN_ITERATIONS {
                spins += 1;
                std::hint::spin_loop();
            } else if started.elapsed() < PARK_AFTER {
                std::thread::yield_now();
            } else {
                let mut guard = self
                    .park_lock
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                // SeqCst pairs with the dispatcher's generation bump and `parked` load: either
                // it sees this worker parked, or this worker sees the new generation.
                self.parked.fetch_add(1, Ordering::SeqCst);
                while self.generation.load(Ordering::SeqCst) == seen {
                    guard = self
                        .wake
                        .wait(guard)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                self.parked.fetch_sub(1, Ordering::SeqCst);
                return self.generation.load(Ordering::SeqCst);
            }
        }
    }

    fn worker_loop(&self) {
        let mut seen = 0;
        loop {
            seen = self.wait_for_job(seen);
            if self.shutdown.load(Ordering::Acquire) {
                return;
            }
            if seen % 2 == 0 {
                // A job closed before this worker got to it.
                continue;
            }
            // Join, then check the job is still open. Both SeqCst, against the dispatcher's
            // close (a generation bump) followed by its load of `active`: either the dispatcher
            // sees this worker inside and waits for it, or this worker sees the job closed.
            self.active.fetch_add(1, Ordering::SeqCst);
            if self.generation.load(Ordering::SeqCst) == seen {
                // SAFETY: `job` was written before the job opened and is neither cleared nor
                // dropped before `active` falls back to zero, after this call.
                if let Some(job) = unsafe { *self.job.get() } {
                    // SAFETY: as above, the job outlives this call.
                    self.run_tasks(unsafe { &*job });
                }
            }
            self.active.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn wake_parked(&self) {
        if self.parked.load(Ordering::SeqCst) > 0 {
            let _guard = self
                .park_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.wake.notify_all();
        }
    }
}

impl Workers {
    pub fn new(threads: usize) -> Result<Workers, String> {
        let threads = threads.max(1);
        // The thread that opens the device is the one that launches on it, in a worker
        // process and in the engine alike.
        reserve_scratch();
        if threads == 1 {
            return Ok(Workers {
                pool: None,
                threads,
            });
        }
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            next_task: AtomicUsize::new(0),
            num_tasks: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            panic: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            parked: AtomicUsize::new(0),
            park_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut pool = Pool {
            shared: Arc::clone(&shared),
            handles: Vec::with_capacity(threads - 1),
            dispatch: Mutex::new(()),
        };
        let (started, ready) = std::sync::mpsc::channel();
        for index in 1..threads {
            let shared = Arc::clone(&shared);
            let started = started.clone();
            let handle = std::thread::Builder::new()
                .name(format!("plughost-cpu-{index}"))
                .spawn(move || {
                    reserve_scratch();
                    // The receiver waits in `new`; it is gone only if `new` returned early.
                    let _ = started.send(());
                    shared.worker_loop()
                })
                .map_err(|error| format!("starting {threads} worker threads: {error}"))?;
            // On an error above, dropping `pool` stops the workers started so far.
            pool.handles.push(handle);
        }
        // Open returns with every thread running and its scratch in place, so a thread's start
        // (its allocations, a busy machine's scheduling delay) never lands inside a step.
        drop(started);
        for _ in 1..threads {
            if ready.recv().is_err() {
                break;
            }
        }
        Ok(Workers {
            pool: Some(pool),
            threads,
        })
    }

    /// The threads a launch runs on, the calling thread included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `task(i)` for every `i` in `0..num_tasks`, spread over the workers; the calling
    /// thread takes tasks too. A panic in any task is re-raised here once all tasks are done.
    pub fn for_each(&self, num_tasks: usize, task: impl Fn(usize) + Sync + Send) {
        let pool = match &self.pool {
            Some(pool) if num_tasks > 1 && !IN_TASK.with(Cell::get) => pool,
            _ => return (0..num_tasks).for_each(task),
        };
        let _dispatch = pool.dispatch.lock().unwrap_or_else(PoisonError::into_inner);
        let shared = &*pool.shared;
        let job: &(dyn Fn(usize) + Sync) = &task;
        // SAFETY: only the lifetime is erased. Workers dereference the pointer only between
        // the generation bump below and their decrement of `active`, and this function waits
        // for `active` to reach zero before `task` goes out of scope.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job) };
        // SAFETY: no job is open and `active` is zero (the previous dispatch waited for it
        // under `dispatch`), so no worker reads `job` now.
        unsafe { *shared.job.get() = Some(job) };
        shared.next_task.store(0, Ordering::Relaxed);
        shared.num_tasks.store(num_tasks, Ordering::Relaxed);
        // Open the job.
        shared.generation.fetch_add(1, Ordering::SeqCst);
        shared.wake_parked();
        shared.run_tasks(&task);
        // Every task is taken: close the job, then wait for the workers still running one.
        shared.generation.fetch_add(1, Ordering::SeqCst);
        let mut spins = 0u32;
        while shared.active.load(Ordering::SeqCst) != 0 {
            if spins < SPIN_ITERATIONS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: the job is closed and every worker that joined it has left.
        unsafe { *shared.job.get() = None };
        let panic = shared
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
    }

    /// Runs `task(index, chunk)` for every `chunk_len`-long chunk of `data` (the last may be
    /// shorter).
    pub fn for_each_chunk<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        task: impl Fn(usize, &mut [T]) + Sync + Send,
    ) {
        let chunk_len = chunk_len.max(1);
        let len = data.len();
        let start = SharedSlice(data.as_mut_ptr());
        self.for_each(len.div_ceil(chunk_len), |index| {
            let first = index * chunk_len;
            let chunk_len = chunk_len.min(len - first);
            // SAFETY: chunks are disjoint and inside `data`, which stays exclusively borrowed
            // until `for_each` returns; each index runs once.
            let chunk = unsafe { std::slice::from_raw_parts_mut(start.at(first), chunk_len) };
            task(index, chunk)
        });
    }

    /// Runs `task(range)` over `0..num_items` cut into ranges the threads claim as they go.
    /// Each thread starts on a share of its own (`0..num_items` cut in `threads` contiguous
    /// parts) and claims it front to back, a `1 / GUIDED_SHARES` of what is left of it at a
    /// time, so its claims continue one stream through memory (weights read once per launch
    /// stream at the rate the hardware prefetcher reaches on long runs); a thread done with
    /// its share claims from the others' the same way. The first claims are large, so a
    /// launch makes few of them, and the last are single items, so the threads finish within
    /// one item of each other.
    pub fn for_each_range(&self, num_items: usize, task: impl Fn(Range<usize>) + Sync + Send) {
        if num_items == 0 {
            return;
        }
        if self.threads == 1 {
            return task(0..num_items);
        }
        let threads = self.threads;
        // Inline for the usual thread counts: this runs for every parallel launch.
        let shares: SmallVec<[Share; 8]> = (0..threads)
            .map(|index| Share {
                next: AtomicUsize::new(index * num_items / threads),
                end: (index + 1) * num_items / threads,
            })
            .collect();
        self.for_each(threads, |own| {
            for share in (0..threads).map(|offset| &shares[(own + offset) % threads]) {
                let mut start = share.next.load(Ordering::Relaxed);
                while start < share.end {
                    let end = start + ((share.end - start) / GUIDED_SHARES).max(1);
                    match share.next.compare_exchange_weak(
                        start,
                        end,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => {
                            task(start..end);
                            start = share.next.load(Ordering::Relaxed);
                        }
                        Err(current) => start = current,
                    }
                }
            }
        });
    }

    /// As [`Workers::for_each_chunk`] over two equally long slices cut at the same places:
    /// `task(index, a_chunk, b_chunk)`.
    pub fn for_each_chunk_pair<T: Send, U: Send>(
        &self,
        (a, b): (&mut [T], &mut [U]),
        chunk_len: usize,
        task: impl Fn(usize, &mut [T], &mut [U]) + Sync + Send,
    ) {
        assert_eq!(a.len(), b.len(), "paired slices differ in length");
        let chunk_len = chunk_len.max(1);
        let len = a.len();
        let (a, b) = (SharedSlice(a.as_mut_ptr()), SharedSlice(b.as_mut_ptr()));
        self.for_each(len.div_ceil(chunk_len), |index| {
            let first = index * chunk_len;
            let chunk_len = chunk_len.min(len - first);
            // SAFETY: as in `for_each_chunk`, for each of the two slices.
            let (a, b) = unsafe {
                (
                    std::slice::from_raw_parts_mut(a.at(first), chunk_len),
                    std::slice::from_raw_parts_mut(b.at(first), chunk_len),
                )
            };
            task(index, a, b)
        });
    }

    /// How many `row_len`-wide rows one task takes so that a launch of `num_rows` rows splits
    /// into a few tasks per thread, none smaller than [`MIN_ELEMENTS_PER_TASK`] elements.
    pub fn rows_per_task(&self, num_rows: usize, row_len: usize) -> usize {
        let min_rows = MIN_ELEMENTS_PER_TASK.div_ceil(row_len.max(1));
        let even_split = num_rows.div_ceil(4 * self.threads);
        even_split.max(min_rows).max(1)
    }
}

/// The start of a slice whose disjoint chunks tasks on several threads write.
struct SharedSlice<T>(*mut T);

// SAFETY: tasks write disjoint chunks (see `Workers::for_each_chunk`).
unsafe impl<T: Send> Sync for SharedSlice<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for SharedSlice<T> {}

impl<T> SharedSlice<T> {
    /// Element `index`; a method (not a field access) so closures capture the whole wrapper.
    fn at(&self, index: usize) -> *mut T {
        self.0.wrapping_add(index)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        // Two bumps keep the generation even: no job is open.
        self.shared.generation.fetch_add(2, Ordering::SeqCst);
        let _guard = self
            .shared
            .park_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.shared.wake.notify_all();
        drop(_guard);
        for handle in self.handles.drain(..) {
            // A worker only panics if the standard library does; there is nothing to report.
            let _ = handle.join();
        }
    }
}

thread_local! {
    /// Per-thread f32 scratch; worker threads live as long as the device, so after the first
    /// launches no kernel allocates here.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// f32s of scratch each of the device's threads holds from its start: more than a decode
/// step's kernels ask for, so no thread first grows its scratch in the middle of a step (a
/// thread claims its first range of a kernel whenever the other threads leave it one).
const SCRATCH_RESERVE: usize = 16 * 1024;

fn reserve_scratch() {
    with_scratch(SCRATCH_RESERVE, |_| ());
    crate::linear::reserve_thread_activations();
}

/// Runs `body` with `len` f32s of this thread's scratch (contents unspecified).
///
/// A task that is itself re-entered on its thread gets a fresh buffer instead of the busy
/// one.
pub fn with_scratch<R>(len: usize, body: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => {
            if scratch.len() < len {
                scratch.resize(len, 0.0);
            }
            body(&mut scratch[..len])
        }
        Err(_) => body(&mut vec![0.0; len]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_every_item_once_and_shrink_to_single_items() {
        for threads in [1, 2, 3] {
            let workers = Workers::new(threads).unwrap();
            for num_items in [0, 1, 2, 7, 100, 1000] {
                let seen: Vec<AtomicUsize> = (0..num_items).map(|_| AtomicUsize::new(0)).collect();
                let ranges = Mutex::new(Vec::new());
                workers.for_each_range(num_items, |range| {
                    for item in range.clone() {
                        seen[item].fetch_add(1, Ordering::Relaxed);
                    }
                    ranges.lock().unwrap().push(range);
                });
                assert!(
                    seen.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                    "{threads} threads, {num_items} items"
                );
                let mut ranges = ranges.into_inner().unwrap();
                ranges.sort_by_key(|r| r.start);
                if threads > 1 && num_items >= 100 {
                    // Large claims first, single items last.
                    assert!(ranges[0].len() > 1 && ranges.last().unwrap().len() == 1);
                    assert!(ranges.len() < num_items / 4, "{} claims", ranges.len());
                }
            }
        }
    }

    #[test]
    fn every_task_and_chunk_runs_once() {
        for threads in [1, 2, 3] {
            let workers = Workers::new(threads).unwrap();
            let sum = AtomicUsize::new(0);
            workers.for_each(100, |index| {
                sum.fetch_add(index, Ordering::Relaxed);
            });
            assert_eq!(sum.into_inner(), 4950, "{threads} threads");

            let mut data = vec![0usize; 103];
            workers.for_each_chunk(&mut data, 10, |index, chunk| {
                chunk.iter_mut().for_each(|value| *value = index)
            });
            assert!(data.iter().enumerate().all(|(i, &v)| v == i / 10));
        }
    }

    #[test]
    fn dropping_the_workers_joins_their_threads() {
        for work in [0, 8] {
            let workers = Workers::new(2).unwrap();
            workers.for_each(work, |_| {});
            let shared = Arc::downgrade(&workers.pool.as_ref().unwrap().shared);
            drop(workers);
            // Each worker holds the shared state until its thread ends.
            assert!(shared.upgrade().is_none());
        }
    }

    #[test]
    fn workers_serve_launches_after_parking() {
        let workers = Workers::new(3).unwrap();
        for round in 0..3 {
            let threads_seen = Mutex::new(std::collections::HashSet::new());
            workers.for_each(64, |_| {
                threads_seen
                    .lock()
                    .unwrap()
                    .insert(std::thread::current().id());
                std::thread::sleep(Duration::from_millis(1));
            });
            assert!(
                threads_seen.into_inner().unwrap().len() > 1,
                "round {round}"
            );
            std::thread::sleep(PARK_AFTER * 3);
        }
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_after_the_others_finish() {
        let workers = Workers::new(2).unwrap();
        let finished = AtomicUsize::new(0);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            workers.for_each(16, |index| {
                assert_ne!(index, 5, "task 5 fails");
                finished.fetch_add(1, Ordering::Relaxed);
            })
        }));
        assert!(outcome.is_err());
        assert_eq!(finished.into_inner(), 15);
        // The workers still serve launches afterwards.
        let sum = AtomicUsize::new(0);
        workers.for_each(10, |index| {
            sum.fetch_add(index, Ordering::Relaxed);
        });
        assert_eq!(sum.into_inner(), 45);
    }

    #[test]
    fn a_launch_inside_a_task_runs_serially() {
        let workers = Workers::new(2).unwrap();
        let sum = AtomicUsize::new(0);
        workers.for_each(4, |_| {
            workers.for_each(4, |index| {
                sum.fetch_add(index, Ordering::Relaxed);
            })
        });
        assert_eq!(sum.into_inner(), 24);
    }

    #[test]
    fn rows_per_task_keeps_tasks_large_enough() {
        let workers = Workers::new(2).unwrap();
        assert_eq!(workers.rows_per_task(4, 1024), 16);
        assert_eq!(workers.rows_per_task(800, 1024), 100);
        assert_eq!(workers.rows_per_task(0, 0), MIN_ELEMENTS_PER_TASK);
    }

    #[test]
    fn scratch_is_reentrant() {
        let inner = with_scratch(4, |outer| {
            outer.fill(1.0);
            with_scratch(8, |inner| inner.len())
        });
        assert_eq!(inner, 8);
    }
}
