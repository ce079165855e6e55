//! Keeping weights in the tiles' own order across launches: arranging a launch's bf16 weights in panels in place, and putting them (or block-quantized weights in groups, see `quant`) back in the host's order.

#[cfg(target_arch = "x86_64")]
use plughost_device_abi::abi::DType;
use plughost_device_abi::export::{AS_WRITTEN, DeviceFailure, Launch};

#[cfg(target_arch = "x86_64")]
use super::elements::MAX_MATRICES;
#[cfg(target_arch = "x86_64")]
use super::{bf16_dot_products, panels};
use crate::Context;
#[cfg(target_arch = "x86_64")]
use crate::isa::IsaLevel;

/// How the weight matrices of a launch lie in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightOrder {
    /// Row-major `[N, K]`, as the host wrote them.
    #[default]
    Rows,
    /// bf16 in the panels of `panels`, read by the AVX2 panel tiles in f32; every `N` a
    /// multiple of 32.
    Panels,
}

/// Puts the weight arguments `(name, N)` of a launch in the order its tiles read: panels when
/// bf16 weights are multiplied in f32 at a level from `avx2` up and every weight can be
/// arranged so (bf16, spanning its own buffer, `N` a multiple of 32), the host's order
/// otherwise. A buffer stays arranged across launches,
/// so only the first launch that reads it pays for the arrangement.
pub(super) fn arrange_weights(
    launch: &mut Launch<'_>,
    weights: &[(&str, usize)],
    inner: usize,
    context: &Context,
) -> Result<WeightOrder, DeviceFailure> {
    #[cfg(target_arch = "x86_64")]
    {
        let in_f32 = !bf16_dot_products(context.isa, context.bf16_products);
        let target = |name: &str, outputs: usize| {
            let fits = context.isa.has(IsaLevel::Avx2)
                && in_f32
                && launch.dtype(name) == DType::BF16
                && launch.spans_buffer(name);
            panels::arrangement(outputs, inner).filter(|_| fits)
        };
        // One per weight of the launch: at most `MAX_MATRICES`, so no allocation per launch.
        let mut targets = [None; MAX_MATRICES];
        for (target_of, &(name, outputs)) in targets.iter_mut().zip(weights) {
            *target_of = target(name, outputs);
        }
        let targets = &targets[..weights.len().min(MAX_MATRICES)];
        let all = weights.len() <= MAX_MATRICES && targets.iter().all(Option::is_some);
        for (&(name, _), target) in weights.iter().zip(targets) {
            let target = target.filter(|_| all).unwrap_or(AS_WRITTEN);
            let current = launch.arrangement(name);
            if current == target {
                continue;
            }
            if current != AS_WRITTEN {
                restore_arrangement(launch, name)?;
            }
            if target != AS_WRITTEN {
                launch.rearrange(name, target, |bytes| {
                    let bits = half_bits_mut(bytes);
                    let panel = panels::ROWS * inner;
                    // Some sixteen tasks: every thread gets a share, and none waits long on
                    // the last.
                    let panels_per_task = (bits.len() / panel).div_ceil(16).max(1);
                    context.workers.for_each_chunk(
                        bits,
                        panels_per_task * panel,
                        |_task, chunk| {
                            #[cfg(test)]
                            faults::panic_if_armed(_task);
                            panels::arrange(chunk, inner, &mut Vec::new())
                        },
                    );
                    Ok(())
                })?;
            }
        }
        if all {
            return Ok(WeightOrder::Panels);
        }
    }
    let _ = (launch, weights, inner, context);
    Ok(WeightOrder::Rows)
}

/// Puts the buffer under `arg` back in the host's order if a launch arranged it.
pub(crate) fn restore_arrangement(launch: &mut Launch<'_>, arg: &str) -> Result<(), DeviceFailure> {
    let current = launch.arrangement(arg);
    if current == AS_WRITTEN {
        return Ok(());
    }
    launch.rearrange(arg, AS_WRITTEN, |bytes| restore(current, bytes))
}

/// Undoes an arrangement of the linears' (bf16 panels, or groups of quantized rows) on a
/// buffer's bytes.
pub(crate) fn restore(arrangement: u64, bytes: &mut [u8]) -> Result<(), DeviceFailure> {
    if let Some((dtype, inner)) = super::quant::interleaved_inner_of(arrangement) {
        super::quant::restore_interleaved(dtype, bytes, inner, &mut Vec::new());
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(inner) = panels::inner_of(arrangement) {
        panels::restore(half_bits_mut(bytes), inner, &mut Vec::new());
        return Ok(());
    }
    let _ = bytes;
    Err(DeviceFailure::internal(format!(
        "the CPU device has no arrangement {arrangement}"
    )))
}

/// A buffer's bytes as 16-bit elements: buffers are 64-byte aligned and hold whole elements.
#[cfg(target_arch = "x86_64")]
fn half_bits_mut(bytes: &mut [u8]) -> &mut [u16] {
    // SAFETY: every bit pattern is a valid u16; `align_to_mut` puts only whole, aligned
    // elements in the middle part.
    let (head, bits, _) = unsafe { bytes.align_to_mut::<u16>() };
    debug_assert!(head.is_empty(), "device buffers are aligned");
    bits
}

/// A way for tests to make an arrangement panic part-way through, as a bug in it would.
#[cfg(test)]
pub(crate) mod faults {
    use std::cell::Cell;

    thread_local! {
        /// The task of the arrangements run on this thread that panics, if any.
        static PANIC_AT_TASK: Cell<Option<usize>> = const { Cell::new(None) };
    }

    /// Makes task `task` (`None`: no task) of the arrangements that run on this thread panic;
    /// with one worker thread, every task of a launch runs on the launching thread.
    pub(crate) fn panic_at_task(task: Option<usize>) {
        PANIC_AT_TASK.set(task);
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn panic_if_armed(task: usize) {
        if PANIC_AT_TASK.get() == Some(task) {
            panic!("arrangement task {task} panicked, as the test asked");
        }
    }
}
