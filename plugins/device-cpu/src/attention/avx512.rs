//! AVX-512 online-softmax tile for heads of 64 or 128: a tile's keys laid out transposed once for every row of the block, then the rows of a pass (the query heads of a token) scored together, sixteen keys to a vector, and their outputs in registers.
//!
//! A score is one chain over the head's dimensions in order in one lane: f32 FMAs (the keys
//! widened) or, with bf16 products, `vdpbf16ps` over pairs of dimensions. Each loaded key
//! vector feeds every row of the pass and no score needs a reduction across lanes; the
//! rows of a pass only share loads, so a row's bits are the same whichever rows it is
//! computed with (a lone decode token's as a prefill row's). Exponentials are vectorized
//! ([`exp`]); the output lanes are FMA (or `vdpbf16ps`) chains over the tile's positions in
//! order.

use std::arch::x86_64::{
    __m512, __m512bh, __m512i, __mmask16, _mm512_add_ps, _mm512_and_si512, _mm512_castps_si512,
    _mm512_castsi512_ps, _mm512_cvtne2ps_pbh, _mm512_cvtss_f32, _mm512_dpbf16_ps, _mm512_fmadd_ps,
    _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mask_mov_ps, _mm512_maskz_mov_ps, _mm512_max_ps,
    _mm512_mul_ps, _mm512_reduce_max_ps, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps,
    _mm512_setzero_si512, _mm512_slli_epi32, _mm512_storeu_ps, _mm512_storeu_si512, _mm512_sub_ps,
};

use super::online::{KvTile, QueryBlock, RowSpan, TILE, state_len};
use crate::kv_cache::{CacheElement, KvOrder, RUN};
use crate::vector::avx512::{exp, reduce};
use layout::{lay_out_keys, pair_values};

mod layout;

/// Rows of at most this many queries read the tile from the cache directly: widening it
/// first pays off only when many rows read it.
const DIRECT_ROWS: usize = 4;

/// The rows of `block` (heads of `16 * C`) through one tile, into their states (see
/// `online::attend_tile`); `buffer` holds at least `2 * TILE * 16 * C` f32s. With
/// `bf16_keys` (the bits of `tile.keys`) the scores are bf16 products. Where the tile's rows
/// are read from changes no bits: widening is exact.
///
/// # Safety
/// The CPU has AVX-512 F and DQ (isa level `avx512`), and AVX-512 BF16 (isa level
/// `avx512_bf16`) if `bf16_keys` is given.
#[target_feature(enable = "avx512f,avx512dq")]
pub unsafe fn attend_tile<E: CacheElement, const C: usize>(
    (block, tile, bf16_keys): (&QueryBlock<'_>, &KvTile<'_, E>, Option<&[u16]>),
    (scale, order): (f32, KvOrder),
    states: &mut [f32],
    buffer: &mut [f32],
) {
    if order == KvOrder::Pairs
        && let (Some(keys), Some(values)) = (bf16_keys, E::bf16_bits(tile.values))
    {
        // SAFETY: bf16 keys come only with isa level `avx512_bf16` (the contract).
        return unsafe { attend_runs::<E, C>(block, tile, (keys, values), scale, states) };
    }
    let rows = (block, tile, bf16_keys);
    // Compiled twice, so the tiles that fetch nothing (a range's last) carry no fetch points.
    if tile.ahead.is_empty() {
        // SAFETY: the caller's promise, passed on.
        unsafe { attend_tile_with::<E, C>(rows, |_, _| {}, scale, states, buffer) }
    } else {
        let fetch = |part, parts| tile.fetch_ahead(part, parts, 16 * C);
        // SAFETY: as above.
        unsafe { attend_tile_with::<E, C>(rows, fetch, scale, states, buffer) }
    }
}

/// [`attend_tile`], with `fetch(part, parts)` at the fetch points of the key layout and the
/// first token's scores (see [`FETCH_PHASES`]).
///
/// # Safety
/// As [`attend_tile`].
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn attend_tile_with<E: CacheElement, const C: usize>(
    (block, tile, bf16_keys): (&QueryBlock<'_>, &KvTile<'_, E>, Option<&[u16]>),
    fetch: impl Fn(usize, usize),
    scale: f32,
    states: &mut [f32],
    buffer: &mut [f32],
) {
    let head_dim = 16 * C;
    let (key_buffer, value_buffer) = buffer.split_at_mut(TILE * head_dim);
    let rows = (block, |token| tile.span(block, token), fetch);
    let updates = (scale, states);
    let paired = lay_out_keys::<E, C>(tile, key_buffer, phase(&rows.2, 0));
    let key_columns = &*key_buffer;
    if let (Some(_), Some(values)) = (bf16_keys, E::bf16_bits(tile.values)) {
        // SAFETY: bf16 keys come only with isa level `avx512_bf16` (the contract).
        unsafe { pair_values::<C>(values, tile.offsets, value_buffer) };
        let values = PairedValues {
            runs: PairRuns::laid_out(value_buffer, head_dim),
            last: Some(KvRows::at(tile.values, tile.offsets, head_dim)),
        };
        let keys = PairColumns(PairRuns::laid_out(key_columns, head_dim));
        return attend_rows::<_, _, C>(rows, (keys, values), updates);
    }
    if paired {
        let keys = WidenedPairColumns(key_columns);
        return attend_wide_values::<E, _, C>((rows, tile), keys, updates, value_buffer);
    }
    let keys = WideColumns(key_columns);
    attend_wide_values::<E, _, C>((rows, tile), keys, updates, value_buffer)
}

/// [`attend_tile`] over a bf16 cache kept in runs of sixteen positions in pair order
/// ([`KvOrder::Pairs`]): the runs are read where they lie, so nothing is laid out. The tile
/// starts on a run (tiles start at whole ranges of whole blocks, and blocks hold whole runs),
/// so run `g` of the tile begins at the offset of its position `16g`.
///
/// # Safety
/// The CPU has isa level `avx512_bf16`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
unsafe fn attend_runs<E: CacheElement, const C: usize>(
    block: &QueryBlock<'_>,
    tile: &KvTile<'_, E>,
    (keys, values): (&[u16], &[u16]),
    scale: f32,
    states: &mut [f32],
) {
    let head_dim = 16 * C;
    assert!(
        tile.start.is_multiple_of(RUN),
        "a tile of a cache in runs starts at position {}",
        tile.start
    );
    // With no layout to spread the first phase of fetching the next tile over, the scores
    // fetch both phases' parts, still a few rows at each step of their loop.
    let fetch = |part: usize, parts: usize| {
        if let Some(first_phase) = part.checked_sub(parts / 2) {
            tile.fetch_ahead(first_phase, parts, head_dim);
        }
        tile.fetch_ahead(part, parts, head_dim);
    };
    let rows = (block, |token| tile.span(block, token), fetch);
    let values = PairedValues {
        runs: PairRuns::in_cache(values, tile.offsets, head_dim),
        last: None::<KvRows<'_, E>>,
    };
    let keys = PairColumns(PairRuns::in_cache(keys, tile.offsets, head_dim));
    attend_rows::<_, _, C>(rows, (keys, values), (scale, states))
}

/// The bits of a run past a tile's last position: zeros, never read into an output (their
/// scores are masked, their values never weighed).
static NO_RUN: [u16; RUN * 128] = [0; RUN * 128];

/// A tile's keys or values in pair order, one run of sixteen positions per score vector, each
/// `16 * D` bf16: the runs of a cache kept in [`KvOrder::Pairs`], or a tile's laid out by
/// [`lay_out_keys`] and [`pair_values`].
#[derive(Clone, Copy)]
struct PairRuns<'a>([&'a [u16]; SCORE_VECTORS]);

impl<'a> PairRuns<'a> {
    /// The runs of a tile laid out in `buffer` one after the other.
    fn laid_out(buffer: &'a [f32], head_dim: usize) -> PairRuns<'a> {
        let (start, len) = (buffer.as_ptr().cast::<u16>(), 2 * buffer.len());
        // SAFETY: any f32 is two u16s, and u16 needs no more alignment than f32.
        let bits = unsafe { std::slice::from_raw_parts(start, len) };
        PairRuns(std::array::from_fn(|g| {
            bits.get(g * RUN * head_dim..(g + 1) * RUN * head_dim)
                .unwrap_or(&NO_RUN[..RUN * head_dim])
        }))
    }

    /// The runs of the tile whose positions lie at `offsets` (row offsets, the first of each
    /// run its start) in a cache kept in [`KvOrder::Pairs`].
    fn in_cache(bits: &'a [u16], offsets: &[usize], head_dim: usize) -> PairRuns<'a> {
        PairRuns(std::array::from_fn(|g| match offsets.get(RUN * g) {
            Some(&start) => &bits[start..start + RUN * head_dim],
            None => &NO_RUN[..RUN * head_dim],
        }))
    }

    /// Vector `index` (64 bytes) of run `run`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn vector(self, run: usize, index: usize) -> __m512i {
        let chunk = &self.0[run][32 * index..32 * index + 32];
        // SAFETY: `chunk` holds 32 u16s.
        unsafe { _mm512_loadu_si512(chunk.as_ptr().cast()) }
    }
}

/// [`attend_rows`] with the values widened to f32: read in the cache by a few rows, widened
/// into `buffer` for more.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
fn attend_wide_values<E: CacheElement, S: Scores, const C: usize>(
    (rows, tile): (
        (
            &QueryBlock<'_>,
            impl Fn(usize) -> RowSpan,
            impl Fn(usize, usize),
        ),
        &KvTile<'_, E>,
    ),
    keys: S,
    updates: (f32, &mut [f32]),
    buffer: &mut [f32],
) {
    let head_dim = 16 * C;
    let block = rows.0;
    if block.tokens * block.heads <= DIRECT_ROWS {
        let values = WideValues(KvRows::at(tile.values, tile.offsets, head_dim));
        return attend_rows::<_, _, C>(rows, (keys, values), updates);
    }
    for (j, &offset) in tile.offsets.iter().enumerate() {
        let row = &tile.values[offset..offset + head_dim];
        for c in 0..C {
            store(&mut buffer[j * head_dim..], c, load_cached(row, c));
        }
    }
    let values = WideValues(KvRows::packed(buffer, head_dim));
    attend_rows::<_, _, C>(rows, (keys, values), updates)
}

/// The phases of a tile's work that fetch a share of the next tile's rows each: laying out
/// the keys, and the first pass's scores. Not its weighted values: the rows fetched last
/// would then still be on their way when the next tile's keys are laid out.
const FETCH_PHASES: usize = 2;

/// `fetch(part, parts)` for part `part` of `parts` of phase `phase` (see [`FETCH_PHASES`]).
fn phase(fetch: &impl Fn(usize, usize), phase: usize) -> impl Fn(usize, usize) + '_ {
    move |part, parts| fetch(phase * parts + part, FETCH_PHASES * parts)
}

/// How the rows of a pass score the tile's keys, laid out by [`lay_out_keys`] sixteen keys to
/// a vector: each score a chain over the head's dimensions in order in one lane, so it has
/// the same bits whichever rows share the pass.
trait Scores: Copy {
    /// The scaled scores of the `G` `queries` against the tile's keys, sixteen per vector;
    /// lanes past `valid` are negative infinity. `fetch(step, steps)` runs after each step of
    /// the chain.
    ///
    /// # Safety
    /// The CPU has the level the implementing type asks for.
    unsafe fn scores<const C: usize, const G: usize>(
        self,
        queries: [&[f32]; G],
        valid_and_scale: (usize, f32),
        fetch: impl Fn(usize, usize),
    ) -> [[__m512; SCORE_VECTORS]; G];
}

/// Keys widened to f32, vector `g * D + d` holding dimension `d` of keys `16g..16g + 16`;
/// scores are f32 FMA chains (isa level `avx512`).
#[derive(Clone, Copy)]
struct WideColumns<'a>(&'a [f32]);

/// Keys of a bf16 cache as stored, vector `g * D / 2 + i` holding dimensions `2i` and `2i +
/// 1` of keys `16g..16g + 16` in each 32-bit lane; scores are `vdpbf16ps` chains with the
/// query rounded to bf16 (isa level `avx512_bf16`).
#[derive(Clone, Copy)]
struct PairColumns<'a>(PairRuns<'a>);

/// Keys of a bf16 cache laid out as for [`PairColumns`], widened as they are read: the same
/// f32 FMA chains as [`WideColumns`] from half the bytes (isa level `avx512`).
#[derive(Clone, Copy)]
struct WidenedPairColumns<'a>(&'a [f32]);

/// Key columns that give, for each dimension `d`, the four vectors of the tile's keys'
/// dimension `d` in f32.
trait F32Columns: Copy {
    /// # Safety
    /// The CPU has isa level `avx512`.
    unsafe fn dimension<const C: usize>(self, d: usize) -> [__m512; SCORE_VECTORS];
}

impl F32Columns for WideColumns<'_> {
    /// # Safety
    /// As [`F32Columns::dimension`]: the CPU has isa level `avx512`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn dimension<const C: usize>(self, d: usize) -> [__m512; SCORE_VECTORS] {
        let mut keys = [_mm512_setzero_ps(); SCORE_VECTORS];
        for (g, k) in keys.iter_mut().enumerate() {
            *k = load(&self.0[(g * 16 * C + d) * 16..], 0);
        }
        keys
    }
}

impl F32Columns for WidenedPairColumns<'_> {
    /// # Safety
    /// As [`F32Columns::dimension`]: the CPU has isa level `avx512`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn dimension<const C: usize>(self, d: usize) -> [__m512; SCORE_VECTORS] {
        let mut keys = [_mm512_setzero_ps(); SCORE_VECTORS];
        for (g, k) in keys.iter_mut().enumerate() {
            let pair = _mm512_castps_si512(load(&self.0[(g * 8 * C + d / 2) * 16..], 0));
            // A bf16 widens to the f32 of its bits shifted up by 16: the even dimension is
            // the low half of each lane, the odd one the high half.
            let wide = if d.is_multiple_of(2) {
                _mm512_slli_epi32::<16>(pair)
            } else {
                _mm512_and_si512(pair, _mm512_set1_epi32(0xffff_0000_u32 as i32))
            };
            *k = _mm512_castsi512_ps(wide);
        }
        keys
    }
}

impl<K: F32Columns> Scores for K {
    /// # Safety
    /// As [`Scores::scores`]: the CPU has isa level `avx512`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn scores<const C: usize, const G: usize>(
        self,
        queries: [&[f32]; G],
        (valid, scale): (usize, f32),
        fetch: impl Fn(usize, usize),
    ) -> [[__m512; SCORE_VECTORS]; G] {
        let head_dim = 16 * C;
        // Slices of the head's length, so indexing them needs no checks.
        let queries = queries.map(|query| &query[..head_dim]);
        // Plain loops, not `array::map`, for the vectors: closures handed to it are compiled
        // without the AVX-512 features, and called once per element.
        let mut acc = [[_mm512_setzero_ps(); SCORE_VECTORS]; G];
        for d in 0..head_dim {
            // SAFETY: the caller's promise, passed on.
            let keys = unsafe { self.dimension::<C>(d) };
            for (acc, query) in acc.iter_mut().zip(&queries) {
                let q = _mm512_set1_ps(query[d]);
                for (acc, &k) in acc.iter_mut().zip(&keys) {
                    *acc = if d == 0 {
                        _mm512_mul_ps(q, k)
                    } else {
                        _mm512_fmadd_ps(q, k, *acc)
                    };
                }
            }
            fetch(d, head_dim);
        }
        for acc in &mut acc {
            scale_and_mask(acc, valid, scale);
        }
        acc
    }
}

impl Scores for PairColumns<'_> {
    /// # Safety
    /// As [`Scores::scores`]: the CPU has isa level `avx512_bf16`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
    unsafe fn scores<const C: usize, const G: usize>(
        self,
        queries: [&[f32]; G],
        (valid, scale): (usize, f32),
        fetch: impl Fn(usize, usize),
    ) -> [[__m512; SCORE_VECTORS]; G] {
        let pairs = 8 * C;
        // Each query rounded to bf16: pair `i` (dimensions `2i`, `2i + 1`) in 32-bit lane `i`.
        let mut rounded = [[0u32; 64]; G];
        for (lanes, query) in rounded.iter_mut().zip(&queries) {
            for (k, chunk) in lanes[..pairs].chunks_exact_mut(16).enumerate() {
                let pair = _mm512_cvtne2ps_pbh(load(query, 2 * k + 1), load(query, 2 * k));
                // SAFETY: `chunk` holds 16 u32s.
                unsafe { _mm512_storeu_si512(chunk.as_mut_ptr().cast(), bf16_lanes_as_bits(pair)) };
            }
        }
        let mut acc = [[_mm512_setzero_ps(); SCORE_VECTORS]; G];
        for i in 0..pairs {
            let mut keys = [bits_as_bf16_lanes(_mm512_setzero_si512()); SCORE_VECTORS];
            for (g, k) in keys.iter_mut().enumerate() {
                *k = bits_as_bf16_lanes(self.0.vector(g, i));
            }
            for (acc, rounded) in acc.iter_mut().zip(&rounded) {
                let q = bits_as_bf16_lanes(_mm512_set1_epi32(rounded[i] as i32));
                for (acc, &k) in acc.iter_mut().zip(&keys) {
                    *acc = _mm512_dpbf16_ps(*acc, q, k);
                }
            }
            fetch(i, pairs);
        }
        for acc in &mut acc {
            scale_and_mask(acc, valid, scale);
        }
        acc
    }
}

/// Dot products times `scale`, negative infinity past the first `valid` keys.
#[inline]
#[target_feature(enable = "avx512f")]
fn scale_and_mask(acc: &mut [__m512; SCORE_VECTORS], valid: usize, scale: f32) {
    for (group, acc) in acc.iter_mut().enumerate() {
        let keep = lanes_mask(valid.saturating_sub(16 * group));
        let scores = _mm512_mul_ps(*acc, _mm512_set1_ps(scale));
        *acc = _mm512_mask_mov_ps(_mm512_set1_ps(f32::NEG_INFINITY), keep, scores);
    }
}

/// The key or value rows of a tile: in the cache at `offsets`, or one after the other.
#[derive(Clone, Copy)]
struct KvRows<'a, K> {
    data: &'a [K],
    offsets: Option<&'a [usize]>,
    head_dim: usize,
}

impl<'a, K> KvRows<'a, K> {
    /// Rows in a cache at these element offsets.
    fn at(data: &'a [K], offsets: &'a [usize], head_dim: usize) -> KvRows<'a, K> {
        KvRows {
            data,
            offsets: Some(offsets),
            head_dim,
        }
    }

    /// Rows one after the other.
    fn packed(data: &'a [K], head_dim: usize) -> KvRows<'a, K> {
        KvRows {
            data,
            offsets: None,
            head_dim,
        }
    }

    #[inline]
    fn row(&self, j: usize) -> &'a [K] {
        let start = match self.offsets {
            Some(offsets) => offsets[j],
            None => j * self.head_dim,
        };
        &self.data[start..start + self.head_dim]
    }
}

/// [`attend_tile`] once the tile's rows are where `keys` and `values` say; `span(t)` is which
/// of the tile's positions token `t` attends to. A token's heads go through the values
/// a few at a time, so each value row is loaded once for all of them.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
fn attend_rows<S: Scores, W: Values, const C: usize>(
    (block, span, fetch): (
        &QueryBlock<'_>,
        impl Fn(usize) -> RowSpan,
        impl Fn(usize, usize),
    ),
    (keys, values): (S, W),
    (scale, states): (f32, &mut [f32]),
) {
    let head_dim = 16 * C;
    let stride = state_len(head_dim);
    // Heads per pass over the values: their accumulators fill half the registers.
    let pass_heads = 16 / C;
    for token in 0..block.tokens {
        let span = span(token);
        if span.is_empty() {
            continue;
        }
        let RowSpan { valid, first, .. } = span;
        let token_states = &mut states[token * block.heads * stride..][..block.heads * stride];
        let mut weights = [[0.0f32; TILE]; 4];
        let mut rescales = [0.0f32; 4];
        for (pass, pass_states) in token_states.chunks_mut(pass_heads * stride).enumerate() {
            let heads = pass_states.len() / stride;
            // The first pass of the first token fetches the next tile, a part each step.
            let fetch = |step, steps| {
                if token == 0 && pass == 0 {
                    fetch(step, steps)
                }
            };
            let score_fetch = phase(&fetch, 1);
            let query = |h: usize| block.query(token, pass * pass_heads + h, head_dim);
            macro_rules! pass {
                ($g:literal) => {{
                    let queries: [&[f32]; $g] = std::array::from_fn(query);
                    let scores = {
                        // SAFETY: `attend_tile` made `keys` at the level it asks for.
                        unsafe { keys.scores::<C, $g>(queries, (valid, scale), score_fetch) }
                    };
                    for (h, state) in pass_states.chunks_exact_mut(stride).enumerate() {
                        rescales[h] = weigh(scores[h], span, state, &mut weights[h]);
                    }
                    let pass_weights = (&weights, &rescales);
                    // SAFETY: `attend_tile` made `values` at the level it asks for.
                    unsafe { values.accumulate::<C, $g>(pass_weights, (valid, first), pass_states) }
                }};
            }
            match heads {
                1 => pass!(1),
                2 => pass!(2),
                3 => pass!(3),
                _ => pass!(4),
            }
        }
    }
}

/// The exponentials of one query row's `scores` over the tile's positions `span` holds into
/// `weights` (zero elsewhere), after its running maximum and sum in `state` take the tile in;
/// returns the factor its output must be rescaled by (none for the first tile).
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
fn weigh(
    mut scores: [__m512; SCORE_VECTORS],
    span: RowSpan,
    state: &mut [f32],
    weights: &mut [f32; TILE],
) -> f32 {
    let RowSpan { skip, valid, first } = span;
    let keep = |group: usize| {
        lanes_mask(valid.saturating_sub(16 * group)) & !lanes_mask(skip.saturating_sub(16 * group))
    };
    if skip > 0 {
        // Positions before the window take no part in the maximum.
        for (group, scores) in scores.iter_mut().enumerate() {
            *scores = _mm512_mask_mov_ps(_mm512_set1_ps(f32::NEG_INFINITY), keep(group), *scores);
        }
    }
    let mut lane_max = scores[0];
    for &scores in &scores[1..] {
        lane_max = _mm512_max_ps(lane_max, scores);
    }
    // A maximum is the same in any order.
    let tile_max = _mm512_reduce_max_ps(lane_max);
    let (old_max, old_sum) = (state[state.len() - 2], state[state.len() - 1]);
    // The first tile has no output or sum to rescale.
    let (max, rescale) = if first {
        (tile_max, 0.0)
    } else {
        let max = old_max.max(tile_max);
        (max, _mm512_cvtss_f32(exp(_mm512_set1_ps(old_max - max))))
    };
    let mut total = _mm512_setzero_ps();
    for (group, &scores) in scores.iter().enumerate() {
        let w = _mm512_maskz_mov_ps(keep(group), exp(_mm512_sub_ps(scores, _mm512_set1_ps(max))));
        total = _mm512_add_ps(total, w);
        store(&mut weights[16 * group..], 0, w);
    }
    let tile_sum = reduce(total);
    let len = state.len();
    state[len - 2] = max;
    state[len - 1] = if first {
        tile_sum
    } else {
        old_sum * rescale + tile_sum
    };
    rescale
}

/// How the weighted value rows of a tile are added into the outputs of a pass's heads.
trait Values: Copy {
    /// The outputs of `G` heads (`states`, one after the other): rescaled, then the value
    /// rows of the first `valid` positions added in position order, weighted by `weights`.
    ///
    /// # Safety
    /// The CPU has the level the implementing type asks for.
    unsafe fn accumulate<const C: usize, const G: usize>(
        self,
        weights: (&[[f32; TILE]; 4], &[f32; 4]),
        rows: (usize, bool),
        states: &mut [f32],
    );
}

/// Value rows widened to f32 and added in f32 FMAs, each loaded once for all `G` heads (isa
/// level `avx512`).
#[derive(Clone, Copy)]
struct WideValues<'a, K>(KvRows<'a, K>);

/// The values of a bf16 cache for `vdpbf16ps` (isa level `avx512_bf16`): pair `i` of the
/// tile's positions is `C` vectors in `pairs` whose lane `l` of vector `c` holds element
/// `16c + l` of positions `2i` and `2i + 1` (see [`pair_values`]), added with the weights
/// rounded to bf16; a row's last position without a partner comes from `rows`, its rounded
/// weight multiplied in f32.
#[derive(Clone, Copy)]
struct PairedValues<'a, E> {
    runs: PairRuns<'a>,
    /// Where an odd last position's row is read: the cache's rows, or (`None`) the low
    /// halves of its pair in `runs`.
    last: Option<KvRows<'a, E>>,
}

/// The outputs of a pass, rescaled for the tile (cleared for the first).
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
fn rescaled<const C: usize, const G: usize>(
    rescales: &[f32; 4],
    first: bool,
    states: &[f32],
) -> [[__m512; C]; G] {
    let stride = state_len(16 * C);
    let mut acc = [[_mm512_setzero_ps(); C]; G];
    if !first {
        for (h, acc) in acc.iter_mut().enumerate() {
            let rescale = _mm512_set1_ps(rescales[h]);
            for (c, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_mul_ps(load(&states[h * stride..], c), rescale);
            }
        }
    }
    acc
}

/// `acc` into the outputs of a pass.
#[inline]
#[target_feature(enable = "avx512f")]
fn store_outputs<const C: usize, const G: usize>(acc: &[[__m512; C]; G], states: &mut [f32]) {
    let stride = state_len(16 * C);
    for (h, acc) in acc.iter().enumerate() {
        for (c, &acc) in acc.iter().enumerate() {
            store(&mut states[h * stride..], c, acc);
        }
    }
}

/// `acc[h] += weight(h) * value` for every head `h`, the value row loaded once for all.
#[inline]
#[target_feature(enable = "avx512f")]
fn add_weighted<K: CacheElement, const C: usize, const G: usize>(
    acc: &mut [[__m512; C]; G],
    value: &[K],
    weight: impl Fn(usize) -> f32,
) {
    let mut v = [_mm512_setzero_ps(); C];
    for (c, v) in v.iter_mut().enumerate() {
        *v = load_cached(value, c);
    }
    add_weighted_vectors(acc, v, weight);
}

/// [`add_weighted`] of a value row already in registers.
#[inline]
#[target_feature(enable = "avx512f")]
fn add_weighted_vectors<const C: usize, const G: usize>(
    acc: &mut [[__m512; C]; G],
    v: [__m512; C],
    weight: impl Fn(usize) -> f32,
) {
    for (h, acc) in acc.iter_mut().enumerate() {
        let weight = _mm512_set1_ps(weight(h));
        for (acc, &v) in acc.iter_mut().zip(&v) {
            *acc = _mm512_fmadd_ps(weight, v, *acc);
        }
    }
}

impl<K: CacheElement> Values for WideValues<'_, K> {
    /// # Safety
    /// As [`Values::accumulate`]: the CPU has isa level `avx512`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn accumulate<const C: usize, const G: usize>(
        self,
        (weights, rescales): (&[[f32; TILE]; 4], &[f32; 4]),
        (valid, first): (usize, bool),
        states: &mut [f32],
    ) {
        let mut acc = rescaled::<C, G>(rescales, first, states);
        let weight = |h: usize, j: usize| weights[h][j];
        for j in 0..valid {
            add_weighted(&mut acc, self.0.row(j), |h| weight(h, j));
        }
        store_outputs(&acc, states);
    }
}

impl<E: CacheElement> Values for PairedValues<'_, E> {
    /// # Safety
    /// As [`Values::accumulate`]: the CPU has isa level `avx512_bf16`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
    unsafe fn accumulate<const C: usize, const G: usize>(
        self,
        (weights, rescales): (&[[f32; TILE]; 4], &[f32; 4]),
        (valid, first): (usize, bool),
        states: &mut [f32],
    ) {
        let mut acc = rescaled::<C, G>(rescales, first, states);
        // Each head's weights rounded to bf16, two positions per 32-bit lane.
        let mut weight_pairs = [[0u32; TILE / 2]; G];
        for (pairs, weights) in weight_pairs.iter_mut().zip(weights) {
            for (k, chunk) in pairs.chunks_exact_mut(16).enumerate() {
                let (low, high) = (load(weights, 2 * k), load(weights, 2 * k + 1));
                let rounded = _mm512_cvtne2ps_pbh(high, low);
                let bits = bf16_lanes_as_bits(rounded);
                // SAFETY: `chunk` holds 16 u32s.
                unsafe { _mm512_storeu_si512(chunk.as_mut_ptr().cast(), bits) };
            }
        }
        for pair in 0..valid / 2 {
            let mut v = [bits_as_bf16_lanes(_mm512_setzero_si512()); C];
            for (c, v) in v.iter_mut().enumerate() {
                *v = bits_as_bf16_lanes(self.runs.vector(pair / 8, (pair % 8) * C + c));
            }
            for (acc, weights) in acc.iter_mut().zip(&weight_pairs) {
                let weight = _mm512_set1_epi32(weights[pair] as i32);
                let weight = bits_as_bf16_lanes(weight);
                for (acc, &v) in acc.iter_mut().zip(&v) {
                    *acc = _mm512_dpbf16_ps(*acc, weight, v);
                }
            }
        }
        if valid % 2 == 1 {
            // The rounded weight: the low half of the last pair.
            let rounded = |h: usize| f32::from_bits((weight_pairs[h][valid / 2] & 0xffff) << 16);
            match self.last {
                Some(rows) => add_weighted(&mut acc, rows.row(valid - 1), rounded),
                None => {
                    // The even position of pair `valid / 2`: the low halves, widened as a
                    // row's bf16 would be.
                    let pair = valid / 2;
                    let v: [__m512; C] = std::array::from_fn(|c| {
                        let lanes = self.runs.vector(pair / 8, (pair % 8) * C + c);
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(lanes))
                    });
                    add_weighted_vectors(&mut acc, v, rounded);
                }
            }
        }
        store_outputs(&acc, states);
    }
}

/// Score vectors of one tile.
const SCORE_VECTORS: usize = TILE / 16;

/// 32 bf16 lanes seen as the 512 bits they are.
#[inline]
fn bf16_lanes_as_bits(v: __m512bh) -> __m512i {
    // SAFETY: both are 512 bits, valid for every bit pattern.
    unsafe { std::mem::transmute::<__m512bh, __m512i>(v) }
}

/// 512 bits seen as 32 bf16 lanes.
#[inline]
fn bits_as_bf16_lanes(v: __m512i) -> __m512bh {
    // SAFETY: both are 512 bits, valid for every bit pattern.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// Sixteen f32s from element `16 * c` of `row`.
#[inline]
#[target_feature(enable = "avx512f")]
fn load(row: &[f32], c: usize) -> __m512 {
    let chunk = &row[16 * c..16 * c + 16];
    // SAFETY: `chunk` holds 16 f32s.
    unsafe { _mm512_loadu_ps(chunk.as_ptr()) }
}

/// `v` into the sixteen f32s from element `16 * c` of `row`.
#[inline]
#[target_feature(enable = "avx512f")]
fn store(row: &mut [f32], c: usize, v: __m512) {
    let chunk = &mut row[16 * c..16 * c + 16];
    // SAFETY: `chunk` holds 16 f32s.
    unsafe { _mm512_storeu_ps(chunk.as_mut_ptr(), v) }
}

/// Sixteen cache elements from element `16 * c` of `row`, widened to f32.
#[inline]
#[target_feature(enable = "avx512f")]
fn load_cached<E: CacheElement>(row: &[E], c: usize) -> __m512 {
    let chunk = &row[16 * c..16 * c + 16];
    // SAFETY: `chunk` holds 16 elements.
    unsafe { <E as crate::linear::avx512::Wide>::load(chunk.as_ptr()) }
}

/// A mask of the first `min(16, len)` lanes.
fn lanes_mask(len: usize) -> __mmask16 {
    ((1u32 << len.min(16)) - 1) as __mmask16
}
