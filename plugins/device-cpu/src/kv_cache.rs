//! `kv_write`: storing this step's keys and values into the paged cache at their slots, in the cache's element type.
//!
//! A cache is `[B, Hk, bs, D]`: slot `s` is offset `s % bs` of block `s / bs`, and inside a
//! block each KV head's `bs` rows lie together, so attention reads one head's rows of a
//! block as one contiguous run. A negative slot skips its token (padding, or a token whose KV
//! is already cached). Caches hold f32, or f16 or bf16 rounded to nearest even: half the
//! bytes for attention to read back at every decode step.
//!
//! Where the AVX-512 BF16 attention tile multiplies a bf16 cache as stored ([`arranged`]),
//! each run of sixteen slots of a head's rows is kept in the order that tile reads
//! ([`KvOrder::Pairs`]) instead of row by row: the keys as sixteen columns of dimension pairs
//! (element `d` of slot `j` at `((d / 2) · 16 + j) · 2 + d % 2`), the values as pairs of
//! slots (at `((j / 2) · D + d) · 2 + j % 2`). A tile then reads a run as it lies, rather
//! than transposing keys and interleaving values at every step, which cost a decode step at
//! depth about twice the products themselves. The run takes the place of its sixteen rows,
//! so a block still spans the same bytes and moves as a whole.

use std::marker::PhantomData;
use std::ops::Range;

use plughost_device_abi::DType;
use plughost_device_abi::export::{DeviceFailure, FloatRowsMut, Launch, RowsMut};

use crate::Context;
pub use plughost_device_abi::kv_cache::CacheLayout;

use crate::isa::{Isa, IsaLevel};
use crate::linear::{Bf16Bits, Bf16Products, F16Bits, as_wide_mut};

/// Slots per run of a cache kept in [`KvOrder::Pairs`].
pub const RUN: usize = 16;

/// How a head's rows lie inside a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvOrder {
    /// One row of `D` elements per slot.
    Rows,
    /// Runs of [`RUN`] slots in the AVX-512 BF16 tile's order (see the module docs).
    Pairs,
}

/// The order a device at `isa` with `products` keeps a cache of `layout` in: pairs where the
/// attention kernel multiplies a bf16 cache as stored (`avx512_bf16`, bf16 products, heads of
/// 64 or 128) and blocks hold whole runs, rows otherwise. One function for the writer and
/// the readers, so they always agree.
pub fn arranged(isa: Isa, products: Bf16Products, bf16: bool, layout: &CacheLayout) -> KvOrder {
    let tile = cfg!(target_arch = "x86_64")
        && isa.has(IsaLevel::Avx512Bf16)
        && products == Bf16Products::Bf16
        && matches!(layout.head_dim, 64 | 128);
    if bf16 && tile && layout.block_size.is_multiple_of(RUN) && layout.block_size > 0 {
        KvOrder::Pairs
    } else {
        KvOrder::Rows
    }
}

/// Where element `d` of slot `slot`'s key (or value) row of KV head `kv_head` lies in a cache
/// kept in `order`: what the tests check `kv_write` against.
#[cfg(test)]
pub fn element_at(
    layout: &CacheLayout,
    order: KvOrder,
    (slot, kv_head, d): (usize, usize, usize),
    value: bool,
) -> usize {
    match order {
        KvOrder::Rows => layout.row(slot, kv_head) + d,
        KvOrder::Pairs => {
            let j = slot % RUN;
            // The run's first row: blocks hold whole runs, so it is in the same block.
            layout.row(slot - j, kv_head) + in_run((j, d), layout.head_dim, value)
        }
    }
}

/// Where element `d` of the run's `j`-th slot lies within a run of [`KvOrder::Pairs`].
fn in_run((j, d): (usize, usize), head_dim: usize, value: bool) -> usize {
    if value {
        ((j / 2) * head_dim + d) * 2 + j % 2
    } else {
        ((d / 2) * RUN + j) * 2 + d % 2
    }
}

/// What a KV cache may hold; the AVX-512 attention kernel loads sixteen at a time.
#[cfg(target_arch = "x86_64")]
pub trait CacheElement:
    Copy + Send + Sync + crate::linear::avx512::Wide + crate::linear::avx2::Wide
{
    fn from_f32(value: f32) -> Self;
    fn to_f32(self) -> f32;
    /// A cache of bf16 as its bits, for kernels that multiply bf16 as stored; `None` for the
    /// other element types.
    fn bf16_bits(cache: &[Self]) -> Option<&[u16]> {
        let _ = cache;
        None
    }
}

/// What a KV cache may hold.
#[cfg(not(target_arch = "x86_64"))]
pub trait CacheElement: Copy + Send + Sync {
    fn from_f32(value: f32) -> Self;
    fn to_f32(self) -> f32;
    /// As on x86-64, where kernels multiply bf16 as stored; none do here.
    fn bf16_bits(cache: &[Self]) -> Option<&[u16]> {
        let _ = cache;
        None
    }
}

impl CacheElement for f32 {
    fn from_f32(value: f32) -> f32 {
        value
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl CacheElement for Bf16Bits {
    fn from_f32(value: f32) -> Bf16Bits {
        Bf16Bits::from_f32(value)
    }
    fn to_f32(self) -> f32 {
        Bf16Bits::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    fn bf16_bits(cache: &[Bf16Bits]) -> Option<&[u16]> {
        Some(crate::linear::as_bits(cache))
    }
}

impl CacheElement for F16Bits {
    fn from_f32(value: f32) -> F16Bits {
        F16Bits::from_f32(value)
    }
    fn to_f32(self) -> f32 {
        F16Bits::to_f32(self)
    }
}

/// A cache `kv_write` stores into, borrowed one row at a time: a launch never holds a `&mut`
/// over the blocks it does not write, which a copy out may be reading meanwhile.
pub trait CacheRows<E> {
    /// Elements of the whole cache.
    fn len(&self) -> usize;
    fn rows(&mut self, range: Range<usize>) -> &mut [E];
}

impl<E> CacheRows<E> for &mut [E] {
    fn len(&self) -> usize {
        <[E]>::len(self)
    }
    fn rows(&mut self, range: Range<usize>) -> &mut [E] {
        &mut self[range]
    }
}

impl CacheRows<f32> for RowsMut<'_, f32> {
    fn len(&self) -> usize {
        RowsMut::len(self)
    }
    fn rows(&mut self, range: Range<usize>) -> &mut [f32] {
        RowsMut::rows(self, range)
    }
}

/// An f16 or bf16 cache passed as its bits, written as `E`.
struct HalfRows<'l, E>(RowsMut<'l, u16>, PhantomData<E>);

impl CacheRows<Bf16Bits> for HalfRows<'_, Bf16Bits> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn rows(&mut self, range: Range<usize>) -> &mut [Bf16Bits] {
        as_wide_mut(self.0.rows(range))
    }
}

impl CacheRows<F16Bits> for HalfRows<'_, F16Bits> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn rows(&mut self, range: Range<usize>) -> &mut [F16Bits] {
        as_wide_mut(self.0.rows(range))
    }
}

/// The rows of one step's keys or values, `Hk*D` wide.
pub struct KvRows<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
}

/// Writes row `t` of `rows` into slot `slot_mapping[t]` of each cache, rounded to the caches'
/// element type. Every slot is checked before anything is written, so a failed launch leaves
/// the caches as they were.
pub fn kv_write<E: CacheElement>(
    rows: KvRows<'_>,
    (mut key_cache, mut value_cache): (impl CacheRows<E>, impl CacheRows<E>),
    slot_mapping: &[i32],
    (layout, order): (CacheLayout, KvOrder),
) -> Result<(), String> {
    let width = layout.slot_width();
    let num_slots = key_cache.len().checked_div(width).unwrap_or(0);
    for (row, &slot) in slot_mapping.iter().enumerate() {
        if slot >= 0 && slot as usize >= num_slots {
            return Err(format!(
                "slot_mapping[{row}] = {slot} is outside the {num_slots} cache slots"
            ));
        }
    }
    for (row, &slot) in slot_mapping.iter().enumerate() {
        let Ok(slot) = usize::try_from(slot) else {
            continue;
        };
        let head_dim = layout.head_dim;
        for kv_head in 0..layout.num_kv_heads {
            let source = (row * layout.num_kv_heads + kv_head) * head_dim;
            let source = source..source + head_dim;
            if order == KvOrder::Rows {
                let target = layout.row(slot, kv_head);
                let target = target..target + head_dim;
                store(key_cache.rows(target.clone()), &rows.keys[source.clone()]);
                store(value_cache.rows(target), &rows.values[source]);
                continue;
            }
            // The slot's run, borrowed whole: its elements are spread over the run.
            let (j, run) = (slot % RUN, layout.row(slot - slot % RUN, kv_head));
            let run = run..run + RUN * head_dim;
            let key_run = key_cache.rows(run.clone());
            for (d, &key) in rows.keys[source.clone()].iter().enumerate() {
                key_run[in_run((j, d), head_dim, false)] = E::from_f32(key);
            }
            let value_run = value_cache.rows(run);
            for (d, &value) in rows.values[source].iter().enumerate() {
                value_run[in_run((j, d), head_dim, true)] = E::from_f32(value);
            }
        }
    }
    Ok(())
}

fn store<E: CacheElement>(target: &mut [E], source: &[f32]) {
    for (element, &value) in target.iter_mut().zip(source) {
        *element = E::from_f32(value);
    }
}

/// A copy of a cache written row by row (`rows`), in `order`: how tests and benchmarks
/// build the caches `kv_write` would have written.
#[cfg(test)]
pub fn in_order<E: CacheElement>(
    rows: &[E],
    layout: &CacheLayout,
    order: KvOrder,
    value: bool,
) -> Vec<E> {
    let mut out = rows.to_vec();
    let slots = rows.len() / layout.slot_width().max(1);
    for slot in 0..slots {
        for kv_head in 0..layout.num_kv_heads {
            for d in 0..layout.head_dim {
                let at = element_at(layout, order, (slot, kv_head, d), value);
                out[at] = rows[layout.row(slot, kv_head) + d];
            }
        }
    }
    out
}

pub(crate) fn run(launch: &mut Launch<'_>, context: &Context) -> Result<(), DeviceFailure> {
    let layout = CacheLayout {
        block_size: launch.dim("bs"),
        num_kv_heads: launch.dim("Hk"),
        head_dim: launch.dim("D"),
    };
    let bf16 = launch.dtype("key_cache") == DType::BF16;
    let order = arranged(context.isa, context.bf16_products, bf16, &layout);
    let mut views = launch.views()?;
    let rows = KvRows {
        keys: views.f32("k"),
        values: views.f32("v"),
    };
    let slot_mapping = views.i32("slot_mapping");
    let caches = (
        views.float_rows_mut("key_cache"),
        views.float_rows_mut("value_cache"),
    );
    let written = match caches {
        (FloatRowsMut::F32(keys), FloatRowsMut::F32(values)) => {
            kv_write(rows, (keys, values), slot_mapping, (layout, order))
        }
        (FloatRowsMut::BF16(keys), FloatRowsMut::BF16(values)) => kv_write::<Bf16Bits>(
            rows,
            (HalfRows(keys, PhantomData), HalfRows(values, PhantomData)),
            slot_mapping,
            (layout, order),
        ),
        (FloatRowsMut::F16(keys), FloatRowsMut::F16(values)) => kv_write::<F16Bits>(
            rows,
            (HalfRows(keys, PhantomData), HalfRows(values, PhantomData)),
            slot_mapping,
            (layout, order),
        ),
        // The ABI checks refuse this before a launch reaches the device.
        _ => Err("the key and value caches have different dtypes".to_string()),
    };
    written.map_err(DeviceFailure::launch_failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::HalfBits;
    use crate::test_support::noise;

    /// One KV head of `head_dim`: a slot is one contiguous row, wherever the block boundaries.
    fn single_head(head_dim: usize) -> CacheLayout {
        CacheLayout {
            block_size: 2,
            num_kv_heads: 1,
            head_dim,
        }
    }

    #[test]
    fn each_heads_rows_of_a_block_lie_together() {
        // Two blocks of two slots, two KV heads of two elements: block 1 is
        // [head 0: slot 2, slot 3][head 1: slot 2, slot 3].
        let layout = CacheLayout {
            block_size: 2,
            num_kv_heads: 2,
            head_dim: 2,
        };
        let keys = [1.0, 2.0, 3.0, 4.0];
        let values = keys.map(|v| -v);
        let (mut key_cache, mut value_cache) = (vec![0.0; 16], vec![0.0; 16]);
        let rows = KvRows {
            keys: &keys,
            values: &values,
        };
        kv_write(
            rows,
            (&mut key_cache[..], &mut value_cache[..]),
            &[3],
            (layout, KvOrder::Rows),
        )
        .unwrap();
        let mut expected = vec![0.0; 16];
        expected[10..12].copy_from_slice(&[1.0, 2.0]);
        expected[14..16].copy_from_slice(&[3.0, 4.0]);
        assert_eq!(key_cache, expected);
        assert_eq!(value_cache, expected.iter().map(|v| -v).collect::<Vec<_>>());
        assert_eq!((layout.row(3, 0), layout.row(3, 1)), (10, 14));
    }

    #[test]
    fn writes_rows_at_their_slots_and_skips_negative_ones() {
        let width = 2;
        let keys = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let values = keys.map(|v| -v);
        // Four slots; rows 0 and 2 land in slots 3 and 0, row 1 is skipped.
        let mut key_cache = vec![9.0; 8];
        let mut value_cache = vec![9.0; 8];
        let rows = KvRows {
            keys: &keys,
            values: &values,
        };
        kv_write(
            rows,
            (&mut key_cache[..], &mut value_cache[..]),
            &[3, -1, 0],
            (single_head(width), KvOrder::Rows),
        )
        .unwrap();
        assert_eq!(key_cache, [5.0, 6.0, 9.0, 9.0, 9.0, 9.0, 1.0, 2.0]);
        assert_eq!(value_cache, [-5.0, -6.0, 9.0, 9.0, 9.0, 9.0, -1.0, -2.0]);
    }

    #[test]
    fn half_width_caches_store_rounded_values() {
        // 1 + 2^-8 is halfway between two bf16 values and goes to the even one; 1 + 2^-12 is
        // a quarter of f16's step at 1; 70000 is past f16's largest finite value.
        let keys = [1.0 + 1.0 / 256.0, -2.5, 1.0 + 1.0 / 4096.0, 70000.0];
        let values = keys.map(|v| -v);
        let rows = || KvRows {
            keys: &keys,
            values: &values,
        };
        let mut bf16_keys = [Bf16Bits::from_f32(9.0); 4];
        let mut bf16_values = bf16_keys;
        kv_write(
            rows(),
            (&mut bf16_keys[..], &mut bf16_values[..]),
            &[1, -1],
            (single_head(2), KvOrder::Rows),
        )
        .unwrap();
        let widened: Vec<f32> = bf16_keys.iter().map(|b| b.to_f32()).collect();
        assert_eq!(widened, [9.0, 9.0, 1.0, -2.5]);
        assert_eq!(bf16_values[2].to_f32(), -1.0);
        let mut f16_keys = [F16Bits::from_f32(0.0); 4];
        let mut f16_values = f16_keys;
        kv_write(
            rows(),
            (&mut f16_keys[..], &mut f16_values[..]),
            &[-1, 0],
            (single_head(2), KvOrder::Rows),
        )
        .unwrap();
        let widened: Vec<f32> = f16_keys.iter().map(|b| b.to_f32()).collect();
        assert_eq!(widened, [1.0, f32::INFINITY, 0.0, 0.0]);
    }

    /// Writes rows of awkward values into a cache of `E` through its `u16` bits, the way
    /// `run` does, and checks every element against `round` (the `half` crate's rounding).
    fn stores_what_half_rounds_to<E: CacheElement + HalfBits>(round: fn(f32) -> u16, what: &str) {
        // Ties (to even) for bf16 and for f16, values below f16's normal range and below f32's,
        // overflow to infinity, signed zero, and NaNs whose payload lies only in bits the
        // rounding drops (which must stay NaN, not become infinity).
        let specials = [
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            1.0 + 1.0 / 2048.0,
            -(1.0 + 3.0 / 2048.0),
            3e-8,
            -6e-8,
            1e-40,
            65519.0,
            65520.0,
            -70000.0,
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xff80_1234),
        ];
        let width = 8;
        let tokens = 6;
        let keys: Vec<f32> = specials
            .iter()
            .copied()
            .chain((0..).map(|i| 3.0 * noise(11, i)))
            .take(tokens * width)
            .collect();
        let values: Vec<f32> = keys.iter().rev().map(|v| -v).collect();
        let slot_mapping = [4, -1, 0, 6, -3, 2];
        const UNTOUCHED: u16 = 0xabcd;
        let mut key_bits = vec![UNTOUCHED; 8 * width];
        let mut value_bits = key_bits.clone();
        let rows = KvRows {
            keys: &keys,
            values: &values,
        };
        let caches = (
            as_wide_mut::<E>(&mut key_bits),
            as_wide_mut(&mut value_bits),
        );
        kv_write(
            rows,
            caches,
            &slot_mapping,
            (single_head(width), KvOrder::Rows),
        )
        .unwrap();
        for (cache, source, which) in [(&key_bits, &keys, "key"), (&value_bits, &values, "value")] {
            for (slot, row) in cache.chunks_exact(width).enumerate() {
                let token = slot_mapping.iter().position(|&s| s == slot as i32);
                for (i, &bits) in row.iter().enumerate() {
                    let expected = match token {
                        Some(token) => round(source[token * width + i]),
                        None => UNTOUCHED,
                    };
                    assert_eq!(
                        bits, expected,
                        "{what} {which} cache, slot {slot}, element {i}: {bits:#06x}"
                    );
                }
            }
        }
        assert!(CacheElement::to_f32(E::from_f32(f32::from_bits(0x7f80_0001))).is_nan());
    }

    #[test]
    fn half_width_caches_hold_exactly_what_half_rounds_to() {
        stores_what_half_rounds_to::<Bf16Bits>(|v| half::bf16::from_f32(v).to_bits(), "bf16");
        stores_what_half_rounds_to::<F16Bits>(|v| half::f16::from_f32(v).to_bits(), "f16");
    }

    #[test]
    fn an_out_of_range_slot_writes_nothing() {
        let mut key_cache = vec![9.0; 4];
        let mut value_cache = vec![9.0; 4];
        let rows = KvRows {
            keys: &[1.0; 4],
            values: &[1.0; 4],
        };
        let message = kv_write(
            rows,
            (&mut key_cache[..], &mut value_cache[..]),
            &[0, 2],
            (single_head(2), KvOrder::Rows),
        )
        .unwrap_err();
        assert_eq!(message, "slot_mapping[1] = 2 is outside the 2 cache slots");
        assert_eq!((key_cache, value_cache), (vec![9.0; 4], vec![9.0; 4]));
    }

    #[test]
    fn a_cache_in_pairs_holds_the_rows_kv_write_keeps_in_rows_in_run_order() {
        let layout = CacheLayout {
            block_size: 32,
            num_kv_heads: 2,
            head_dim: 64,
        };
        let slots = 3 * layout.block_size;
        let width = layout.slot_width();
        let written: Vec<i32> = [0, 1, 15, 16, 17, 31, 40, 63, 64, 95].to_vec();
        let keys: Vec<f32> = (0..written.len() * width).map(|i| noise(3, i)).collect();
        let values: Vec<f32> = (0..written.len() * width).map(|i| noise(4, i)).collect();
        let rows = || KvRows {
            keys: &keys,
            values: &values,
        };
        // f32 elements: where each lands does not depend on the element type.
        let write = |order| {
            let (mut k, mut v) = (vec![0.0f32; slots * width], vec![0.0f32; slots * width]);
            kv_write(rows(), (&mut k[..], &mut v[..]), &written, (layout, order)).unwrap();
            (k, v)
        };
        let (row_keys, row_values) = write(KvOrder::Rows);
        let (pair_keys, pair_values) = write(KvOrder::Pairs);
        assert_eq!(
            in_order(&row_keys, &layout, KvOrder::Pairs, false),
            pair_keys
        );
        assert_eq!(
            in_order(&row_values, &layout, KvOrder::Pairs, true),
            pair_values
        );
        // Dimensions 2 and 3 of slot 17's key sit side by side in lane 1 of the run from 16.
        let run = layout.row(16, 1);
        let slot_17 = layout.row(17, 1);
        assert_eq!(pair_keys[run + (16 + 1) * 2], row_keys[slot_17 + 2]);
        assert_eq!(pair_keys[run + (16 + 1) * 2 + 1], row_keys[slot_17 + 3]);
        // Element 5 of slots 16 and 17's values share a lane.
        assert_eq!(pair_values[run + 5 * 2], row_values[layout.row(16, 1) + 5]);
        assert_eq!(pair_values[run + 5 * 2 + 1], row_values[slot_17 + 5]);
    }
}
