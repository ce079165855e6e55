//! `kv_write`: storing this step's keys and values into the paged cache at their slots.
//!
//! A cache is `[B, bs, Hk, D]`, so slot `s` (block `s / bs`, offset `s % bs`) is row `s` of the
//! cache seen as `[B*bs, Hk*D]`. A negative slot skips its token (padding, or a token whose
//! KV is already cached).

use plughost_device_abi::export::{DeviceFailure, Launch};

/// The rows of one step's keys or values and the cache they go to, both `width = Hk*D` wide.
pub struct KvRows<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
}

/// Writes row `t` of `rows` into row `slot_mapping[t]` of each cache. Every slot is checked
/// before anything is written, so a failed launch leaves the caches as they were.
pub fn kv_write(
    rows: KvRows<'_>,
    (key_cache, value_cache): (&mut [f32], &mut [f32]),
    slot_mapping: &[i32],
    width: usize,
) -> Result<(), String> {
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
        let (source, target) = (
            row * width..(row + 1) * width,
            slot * width..(slot + 1) * width,
        );
        key_cache[target.clone()].copy_from_slice(&rows.keys[source.clone()]);
        value_cache[target].copy_from_slice(&rows.values[source]);
    }
    Ok(())
}

pub(crate) fn run(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let width = launch.dim("Hk") * launch.dim("D");
    let mut views = launch.views()?;
    let rows = KvRows {
        keys: views.f32("k"),
        values: views.f32("v"),
    };
    let slot_mapping = views.i32("slot_mapping");
    let caches = (views.f32_mut("key_cache"), views.f32_mut("value_cache"));
    kv_write(rows, caches, slot_mapping, width).map_err(DeviceFailure::launch_failed)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        kv_write(rows, (&mut key_cache, &mut value_cache), &[3, -1, 0], width).unwrap();
        assert_eq!(key_cache, [5.0, 6.0, 9.0, 9.0, 9.0, 9.0, 1.0, 2.0]);
        assert_eq!(value_cache, [-5.0, -6.0, 9.0, 9.0, 9.0, 9.0, -1.0, -2.0]);
    }

    #[test]
    fn an_out_of_range_slot_writes_nothing() {
        let mut key_cache = vec![9.0; 4];
        let mut value_cache = vec![9.0; 4];
        let rows = KvRows {
            keys: &[1.0; 4],
            values: &[1.0; 4],
        };
        let message = kv_write(rows, (&mut key_cache, &mut value_cache), &[0, 2], 2).unwrap_err();
        assert_eq!(message, "slot_mapping[1] = 2 is outside the 2 cache slots");
        assert_eq!((key_cache, value_cache), (vec![9.0; 4], vec![9.0; 4]));
    }
}
