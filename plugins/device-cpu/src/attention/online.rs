//! The online softmax: query rows meet key/value tiles one at a time, each row keeping a running maximum, sum and unnormalized output ([`state_len`] f32s), and states over separate ranges of the history merge in range order.
//!
//! A row's state after a tile depends only on its query, its state before and the tile's
//! keys and values up to the row's own position, never on the other rows of its block. So a
//! row computes the same bits whether it is one of a prefill block's rows or a lone decode,
//! and whichever range of the history a thread took.

use std::ops::Range;

use super::Head;
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use crate::isa::Isa;
use crate::kv_cache::{CacheElement, KvOrder};
use crate::vector::{axpy, dot};

/// Key positions per tile: the running maximum and sum are updated once per tile, so a long
/// tile spreads their cost; a short one keeps the widened keys and values in L1.
pub const TILE: usize = 64;

/// The f32s of one row's state: the unnormalized output (`head_dim`), then the running
/// maximum of the scores, then the running sum of their exponentials.
pub fn state_len(head_dim: usize) -> usize {
    head_dim + 2
}

/// The f32s of a tile's keys and values as a kernel lays them out (widened, transposed or
/// paired), at most.
pub fn tile_buffer_len(head_dim: usize) -> usize {
    2 * TILE * head_dim
}

/// How the rows of a tile are computed; chosen once per launch, so every row of a step
/// computes the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileKernel {
    /// Any head size: `dot` and `axpy` at the level's width, scalar softmax.
    Portable(Isa),
    /// AVX-512, heads of `16 * C`; with `bf16_scores` (a bf16 cache at `avx512_bf16` with
    /// `bf16_products=bf16`) the scores are `vdpbf16ps` products of the query rounded to bf16
    /// and the keys as stored, and the outputs `vdpbf16ps` products of the weights rounded to
    /// bf16 and the values as stored.
    /// `order`: how the cache keeps a head's rows (runs in pair order only with bf16 scores).
    #[cfg(target_arch = "x86_64")]
    Avx512 {
        vectors: usize,
        bf16_scores: bool,
        order: KvOrder,
    },
    /// AVX2, heads of `8 * C`.
    #[cfg(target_arch = "x86_64")]
    Avx2 { vectors: usize },
}

impl TileKernel {
    /// The kernel for heads of `head_dim` at `isa`: a vector kernel for 64 and 128.
    /// `bf16_keys`: the keys are bf16 and bf16 products are asked for.
    /// `order`: how the cache keeps a head's rows ([`crate::kv_cache::arranged`]).
    pub fn new(isa: Isa, head_dim: usize, bf16_keys: bool, order: KvOrder) -> TileKernel {
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (head_dim, bf16_keys, order);
        #[cfg(target_arch = "x86_64")]
        match (isa.vectors(), head_dim) {
            (crate::isa::Vectors::Avx512, 64 | 128) => {
                return TileKernel::Avx512 {
                    vectors: head_dim / 16,
                    bf16_scores: bf16_keys && isa.has(crate::isa::IsaLevel::Avx512Bf16),
                    order,
                };
            }
            (crate::isa::Vectors::Avx2, 64 | 128) => {
                return TileKernel::Avx2 {
                    vectors: head_dim / 8,
                };
            }
            _ => {}
        }
        TileKernel::Portable(isa)
    }
}

/// Consecutive query tokens of one sequence and the query heads of one KV head.
pub struct QueryBlock<'a> {
    /// The first token's heads (`heads * head_dim` f32s); token `t`'s start `t * stride`
    /// further on.
    pub queries: &'a [f32],
    pub stride: usize,
    pub tokens: usize,
    pub heads: usize,
    /// The first token attends to positions `0..first_end`, each next one to one more.
    pub first_end: usize,
    /// Positions a token attends to at most, its own included: a sliding window, or
    /// `usize::MAX` for its whole history.
    pub window: usize,
}

impl QueryBlock<'_> {
    /// Where token `t` stops attending.
    pub fn end(&self, token: usize) -> usize {
        self.first_end + token
    }

    /// Where token `t` starts attending: 0, or where its window begins.
    pub fn start(&self, token: usize) -> usize {
        self.end(token).saturating_sub(self.window)
    }

    /// Query head `head` of token `token`.
    pub fn query(&self, token: usize, head: usize, head_dim: usize) -> &[f32] {
        &self.queries[token * self.stride + head * head_dim..][..head_dim]
    }
}

/// The keys and values of one tile: positions `start..start + offsets.len()`, at these
/// element offsets of the caches.
pub struct KvTile<'a, E> {
    pub keys: &'a [E],
    pub values: &'a [E],
    pub offsets: &'a [usize],
    /// The next tile's offsets, whose rows are fetched while this one computes (see
    /// [`KvTile::fetch_ahead`]): a lone token's rows are in memory, and at depth even a
    /// prefill block's come from the last-level cache; empty for a range's last tile.
    // Only the x86-64 kernels fetch ahead.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub ahead: &'a [usize],
    pub start: usize,
    /// Where the range the tile belongs to starts.
    pub range_start: usize,
}

/// What a tile is to one token: the positions it attends to are `skip..valid` of the tile's,
/// and `first` when no earlier tile of the range held any of them (the token's state holds
/// nothing of this range yet).
#[derive(Clone, Copy)]
pub struct RowSpan {
    pub skip: usize,
    pub valid: usize,
    pub first: bool,
}

impl RowSpan {
    pub fn is_empty(&self) -> bool {
        self.skip >= self.valid
    }
}

impl<E> KvTile<'_, E> {
    /// The tile as token `token` of `block` sees it. A token's first tile of a range is the
    /// one holding the later of the range's start and its window's start.
    pub fn span(&self, block: &QueryBlock<'_>, token: usize) -> RowSpan {
        let start = block.start(token);
        let from = start.max(self.range_start);
        RowSpan {
            skip: start.saturating_sub(self.start),
            valid: self.valid(block.end(token)),
            first: (self.start..self.start + TILE).contains(&from),
        }
    }

    /// Asks for part `part` of `parts` of the next tile's key and value rows (those in
    /// [`KvTile::ahead`]) to be brought into cache. The vector kernels call it at `parts` even
    /// points of their loops, so the fetches overlap the arithmetic: fetched all at once, a
    /// tile's hundreds of misses would fill the core's miss buffers and hold up the
    /// arithmetic behind them until most had returned.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    pub fn fetch_ahead(&self, part: usize, parts: usize, head_dim: usize) {
        let len = self.ahead.len();
        if part >= parts {
            return;
        }
        for &offset in &self.ahead[part * len / parts..(part + 1) * len / parts] {
            super::prefetch_row(self.keys, offset, head_dim);
            super::prefetch_row(self.values, offset, head_dim);
        }
    }

    /// How many of the tile's positions a token ending at `end` attends to.
    pub fn valid(&self, end: usize) -> usize {
        end.min(self.start + self.offsets.len())
            .saturating_sub(self.start)
    }
}

/// The states of `block`'s rows (`tokens * heads` of [`state_len`], token-major) over the
/// positions of `range` they attend to. Tiles start at `range.start` and every
/// [`TILE`] positions after, whatever the block, so a row's tiles are the same in every
/// block it may be part of; the tiles before the first token's window are skipped. Every
/// token of the block must attend to some position of the range.
pub fn attend_range<E: CacheElement>(
    kernel: TileKernel,
    block: &QueryBlock<'_>,
    head: &Head<'_, E>,
    (range, scale): (Range<usize>, f32),
    states: &mut [f32],
    buffer: &mut [f32],
) {
    let end = range.end.min(block.end(block.tokens - 1));
    let mut offsets = [0usize; TILE];
    let mut next = [0usize; TILE];
    let tile_offsets = |start: usize, offsets: &mut [usize; TILE]| {
        let len = TILE.min(end.saturating_sub(start));
        if len > 0 {
            head.offsets(start, &mut offsets[..len]);
        }
        len
    };
    // Later tokens' windows start later: none of them reaches a tile the first one does not.
    let first_tile = range.start + block.start(0).saturating_sub(range.start) / TILE * TILE;
    let mut len = tile_offsets(first_tile, &mut offsets);
    for start in (first_tile..end).step_by(TILE) {
        let next_len = tile_offsets(start + TILE, &mut next);
        let tile = KvTile {
            keys: head.cache.keys,
            values: head.cache.values,
            offsets: &offsets[..len],
            ahead: &next[..next_len],
            start,
            range_start: range.start,
        };
        attend_tile(kernel, block, &tile, scale, states, buffer);
        (offsets, len) = (next, next_len);
    }
}

/// One tile into the states of `block`'s rows (see [`KvTile::span`]).
fn attend_tile<E: CacheElement>(
    kernel: TileKernel,
    block: &QueryBlock<'_>,
    tile: &KvTile<'_, E>,
    scale: f32,
    states: &mut [f32],
    buffer: &mut [f32],
) {
    match kernel {
        TileKernel::Portable(isa) => portable_tile(isa, block, tile, scale, states, buffer),
        #[cfg(target_arch = "x86_64")]
        TileKernel::Avx512 {
            vectors,
            bf16_scores,
            order,
        } => {
            let bf16_keys = if bf16_scores {
                E::bf16_bits(tile.keys)
            } else {
                None
            };
            macro_rules! tile {
                ($c:literal) => {
                    // SAFETY: `TileKernel::new` chose this kernel from a level with AVX-512,
                    // and asked for bf16 scores only at a level with AVX-512 BF16.
                    unsafe {
                        avx512::attend_tile::<E, $c>(
                            (block, tile, bf16_keys),
                            (scale, order),
                            states,
                            buffer,
                        )
                    }
                };
            }
            if vectors == 4 { tile!(4) } else { tile!(8) }
        }
        #[cfg(target_arch = "x86_64")]
        TileKernel::Avx2 { vectors } => {
            macro_rules! tile {
                ($c:literal) => {
                    // SAFETY: `TileKernel::new` chose this kernel from a level with AVX2.
                    unsafe { avx2::attend_tile::<E, $c>(block, tile, scale, states, buffer) }
                };
            }
            if vectors == 8 { tile!(8) } else { tile!(16) }
        }
    }
}

/// [`attend_tile`] for any head size: scores by `dot`, outputs by `axpy`.
fn portable_tile<E: CacheElement>(
    isa: Isa,
    block: &QueryBlock<'_>,
    tile: &KvTile<'_, E>,
    scale: f32,
    states: &mut [f32],
    buffer: &mut [f32],
) {
    let head_dim = (buffer.len() / 2) / TILE;
    let (keys, values) = buffer.split_at_mut(TILE * head_dim);
    for ((key, value), &offset) in keys
        .chunks_exact_mut(head_dim)
        .zip(values.chunks_exact_mut(head_dim))
        .zip(tile.offsets)
    {
        let widen = |row: &mut [f32], cache: &[E]| {
            for (x, &e) in row.iter_mut().zip(&cache[offset..offset + head_dim]) {
                *x = CacheElement::to_f32(e);
            }
        };
        widen(key, tile.keys);
        widen(value, tile.values);
    }
    let stride = state_len(head_dim);
    let mut states = states.chunks_exact_mut(stride);
    for token in 0..block.tokens {
        let span = tile.span(block, token);
        let RowSpan { skip, valid, first } = span;
        for head in 0..block.heads {
            let Some(state) = states.next() else { return };
            if span.is_empty() {
                continue;
            }
            let query = block.query(token, head, head_dim);
            let mut weights = [0.0f32; TILE];
            let keys = keys.chunks_exact(head_dim).skip(skip);
            for (weight, key) in weights[skip..valid].iter_mut().zip(keys) {
                *weight = dot(isa, query, key) * scale;
            }
            let tile_max = weights[skip..valid]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            let statistics = TileStatistics::new(state, tile_max, first);
            let mut tile_sum = 0.0f32;
            for weight in &mut weights[skip..valid] {
                *weight = (*weight - statistics.max).exp();
                tile_sum += *weight;
            }
            statistics.store(state, tile_sum);
            let out = &mut state[..head_dim];
            if first {
                out.fill(0.0);
            } else {
                out.iter_mut().for_each(|x| *x *= statistics.rescale);
            }
            let values = values.chunks_exact(head_dim).skip(skip);
            for (&weight, value) in weights[skip..valid].iter().zip(values) {
                axpy(isa, out, weight, value);
            }
        }
    }
}

/// A row's running maximum and sum taking in one tile.
#[derive(Clone, Copy)]
pub struct TileStatistics {
    /// The running maximum with the tile.
    pub max: f32,
    /// What the output and sum so far are multiplied by: `exp(old - new)`, or zero for the
    /// first tile (there is nothing so far).
    pub rescale: f32,
    old_sum: f32,
    first: bool,
}

impl TileStatistics {
    /// The statistics of the row whose state is `state` after a tile whose largest score is
    /// `tile_max`.
    pub fn new(state: &[f32], tile_max: f32, first: bool) -> TileStatistics {
        let head_dim = state.len() - 2;
        let (old_max, old_sum) = (state[head_dim], state[head_dim + 1]);
        if first {
            return TileStatistics {
                max: tile_max,
                rescale: 0.0,
                old_sum: 0.0,
                first,
            };
        }
        let max = old_max.max(tile_max);
        TileStatistics {
            max,
            rescale: (old_max - max).exp(),
            old_sum,
            first,
        }
    }

    /// Stores the new maximum, and the sum so far rescaled plus the tile's exponentials.
    pub fn store(self, state: &mut [f32], tile_sum: f32) {
        let head_dim = state.len() - 2;
        state[head_dim] = self.max;
        state[head_dim + 1] = if self.first {
            tile_sum
        } else {
            self.old_sum * self.rescale + tile_sum
        };
    }
}

/// Folds the state `part` of a later range into `acc`, as if `acc`'s row had gone on through
/// `part`'s tiles: both rescaled to the larger maximum and added.
pub fn merge(acc: &mut [f32], part: &[f32]) {
    let head_dim = acc.len() - 2;
    let (max_a, max_b) = (acc[head_dim], part[head_dim]);
    let max = max_a.max(max_b);
    let (a, b) = ((max_a - max).exp(), (max_b - max).exp());
    for (x, &y) in acc[..head_dim].iter_mut().zip(&part[..head_dim]) {
        *x = *x * a + y * b;
    }
    acc[head_dim] = max;
    acc[head_dim + 1] = acc[head_dim + 1] * a + part[head_dim + 1] * b;
}

/// The attention output of a finished state: its output divided by its sum.
pub fn finish(state: &[f32], out: &mut [f32]) {
    let head_dim = out.len();
    let sum = state[head_dim + 1];
    for (o, &x) in out.iter_mut().zip(&state[..head_dim]) {
        *o = x / sum;
    }
}
