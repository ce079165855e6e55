//! The engine's side of the KV tiers below the device: blocks copied down when they become cached-free, prefixes looked up through every tier, requests waiting while their blocks load from disk, and loaded blocks written into fresh device blocks.
//!
//! Copies are started between steps, as one batched device call per staging buffer's worth of
//! blocks. On a device that copies out in the background (device table revision 1.2) a batch
//! runs while later steps go on: its blocks stay pinned (no allocation takes them; a prefix
//! hit may read them) until a poll between steps sees it end; only then does the store
//! thread put them into the tiers. Other devices copy synchronously between steps. A block
//! enters a tier only after its copy completed; a copy that fails (a lost worker) stores
//! nothing.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::kv::offload::{KvOffload, TierName};
use crate::kv::{BlockHash, BlockId, ComputedPrefix, KvCacheManager};
use crate::kv_tier_metrics::Direction;
use crate::metrics::Metrics;
use crate::profile::Track;

use super::super::request::FinishReason;
use super::super::state::{LoadedPrefix, RequestState};
use super::EngineCore;

/// How long an engine with nothing but loading requests (or copies out) waits for a load (or
/// copy) before it looks at its commands again.
const LOAD_POLL: Duration = Duration::from_millis(20);

/// The blocks that became cached-free and wait for their copy out of the device in the
/// background, and the batch being copied, whose blocks are pinned until it ends.
#[derive(Default)]
pub(in crate::engine) struct StoreQueue {
    waiting: VecDeque<(BlockId, BlockHash)>,
    batch: StoreBatch,
}

/// One batch: copied out of the device (its blocks pinned meanwhile), then stored in the tiers
/// by the store thread from the device's staging memory, which no other copy reuses until it
/// is done.
#[derive(Default)]
struct StoreBatch {
    /// The pinned blocks, while the copy runs.
    blocks: Vec<BlockId>,
    hashes: Vec<BlockHash>,
    copying: bool,
    /// The copy ended and the store thread has its blocks.
    storing: bool,
}

impl StoreBatch {
    fn clear(&mut self) {
        self.blocks.clear();
        self.hashes.clear();
        self.copying = false;
        self.storing = false;
    }
}

impl StoreQueue {
    /// Whether a batch is being copied or stored.
    fn in_flight(&self) -> bool {
        self.batch.copying || self.batch.storing
    }
}

impl EngineCore {
    /// Keeps the KV tiers `offload` below the device from now on.
    pub fn offload_to(&mut self, offload: KvOffload) {
        self.kv.record_cached_free();
        // The staging memory of background copies, pooled now rather than at the first copy.
        if let Err(e) = self.runtime.reserve_kv_copy_out(offload.staging_blocks()) {
            tracing::warn!("cannot reserve staging memory for KV copies out: {e}");
        }
        let copies = if self.runtime.copies_kv_out_in_background() {
            "in the background"
        } else {
            "synchronously, between steps"
        };
        tracing::info!("KV blocks go down to the tiers by copies out of the device {copies}");
        self.offload = Some(offload);
        self.publish_tier_gauges();
    }

    /// Copies every block that became free and cached since the last call, and that some
    /// tier lacks, down to the tiers. Runs between steps, before any allocation can evict them.
    /// A device that copies out in the background gets the blocks queued, to be copied batch
    /// by batch while steps go on ([`Self::advance_stores`]); any other copies them now.
    pub(super) fn store_freed_blocks(&mut self) {
        let Some(offload) = self.offload.as_mut() else {
            return;
        };
        let mut freed = std::mem::take(&mut self.freed_blocks);
        self.kv.take_cached_free(&mut freed);
        freed.retain(|&(_, hash)| offload.wants(hash));
        if self.runtime.copies_kv_out_in_background() {
            self.stores.waiting.extend(freed.drain(..));
            self.freed_blocks = freed;
            return;
        }
        if freed.is_empty() {
            self.freed_blocks = freed;
            return;
        }
        let started = Instant::now();
        let block_bytes = offload.block_bytes() as u64;
        let mut blocks: Vec<u32> = Vec::with_capacity(offload.staging_blocks());
        let mut hashes: Vec<BlockHash> = Vec::with_capacity(offload.staging_blocks());
        for chunk in freed.chunks(offload.staging_blocks()) {
            blocks.clear();
            hashes.clear();
            blocks.extend(chunk.iter().map(|&(block, _)| block));
            hashes.extend(chunk.iter().map(|&(_, hash)| hash));
            let staging = offload.staging_mut(chunk.len());
            if let Err(e) = self.runtime.read_kv_blocks(&blocks, staging) {
                // Nothing of this copy is indexed; the blocks are recomputed when needed.
                tracing::warn!("copying KV blocks out of the device failed: {e}");
                break;
            }
            offload.store_staged(&hashes);
            self.metrics.kv_tiers.moved(
                Direction::Store,
                chunk.len() as u64,
                chunk.len() as u64 * block_bytes,
            );
        }
        self.freed_blocks = freed;
        self.record("kv_store", Track::Host, started, started.elapsed());
    }

    /// The background copy out, between steps: when the batch in flight has ended (at once
    /// with `wait`), unpins its blocks and hands them to the store thread; once it has stored
    /// them (at once with `wait`), starts the next batch. The engine thread only polls and
    /// hands over: filling host memory and queueing disk writes happen on the store thread. A
    /// failed copy (a lost worker) stores nothing.
    pub(super) fn advance_stores(&mut self, wait: bool) {
        let Some(offload) = self.offload.as_mut() else {
            return;
        };
        if !self.stores.in_flight() && self.stores.waiting.is_empty() {
            return;
        }
        let started = Instant::now();
        let batch = &mut self.stores.batch;
        if batch.copying {
            match self.runtime.poll_kv_copy_out(wait) {
                Ok(None) => return,
                Ok(Some(_)) => {
                    let count = batch.blocks.len() as u64;
                    let block_bytes = offload.block_bytes() as u64;
                    self.metrics
                        .kv_tiers
                        .moved(Direction::Store, count, count * block_bytes);
                    if let Some(bytes) = self.runtime.kv_copied_out() {
                        offload.store_in_background(&batch.hashes, bytes);
                        batch.storing = true;
                    }
                }
                Err(e) => {
                    tracing::warn!("copying KV blocks out of the device failed: {e}");
                }
            }
            batch.copying = false;
            // The staging memory holds what the blocks held: the device may reuse them.
            self.kv.unpin(&batch.blocks);
            batch.blocks.clear();
            // A copy that ended is progress, as a finished load is, for the stall watchdog.
            self.health.liveness.progressed();
        }
        if batch.storing {
            if offload.storing(wait) {
                self.record("kv_store", Track::Host, started, started.elapsed());
                return;
            }
            batch.storing = false;
        }
        batch.clear();
        // The next batch: blocks still cached under their hash (a block waiting is not pinned,
        // so an allocation may have taken it) that some tier still lacks, each once. The store
        // thread is idle now, so `wants` answers from the tiers, not from a busy lock.
        while batch.blocks.len() < offload.staging_blocks() {
            let Some((block, hash)) = self.stores.waiting.pop_front() else {
                break;
            };
            if self.kv.caches(block, &hash) && offload.wants(hash) && !batch.hashes.contains(&hash)
            {
                batch.blocks.push(block);
                batch.hashes.push(hash);
            }
        }
        if !batch.blocks.is_empty() {
            self.kv.pin(&batch.blocks);
            match self.runtime.start_kv_copy_out(&batch.blocks) {
                Ok(()) => batch.copying = true,
                Err(e) => {
                    tracing::warn!("cannot start copying KV blocks out of the device: {e}");
                    self.kv.unpin(&batch.blocks);
                    batch.clear();
                }
            }
        }
        self.record("kv_store", Track::Host, started, started.elapsed());
    }

    /// Whether copies out are queued or in flight.
    pub(super) fn has_stores(&self) -> bool {
        self.stores.in_flight() || !self.stores.waiting.is_empty()
    }

    /// Waits for every queued copy out to end and its blocks to be stored, at shutdown or while
    /// no request runs.
    pub(super) fn finish_stores(&mut self) {
        while self.has_stores() {
            self.advance_stores(true);
        }
    }

    /// With nothing to step: waits a moment for the copy out in flight, then advances it.
    pub(super) fn wait_for_stores(&mut self) {
        if self.stores.batch.copying {
            std::thread::sleep(LOAD_POLL);
        }
        self.advance_stores(false);
    }

    /// Forgets the copy out in flight and the blocks waiting for one, after the device (and
    /// its KV cache) was replaced: the copy died with the old device, and the new KV manager
    /// holds no pins.
    pub(super) fn forget_stores(&mut self) {
        // The pins died with the old KV manager. A store of the old device's last copy ends
        // first (its memory stays alive while read), so the next copy has the thread.
        if let Some(offload) = self.offload.as_mut() {
            offload.storing(true);
        }
        self.stores.batch.clear();
        self.stores.waiting.clear();
    }

    /// Looks a new request's prefix up through every tier. Returns it when it can queue now;
    /// keeps it while blocks it needs load from disk.
    pub(super) fn lookup_or_load(&mut self, mut state: RequestState) -> Option<RequestState> {
        if state.prompt_scores.is_some() {
            // Its prompt rows must all be computed: it takes no cached prefix from any tier.
            return Some(state);
        }
        let prefix = self.kv.find_cached_prefix(state.tokens());
        self.metrics
            .kv_tiers
            .hit("device", u64::from(prefix.num_tokens));
        let device_blocks = prefix.blocks.len();
        state.take_prefix(prefix);
        let Some(offload) = self.offload.as_mut() else {
            return Some(state);
        };
        let hashes = self.kv.hashes_after(state.tokens(), device_blocks);
        let run = offload.find_run(&hashes, false);
        if run.is_empty() {
            return Some(state);
        }
        offload.start_load(state.id, &hashes[..run.len()], &run);
        self.loading.push((state, device_blocks as u32));
        // Runs that needed no disk are ready at once.
        self.poll_loads();
        None
    }

    /// Queues the requests whose blocks finished loading, with the blocks they got.
    pub(super) fn poll_loads(&mut self) {
        let Some(offload) = self.offload.as_mut() else {
            return;
        };
        let finished = offload.finished_loads();
        if finished.is_empty() {
            return;
        }
        let block_size = self.kv.block_size();
        for mut run in finished {
            let Some(position) = self.loading.iter().position(|(s, _)| s.id == run.request) else {
                continue;
            };
            let (mut state, first_block) = self.loading.swap_remove(position);
            let tokens = |blocks: usize| blocks as u64 * u64::from(block_size);
            self.metrics
                .kv_tiers
                .hit("memory", tokens(run.blocks_from(TierName::Memory)));
            self.metrics
                .kv_tiers
                .hit("disk", tokens(run.blocks_from(TierName::Disk)));
            self.kv.count_lower_tier_hits(tokens(run.blocks) as u32);
            run.bytes.truncate(run.blocks * offload.block_bytes());
            state.take_loaded_prefix(
                LoadedPrefix {
                    first_block,
                    blocks: run.blocks as u32,
                    bytes: run.bytes,
                    found: run.started,
                },
                block_size,
            );
            self.health.liveness.progressed();
            self.requests.queue(state);
        }
    }

    /// With only loading requests, waits a moment for a load rather than spinning.
    pub(super) fn wait_for_loads(&mut self) {
        if let Some(offload) = self.offload.as_mut() {
            offload.wait_for_load(LOAD_POLL);
        }
        self.poll_loads();
    }

    pub(super) fn has_loading(&self) -> bool {
        !self.loading.is_empty()
    }

    /// Ends loading requests whose client went away, or all of them.
    pub(super) fn abort_loading(&mut self, all: bool) {
        let mut i = 0;
        while i < self.loading.len() {
            if all || self.loading[i].0.is_abandoned() {
                let (state, _) = self.loading.swap_remove(i);
                self.health.in_flight.remove(state.id);
                self.output.finished(state, FinishReason::Abort);
            } else {
                i += 1;
            }
        }
    }

    /// After a request's first allocation: writes the blocks a lower tier supplied into the
    /// device blocks its table holds for them, and caches them under their hashes. A failed
    /// write makes the request compute those tokens instead.
    pub(super) fn install_loaded(&mut self, id: u64) {
        let Some(state) = self.requests.get_mut(id) else {
            return;
        };
        let Some(loaded) = state.loaded_prefix.take() else {
            return;
        };
        let started = Instant::now();
        let (first, count) = (loaded.first_block as usize, loaded.blocks as usize);
        let table = self.kv.block_table(id);
        let written = match table.get(first..first + count) {
            Some(blocks) => {
                let blocks = blocks.to_vec();
                self.runtime.write_kv_blocks(&blocks, &loaded.bytes)
            }
            None => Err(crate::runtime::RuntimeError::Program(format!(
                "{count} loaded blocks do not fit a table of {} after block {first}",
                table.len()
            ))),
        };
        let block_size = self.kv.block_size();
        match written {
            Ok(()) => {
                self.kv
                    .cache_full_blocks(id, state.tokens(), state.num_computed);
                self.metrics.kv_tiers.moved(
                    Direction::Load,
                    count as u64,
                    loaded.bytes.len() as u64,
                );
                self.metrics
                    .kv_tiers
                    .loaded_in(loaded.found.elapsed().as_secs_f64());
            }
            Err(e) => {
                tracing::warn!(
                    request = id,
                    "writing loaded KV blocks into the device failed; they are recomputed: {e}"
                );
                let tokens = loaded.blocks * block_size;
                state.num_computed -= tokens;
                state.num_cached_prefix -= tokens;
            }
        }
        self.record("kv_load", Track::Host, started, started.elapsed());
    }

    pub(super) fn publish_tier_gauges(&self) {
        if let Some(offload) = self.offload.as_ref() {
            self.metrics.kv_tiers.publish(offload);
        }
    }

    /// Finishes every copy out, then waits for the disk writes queued so far, at shutdown.
    pub(super) fn flush_tiers(&mut self) {
        self.store_freed_blocks();
        self.finish_stores();
        if let Some(offload) = self.offload.as_mut() {
            offload.flush();
        }
    }
}

/// Looks `state`'s prefix up again after it went stale or the request was preempted: the
/// device, then host memory (loaded at once), never the disk, which would make a request
/// already queued wait.
pub(super) fn relookup_prefix(
    kv: &mut KvCacheManager,
    offload: Option<&mut KvOffload>,
    metrics: &Metrics,
    state: &mut RequestState,
) {
    if state.prompt_scores.is_some() {
        state.take_prefix(ComputedPrefix::default());
        return;
    }
    let prefix = kv.find_cached_prefix(state.tokens());
    metrics.kv_tiers.hit("device", u64::from(prefix.num_tokens));
    let device_blocks = prefix.blocks.len();
    state.take_prefix(prefix);
    let Some(offload) = offload else {
        return;
    };
    let hashes = kv.hashes_after(state.tokens(), device_blocks);
    let run = offload.find_run(&hashes, true);
    if run.is_empty() {
        return;
    }
    let mut loaded = offload.load_from_memory(state.id, &hashes[..run.len()], &run);
    let block_size = kv.block_size();
    let tokens = loaded.blocks as u32 * block_size;
    metrics.kv_tiers.hit("memory", u64::from(tokens));
    kv.count_lower_tier_hits(tokens);
    loaded.bytes.truncate(loaded.blocks * offload.block_bytes());
    state.take_loaded_prefix(
        LoadedPrefix {
            first_block: device_blocks as u32,
            blocks: loaded.blocks as u32,
            bytes: loaded.bytes,
            found: loaded.started,
        },
        block_size,
    );
}
