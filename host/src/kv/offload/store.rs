//! The store thread: blocks copied out of the device go into the tiers here, read from the copy's own memory, so the engine thread never spends a step's time filling host memory.

use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;

use crate::device::CopiedOut;

use super::super::tier::TierKey;
use super::SharedTiers;

/// One copy's blocks: `keys[i]` is the `i`-th block of `bytes`.
pub(super) struct StoreJob {
    pub(super) keys: Vec<TierKey>,
    pub(super) bytes: CopiedOut,
    pub(super) block_bytes: usize,
}

/// The thread and the job it runs, at most one at a time.
pub(super) struct StoreThread {
    jobs: Option<Sender<StoreJob>>,
    done: Receiver<()>,
    thread: Option<JoinHandle<()>>,
    in_flight: bool,
}

impl StoreThread {
    pub(super) fn start(tiers: SharedTiers) -> std::io::Result<StoreThread> {
        let (jobs, incoming) = channel::<StoreJob>();
        let (finished, done) = channel();
        let thread = std::thread::Builder::new()
            .name("kv-store".into())
            .spawn(move || store_jobs(&tiers, incoming, finished))?;
        Ok(StoreThread {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            in_flight: false,
        })
    }

    /// Hands `job` to the thread, or back when a job is still running or the thread is gone.
    pub(super) fn submit(&mut self, job: StoreJob) -> Result<(), StoreJob> {
        if self.in_flight {
            return Err(job);
        }
        let Some(jobs) = &self.jobs else {
            return Err(job);
        };
        jobs.send(job).map_err(|returned| returned.0)?;
        self.in_flight = true;
        Ok(())
    }

    /// Whether a job is running; with `wait`, waits for its end first. A job ended has
    /// dropped its bytes, so the device may copy into that memory again.
    pub(super) fn busy(&mut self, wait: bool) -> bool {
        if self.in_flight {
            // A thread that died (a panic in a tier) ended its job too: its sender is gone.
            self.in_flight = if wait {
                let _ = self.done.recv();
                false
            } else {
                matches!(self.done.try_recv(), Err(TryRecvError::Empty))
            };
        }
        self.in_flight
    }
}

impl Drop for StoreThread {
    fn drop(&mut self) {
        // The job running ends first: the tiers it writes are shared with the engine.
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Stores each job's blocks in every tier that lacks them, locking the tiers one block at a
/// time, so a lookup on the engine thread waits at most one block's copy.
fn store_jobs(tiers: &SharedTiers, jobs: Receiver<StoreJob>, finished: Sender<()>) {
    for job in jobs {
        for (i, &key) in job.keys.iter().enumerate() {
            let Some(block) = job
                .bytes
                .get(i * job.block_bytes..(i + 1) * job.block_bytes)
            else {
                break;
            };
            super::lock(tiers).store(key, block);
        }
        // The copy's memory goes back to the device before the engine hears the job ended.
        drop(job);
        if finished.send(()).is_err() {
            return;
        }
    }
}
