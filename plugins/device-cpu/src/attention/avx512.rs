//! AVX-512 online-softmax tile for heads of 64 or 128: a tile's keys and values widened once for every row of the block, then per row sixteen scores at a time and the output in registers.
//!
//! Scores are sixteen 16-lane dot products and one transposed reduction
//! (`sum_lanes_of_each`) that adds each product's lanes in a fixed tree; exponentials are
//! vectorized ([`exp`]); the output lanes are FMA chains over the tile's positions in order.
//! None of it depends on the other rows of the block.

use std::arch::x86_64::{
    __m512, __m512bh, __m512i, __mmask16, _mm512_add_ps, _mm512_castps_si512, _mm512_castsi512_ps,
    _mm512_cvtne2ps_pbh, _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_loadu_si512,
    _mm512_mask_mov_ps, _mm512_maskz_mov_ps, _mm512_max_ps, _mm512_mul_ps,
    _mm512_permutex2var_epi16, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps,
    _mm512_storeu_ps, _mm512_storeu_si512, _mm512_sub_ps,
};

use super::online::{KvTile, QueryBlock, RowSpan, TILE, TileStatistics, state_len};
use crate::kv_cache::CacheElement;
use crate::vector::avx512::{exp, reduce, sum_lanes_of_each};

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
    scale: f32,
    states: &mut [f32],
    buffer: &mut [f32],
) {
    let rows = (block, tile, bf16_keys);
    // Compiled twice, so the tiles that fetch nothing (a prefill's) carry no fetch points.
    if tile.ahead.is_empty() {
        // SAFETY: the caller's promise, passed on.
        unsafe { attend_tile_with::<E, C>(rows, |_, _| {}, scale, states, buffer) }
    } else {
        let fetch = |part, parts| tile.fetch_ahead(part, parts, 16 * C);
        // SAFETY: as above.
        unsafe { attend_tile_with::<E, C>(rows, fetch, scale, states, buffer) }
    }
}

/// [`attend_tile`], with `fetch(part, parts)` at the fetch points of the first token's score
/// groups.
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
    let in_cache = |data| KvRows::at(data, tile.offsets, head_dim);
    if let (Some(keys), Some(values)) = (bf16_keys, E::bf16_bits(tile.values)) {
        // SAFETY: bf16 keys come only with isa level `avx512_bf16` (the contract).
        unsafe { pair_values::<C>(values, tile.offsets, value_buffer) };
        let values = PairedValues {
            pairs: value_buffer,
            rows: KvRows::at(tile.values, tile.offsets, head_dim),
        };
        return attend_rows::<_, _, C>(rows, (Bf16Keys(in_cache(keys)), values), updates);
    }
    if block.tokens * block.heads <= DIRECT_ROWS {
        let kv = (
            WideKeys(KvRows::at(tile.keys, tile.offsets, head_dim)),
            WideValues(KvRows::at(tile.values, tile.offsets, head_dim)),
        );
        return attend_rows::<_, _, C>(rows, kv, updates);
    }
    for (cache, buffer) in [
        (tile.keys, &mut *key_buffer),
        (tile.values, &mut *value_buffer),
    ] {
        for (j, &offset) in tile.offsets.iter().enumerate() {
            let row = &cache[offset..offset + head_dim];
            for c in 0..C {
                store(&mut buffer[j * head_dim..], c, load_cached(row, c));
            }
        }
    }
    let kv = (
        WideKeys(KvRows::packed(key_buffer, head_dim)),
        WideValues(KvRows::packed(value_buffer, head_dim)),
    );
    attend_rows::<_, _, C>(rows, kv, updates)
}

/// How a query row's scores against a tile's keys are computed.
trait Scores: Copy {
    /// The scaled scores of `query` against the tile's first `valid` keys, sixteen per vector;
    /// the lanes past `valid` are negative infinity. `fetch(g)` runs after each group `g` of
    /// sixteen keys.
    ///
    /// # Safety
    /// The CPU has the level the implementing type asks for.
    unsafe fn scores<const C: usize>(
        self,
        query: &[f32],
        valid: usize,
        scale: f32,
        fetch: impl Fn(usize),
    ) -> [__m512; SCORE_VECTORS];
}

/// Keys widened to f32 and multiplied in f32 FMAs (isa level `avx512`).
#[derive(Clone, Copy)]
struct WideKeys<'a, K>(KvRows<'a, K>);

/// Keys as stored in a bf16 cache, multiplied by the query rounded to bf16 through
/// `vdpbf16ps` (isa level `avx512_bf16`).
#[derive(Clone, Copy)]
struct Bf16Keys<'a>(KvRows<'a, u16>);

impl<K: CacheElement> Scores for WideKeys<'_, K> {
    /// # Safety
    /// As [`Scores::scores`]: the CPU has isa level `avx512`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn scores<const C: usize>(
        self,
        query: &[f32],
        valid: usize,
        scale: f32,
        fetch: impl Fn(usize),
    ) -> [__m512; SCORE_VECTORS] {
        let q: [__m512; C] = std::array::from_fn(|c| load(query, c));
        score_groups((valid, scale), fetch, |j| {
            let key = self.0.row(j);
            let mut acc = _mm512_mul_ps(q[0], load_cached(key, 0));
            for (c, &q) in q.iter().enumerate().skip(1) {
                acc = _mm512_fmadd_ps(q, load_cached(key, c), acc);
            }
            acc
        })
    }
}

impl Scores for Bf16Keys<'_> {
    /// # Safety
    /// As [`Scores::scores`]: the CPU has isa level `avx512_bf16`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
    unsafe fn scores<const C: usize>(
        self,
        query: &[f32],
        valid: usize,
        scale: f32,
        fetch: impl Fn(usize),
    ) -> [__m512; SCORE_VECTORS] {
        // Pairs of query vectors rounded into one vector of 32 bf16s; `C` is even.
        let q: [__m512bh; 4] = std::array::from_fn(|i| {
            if 2 * i + 1 < C {
                _mm512_cvtne2ps_pbh(load(query, 2 * i + 1), load(query, 2 * i))
            } else {
                _mm512_cvtne2ps_pbh(_mm512_setzero_ps(), _mm512_setzero_ps())
            }
        });
        score_groups((valid, scale), fetch, |j| {
            let key = self.0.row(j);
            let mut acc = _mm512_setzero_ps();
            for (i, &q) in q.iter().enumerate().take(C / 2) {
                let chunk = &key[32 * i..32 * i + 32];
                // SAFETY: `chunk` holds 32 bf16s.
                let k = unsafe {
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                        chunk.as_ptr().cast(),
                    ))
                };
                acc = _mm512_dpbf16_ps(acc, q, k);
            }
            acc
        })
    }
}

/// The scaled scores of the first `valid` keys from `product(j)`, key `j`'s sixteen partial
/// sums: one transposed reduction per sixteen keys, negative infinity past `valid`.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
fn score_groups(
    (valid, scale): (usize, f32),
    fetch: impl Fn(usize),
    product: impl Fn(usize) -> __m512,
) -> [__m512; SCORE_VECTORS] {
    let mut scores = [_mm512_set1_ps(f32::NEG_INFINITY); SCORE_VECTORS];
    for (group, scores) in scores.iter_mut().enumerate() {
        let count = valid.saturating_sub(16 * group).min(16);
        if count == 0 {
            break;
        }
        let mut products = [_mm512_setzero_ps(); 16];
        for (j, p) in products[..count].iter_mut().enumerate() {
            *p = product(16 * group + j);
        }
        let sums = _mm512_mul_ps(sum_lanes_of_each(&products), _mm512_set1_ps(scale));
        *scores = _mm512_mask_mov_ps(*scores, lanes_mask(count), sums);
        fetch(group);
    }
    scores
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
            for (h, state) in pass_states.chunks_exact_mut(stride).enumerate() {
                let head = pass * pass_heads + h;
                let query = block.query(token, head, head_dim);
                // The first token's score groups fetch the next tile, a part each.
                let parts = block.heads * SCORE_VECTORS;
                let fetch = |group| {
                    if token == 0 {
                        fetch(head * SCORE_VECTORS + group, parts)
                    }
                };
                // SAFETY: `attend_tile` made `keys` at the level it asks for.
                let scores = unsafe { keys.scores::<C>(query, valid, scale, fetch) };
                rescales[h] = weigh(scores, span, state, &mut weights[h]);
            }
            let pass_weights = (&weights, &rescales);
            macro_rules! accumulate {
                ($g:literal) => {
                    // SAFETY: `attend_tile` made `values` at the level it asks for.
                    unsafe { values.accumulate::<C, $g>(pass_weights, (valid, first), pass_states) }
                };
            }
            match heads {
                1 => accumulate!(1),
                2 => accumulate!(2),
                3 => accumulate!(3),
                _ => accumulate!(4),
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
    let lane_max = scores
        .iter()
        .fold(_mm512_set1_ps(f32::NEG_INFINITY), |m, &s| {
            _mm512_max_ps(m, s)
        });
    let tile_max = to_array(lane_max)
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let statistics = TileStatistics::new(state, tile_max, first);
    let max = statistics.max;
    let mut total = _mm512_setzero_ps();
    for (group, &scores) in scores.iter().enumerate() {
        let w = _mm512_maskz_mov_ps(keep(group), exp(_mm512_sub_ps(scores, _mm512_set1_ps(max))));
        total = _mm512_add_ps(total, w);
        store(&mut weights[16 * group..], 0, w);
    }
    statistics.store(state, reduce(total));
    statistics.rescale
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
    pairs: &'a [f32],
    rows: KvRows<'a, E>,
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
    std::array::from_fn(|h| {
        if first {
            [_mm512_setzero_ps(); C]
        } else {
            let rescale = _mm512_set1_ps(rescales[h]);
            std::array::from_fn(|c| _mm512_mul_ps(load(&states[h * stride..], c), rescale))
        }
    })
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
    let v: [__m512; C] = std::array::from_fn(|c| load_cached(value, c));
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
        let weight_pairs: [[u32; TILE / 2]; G] = std::array::from_fn(|h| {
            let mut pairs = [0u32; TILE / 2];
            for (k, chunk) in pairs.chunks_exact_mut(16).enumerate() {
                let (low, high) = (load(&weights[h], 2 * k), load(&weights[h], 2 * k + 1));
                let rounded = _mm512_cvtne2ps_pbh(high, low);
                let bits = bf16_lanes_as_bits(rounded);
                // SAFETY: `chunk` holds 16 u32s.
                unsafe { _mm512_storeu_si512(chunk.as_mut_ptr().cast(), bits) };
            }
            pairs
        });
        for pair in 0..valid / 2 {
            let v: [__m512bh; C] = std::array::from_fn(|c| {
                let lanes = _mm512_castps_si512(load(&self.pairs[(pair * C + c) * 16..], 0));
                bits_as_bf16_lanes(lanes)
            });
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
            add_weighted(&mut acc, self.rows.row(valid - 1), rounded);
        }
        store_outputs(&acc, states);
    }
}

/// The value rows of a bf16 tile (`bits` at `offsets`) interleaved in pairs of positions
/// into `pairs`, as [`PairedValues`] reads them; an odd last row stays out.
///
/// # Safety
/// The CPU has isa level `avx512_bf16`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")]
unsafe fn pair_values<const C: usize>(bits: &[u16], offsets: &[usize], pairs: &mut [f32]) {
    let head_dim = 16 * C;
    // Lanes of the first and second rows, alternately: elements 0..16, then 16..32.
    let low: [i16; 32] = std::array::from_fn(|i| (i / 2 + 32 * (i % 2)) as i16);
    let high: [i16; 32] = std::array::from_fn(|i| (16 + i / 2 + 32 * (i % 2)) as i16);
    // SAFETY: both arrays hold 32 i16s.
    let (low, high) = unsafe {
        (
            _mm512_loadu_si512(low.as_ptr().cast()),
            _mm512_loadu_si512(high.as_ptr().cast()),
        )
    };
    for (pair, rows) in offsets.chunks_exact(2).enumerate() {
        let (a, b) = (
            &bits[rows[0]..rows[0] + head_dim],
            &bits[rows[1]..rows[1] + head_dim],
        );
        for half in 0..C / 2 {
            let (a, b) = (&a[32 * half..32 * half + 32], &b[32 * half..32 * half + 32]);
            // SAFETY: `a` and `b` hold 32 u16s each.
            let (a, b) = unsafe {
                (
                    _mm512_loadu_si512(a.as_ptr().cast()),
                    _mm512_loadu_si512(b.as_ptr().cast()),
                )
            };
            for (i, index) in [low, high].into_iter().enumerate() {
                let c = 2 * half + i;
                let lanes = _mm512_permutex2var_epi16(a, index, b);
                store(
                    &mut pairs[(pair * C + c) * 16..],
                    0,
                    _mm512_castsi512_ps(lanes),
                );
            }
        }
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

#[inline]
#[target_feature(enable = "avx512f")]
fn to_array(v: __m512) -> [f32; 16] {
    let mut lanes = [0.0f32; 16];
    store(&mut lanes, 0, v);
    lanes
}

/// A mask of the first `min(16, len)` lanes.
fn lanes_mask(len: usize) -> __mmask16 {
    ((1u32 << len.min(16)) - 1) as __mmask16
}
