//! [`DeviceState`]: everything behind one handle (the backend, its buffers, stats, device time and last error) and the checked operations the entry points run on it.

use std::ffi::CString;
use std::time::{Duration, Instant};

use crate::abi::{CopyRange, DeviceStats, TensorArg, status};
use crate::callables::{self, CallableSpec};

use super::buffers::{AlignedBytes, BufferTable, checked_range};
use super::checked::CheckedShapes;
use super::copy_out::{Copier, Piece};
use super::launch::{Launch, ResolvedArg, ResolvedArgs};
use super::{AS_WRITTEN, DeviceBackend, DeviceFailure};

/// Everything behind one handle.
pub(super) struct DeviceState<B> {
    // Dropped first: dropping it waits for a copy out in flight, which reads `buffers`.
    copier: Copier,
    backend: B,
    buffers: BufferTable,
    stats: DeviceStats,
    /// The spec check of each callable's last launch.
    checked: CheckedShapes,
    launches_by_callable: Vec<u64>,
    /// Time inside the backend's successful launches, per callable.
    time_by_callable: Vec<Duration>,
    callable_names: Vec<CString>,
    /// Launch time not yet reported by `synchronize`.
    unreported_device_time: Duration,
    last_error: String,
}

impl<B: DeviceBackend> DeviceState<B> {
    pub(super) fn new(backend: B) -> DeviceState<B> {
        let callable_names = callables::ALL
            .iter()
            .map(|spec| CString::new(spec.name).expect("callable names have no NUL"))
            .collect();
        DeviceState {
            copier: Copier::default(),
            backend,
            buffers: BufferTable::default(),
            stats: DeviceStats::default(),
            checked: CheckedShapes::new(callables::ALL.len()),
            launches_by_callable: vec![0; callables::ALL.len()],
            time_by_callable: vec![Duration::ZERO; callables::ALL.len()],
            callable_names,
            unreported_device_time: Duration::ZERO,
            last_error: String::new(),
        }
    }

    pub(super) fn alloc(&mut self, bytes: u64) -> Result<u64, DeviceFailure> {
        let out_of_memory = |detail: String| {
            DeviceFailure::new(
                status::OUT_OF_MEMORY,
                format!("alloc of {bytes} bytes: {detail}"),
            )
        };
        let capacity = self.backend.memory_capacity();
        let available = capacity.saturating_sub(self.stats.live_bytes);
        if bytes > available {
            return Err(out_of_memory(format!(
                "only {available} of {capacity} bytes are free"
            )));
        }
        let len = usize::try_from(bytes)
            .map_err(|_| out_of_memory("larger than the address space".into()))?;
        let storage = AlignedBytes::zeroed(len).map_err(out_of_memory)?;
        let id = self.buffers.insert(storage);
        self.stats.allocations += 1;
        self.stats.live_allocations += 1;
        self.stats.live_bytes += bytes;
        Ok(id)
    }

    pub(super) fn free(&mut self, buffer: u64) -> Result<(), DeviceFailure> {
        let storage = self.buffers.remove(buffer).map_err(|f| f.context("free"))?;
        self.stats.frees += 1;
        self.stats.live_allocations -= 1;
        self.stats.live_bytes -= storage.len() as u64;
        Ok(())
    }

    /// Puts a buffer the backend rearranged back in the order the host wrote it; refuses a
    /// poisoned one, whose bytes are in no order to restore from.
    fn restore(&mut self, buffer: u64) -> Result<(), DeviceFailure> {
        self.buffers.check_not_poisoned(buffer)?;
        let arrangement = self.buffers.arrangement(buffer);
        if arrangement != AS_WRITTEN {
            let backend = &mut self.backend;
            self.buffers.rearrange(buffer, AS_WRITTEN, |bytes| {
                backend.restore(arrangement, bytes)
            })?;
        }
        Ok(())
    }

    pub(super) fn write(
        &mut self,
        buffer: u64,
        offset: u64,
        src: &[u8],
    ) -> Result<(), DeviceFailure> {
        let whole = offset == 0
            && self
                .buffers
                .get(buffer)
                .is_ok_and(|storage| storage.len() == src.len());
        if whole {
            // Every byte is about to be the host's again, whatever order they were in.
            self.buffers.forget_order(buffer);
        }
        self.restore(buffer).map_err(|f| f.context("write"))?;
        let storage = self.buffers.get(buffer).map_err(|f| f.context("write"))?;
        let range = checked_range(buffer, storage.len(), offset, src.len() as u64)
            .map_err(|f| f.context("write"))?;
        self.buffers
            .check_not_copied(buffer, Some(&range))
            .map_err(|f| f.context("write"))?;
        self.buffers
            .write_at(buffer, range.start, src)
            .map_err(|f| f.context("write"))?;
        self.stats.h2d_bytes += src.len() as u64;
        self.stats.h2d_calls += 1;
        Ok(())
    }

    pub(super) fn read(
        &mut self,
        buffer: u64,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), DeviceFailure> {
        self.restore(buffer).map_err(|f| f.context("read"))?;
        let storage = self.buffers.get(buffer).map_err(|f| f.context("read"))?;
        let range = checked_range(buffer, storage.len(), offset, dst.len() as u64)
            .map_err(|f| f.context("read"))?;
        dst.copy_from_slice(&storage[range]);
        self.stats.d2h_bytes += dst.len() as u64;
        self.stats.d2h_calls += 1;
        Ok(())
    }

    /// Checks every range (a known, unpoisoned buffer, in bounds, in the host's order) and
    /// starts copying them into `dst` on the copy thread.
    ///
    /// # Safety
    /// `dst` is writable for `dst_len` bytes, overlaps no device buffer, and stays valid and
    /// untouched by anyone else until [`DeviceState::copy_out_poll`] reports the copy done or
    /// the state is dropped.
    pub(super) unsafe fn copy_out_start(
        &mut self,
        ranges: &[CopyRange],
        dst: *mut u8,
        dst_len: u64,
    ) -> Result<(), DeviceFailure> {
        if self.copier.in_flight() {
            // Refused before anything changes: the ranges of the copy in flight stay marked.
            return Err(DeviceFailure::invalid_argument(
                "a copy out is already in flight; poll it to its end first",
            ));
        }
        let total: u64 = ranges.iter().map(|r| r.len).fold(0, u64::saturating_add);
        if total != dst_len {
            return Err(DeviceFailure::invalid_argument(format!(
                "the ranges hold {total} bytes, the destination {dst_len}"
            )));
        }
        for (i, range) in ranges.iter().enumerate() {
            self.restore(range.buffer)
                .and_then(|()| {
                    let storage = self.buffers.get(range.buffer)?;
                    checked_range(range.buffer, storage.len(), range.offset, range.len).map(drop)
                })
                .map_err(|f| f.context(format_args!("range {i}")))?;
        }
        let pieces = self.copier.pieces();
        let mut at = 0usize;
        for range in ranges {
            let bytes = self.buffers.get(range.buffer)?;
            let bytes = checked_range(range.buffer, bytes.len(), range.offset, range.len)?;
            let src = self.buffers.base_ptr(range.buffer);
            self.buffers.begin_copy(range.buffer, bytes.clone());
            pieces.push(Piece {
                // SAFETY: `bytes` lies inside the buffer's allocation (checked above).
                src: unsafe { src.add(bytes.start) },
                // SAFETY: `at + len <= dst_len`, the ranges' total, checked above.
                dst: unsafe { dst.add(at) },
                len: bytes.len(),
            });
            at += bytes.len();
        }
        let fault = self.backend.copy_out_fault();
        // SAFETY: every `src` lies in a live buffer that `free`, `write` and rearranging now
        // refuse until `copy_out_poll` ends the copy (and dropping the state joins the copy
        // before the buffers go); launches never hold a `&mut` to bytes they do not write, and
        // the ABI forbids the host to launch writes into the ranges. `dst` is the caller's.
        let started = unsafe { self.copier.start(dst_len, fault) };
        if started.is_err() {
            self.buffers.end_copy();
        }
        started
    }

    /// Whether the copy out in flight (if any) has ended; with `wait`, waits for it.
    pub(super) fn copy_out_poll(&mut self, wait: bool) -> Result<bool, DeviceFailure> {
        let Some(bytes) = self.copier.poll(wait) else {
            return Ok(false);
        };
        if bytes > 0 {
            self.stats.d2h_bytes += bytes;
            self.stats.d2h_calls += 1;
        }
        self.buffers.end_copy();
        Ok(true)
    }

    pub(super) fn launch(
        &mut self,
        callable_index: u32,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<(), DeviceFailure> {
        let index = callable_index as usize;
        let spec = callables::ALL.get(index).ok_or_else(|| {
            DeviceFailure::invalid_argument(format!(
                "launch: unknown callable index {callable_index}, the device has {}",
                callables::ALL.len()
            ))
        })?;
        self.launch_checked(index, spec, args, params)
            .map_err(|failure| failure.context(format_args!("launch `{}`", spec.name)))
    }

    fn launch_checked(
        &mut self,
        index: usize,
        spec: &'static CallableSpec,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<(), DeviceFailure> {
        let shapes = self
            .checked
            .check(index, spec, args, params)
            .map_err(DeviceFailure::invalid_argument)?;
        let resolved = args
            .iter()
            .enumerate()
            .map(|(arg_index, arg)| {
                ResolvedArg::resolve(&self.buffers, arg).map_err(|failure| {
                    let name = spec.args[arg_index].name;
                    failure.context(format_args!("argument `{name}` (#{arg_index})"))
                })
            })
            .collect::<Result<ResolvedArgs, _>>()?;
        let mut launch = Launch::new(spec, resolved, params, shapes, &mut self.buffers);
        let started = Instant::now();
        let outcome = self.backend.launch(&mut launch);
        let elapsed = started.elapsed();
        self.unreported_device_time += elapsed;
        outcome?;
        self.stats.launches += 1;
        self.launches_by_callable[index] += 1;
        self.time_by_callable[index] += elapsed;
        Ok(())
    }

    pub(super) fn take_device_time(&mut self) -> Duration {
        std::mem::take(&mut self.unreported_device_time)
    }

    pub(super) fn stats(&self) -> DeviceStats {
        self.stats
    }

    /// The NUL-terminated name of callable `index`, living as long as the state.
    pub(super) fn callable_name(&self, index: u32) -> Option<&CString> {
        self.callable_names.get(index as usize)
    }

    /// Successful launches of callable `index` so far.
    pub(super) fn launches_of(&self, index: u32) -> u64 {
        self.launches_by_callable
            .get(index as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Nanoseconds inside each callable's successful launches so far, in callable order.
    pub(super) fn device_ns_by_callable(&self) -> impl Iterator<Item = u64> + '_ {
        self.time_by_callable
            .iter()
            .map(|t| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX))
    }

    pub(super) fn last_error(&self) -> &str {
        &self.last_error
    }

    pub(super) fn set_last_error(&mut self, message: String) {
        self.last_error = message;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{ArgTag, DType};
    use crate::elements;
    use crate::export::entry_points::contain;

    /// `add` that keeps `y` (when it spans its buffer) with its elements reversed, as a device
    /// keeps weights in an order of its own.
    struct ReversesY;

    const REVERSED: u64 = 7;

    fn reverse_f32(bytes: &mut [u8]) {
        let mut values = elements::decode_float(DType::F32, bytes).unwrap();
        values.reverse();
        bytes.copy_from_slice(&elements::encode_f32(&values));
    }

    impl DeviceBackend for ReversesY {
        fn open(_config: &str) -> Result<Self, DeviceFailure> {
            Ok(ReversesY)
        }

        fn launch(&mut self, launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
            if launch.spans_buffer("y") && launch.arrangement("y") == AS_WRITTEN {
                launch.rearrange("y", REVERSED, |bytes| {
                    reverse_f32(bytes);
                    Ok(())
                })?;
            }
            let mut y = launch.read_f32("y");
            if launch.arrangement("y") == REVERSED {
                y.reverse();
            }
            let x: Vec<f32> = launch
                .read_f32("x")
                .iter()
                .zip(&y)
                .map(|(a, b)| a + b)
                .collect();
            launch.write_f32("x", &x);
            Ok(())
        }

        fn restore(&mut self, arrangement: u64, bytes: &mut [u8]) -> Result<(), DeviceFailure> {
            assert_eq!(arrangement, REVERSED);
            reverse_f32(bytes);
            Ok(())
        }
    }

    #[test]
    fn a_rearranged_buffer_is_restored_before_the_host_touches_it() {
        let mut state = DeviceState::new(ReversesY);
        let x = state.alloc(12).unwrap();
        let y = state.alloc(12).unwrap();
        state.write(x, 0, &elements::encode_f32(&[0.0; 3])).unwrap();
        state
            .write(y, 0, &elements::encode_f32(&[1.0, 2.0, 3.0]))
            .unwrap();
        let add = |state: &mut DeviceState<ReversesY>| {
            let (index, _) = callables::by_name("add").unwrap();
            let args = [
                TensorArg::new(x, 0, DType::F32, &[1, 3], ArgTag::Inout).unwrap(),
                TensorArg::new(y, 0, DType::F32, &[1, 3], ArgTag::Input).unwrap(),
            ];
            state.launch(index as u32, &args, &[]).unwrap();
        };
        let read = |state: &mut DeviceState<ReversesY>, buffer| {
            let mut bytes = vec![0; 12];
            state.read(buffer, 0, &mut bytes).unwrap();
            elements::decode_float(DType::F32, &bytes).unwrap()
        };
        add(&mut state);
        assert_eq!(state.buffers.arrangement(y), REVERSED);
        add(&mut state);
        assert_eq!(read(&mut state, x), [2.0, 4.0, 6.0]);
        assert_eq!(read(&mut state, y), [1.0, 2.0, 3.0]);
        assert_eq!(state.buffers.arrangement(y), AS_WRITTEN);
        // A write into part of a rearranged buffer lands where the host meant it.
        add(&mut state);
        state.write(y, 4, &elements::encode_f32(&[5.0])).unwrap();
        assert_eq!(read(&mut state, y), [1.0, 5.0, 3.0]);
        add(&mut state);
        assert_eq!(read(&mut state, x), [4.0, 11.0, 12.0]);
        state.free(y).unwrap();
        assert!(!state.buffers.tracks_any_order());
    }

    /// `add` that rearranges `y` as [`ReversesY`] does, but whose rearrangement panics half-way
    /// when `arrange_panics`, and whose restore does when `restore_panics`: a bug in a device.
    struct PanicsHalfWay {
        arrange_panics: bool,
        restore_panics: bool,
    }

    impl DeviceBackend for PanicsHalfWay {
        fn open(_config: &str) -> Result<Self, DeviceFailure> {
            Ok(PanicsHalfWay {
                arrange_panics: true,
                restore_panics: false,
            })
        }

        fn launch(&mut self, launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
            if launch.arrangement("y") == AS_WRITTEN {
                let arrange_panics = self.arrange_panics;
                launch.rearrange("y", REVERSED, |bytes| {
                    if arrange_panics {
                        bytes[..4].fill(0xff);
                        panic!("arranging half-way");
                    }
                    reverse_f32(bytes);
                    Ok(())
                })?;
            }
            Ok(())
        }

        fn restore(&mut self, _arrangement: u64, bytes: &mut [u8]) -> Result<(), DeviceFailure> {
            if self.restore_panics {
                bytes[..4].fill(0xff);
                panic!("restoring half-way");
            }
            reverse_f32(bytes);
            Ok(())
        }
    }

    /// Runs `add` on `x` and `y` (3 elements each) as the C entry point does.
    fn contained_add<B: DeviceBackend>(
        state: &mut DeviceState<B>,
        (x, y): (u64, u64),
    ) -> Result<(), DeviceFailure> {
        let (index, _) = callables::by_name("add").unwrap();
        let args = [
            TensorArg::new(x, 0, DType::F32, &[1, 3], ArgTag::Inout).unwrap(),
            TensorArg::new(y, 0, DType::F32, &[1, 3], ArgTag::Input).unwrap(),
        ];
        contain("launch", || state.launch(index as u32, &args, &[]))
    }

    fn contained_read<B: DeviceBackend>(
        state: &mut DeviceState<B>,
        buffer: u64,
    ) -> Result<Vec<f32>, DeviceFailure> {
        let mut bytes = vec![0; 12];
        contain("read", || state.read(buffer, 0, &mut bytes))?;
        Ok(elements::decode_float(DType::F32, &bytes).unwrap())
    }

    fn poisoned(buffer: u64) -> String {
        format!(
            "buffer {buffer} is poisoned: a rearrangement of its bytes did not finish, so they \
             are in no known order; write it whole or free it"
        )
    }

    #[test]
    fn a_rearrangement_that_panics_poisons_its_buffer_until_the_host_writes_it_whole() {
        let mut state = DeviceState::new(PanicsHalfWay::open("").unwrap());
        let (x, y) = (state.alloc(12).unwrap(), state.alloc(12).unwrap());
        state
            .write(y, 0, &elements::encode_f32(&[1.0, 2.0, 3.0]))
            .unwrap();
        let error = contained_add(&mut state, (x, y)).unwrap_err();
        assert_eq!(error.status(), status::INTERNAL);
        assert!(
            error
                .message()
                .contains("launch panicked: arranging half-way"),
            "{error}"
        );
        // Launches and reads of the half-arranged bytes fail rather than misread them.
        let error = contained_add(&mut state, (x, y)).unwrap_err();
        assert_eq!(error.status(), status::INTERNAL);
        assert_eq!(
            error.message(),
            format!("launch `add`: argument `y` (#1): {}", poisoned(y))
        );
        let error = contained_read(&mut state, y).unwrap_err();
        assert_eq!(error.status(), status::INTERNAL);
        assert_eq!(error.message(), format!("read: {}", poisoned(y)));
        let error = state
            .write(y, 4, &elements::encode_f32(&[5.0]))
            .unwrap_err();
        assert_eq!(error.message(), format!("write: {}", poisoned(y)));
        // The other buffers are as they were.
        assert_eq!(contained_read(&mut state, x).unwrap(), [0.0; 3]);
        // Written whole, the buffer is the host's again.
        state
            .write(y, 0, &elements::encode_f32(&[4.0, 5.0, 6.0]))
            .unwrap();
        assert_eq!(contained_read(&mut state, y).unwrap(), [4.0, 5.0, 6.0]);
        state.backend.arrange_panics = false;
        contained_add(&mut state, (x, y)).unwrap();
        assert_eq!(state.buffers.arrangement(y), REVERSED);
        // Freeing a poisoned buffer forgets it.
        state.backend.arrange_panics = true;
        let z = state.alloc(12).unwrap();
        contained_add(&mut state, (x, z)).unwrap_err();
        state.free(y).unwrap();
        state.free(z).unwrap();
        assert!(!state.buffers.tracks_any_order());
    }

    #[test]
    fn a_restore_that_panics_poisons_its_buffer() {
        let mut state = DeviceState::new(PanicsHalfWay {
            arrange_panics: false,
            restore_panics: true,
        });
        let (x, y) = (state.alloc(12).unwrap(), state.alloc(12).unwrap());
        state
            .write(y, 0, &elements::encode_f32(&[1.0, 2.0, 3.0]))
            .unwrap();
        contained_add(&mut state, (x, y)).unwrap();
        assert_eq!(state.buffers.arrangement(y), REVERSED);
        let error = contained_read(&mut state, y).unwrap_err();
        assert!(
            error
                .message()
                .contains("read panicked: restoring half-way"),
            "{error}"
        );
        let error = contained_add(&mut state, (x, y)).unwrap_err();
        assert_eq!(
            error.message(),
            format!("launch `add`: argument `y` (#1): {}", poisoned(y))
        );
        let error = contained_read(&mut state, y).unwrap_err();
        assert_eq!(error.message(), format!("read: {}", poisoned(y)));
    }

    /// `add` through [`Launch::views`]; `rotary` borrows `q` and `k` and leaves them as they are.
    struct InPlace;

    impl DeviceBackend for InPlace {
        fn open(_config: &str) -> Result<Self, DeviceFailure> {
            Ok(InPlace)
        }

        fn launch(&mut self, launch: &mut Launch<'_>) -> Result<(), DeviceFailure> {
            let name = launch.spec().name;
            let mut views = launch.views()?;
            match name {
                "add" => {
                    let y = views.f32("y");
                    let x = views.f32_mut("x");
                    assert_eq!(x.as_ptr() as usize % 4, 0);
                    for (x, y) in x.iter_mut().zip(y) {
                        *x += y;
                    }
                }
                "rotary" => {
                    views.f32_mut("q");
                    views.f32_mut("k");
                    views.f32_mut("k");
                }
                other => panic!("InPlace does not run `{other}`"),
            }
            Ok(())
        }
    }

    fn f32_arg(buffer: u64, first: u64, shape: &[u64], tag: ArgTag) -> TensorArg {
        TensorArg::new(buffer, first * 4, DType::F32, shape, tag).unwrap()
    }

    fn run(
        state: &mut DeviceState<InPlace>,
        name: &str,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<(), DeviceFailure> {
        let (index, _) = callables::by_name(name).unwrap();
        // As the C entry point does, so a panic comes back as an INTERNAL failure.
        contain("launch", || state.launch(index as u32, args, params))
    }

    fn read_all(state: &mut DeviceState<InPlace>, buffer: u64, count: usize) -> Vec<f32> {
        let mut bytes = vec![0; count * 4];
        state.read(buffer, 0, &mut bytes).unwrap();
        elements::decode_float(DType::F32, &bytes).unwrap()
    }

    #[test]
    fn views_borrow_in_place_and_snapshot_aliased_reads() {
        let mut state = DeviceState::new(InPlace);
        let x = state.alloc(16).unwrap();
        let y = state.alloc(16).unwrap();
        assert_eq!(state.buffers.storage(x).as_ptr() as usize % 64, 0);
        let reset = |state: &mut DeviceState<InPlace>| {
            state
                .write(x, 0, &elements::encode_f32(&[1.0, 2.0, 3.0, 4.0]))
                .unwrap();
            state
                .write(y, 0, &elements::encode_f32(&[10.0, 20.0, 30.0, 40.0]))
                .unwrap();
        };
        let (inout, input) = (ArgTag::Inout, ArgTag::Input);
        let cases: [(&str, [TensorArg; 2], [f32; 4]); 3] = [
            (
                "distinct buffers",
                [f32_arg(x, 0, &[1, 4], inout), f32_arg(y, 0, &[1, 4], input)],
                [11.0, 22.0, 33.0, 44.0],
            ),
            (
                "y is x",
                [f32_arg(x, 0, &[1, 4], inout), f32_arg(x, 0, &[1, 4], input)],
                [2.0, 4.0, 6.0, 8.0],
            ),
            (
                "y overlaps x shifted by one element",
                [f32_arg(x, 1, &[1, 3], inout), f32_arg(x, 0, &[1, 3], input)],
                // x[1..4] += old x[0..3]
                [1.0, 3.0, 5.0, 7.0],
            ),
        ];
        for (what, args, expected) in cases {
            reset(&mut state);
            run(&mut state, "add", &args, &[]).unwrap();
            assert_eq!(read_all(&mut state, x, 4), expected, "{what}");
        }
    }

    #[test]
    fn overlapping_written_arguments_are_refused() {
        let mut state = DeviceState::new(InPlace);
        let buffer = state.alloc(64).unwrap();
        let positions = state.alloc(4).unwrap();
        let rotary = |q_first: u64, k_first: u64| {
            [
                f32_arg(buffer, q_first, &[1, 4], ArgTag::Inout),
                f32_arg(buffer, k_first, &[1, 4], ArgTag::Inout),
                TensorArg::new(positions, 0, DType::I32, &[1], ArgTag::Input).unwrap(),
            ]
        };
        // head_dim 4, then one inverse frequency per pair.
        let params = [4, 0, 0];
        let error = run(&mut state, "rotary", &rotary(0, 2), &params).unwrap_err();
        assert_eq!(error.status(), status::INVALID_ARGUMENT);
        assert_eq!(
            error.message(),
            format!(
                "launch `rotary`: arguments `q` and `k` overlap in buffer {buffer}, and the callable writes both"
            )
        );
        // Disjoint ranges of one buffer are fine; borrowing `k` twice is a device bug.
        let error = run(&mut state, "rotary", &rotary(0, 4), &params).unwrap_err();
        assert_eq!(error.status(), status::INTERNAL);
        assert!(
            error.message().contains("`k` was already borrowed"),
            "{error}"
        );
    }
}
