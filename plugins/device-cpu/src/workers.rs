//! The device's worker threads: spreading one launch over them, and per-thread scratch memory.
//!
//! Each device owns its own rayon pool, so `threads=N` holds per device and no kernel touches
//! rayon's global pool. Small launches run on the calling thread: waking the pool costs more
//! than it saves for a few thousand elements. Dropping [`Workers`] (closing the device) waits
//! for the pool's threads to exit, so nothing of the device outlives `close`.

use std::cell::RefCell;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use rayon::prelude::*;

/// The fewest elements a task of [`Workers::rows_per_task`] gets, so launches smaller than
/// two tasks run on the calling thread.
const MIN_ELEMENTS_PER_TASK: usize = 16 * 1024;

/// How long closing a device waits for its threads; they only have to leave rayon's loop.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

pub struct Workers {
    /// `None` with one thread: everything runs on the calling thread.
    pool: Option<rayon::ThreadPool>,
    threads: usize,
    /// Pool threads that have not exited yet.
    running: Arc<(Mutex<usize>, Condvar)>,
}

impl Workers {
    pub fn new(threads: usize) -> Result<Workers, String> {
        let pooled = threads > 1;
        // Counted before the threads start, so a drop right after `new` still waits for all.
        let running = Arc::new((Mutex::new(if pooled { threads } else { 0 }), Condvar::new()));
        let pool = if pooled {
            let exited = Arc::clone(&running);
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|index| format!("plughost-cpu-{index}"))
                .exit_handler(move |_| {
                    let (count, changed) = &*exited;
                    *count.lock().unwrap_or_else(PoisonError::into_inner) -= 1;
                    changed.notify_all();
                })
                .build()
                .map_err(|error| format!("starting {threads} worker threads: {error}"))?;
            Some(pool)
        } else {
            None
        };
        Ok(Workers {
            pool,
            threads: threads.max(1),
            running,
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `task(i)` for every `i` in `0..num_tasks`, spread over the workers.
    pub fn for_each(&self, num_tasks: usize, task: impl Fn(usize) + Sync + Send) {
        match &self.pool {
            Some(pool) if num_tasks > 1 => {
                pool.install(|| (0..num_tasks).into_par_iter().for_each(task))
            }
            _ => (0..num_tasks).for_each(task),
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
        match &self.pool {
            Some(pool) if data.len() > chunk_len => pool.install(|| {
                data.par_chunks_mut(chunk_len)
                    .enumerate()
                    .for_each(|(index, chunk)| task(index, chunk))
            }),
            _ => data
                .chunks_mut(chunk_len)
                .enumerate()
                .for_each(|(index, chunk)| task(index, chunk)),
        }
    }

    /// How many `row_len`-wide rows one task takes so that a launch of `num_rows` rows splits
    /// into a few tasks per thread, none smaller than [`MIN_ELEMENTS_PER_TASK`] elements.
    pub fn rows_per_task(&self, num_rows: usize, row_len: usize) -> usize {
        let min_rows = MIN_ELEMENTS_PER_TASK.div_ceil(row_len.max(1));
        let even_split = num_rows.div_ceil(4 * self.threads);
        even_split.max(min_rows).max(1)
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // Dropping the pool asks its threads to exit; wait until they have.
        drop(self.pool.take());
        let (count, changed) = &*self.running;
        let count = count.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = changed.wait_timeout_while(count, EXIT_TIMEOUT, |running| *running > 0);
    }
}

thread_local! {
    /// Per-thread f32 scratch; worker threads live as long as the device, so after the first
    /// launches no kernel allocates here.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `body` with `len` f32s of this thread's scratch (contents unspecified).
///
/// A task that is itself re-entered on its thread (rayon may run another task while one
/// waits) gets a fresh buffer instead of the busy one.
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
    use std::sync::atomic::{AtomicUsize, Ordering};

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
    fn dropping_the_workers_waits_for_their_threads() {
        for work in [0, 8] {
            let workers = Workers::new(2).unwrap();
            workers.for_each(work, |_| {});
            let running = Arc::clone(&workers.running);
            drop(workers);
            assert_eq!(*running.0.lock().unwrap(), 0);
        }
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
