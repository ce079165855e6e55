//! AVX2 online-softmax tile for heads of 64 or 128: each token's heads two at a time (three straight from the cache, so a decode with three heads per KV head widens each row once), so a key or value chunk loaded once meets them all, their scores two keys at a time and their outputs eight accumulators at a time in registers; a block of few rows (a decode) widens the cache's rows as it reads them, a larger one lays the tile out widened once.
//!
//! A score is one dot product in two 8-lane accumulators (alternate chunks), added and
//! reduced in a fixed tree; the output lanes are FMA chains over the tile's positions in
//! order. Widening a bf16 or f16 element to f32 is exact, so a row computes the same bits from
//! the cache or from the laid-out tile, and none of it depends on the other rows of the block.
//! A laid-out tile's scores are reduced eight at a time, lane by lane in that same tree (one
//! vector of shuffles and adds for eight scores, not a horizontal reduction each).
use std::arch::x86_64::{
    __m256, _mm_cvtss_f32, _mm_max_ps, _mm_max_ss, _mm_movehl_ps, _mm_shuffle_ps, _mm256_add_ps,
    _mm256_and_ps, _mm256_and_si256, _mm256_blendv_ps, _mm256_castps256_ps128, _mm256_castsi256_ps,
    _mm256_cmpgt_epi32, _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_max_ps,
    _mm256_mul_ps, _mm256_permute2f128_ps, _mm256_permutevar8x32_ps, _mm256_set1_epi32,
    _mm256_set1_ps, _mm256_setr_epi32, _mm256_setzero_ps, _mm256_shuffle_ps, _mm256_storeu_ps,
    _mm256_sub_ps,
};

use super::online::{KvTile, QueryBlock, RowSpan, TILE, TileStatistics, state_len};
use crate::kv_cache::CacheElement;
use crate::linear::avx2::{Wide, reduce};
use crate::vector::avx2::exp;

/// Rows of a block at most (tokens times heads) that read a tile straight from the cache. A
/// head pair widens each key and value chunk as it loads it; laying the tile out costs two
/// stores per eight elements, which pays only when more rows than a decode's few read it.
const DIRECT_ROWS: usize = 4;

/// Fetch points in a tile: the first head group of the first token fetches a part of the next
/// tile's rows after every four keys it scores.
const FETCH_PARTS: usize = TILE / 4;

/// The rows of `block` (heads of `8 * C`, `C` a multiple of 8) through one tile, into their
/// states (see `online::attend_tile`); `buffer` holds at least `2 * TILE * 8 * C` f32s.
///
/// # Safety
/// The CPU has isa level `avx2`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend_tile<E: CacheElement, const C: usize>(
    block: &QueryBlock<'_>,
    tile: &KvTile<'_, E>,
    scale: f32,
    states: &mut [f32],
    buffer: &mut [f32],
) {
    let head_dim = 8 * C;
    if block.tokens * block.heads <= DIRECT_ROWS {
        let rows = TileRows::new(tile.offsets, head_dim, [tile.keys, tile.values]);
        attend_rows::<E, E, C, false>((block, tile), &rows, scale, states);
        return;
    }
    let (keys, values) = buffer.split_at_mut(TILE * head_dim);
    for (j, &offset) in tile.offsets.iter().enumerate() {
        let (key, value) = (
            &tile.keys[offset..offset + head_dim],
            &tile.values[offset..offset + head_dim],
        );
        for c in 0..C {
            store(&mut keys[j * head_dim..], c, load_cached(key, c));
            store(&mut values[j * head_dim..], c, load_cached(value, c));
        }
    }
    let laid_out: [usize; TILE] = std::array::from_fn(|j| j * head_dim);
    let offsets = &laid_out[..tile.offsets.len()];
    let rows = TileRows::new(offsets, head_dim, [keys, values]);
    attend_rows::<E, f32, C, true>((block, tile), &rows, scale, states);
}

/// Where each position of a tile keeps its key and its value row.
struct TileRows<W> {
    keys: [*const W; TILE],
    values: [*const W; TILE],
    len: usize,
}

impl<W> TileRows<W> {
    /// The rows of `head_dim` elements at `offsets` of the keys and the values.
    fn new(offsets: &[usize], head_dim: usize, [keys, values]: [&[W]; 2]) -> TileRows<W> {
        let mut rows = TileRows {
            keys: [std::ptr::null(); TILE],
            values: [std::ptr::null(); TILE],
            len: offsets.len(),
        };
        for (j, &offset) in offsets.iter().enumerate() {
            rows.keys[j] = keys[offset..offset + head_dim].as_ptr();
            rows.values[j] = values[offset..offset + head_dim].as_ptr();
        }
        rows
    }
}

/// Eight elements from element `8 * c` of row `row`, widened to f32.
///
/// # Safety
/// `row` starts `8 * (c + 1)` readable elements; the CPU has isa level `avx2`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk<W: Wide>(row: *const W, c: usize) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe { W::load(row.add(8 * c)) }
}

/// [`attend_tile`] over `rows` (`8 * C` elements each): each token's heads in pairs, an odd
/// last one alone, or three at a time from the cache (`!LAID_OUT`), where every pass over the
/// tile widens its rows again; `LAID_OUT` when the rows are the tile laid out for a block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn attend_rows<E: CacheElement, W: Wide, const C: usize, const LAID_OUT: bool>(
    (block, tile): (&QueryBlock<'_>, &KvTile<'_, E>),
    rows: &TileRows<W>,
    scale: f32,
    states: &mut [f32],
) {
    // Compiled twice, so the tiles that fetch nothing (a range's last) carry no fetch points.
    if tile.ahead.is_empty() {
        token_rows::<W, C, LAID_OUT>((block, tile, |_| {}), rows, scale, states)
    } else {
        let fetch = |part| tile.fetch_ahead(part, FETCH_PARTS, 8 * C);
        token_rows::<W, C, LAID_OUT>((block, tile, fetch), rows, scale, states)
    }
}

/// [`attend_rows`] with `fetch(part)` for the parts of the next tile.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn token_rows<W: Wide, const C: usize, const LAID_OUT: bool>(
    (block, tile, fetch): (&QueryBlock<'_>, &KvTile<'_, impl Sized>, impl Fn(usize)),
    rows: &TileRows<W>,
    scale: f32,
    states: &mut [f32],
) {
    let stride = state_len(8 * C);
    for token in 0..block.tokens {
        let span = tile.span(block, token);
        if span.is_empty() {
            continue;
        }
        let mut head = 0;
        while head < block.heads {
            let group = Group {
                block,
                token,
                head,
                span,
            };
            let at = (token * block.heads + head) * stride;
            let fetch = |part: usize| {
                if token == 0 && head == 0 {
                    fetch(part);
                }
            };
            if !LAID_OUT && head + 2 < block.heads {
                let states = &mut states[at..at + 3 * stride];
                // SAFETY: every row of `rows` holds `8 * C` elements; the CPU has `avx2`.
                unsafe { group.attend::<W, C, 3, 2, LAID_OUT>(rows, scale, states, fetch) };
                head += 3;
            } else if head + 1 < block.heads {
                let states = &mut states[at..at + 2 * stride];
                // SAFETY: every row of `rows` holds `8 * C` elements; the CPU has `avx2`.
                unsafe { group.attend::<W, C, 2, 4, LAID_OUT>(rows, scale, states, fetch) };
                head += 2;
            } else {
                let states = &mut states[at..at + stride];
                // SAFETY: as above.
                unsafe { group.attend::<W, C, 1, 8, LAID_OUT>(rows, scale, states, fetch) };
                head += 1;
            }
        }
    }
}

/// Heads `head..head + H` of token `token` of a block, and what the tile is to that token.
struct Group<'a, 'b> {
    block: &'a QueryBlock<'b>,
    token: usize,
    head: usize,
    span: RowSpan,
}

impl Group<'_, '_> {
    /// The group's `H` rows through the tile into `states` (`H` consecutive states): scores,
    /// their exponentials, then the outputs `G` chunks at a time (`H · G` accumulators, at most eight).
    ///
    /// # Safety
    /// Every row of `rows` starts `8 * C` readable elements; the CPU has isa level `avx2`.
    // Index loops: the iterator adapters over these arrays stayed out-of-line calls in the
    // hot loops, and their accumulators went through the stack.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn attend<
        W: Wide,
        const C: usize,
        const H: usize,
        const G: usize,
        const LAID_OUT: bool,
    >(
        &self,
        rows: &TileRows<W>,
        scale: f32,
        states: &mut [f32],
        fetch: impl Fn(usize),
    ) {
        const { assert!(H * G <= 8) };
        let head_dim = 8 * C;
        let stride = state_len(head_dim);
        let RowSpan { skip, valid, first } = self.span;
        let valid = valid.min(rows.len);
        let queries: [*const f32; H] = std::array::from_fn(|h| {
            self.block
                .query(self.token, self.head + h, head_dim)
                .as_ptr()
        });
        // Positions outside the window score negative infinity and weigh nothing.
        // SAFETY: the caller's contract.
        let scores = unsafe { self.scores::<W, C, H, LAID_OUT>(rows, queries, scale, &fetch) };
        let runs = skip / 8..valid.div_ceil(8);
        let mut weights = [[0.0f32; TILE]; H];
        let mut rescales = [0.0f32; H];
        for h in 0..H {
            let scores = &scores[h];
            // Every lane outside the window holds negative infinity, so whole runs can meet.
            let lanes = runs
                .clone()
                .fold(_mm256_set1_ps(f32::NEG_INFINITY), |m, run| {
                    _mm256_max_ps(m, load(scores, run))
                });
            let tile_max = max_of_lanes(lanes);
            let state = &mut states[h * stride..][..stride];
            let statistics = TileStatistics::new(state, tile_max, first);
            let max_lanes = _mm256_set1_ps(statistics.max);
            let mut total = _mm256_setzero_ps();
            for chunk in runs.clone() {
                let x = load(scores, chunk);
                let w = exp(_mm256_sub_ps(x, max_lanes));
                let w = lanes_between(w, skip.saturating_sub(8 * chunk), valid - 8 * chunk);
                total = _mm256_add_ps(total, w);
                store(&mut weights[h], chunk, w);
            }
            rescales[h] = statistics.rescale;
            statistics.store(state, reduce(total));
        }
        for c0 in (0..C).step_by(G) {
            let mut acc = [[_mm256_setzero_ps(); G]; H];
            if !first {
                for (h, acc) in acc.iter_mut().enumerate() {
                    let state = &states[h * stride..][..head_dim];
                    let rescale = _mm256_set1_ps(rescales[h]);
                    for (i, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm256_mul_ps(load(state, c0 + i), rescale);
                    }
                }
            }
            for j in skip..valid {
                let value = rows.values[j];
                // SAFETY: the caller's contract: `c0 + i < C`.
                let v: [__m256; G] = std::array::from_fn(|i| unsafe { chunk(value, c0 + i) });
                for h in 0..H {
                    let weight = _mm256_set1_ps(weights[h][j]);
                    for i in 0..G {
                        acc[h][i] = _mm256_fmadd_ps(weight, v[i], acc[h][i]);
                    }
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                let state = &mut states[h * stride..][..head_dim];
                for (i, &acc) in acc.iter().enumerate() {
                    store(state, c0 + i, acc);
                }
            }
        }
    }

    /// The group's scores of the tile, negative infinity outside the window. Laid out, eight
    /// keys at a time: each lane's sum finished by [`fold_halves`] and [`finish_eight`] with the
    /// adds of [`reduce`], so a score has the bits it has from the cache. From the cache (a
    /// decode's few rows), two at a time, each reduced on its own: waiting on memory, the lone
    /// reductions keep more loads in flight than eight sums held for one fold.
    ///
    /// # Safety
    /// As [`Group::attend`]; each query starts `8 * C` readable f32s.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores<W: Wide, const C: usize, const H: usize, const LAID_OUT: bool>(
        &self,
        rows: &TileRows<W>,
        queries: [*const f32; H],
        scale: f32,
        fetch: &impl Fn(usize),
    ) -> [[f32; TILE]; H] {
        let mut scores = [[f32::NEG_INFINITY; TILE]; H];
        let RowSpan { skip, valid, .. } = self.span;
        let valid = valid.min(rows.len);
        let mut fetches = Fetches { fetch, asked: 0 };
        if LAID_OUT {
            let scale_lanes = _mm256_set1_ps(scale);
            for run in skip / 8..valid.div_ceil(8) {
                let base = 8 * run;
                // A position outside the window scores a row that exists; its lane is dropped.
                let key = |j: usize| rows.keys[if (skip..valid).contains(&j) { j } else { skip }];
                let mut halves = [[_mm256_setzero_ps(); 4]; H];
                for i in 0..4 {
                    let pair = [key(base + 2 * i), key(base + 2 * i + 1)];
                    // SAFETY: the caller's contract.
                    let sums = unsafe { key_sums::<W, C, H>(pair, queries) };
                    for h in 0..H {
                        halves[h][i] = fold_halves(sums[h]);
                    }
                }
                let window = lane_mask(skip.saturating_sub(base), valid - base);
                for h in 0..H {
                    let dots = _mm256_mul_ps(finish_eight(halves[h]), scale_lanes);
                    let dots = _mm256_blendv_ps(_mm256_set1_ps(f32::NEG_INFINITY), dots, window);
                    store(&mut scores[h], run, dots);
                }
                fetches.after(base + 8);
            }
        } else {
            let mut j = skip;
            while j < valid {
                // The last key of an odd window pairs with itself; its second score is dropped.
                let second = (j + 1).min(valid - 1);
                let pair = [rows.keys[j], rows.keys[second]];
                // SAFETY: the caller's contract.
                let sums = unsafe { key_sums::<W, C, H>(pair, queries) };
                for h in 0..H {
                    scores[h][j] = reduce(sums[h][0]) * scale;
                    if second > j {
                        scores[h][second] = reduce(sums[h][1]) * scale;
                    }
                }
                j += 2;
                fetches.after(j);
            }
        }
        fetches.after(TILE);
        scores
    }
}

/// The next tile's parts, asked for as a group's scores advance through this one.
struct Fetches<'f, F: Fn(usize)> {
    fetch: &'f F,
    asked: usize,
}

impl<F: Fn(usize)> Fetches<'_, F> {
    /// Asks for one part per four positions up to `position`.
    #[inline]
    fn after(&mut self, position: usize) {
        while self.asked < (position / 4).min(FETCH_PARTS) {
            (self.fetch)(self.asked);
            self.asked += 1;
        }
    }
}

/// The sums of two keys with `H` queries of `8 * C` elements, left in lanes: per pair two
/// accumulators over alternate chunks, added; [`fold_halves`] and [`finish_eight`] then add
/// the lanes in the tree of [`reduce`].
///
/// # Safety
/// Each key starts `8 * C` readable elements, each query `8 * C` f32s; the CPU has isa level
/// `avx2`.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn key_sums<W: Wide, const C: usize, const H: usize>(
    keys: [*const W; 2],
    queries: [*const f32; H],
) -> [[__m256; 2]; H] {
    // Even and odd chunks in accumulators of their own, so no index into them is computed.
    let (mut even, mut odd) = ([[_mm256_setzero_ps(); 2]; H], [[_mm256_setzero_ps(); 2]; H]);
    for c in (0..C).step_by(2) {
        // SAFETY: the caller's contract.
        let k0: [__m256; 2] = std::array::from_fn(|x| unsafe { chunk(keys[x], c) });
        // SAFETY: the caller's contract.
        let k1: [__m256; 2] = std::array::from_fn(|x| unsafe { chunk(keys[x], c + 1) });
        for h in 0..H {
            // SAFETY: the caller's contract.
            let (q0, q1) = unsafe { (chunk(queries[h], c), chunk(queries[h], c + 1)) };
            for x in 0..2 {
                even[h][x] = _mm256_fmadd_ps(q0, k0[x], even[h][x]);
                odd[h][x] = _mm256_fmadd_ps(q1, k1[x], odd[h][x]);
            }
        }
    }
    let mut out = [[_mm256_setzero_ps(); 2]; H];
    for h in 0..H {
        for x in 0..2 {
            out[h][x] = _mm256_add_ps(even[h][x], odd[h][x]);
        }
    }
    out
}

/// The first add of [`reduce`] for two sums `[a, b]` at once: `a`'s low half plus its high
/// half in the low four lanes, `b`'s in the high four.
#[inline]
#[target_feature(enable = "avx")]
fn fold_halves([a, b]: [__m256; 2]) -> __m256 {
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(a, b),
        _mm256_permute2f128_ps::<0x31>(a, b),
    )
}

/// The rest of [`reduce`]'s tree for eight sums: `halves[i]` folds sums `i` and `i + 4`, and
/// lane `i` of the result is sum `i` reduced, with the same adds in the same order.
#[inline]
#[target_feature(enable = "avx2")]
fn finish_eight(halves: [__m256; 4]) -> __m256 {
    // Lanes (0 + 2, 1 + 3) of each four: sums 0, 1 | 4, 5 and 2, 3 | 6, 7.
    let pairs = |p: __m256, q: __m256| {
        _mm256_add_ps(
            _mm256_shuffle_ps::<0x44>(p, q),
            _mm256_shuffle_ps::<0xEE>(p, q),
        )
    };
    let (low, high) = (pairs(halves[0], halves[1]), pairs(halves[2], halves[3]));
    let sums = _mm256_add_ps(
        _mm256_shuffle_ps::<0x88>(low, high),
        _mm256_shuffle_ps::<0xDD>(low, high),
    );
    // Sums 0, 2, 4, 6 | 1, 3, 5, 7 back in order.
    _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// The largest of the eight lanes of `v` (exact in any order).
#[inline]
#[target_feature(enable = "avx")]
fn max_of_lanes(v: __m256) -> f32 {
    let four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let two = _mm_max_ps(four, _mm_movehl_ps(four, four));
    _mm_cvtss_f32(_mm_max_ss(two, _mm_shuffle_ps::<1>(two, two)))
}

/// Eight f32s from element `8 * c` of `row`.
#[inline]
#[target_feature(enable = "avx")]
fn load(row: &[f32], c: usize) -> __m256 {
    let chunk = &row[8 * c..8 * c + 8];
    // SAFETY: `chunk` holds 8 f32s.
    unsafe { _mm256_loadu_ps(chunk.as_ptr()) }
}

/// `v` into the eight f32s from element `8 * c` of `row`.
#[inline]
#[target_feature(enable = "avx")]
fn store(row: &mut [f32], c: usize, v: __m256) {
    let chunk = &mut row[8 * c..8 * c + 8];
    // SAFETY: `chunk` holds 8 f32s.
    unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), v) }
}

/// Eight cache elements from element `8 * c` of `row`, widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_cached<E: CacheElement>(row: &[E], c: usize) -> __m256 {
    let chunk = &row[8 * c..8 * c + 8];
    // SAFETY: `chunk` holds 8 elements; the CPU has level `avx2`.
    unsafe { <E as Wide>::load(chunk.as_ptr()) }
}

/// `x` in lanes `from..to`, zero in the others.
#[inline]
#[target_feature(enable = "avx2")]
fn lanes_between(x: __m256, from: usize, to: usize) -> __m256 {
    _mm256_and_ps(x, lane_mask(from, to))
}

/// All ones in lanes `from..to`, zero in the others.
#[inline]
#[target_feature(enable = "avx2")]
fn lane_mask(from: usize, to: usize) -> __m256 {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let below_to = _mm256_cmpgt_epi32(_mm256_set1_epi32(to.min(8) as i32), lanes);
    let from_on = _mm256_cmpgt_epi32(lanes, _mm256_set1_epi32(from.min(8) as i32 - 1));
    _mm256_castsi256_ps(_mm256_and_si256(below_to, from_on))
}
