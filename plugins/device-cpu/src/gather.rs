//! Row gathers: `embedding_gather` (token ids to hidden states, widening or dequantizing the table) and `gather_rows` (the rows whose logits are computed).

use plughost_device_abi::export::{AS_WRITTEN, DeviceFailure, FloatSlice, Launch};

use crate::Context;
use crate::widen::widen_into;
use crate::workers::Workers;

/// `out[e] = table[indices[e]]` for a `[num_rows, width]` table; every index is checked before
/// anything is written. `what` names the index argument in the error.
pub fn gather(
    table: FloatSlice<'_>,
    width: usize,
    indices: &[i32],
    out: &mut [f32],
    (what, workers): (&str, &Workers),
) -> Result<(), String> {
    gather_each(
        (table.len(), width),
        indices,
        out,
        (what, workers),
        |index, out_row| widen_into(table, index * width, out_row),
    )
}

/// As [`gather`], from a bf16 table the linear kernels keep in panels (a tied embedding that
/// is also the output projection): a row's elements lie one panel column apart.
#[cfg(target_arch = "x86_64")]
pub fn gather_from_panels(
    table: &[u16],
    width: usize,
    indices: &[i32],
    out: &mut [f32],
    (what, workers): (&str, &Workers),
) -> Result<(), String> {
    use crate::linear::panels;
    gather_each(
        (table.len(), width),
        indices,
        out,
        (what, workers),
        |index, out_row| {
            let column = &table[panels::index(index, 0, width)..];
            for (k, value) in out_row.iter_mut().enumerate() {
                *value = crate::widen::bf16_to_f32(column[k * panels::ROWS]);
            }
        },
    )
}

/// Checks that every index names one of the `len / width` rows of a table, then has
/// `row_into(index, out_row)` fill each output row, spread over the workers.
fn gather_each(
    (len, width): (usize, usize),
    indices: &[i32],
    out: &mut [f32],
    (what, workers): (&str, &Workers),
    row_into: impl Fn(usize, &mut [f32]) + Sync + Send,
) -> Result<(), String> {
    let num_rows = len.checked_div(width).unwrap_or(0);
    for (position, &index) in indices.iter().enumerate() {
        if usize::try_from(index).map_or(true, |index| index >= num_rows) {
            return Err(format!(
                "{what}[{position}] = {index} is outside 0..{num_rows}"
            ));
        }
    }
    if width == 0 {
        return Ok(());
    }
    let rows_per_task = workers.rows_per_task(indices.len(), width);
    workers.for_each_chunk(out, rows_per_task * width, |task, out_rows| {
        let first = task * rows_per_task;
        for (out_row, &index) in out_rows.chunks_exact_mut(width).zip(&indices[first..]) {
            row_into(index as usize, out_row);
        }
    });
    Ok(())
}

pub(crate) fn run_embedding(
    launch: &mut Launch<'_>,
    context: &mut Context,
) -> Result<(), DeviceFailure> {
    let width = launch.dim("H");
    let dtype = launch.dtype("table");
    if dtype.is_block_quantized() {
        let arrangement = launch.arrangement("table");
        let mut views = launch.views()?;
        let (ids, table) = (views.i32("ids"), views.blocks("table"));
        return crate::linear::gather_quantized_rows(
            (dtype, arrangement),
            table,
            width,
            ids,
            views.f32_mut("out"),
            &context.workers,
        )
        .map_err(DeviceFailure::launch_failed);
    }
    let arrangement = launch.arrangement("table");
    #[cfg(target_arch = "x86_64")]
    if crate::linear::panels::inner_of(arrangement) == Some(width) {
        let mut views = launch.views()?;
        let (ids, table) = (views.i32("ids"), views.float("table"));
        let FloatSlice::BF16(table) = table else {
            return Err(DeviceFailure::internal("a table in panels is not bf16"));
        };
        return gather_from_panels(
            table,
            width,
            ids,
            views.f32_mut("out"),
            ("ids", &context.workers),
        )
        .map_err(DeviceFailure::launch_failed);
    }
    if arrangement != AS_WRITTEN {
        crate::linear::restore_arrangement(launch, "table")?;
    }
    let mut views = launch.views()?;
    let (ids, table) = (views.i32("ids"), views.float("table"));
    gather(
        table,
        width,
        ids,
        views.f32_mut("out"),
        ("ids", &context.workers),
    )
    .map_err(DeviceFailure::launch_failed)
}

pub(crate) fn run_rows(
    launch: &mut Launch<'_>,
    context: &mut Context,
) -> Result<(), DeviceFailure> {
    let width = launch.dim("H");
    let mut views = launch.views()?;
    let (x, indices) = (FloatSlice::F32(views.f32("x")), views.i32("indices"));
    gather(
        x,
        width,
        indices,
        views.f32_mut("out"),
        ("indices", &context.workers),
    )
    .map_err(DeviceFailure::launch_failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn gathers_and_widens_rows() {
        let workers = Workers::new(1).unwrap();
        let table = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let table_bf16 = table.map(|v| bf16::from_f32(v).to_bits());
        for table in [FloatSlice::F32(&table), FloatSlice::BF16(&table_bf16)] {
            let mut out = [0.0; 6];
            gather(table, 2, &[2, 0, 2], &mut out, ("ids", &workers)).unwrap();
            assert_eq!(out, [5.0, 6.0, 1.0, 2.0, 5.0, 6.0]);
        }
    }

    #[test]
    fn an_out_of_range_index_writes_nothing() {
        let workers = Workers::new(1).unwrap();
        let mut out = [9.0; 4];
        let table = FloatSlice::F32(&[1.0, 2.0, 3.0, 4.0]);
        for (indices, expected) in [
            ([0, 2], "ids[1] = 2 is outside 0..2"),
            ([-1, 0], "ids[0] = -1 is outside 0..2"),
        ] {
            let message = gather(table, 2, &indices, &mut out, ("ids", &workers)).unwrap_err();
            assert_eq!(message, expected);
            assert_eq!(out, [9.0; 4]);
        }
    }
}
