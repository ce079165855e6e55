//! AVX2 online-softmax tile for heads of 64 or 128: each token's heads two at a time, so a key or value chunk loaded once meets both, their scores two keys at a time and their outputs four chunks at a time in registers; a block of few rows (a decode) widens the cache's rows as it reads them, a larger one lays the tile out widened once.
//!
//! A score is one dot product in two 8-lane accumulators (alternate chunks), added and
//! reduced in a fixed tree; the output lanes are FMA chains over the tile's positions in
//! order. Widening a bf16 or f16 element to f32 is exact, so a row computes the same bits from
//! the cache or from the laid-out tile, and none of it depends on the other rows of the block.

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_and_ps, _mm256_and_si256, _mm256_castsi256_ps,
    _mm256_cmpgt_epi32, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_epi32,
    _mm256_set1_ps, _mm256_setr_epi32, _mm256_setzero_ps, _mm256_storeu_ps, _mm256_sub_ps,
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
        attend_rows::<E, E, C>((block, tile), &rows, scale, states);
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
    attend_rows::<E, f32, C>((block, tile), &rows, scale, states);
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
/// last one alone.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn attend_rows<E: CacheElement, W: Wide, const C: usize>(
    (block, tile): (&QueryBlock<'_>, &KvTile<'_, E>),
    rows: &TileRows<W>,
    scale: f32,
    states: &mut [f32],
) {
    // Compiled twice, so the tiles that fetch nothing (a range's last) carry no fetch points.
    if tile.ahead.is_empty() {
        token_rows::<W, C>((block, tile, |_| {}), rows, scale, states)
    } else {
        let fetch = |part| tile.fetch_ahead(part, FETCH_PARTS, 8 * C);
        token_rows::<W, C>((block, tile, fetch), rows, scale, states)
    }
}

/// [`attend_rows`] with `fetch(part)` for the parts of the next tile.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn token_rows<W: Wide, const C: usize>(
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
            if head + 1 < block.heads {
                let states = &mut states[at..at + 2 * stride];
                // SAFETY: every row of `rows` holds `8 * C` elements; the CPU has `avx2`.
                unsafe { group.attend::<W, C, 2, 4>(rows, scale, states, fetch) };
                head += 2;
            } else {
                let states = &mut states[at..at + stride];
                // SAFETY: as above.
                unsafe { group.attend::<W, C, 1, 8>(rows, scale, states, fetch) };
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
    /// their exponentials, then the outputs `G` chunks at a time (`H · G` accumulators, eight).
    ///
    /// # Safety
    /// Every row of `rows` starts `8 * C` readable elements; the CPU has isa level `avx2`.
    // Index loops: the iterator adapters over these arrays stayed out-of-line calls in the
    // hot loops, and their accumulators went through the stack.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn attend<W: Wide, const C: usize, const H: usize, const G: usize>(
        &self,
        rows: &TileRows<W>,
        scale: f32,
        states: &mut [f32],
        fetch: impl Fn(usize),
    ) {
        const { assert!(H * G == 8) };
        let head_dim = 8 * C;
        let stride = state_len(head_dim);
        let RowSpan { skip, valid, first } = self.span;
        let valid = valid.min(rows.len);
        let queries: [*const f32; H] = std::array::from_fn(|h| {
            self.block
                .query(self.token, self.head + h, head_dim)
                .as_ptr()
        });
        // Positions before the window score negative infinity and weigh nothing.
        let mut scores = [[f32::NEG_INFINITY; TILE]; H];
        let mut fetched = 0;
        let mut j = skip;
        while j < valid {
            let pair = j + 1 < valid;
            // SAFETY: the caller's contract for the rows; a query holds `head_dim` f32s.
            unsafe {
                if pair {
                    let dots = key_dots::<W, C, H, 2>([rows.keys[j], rows.keys[j + 1]], queries);
                    for (h, dots) in dots.iter().enumerate() {
                        scores[h][j] = dots[0] * scale;
                        scores[h][j + 1] = dots[1] * scale;
                    }
                } else {
                    let dots = key_dots::<W, C, H, 1>([rows.keys[j]], queries);
                    for (h, dots) in dots.iter().enumerate() {
                        scores[h][j] = dots[0] * scale;
                    }
                }
            }
            j += if pair { 2 } else { 1 };
            while fetched < (j / 4).min(FETCH_PARTS) {
                fetch(fetched);
                fetched += 1;
            }
        }
        while fetched < FETCH_PARTS {
            fetch(fetched);
            fetched += 1;
        }
        let mut weights = [[0.0f32; TILE]; H];
        let mut rescales = [0.0f32; H];
        for h in 0..H {
            let scores = &scores[h];
            let tile_max = scores[skip..valid]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            let state = &mut states[h * stride..][..stride];
            let statistics = TileStatistics::new(state, tile_max, first);
            let max_lanes = _mm256_set1_ps(statistics.max);
            let mut total = _mm256_setzero_ps();
            for chunk in skip / 8..valid.div_ceil(8) {
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
}

/// The dot products of `K` keys with `H` queries of `8 * C` elements: per pair two
/// accumulators over alternate chunks, added and reduced as every score is.
///
/// # Safety
/// Each key starts `8 * C` readable elements, each query `8 * C` f32s; the CPU has isa level
/// `avx2`.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn key_dots<W: Wide, const C: usize, const H: usize, const K: usize>(
    keys: [*const W; K],
    queries: [*const f32; H],
) -> [[f32; K]; H] {
    // Even and odd chunks in accumulators of their own, so no index into them is computed.
    let (mut even, mut odd) = ([[_mm256_setzero_ps(); K]; H], [[_mm256_setzero_ps(); K]; H]);
    for c in (0..C).step_by(2) {
        // SAFETY: the caller's contract.
        let k0: [__m256; K] = std::array::from_fn(|x| unsafe { chunk(keys[x], c) });
        // SAFETY: the caller's contract.
        let k1: [__m256; K] = std::array::from_fn(|x| unsafe { chunk(keys[x], c + 1) });
        for h in 0..H {
            // SAFETY: the caller's contract.
            let (q0, q1) = unsafe { (chunk(queries[h], c), chunk(queries[h], c + 1)) };
            for x in 0..K {
                even[h][x] = _mm256_fmadd_ps(q0, k0[x], even[h][x]);
                odd[h][x] = _mm256_fmadd_ps(q1, k1[x], odd[h][x]);
            }
        }
    }
    let mut out = [[0.0; K]; H];
    for h in 0..H {
        for x in 0..K {
            out[h][x] = reduce(_mm256_add_ps(even[h][x], odd[h][x]));
        }
    }
    out
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
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let below_to = _mm256_cmpgt_epi32(_mm256_set1_epi32(to.min(8) as i32), lanes);
    let from_on = _mm256_cmpgt_epi32(lanes, _mm256_set1_epi32(from.min(8) as i32 - 1));
    let keep = _mm256_and_si256(below_to, from_on);
    _mm256_and_ps(x, _mm256_castsi256_ps(keep))
}
