//! The CPU device's launches of the device-maintained step inputs, over the shared implementation in `plughost_device_abi::step_inputs`, borrowing the buffers in place.
//!
//! The functions and [`SequenceSpan`] are re-exported for attention and the tests.

use plughost_device_abi::export::{DeviceFailure, Launch};
pub use plughost_device_abi::step_inputs::{
    SequenceSpan, advance_seq_lens, derive_positions, derive_slot_mapping, sequence_span,
};

pub(crate) fn run_advance_seq_lens(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let mut views = launch.views()?;
    let query_start = views.i32("query_start");
    advance_seq_lens(views.i32_mut("seq_lens"), query_start).map_err(DeviceFailure::from)
}

pub(crate) fn run_derive_positions(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let mut views = launch.views()?;
    let (seq_lens, query_start) = (views.i32("seq_lens"), views.i32("query_start"));
    derive_positions(seq_lens, query_start, views.i32_mut("positions")).map_err(DeviceFailure::from)
}

pub(crate) fn run_derive_slot_mapping(launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
    let (blocks_per_seq, block_size) = (launch.dim("M"), launch.dim("bs"));
    let mut views = launch.views()?;
    let block_table = (views.i32("block_table"), blocks_per_seq);
    let (seq_lens, query_start) = (views.i32("seq_lens"), views.i32("query_start"));
    let slots = views.i32_mut("slot_mapping");
    derive_slot_mapping(block_table, seq_lens, query_start, block_size, slots)
        .map_err(DeviceFailure::from)
}
