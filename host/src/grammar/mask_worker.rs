//! A host thread that computes a step's grammar masks while the device runs that step.
//!
//! The mask for step t depends only on the tokens up to t-1, so it can be computed while the
//! device computes the logits of step t. The engine hands the step's matchers over before it
//! launches the step and takes them back before it samples; the batch vector travels both
//! ways, so the steady state allocates nothing here.

use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use super::matcher::GrammarMatcher;

/// A step's constrained rows: the engine's request id and its matcher.
pub type MaskJobs = Vec<(u64, Box<GrammarMatcher>)>;

pub struct MaskWorker {
    jobs: SyncSender<MaskJobs>,
    done: Receiver<MaskJobs>,
    thread: Option<JoinHandle<()>>,
    /// Whether a batch is out with the worker.
    busy: bool,
}

impl MaskWorker {
    pub fn start() -> std::io::Result<MaskWorker> {
        let (jobs, inbox) = sync_channel::<MaskJobs>(1);
        let (outbox, done) = sync_channel::<MaskJobs>(1);
        let thread = std::thread::Builder::new()
            .name("grammar-masks".into())
            .spawn(move || {
                while let Ok(mut batch) = inbox.recv() {
                    for (_, matcher) in batch.iter_mut() {
                        matcher.compute_mask();
                    }
                    if outbox.send(batch).is_err() {
                        return;
                    }
                }
            })?;
        Ok(MaskWorker {
            jobs,
            done,
            thread: Some(thread),
            busy: false,
        })
    }

    /// Starts computing the masks of `batch`; [`MaskWorker::finish`] returns it. A worker that
    /// is gone hands the batch back at once, uncomputed (the engine then computes in line).
    pub fn begin(&mut self, batch: MaskJobs) -> Result<(), MaskJobs> {
        match self.jobs.send(batch) {
            Ok(()) => {
                self.busy = true;
                Ok(())
            }
            Err(e) => Err(e.0),
        }
    }

    /// Whether a batch is out with the worker.
    pub fn is_busy(&self) -> bool {
        self.busy
    }

    /// Waits for the batch [`MaskWorker::begin`] handed over; empty if none is out or the
    /// worker died (llguidance catches its own panics, so that takes a bug here).
    pub fn finish(&mut self) -> MaskJobs {
        if !std::mem::take(&mut self.busy) {
            return Vec::new();
        }
        self.done.recv().unwrap_or_default()
    }
}

impl Drop for MaskWorker {
    fn drop(&mut self) {
        // Closing the job channel ends the thread's loop.
        let (closed, _) = sync_channel(1);
        drop(std::mem::replace(&mut self.jobs, closed));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
