//! The engine's request table: every request it holds and the running and waiting queues over them, kept consistent with each other.

use std::collections::HashMap;

use crate::sched::{Phase, RequestView};

use super::request::RequestId;
use super::state::RequestState;

/// The requests of the engine and the queue each stands in.
///
/// Invariants: every request of the table is in exactly one of `running` and `waiting`, once;
/// neither queue names a request the table does not hold; a request is in `running` exactly
/// when its phase is [`Phase::Running`]. Every change goes through a method that keeps them.
#[derive(Default)]
pub(super) struct RequestTable {
    requests: HashMap<RequestId, RequestState>,
    /// Running requests in admission order.
    running: Vec<RequestId>,
    /// Waiting and preempted requests, in the order they were queued.
    waiting: Vec<RequestId>,
}

impl RequestTable {
    pub(super) fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    pub(super) fn get(&self, id: RequestId) -> Option<&RequestState> {
        self.requests.get(&id)
    }

    pub(super) fn get_mut(&mut self, id: RequestId) -> Option<&mut RequestState> {
        self.requests.get_mut(&id)
    }

    pub(super) fn running(&self) -> &[RequestId] {
        &self.running
    }

    pub(super) fn waiting(&self) -> &[RequestId] {
        &self.waiting
    }

    /// Every request held, in no particular order.
    pub(super) fn ids(&self) -> Vec<RequestId> {
        self.requests.keys().copied().collect()
    }

    /// The requests whose client went away.
    pub(super) fn abandoned(&self) -> Vec<RequestId> {
        self.requests
            .values()
            .filter(|r| r.is_abandoned())
            .map(|r| r.id)
            .collect()
    }

    /// Queues a new request at the back of the waiting queue; a request of that id already
    /// held is replaced, from whichever queue it was in.
    pub(super) fn queue(&mut self, mut state: RequestState) {
        let id = state.id;
        self.remove(id);
        state.phase = Phase::Waiting;
        self.waiting.push(id);
        self.requests.insert(id, state);
    }

    /// Takes `id` out of the table and out of every queue at once.
    pub(super) fn remove(&mut self, id: RequestId) -> Option<RequestState> {
        self.running.retain(|r| *r != id);
        self.waiting.retain(|r| *r != id);
        self.requests.remove(&id)
    }

    /// Moves a waiting or preempted request to the back of the running queue. Whether it was
    /// not running before.
    pub(super) fn start_running(&mut self, id: RequestId) -> bool {
        let Some(state) = self.requests.get_mut(&id) else {
            return false;
        };
        if state.phase == Phase::Running {
            return false;
        }
        state.phase = Phase::Running;
        self.waiting.retain(|w| *w != id);
        self.running.push(id);
        true
    }

    /// Moves a running request back to the waiting queue, preempted. The request, if held.
    pub(super) fn preempt(&mut self, id: RequestId) -> Option<&mut RequestState> {
        let state = self.requests.get_mut(&id)?;
        self.running.retain(|r| *r != id);
        if state.phase != Phase::Preempted && !self.waiting.contains(&id) {
            self.waiting.push(id);
        }
        state.phase = Phase::Preempted;
        Some(state)
    }

    /// The oldest request that waits, by arrival.
    pub(super) fn oldest_waiting(&self) -> Option<&RequestState> {
        self.waiting
            .iter()
            .filter_map(|id| self.requests.get(id))
            .min_by_key(|r| (r.arrival_us, r.id))
    }

    /// What the scheduler sees: the running requests in admission order, then the waiting
    /// ones by arrival. `blocks_held` gives the KV blocks a request holds.
    pub(super) fn views(&self, blocks_held: impl Fn(RequestId) -> u32) -> Vec<RequestView> {
        let mut waiting: Vec<&RequestState> = self
            .waiting
            .iter()
            .filter_map(|id| self.requests.get(id))
            .collect();
        waiting.sort_by_key(|r| (r.arrival_us, r.id));
        self.running
            .iter()
            .filter_map(|id| self.requests.get(id))
            .chain(waiting)
            .map(|r| r.view(blocks_held(r.id)))
            .collect()
    }
}
