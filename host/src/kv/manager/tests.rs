//! The KV cache manager's block accounting, prefix reuse and eviction, checked step by step.

use super::*;

fn manager(num_blocks: u32, block_size: u32) -> KvCacheManager {
    KvCacheManager::new(KvCacheConfig {
        num_blocks,
        block_size,
        enable_prefix_caching: true,
    })
}

/// Looks up `tokens`, allocates for all of them and caches them as if one step computed
/// the whole prompt. Returns the prefix that was hit.
fn admit(kv: &mut KvCacheManager, request: RequestId, tokens: &[u32]) -> ComputedPrefix {
    let prefix = kv.find_cached_prefix(tokens);
    kv.allocate(request, tokens.len() as u32, Some(&prefix))
        .expect("enough blocks");
    kv.cache_full_blocks(request, tokens, tokens.len() as u32);
    check_invariants(kv);
    prefix
}

/// Panics unless the manager and its pool are consistent (see the module invariants).
fn check_invariants(kv: &KvCacheManager) {
    let mut ref_counts = vec![0; kv.num_blocks() as usize];
    for (request, entry) in &kv.request_to_blocks {
        assert!(
            entry.block_hashes.len() <= entry.blocks.len(),
            "request {request}"
        );
        let mut blocks = entry.blocks.clone();
        blocks.sort_unstable();
        blocks.dedup();
        assert_eq!(
            blocks.len(),
            entry.blocks.len(),
            "request {request} holds a block twice"
        );
        for &block in &entry.blocks {
            ref_counts[block as usize] += 1;
        }
    }
    kv.pool.check_invariants(&ref_counts);
}

fn range(first: u32, last: u32) -> Vec<u32> {
    (first..=last).collect()
}

#[test]
fn allocation_grows_across_block_boundaries() {
    let mut kv = manager(8, 4);
    // (num_tokens, blocks needed before, blocks held after)
    let steps = [
        (0, 0, 0),
        (1, 1, 1),
        (4, 0, 1),
        (5, 1, 2),
        (8, 0, 2),
        (9, 1, 3),
        (3, 0, 3),
        (17, 2, 5),
    ];
    let mut previous = Vec::new();
    for (num_tokens, num_needed, num_held) in steps {
        assert_eq!(
            kv.num_blocks_needed(7, num_tokens),
            num_needed,
            "{num_tokens} tokens"
        );
        let table = kv
            .allocate(7, num_tokens, None)
            .expect("enough blocks")
            .to_vec();
        assert_eq!(table.len(), num_held, "{num_tokens} tokens");
        assert_eq!(
            table[..previous.len()],
            previous[..],
            "earlier blocks stay put"
        );
        assert_eq!(kv.num_free_blocks(), 8 - num_held as u32);
        check_invariants(&kv);
        previous = table;
    }
    assert_eq!(previous, [0, 1, 2, 3, 4]);
    assert_eq!(kv.usage(), 5.0 / 8.0);
}

#[test]
fn out_of_blocks_returns_none_and_changes_nothing() {
    let mut kv = manager(4, 4);
    kv.allocate(1, 12, None).expect("3 of 4 blocks");
    let cases = [(2, 8), (2, 17), (1, 17), (1, 21)];
    for (request, num_tokens) in cases {
        let table_before = kv.block_table(request).to_vec();
        assert!(
            kv.allocate(request, num_tokens, None).is_none(),
            "request {request}, {num_tokens} tokens"
        );
        assert_eq!(kv.block_table(request), table_before);
        assert_eq!(kv.num_free_blocks(), 1);
        assert_eq!(kv.num_requests(), 1);
        check_invariants(&kv);
    }
    assert_eq!(
        kv.allocate(1, 16, None).map(<[_]>::len),
        Some(4),
        "the last block still fits"
    );
}

#[test]
fn evictable_prefix_blocks_count_against_free_blocks() {
    let mut kv = manager(4, 2);
    admit(&mut kv, 1, &range(1, 8));
    kv.free(1);
    let prefix = kv.find_cached_prefix(&range(1, 9));
    assert_eq!((prefix.blocks.len(), kv.num_free_blocks()), (4, 4));
    // Four cached blocks plus one new block for token 9: one more than the pool has.
    assert!(kv.allocate(2, 9, Some(&prefix)).is_none());
    assert_eq!(kv.num_requests(), 0);
    assert_eq!(
        kv.pool.evictable_in_order().len(),
        4,
        "prefix blocks stay evictable"
    );
    check_invariants(&kv);
}

#[test]
fn free_returns_blocks() {
    let mut kv = manager(6, 4);
    kv.allocate(1, 10, None).expect("enough blocks");
    kv.allocate(2, 5, None).expect("enough blocks");
    assert_eq!((kv.num_free_blocks(), kv.num_requests()), (1, 2));
    let cases = [(1, 4, 1), (1, 4, 1), (2, 6, 0), (3, 6, 0)];
    for (request, num_free, num_requests) in cases {
        kv.free(request);
        assert!(kv.block_table(request).is_empty());
        assert_eq!(
            (kv.num_free_blocks(), kv.num_requests()),
            (num_free, num_requests),
            "free {request}"
        );
        check_invariants(&kv);
    }
    assert_eq!(kv.usage(), 0.0);
}

#[test]
fn prefix_hits_need_the_same_whole_prefix_in_full_blocks() {
    struct Case {
        name: &'static str,
        cached: Vec<Vec<u32>>,
        query: Vec<u32>,
        num_hit_tokens: u32,
        /// Which cached prompt the hit blocks belong to.
        source: usize,
    }
    let cases = [
        Case {
            name: "two shared full blocks",
            cached: vec![range(1, 10)],
            query: [range(1, 8), vec![50, 51]].concat(),
            num_hit_tokens: 8,
            source: 0,
        },
        Case {
            name: "a partial block is never cached",
            cached: vec![range(1, 6)],
            query: range(1, 9),
            num_hit_tokens: 4,
            source: 0,
        },
        Case {
            name: "same block tokens after a different prefix",
            cached: vec![range(1, 9), vec![9, 9, 9, 9, 0]],
            query: vec![9, 9, 9, 9, 5, 6, 7, 8, 0],
            num_hit_tokens: 4,
            source: 1,
        },
        Case {
            name: "first token differs",
            cached: vec![range(1, 9)],
            query: [vec![0], range(2, 9)].concat(),
            num_hit_tokens: 0,
            source: 0,
        },
        Case {
            name: "empty cache",
            cached: vec![],
            query: range(1, 9),
            num_hit_tokens: 0,
            source: 0,
        },
    ];
    for case in &cases {
        for free_cached in [false, true] {
            let name = format!("{} (cached requests freed: {free_cached})", case.name);
            let mut kv = manager(16, 4);
            let mut tables = Vec::new();
            for (request, prompt) in case.cached.iter().enumerate() {
                admit(&mut kv, request as RequestId, prompt);
                tables.push(kv.block_table(request as RequestId).to_vec());
            }
            if free_cached {
                (0..case.cached.len()).for_each(|request| kv.free(request as RequestId));
            }
            let prefix = kv.find_cached_prefix(&case.query);
            assert_eq!(prefix.num_tokens, case.num_hit_tokens, "{name}");
            assert_eq!(
                prefix.blocks.len() as u32,
                case.num_hit_tokens / 4,
                "{name}"
            );
            if case.num_hit_tokens > 0 {
                assert_eq!(
                    prefix.blocks,
                    tables[case.source][..prefix.blocks.len()],
                    "{name}"
                );
            }
            let table = kv
                .allocate(99, case.query.len() as u32, Some(&prefix))
                .expect("enough blocks");
            assert_eq!(table[..prefix.blocks.len()], prefix.blocks[..], "{name}");
            check_invariants(&kv);
        }
    }
}

#[test]
fn at_least_one_token_is_left_to_compute() {
    let mut kv = manager(8, 4);
    admit(&mut kv, 1, &range(1, 12));
    // (query, tokens hit)
    let cases = [
        (range(1, 12), 8),
        (range(1, 11), 8),
        (range(1, 9), 8),
        (range(1, 8), 4),
        (range(1, 5), 4),
        (range(1, 4), 0),
        (vec![1], 0),
        (vec![], 0),
        ([range(1, 12), vec![99]].concat(), 12),
    ];
    for (query, num_hit_tokens) in cases {
        let prefix = kv.find_cached_prefix(&query);
        assert_eq!(prefix.num_tokens, num_hit_tokens, "{} tokens", query.len());
        assert!(query.is_empty() || prefix.num_tokens < query.len() as u32);
    }
}

/// Four blocks of size 2: A's blocks a0 a1 and B's b0 b1, all cached, freed A then B.
fn two_freed_requests(num_blocks: u32) -> (KvCacheManager, [BlockId; 4]) {
    let mut kv = manager(num_blocks, 2);
    admit(&mut kv, 1, &[1, 2, 3, 4]);
    admit(&mut kv, 2, &[5, 6, 7, 8]);
    let (a, b) = (kv.block_table(1).to_vec(), kv.block_table(2).to_vec());
    kv.free(1);
    kv.free(2);
    let blocks = [a[0], a[1], b[0], b[1]];
    // Each request's tail is freed first, so it is evicted first.
    assert_eq!(kv.pool.evictable_in_order(), [a[1], a[0], b[1], b[0]]);
    check_invariants(&kv);
    (kv, blocks)
}

#[test]
fn least_recently_freed_cached_blocks_are_evicted_first() {
    // (blocks a new request takes, A's prompt tokens still hit, B's prompt tokens still hit)
    let cases = [(1, 2, 4), (2, 0, 4), (3, 0, 2), (4, 0, 0)];
    for (num_taken, num_hit_a, num_hit_b) in cases {
        let (mut kv, [a0, a1, b0, b1]) = two_freed_requests(4);
        let taken = kv
            .allocate(3, 2 * num_taken, None)
            .expect("enough blocks")
            .to_vec();
        assert_eq!(
            taken,
            [a1, a0, b1, b0][..num_taken as usize],
            "take {num_taken}"
        );
        for block in &taken {
            assert_eq!(
                kv.pool.block_hash(*block),
                None,
                "evicted block {block} keeps no hash"
            );
        }
        assert_eq!(kv.pool.num_cached_blocks(), 4 - num_taken as usize);
        assert_eq!(
            kv.find_cached_prefix(&[1, 2, 3, 4, 0]).num_tokens,
            num_hit_a,
            "take {num_taken}"
        );
        assert_eq!(
            kv.find_cached_prefix(&[5, 6, 7, 8, 0]).num_tokens,
            num_hit_b,
            "take {num_taken}"
        );
        check_invariants(&kv);
    }
}

#[test]
fn a_hit_takes_blocks_out_of_the_lru_and_freeing_puts_them_back_last() {
    let (mut kv, [a0, a1, b0, b1]) = two_freed_requests(5);
    admit(&mut kv, 3, &[1, 2, 3, 4, 9]);
    assert_eq!(kv.block_table(3)[..2], [a0, a1]);
    assert_eq!(
        kv.pool.evictable_in_order(),
        [b1, b0],
        "the uncached free block was used, nothing evicted"
    );
    kv.free(3);
    assert_eq!(kv.pool.evictable_in_order(), [b1, b0, a1, a0]);
    check_invariants(&kv);
}

#[test]
fn shared_prefix_blocks_count_one_reference_per_request() {
    let mut kv = manager(8, 4);
    admit(&mut kv, 1, &range(1, 9));
    let prefix = admit(&mut kv, 2, &[range(1, 8), vec![20, 21]].concat());
    let (a, b) = (kv.block_table(1).to_vec(), kv.block_table(2).to_vec());
    assert_eq!(prefix.blocks, a[..2]);
    assert_eq!(b[..2], a[..2]);
    assert_ne!(b[2], a[2]);
    assert_eq!(
        [a[0], a[1], a[2], b[2]].map(|block| kv.pool.ref_count(block)),
        [2, 2, 1, 1]
    );
    assert_eq!(kv.num_free_blocks(), 4);

    kv.free(1);
    check_invariants(&kv);
    assert_eq!(
        [a[0], a[1], a[2], b[2]].map(|block| kv.pool.ref_count(block)),
        [1, 1, 0, 1]
    );
    assert_eq!(kv.block_table(2), b);
    assert_eq!(kv.num_free_blocks(), 5);
    assert!(
        kv.pool.evictable_in_order().is_empty(),
        "shared blocks are still held"
    );
    assert_eq!(kv.find_cached_prefix(&range(1, 9)).num_tokens, 8);

    kv.free(2);
    check_invariants(&kv);
    assert_eq!(kv.num_free_blocks(), 8);
    assert_eq!(kv.pool.evictable_in_order(), [a[1], a[0]]);
}

#[test]
fn a_block_computed_twice_is_cached_once() {
    let mut kv = manager(8, 4);
    let prompt = range(1, 9);
    for request in [1, 2] {
        let prefix = kv.find_cached_prefix(&prompt);
        assert_eq!(prefix.num_tokens, 0, "neither has cached anything yet");
        kv.allocate(request, 9, Some(&prefix))
            .expect("enough blocks");
    }
    for _ in 0..2 {
        kv.cache_full_blocks(1, &prompt, 9);
        kv.cache_full_blocks(2, &prompt, 9);
        assert_eq!(kv.pool.num_cached_blocks(), 2);
        check_invariants(&kv);
    }
    let (a, b) = (kv.block_table(1).to_vec(), kv.block_table(2).to_vec());
    assert!(b.iter().all(|&block| kv.pool.block_hash(block).is_none()));
    assert_eq!(kv.find_cached_prefix(&prompt).blocks, a[..2]);
    kv.free(2);
    assert!(
        kv.pool.evictable_in_order().is_empty(),
        "B's duplicates went to the free list"
    );
    check_invariants(&kv);
}

#[test]
fn a_stale_prefix_is_refused_without_changes() {
    let mut kv = manager(3, 2);
    admit(&mut kv, 1, &[1, 2, 3, 4]);
    kv.free(1);
    let prefix = kv.find_cached_prefix(&[1, 2, 3, 4, 5]);
    assert_eq!(prefix.num_tokens, 4);
    assert!(kv.is_prefix_cached(&prefix));

    // Another request takes the uncached block and evicts A's tail block.
    kv.allocate(2, 4, None).expect("enough blocks");
    kv.cache_full_blocks(2, &[7, 7, 7, 7], 4);
    assert!(!kv.is_prefix_cached(&prefix));
    let num_free = kv.num_free_blocks();
    assert!(kv.allocate(3, 5, Some(&prefix)).is_none());
    assert_eq!((kv.num_free_blocks(), kv.num_requests()), (num_free, 1));
    check_invariants(&kv);

    kv.free(2);
    let prefix = kv.find_cached_prefix(&[1, 2, 3, 4, 5]);
    assert_eq!(prefix.num_tokens, 2, "only A's first block is left");
    assert_eq!(kv.allocate(3, 5, Some(&prefix)).map(<[_]>::len), Some(3));
    check_invariants(&kv);
}

#[test]
fn stats_count_tokens_looked_up_and_found() {
    let mut kv = manager(8, 4);
    admit(&mut kv, 1, &range(1, 9));
    let base = kv.prefix_cache_stats();
    assert_eq!(
        base,
        PrefixCacheStats {
            num_queries: 9,
            num_hits: 0
        }
    );
    // (query, num_queries, num_hits) cumulative since `base`
    let cases = [
        (range(1, 9), 9, 8),
        (range(1, 5), 14, 12),
        (vec![7; 6], 20, 12),
        (vec![], 20, 12),
    ];
    for (query, num_queries, num_hits) in cases {
        kv.find_cached_prefix(&query);
        let stats = kv.prefix_cache_stats();
        assert_eq!(
            (
                stats.num_queries - base.num_queries,
                stats.num_hits - base.num_hits
            ),
            (num_queries, num_hits),
            "after {query:?}"
        );
    }
}

#[test]
fn disabled_prefix_caching_still_allocates_and_caches_nothing() {
    let mut kv = KvCacheManager::new(KvCacheConfig {
        num_blocks: 4,
        block_size: 2,
        enable_prefix_caching: false,
    });
    let prompt = [1, 2, 3, 4, 5];
    for request in [1, 2] {
        let prefix = kv.find_cached_prefix(&prompt);
        assert_eq!(prefix, ComputedPrefix::default());
        kv.allocate(request, 5, Some(&prefix))
            .expect("enough blocks");
        kv.cache_full_blocks(request, &prompt, 5);
        assert_eq!(kv.pool.num_cached_blocks(), 0);
        kv.free(request);
        assert_eq!(kv.num_free_blocks(), 4);
        assert!(kv.pool.evictable_in_order().is_empty());
        check_invariants(&kv);
    }
    assert_eq!(kv.prefix_cache_stats(), PrefixCacheStats::default());
}

/// splitmix64: a fixed seed gives the same sequence everywhere.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    }
}

struct SimRequest {
    tokens: Vec<u32>,
    num_computed: u32,
    /// Waiting with the prefix found when it was (re)queued; may go stale meanwhile.
    pending: Option<ComputedPrefix>,
}

/// Drives the manager the way the engine does, with a reference model of what each
/// block holds, and checks every invariant after each operation.
struct Sim {
    kv: KvCacheManager,
    rng: Rng,
    requests: HashMap<RequestId, SimRequest>,
    next_id: RequestId,
    /// Per block: the whole token prefix through its end, as last written.
    block_contents: Vec<Vec<u32>>,
    num_out_of_blocks: u32,
    num_stale: u32,
}

const BLOCK_SIZE: u32 = 4;

impl Sim {
    fn new(seed: u64) -> Self {
        Sim {
            kv: manager(24, BLOCK_SIZE),
            rng: Rng(seed),
            requests: HashMap::new(),
            next_id: 0,
            block_contents: vec![Vec::new(); 24],
            num_out_of_blocks: 0,
            num_stale: 0,
        }
    }

    fn random_request(&mut self) {
        let base = [
            range(1, 12),
            range(100, 111),
            [range(1, 4), range(200, 207)].concat(),
        ];
        let mut tokens = base[self.rng.below(3) as usize].clone();
        tokens.truncate(self.rng.below(13) as usize);
        // A tiny alphabet so tails collide with each other now and then.
        tokens.extend((0..1 + self.rng.below(9)).map(|_| self.rng.below(3) as u32));
        let pending = Some(self.kv.find_cached_prefix(&tokens));
        self.requests.insert(
            self.next_id,
            SimRequest {
                tokens,
                num_computed: 0,
                pending,
            },
        );
        self.next_id += 1;
    }

    /// Admits a waiting request or runs a step of a running one.
    fn step(&mut self, id: RequestId) {
        let request = self.requests.get_mut(&id).expect("live request");
        let start = request
            .pending
            .as_ref()
            .map_or(request.num_computed, |prefix| prefix.num_tokens);
        let num_left = request.tokens.len() as u32 - start;
        let num_tokens = start + 1 + self.rng.below(u64::from(num_left)) as u32;
        let free_before = (self.kv.num_free_blocks(), self.kv.pool.evictable_in_order());
        let table_before = self.kv.block_table(id).to_vec();
        if self
            .kv
            .allocate(id, num_tokens, request.pending.as_ref())
            .is_none()
        {
            assert_eq!(
                (self.kv.num_free_blocks(), self.kv.pool.evictable_in_order()),
                free_before
            );
            assert_eq!(self.kv.block_table(id), table_before);
            match &request.pending {
                Some(prefix) if !self.kv.is_prefix_cached(prefix) => self.num_stale += 1,
                _ => self.num_out_of_blocks += 1,
            }
            // Preempt a running request, re-look-up a waiting one.
            self.kv.free(id);
            request.num_computed = 0;
            request.pending = Some(self.kv.find_cached_prefix(&request.tokens));
            return;
        }
        request.pending = None;
        request.num_computed = num_tokens;
        let table = self.kv.block_table(id);
        for (index, &block) in table
            .iter()
            .enumerate()
            .take((num_tokens / BLOCK_SIZE) as usize)
        {
            self.block_contents[block as usize] =
                request.tokens[..(index + 1) * BLOCK_SIZE as usize].to_vec();
        }
        if num_tokens as usize == request.tokens.len() {
            request.tokens.push(self.rng.below(3) as u32);
        }
        self.kv.cache_full_blocks(id, &request.tokens, num_tokens);
    }

    fn check(&self) {
        check_invariants(&self.kv);
        for (block, contents) in self.block_contents.iter().enumerate() {
            if let Some(hash) = self.kv.pool.block_hash(block as BlockId) {
                let expected = hash::block_hashes(contents, BLOCK_SIZE as usize).last();
                assert_eq!(
                    Some(hash),
                    expected,
                    "block {block} is cached under a hash of other tokens"
                );
            }
        }
        let num_running = self
            .requests
            .values()
            .filter(|request| request.pending.is_none())
            .count();
        assert_eq!(self.kv.num_requests(), num_running);
        for (id, request) in &self.requests {
            let num_held = self.kv.block_table(*id).len() as u32;
            assert!(
                num_held * BLOCK_SIZE >= request.num_computed,
                "request {id} outgrew its blocks"
            );
        }
    }
}

#[test]
fn random_operations_keep_the_invariants() {
    for seed in 0..8 {
        let mut sim = Sim::new(seed);
        for _ in 0..2_000 {
            let mut ids: Vec<RequestId> = sim.requests.keys().copied().collect();
            ids.sort_unstable();
            match sim.rng.below(10) {
                0..=1 if ids.len() < 10 => sim.random_request(),
                0..=7 if !ids.is_empty() => {
                    let id = ids[sim.rng.below(ids.len() as u64) as usize];
                    sim.step(id)
                }
                _ if !ids.is_empty() => {
                    let id = ids[sim.rng.below(ids.len() as u64) as usize];
                    sim.kv.free(id);
                    sim.requests.remove(&id);
                }
                _ => sim.random_request(),
            }
            sim.check();
        }
        let stats = sim.kv.prefix_cache_stats();
        assert!(stats.num_hits > 0, "seed {seed}: no prefix hits exercised");
        assert!(
            sim.num_out_of_blocks > 0,
            "seed {seed}: never ran out of blocks"
        );
        assert!(sim.num_stale > 0, "seed {seed}: no stale prefix exercised");
    }
}

#[test]
fn blocks_that_become_cached_free_are_reported_once_while_still_cached() {
    let mut kv = manager(4, 2);
    let mut freed = Vec::new();
    // Not recording: nothing is reported.
    admit(&mut kv, 1, &range(1, 5));
    kv.free(1);
    kv.take_cached_free(&mut freed);
    assert!(freed.is_empty());

    kv.record_cached_free();
    admit(&mut kv, 2, &range(1, 5));
    admit(&mut kv, 3, &range(1, 5));
    kv.free(2);
    kv.take_cached_free(&mut freed);
    assert!(freed.is_empty(), "request 3 still holds the blocks");
    kv.free(3);
    kv.take_cached_free(&mut freed);
    let hashes: Vec<BlockHash> = hash::block_hashes(&range(1, 4), 2).collect();
    let table: Vec<(BlockId, BlockHash)> = freed.clone();
    assert_eq!(table.len(), 2, "both full blocks, tail first: {table:?}");
    assert_eq!(table[0].1, hashes[1]);
    assert_eq!(table[1].1, hashes[0]);
    kv.take_cached_free(&mut freed);
    assert!(freed.is_empty(), "reported once");

    // Freed, then evicted by an allocation before anyone took them: not reported.
    admit(&mut kv, 4, &range(1, 5));
    kv.free(4);
    kv.allocate(5, 8, None).expect("the whole pool");
    kv.take_cached_free(&mut freed);
    assert!(
        freed.is_empty(),
        "evicted blocks hold other keys and values now"
    );
    check_invariants(&kv);
}

#[test]
fn hashes_after_a_device_prefix_leave_the_last_token_to_compute() {
    let kv = manager(8, 2);
    let all: Vec<BlockHash> = hash::block_hashes(&range(1, 6), 2).collect();
    assert_eq!(
        kv.hashes_after(&range(1, 6), 1),
        all[1..2],
        "tokens 5-6 hold the last token"
    );
    assert_eq!(kv.hashes_after(&range(1, 7), 0), all);
}
