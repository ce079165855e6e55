//! [`CheckedShapes`]: the spec check of each callable's last launch, reused while its shapes and params repeat.
//!
//! A decode step launches the same few callables on the same shapes layer after layer and step
//! after step; only the buffers differ. The spec check (dtypes, tags, ranks, the shape
//! symbols, the constraints) reads nothing but those shapes and the params, so its result
//! holds for every launch that repeats them. Buffers and offsets are checked on every launch
//! all the same.

use smallvec::SmallVec;

use crate::abi::{MAX_RANK, TensorArg};
use crate::callables::{CallableSpec, MAX_ARGS};
use crate::validate::{self, ShapeBindings};

/// What the spec check reads of one argument.
#[derive(Clone, Copy, PartialEq, Eq)]
struct ArgShape {
    dtype: u32,
    tag: u32,
    ndim: u32,
    shape: [u64; MAX_RANK],
}

impl ArgShape {
    fn of(arg: &TensorArg) -> ArgShape {
        ArgShape {
            dtype: arg.dtype,
            tag: arg.tag,
            ndim: arg.ndim,
            shape: arg.shape,
        }
    }
}

/// One callable's last launch that passed the check.
#[derive(Default)]
struct Passed {
    args: SmallVec<[ArgShape; MAX_ARGS]>,
    /// Kept as a vector that keeps its capacity, so a repeated check allocates nothing.
    params: Vec<i64>,
    shapes: ShapeBindings,
}

impl Passed {
    fn matches(&self, args: &[TensorArg], params: &[i64]) -> bool {
        self.params == params
            && self.args.len() == args.len()
            && self
                .args
                .iter()
                .zip(args)
                .all(|(kept, arg)| *kept == ArgShape::of(arg))
    }
}

/// Passed checks kept per callable: a step launches one callable on a few shapes in turn
/// (`linear` as the attention's output projection, the MLP's down projection and the output
/// head), and every one of them should find its check.
const KEPT_PER_CALLABLE: usize = 4;

/// The last passed checks of each callable, by index, oldest first.
pub(super) struct CheckedShapes {
    passed: Vec<Vec<Passed>>,
}

impl CheckedShapes {
    pub(super) fn new(callables: usize) -> CheckedShapes {
        CheckedShapes {
            passed: (0..callables).map(|_| Vec::new()).collect(),
        }
    }

    /// The shape symbols of a launch of `spec` (callable `index`) over `args` and `params`,
    /// or the check's message.
    pub(super) fn check(
        &mut self,
        index: usize,
        spec: &CallableSpec,
        args: &[TensorArg],
        params: &[i64],
    ) -> Result<&ShapeBindings, String> {
        let kept = &mut self.passed[index];
        let at = match kept.iter().position(|passed| passed.matches(args, params)) {
            Some(at) => at,
            None => {
                // Only a launch that passes is kept: a failed one never matches later.
                let shapes = validate::check_launch(spec, args, params)?;
                let mut passed = if kept.len() == KEPT_PER_CALLABLE {
                    kept.remove(0)
                } else {
                    Passed::default()
                };
                passed.shapes = shapes;
                passed.args.clear();
                passed.args.extend(args.iter().map(ArgShape::of));
                passed.params.clear();
                passed.params.extend_from_slice(params);
                kept.push(passed);
                kept.len() - 1
            }
        };
        Ok(&kept[at].shapes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{ArgTag, DType};
    use crate::callables;

    fn add_args(len: u64) -> [TensorArg; 2] {
        let arg = |buffer, tag| TensorArg::new(buffer, 0, DType::F32, &[2, len], tag).unwrap();
        [arg(1, ArgTag::Inout), arg(2, ArgTag::Input)]
    }

    fn add() -> (usize, &'static CallableSpec) {
        callables::ALL
            .iter()
            .enumerate()
            .find(|(_, spec)| spec.name == "add")
            .expect("the add callable")
    }

    /// The symbols `checked` gives a launch of `add` over `args`, which must be those a check
    /// of its own gives.
    fn symbols_of(checked: &mut CheckedShapes, args: &[TensorArg]) -> ShapeBindings {
        let (index, spec) = add();
        let symbols = checked.check(index, spec, args, &[]).unwrap().clone();
        assert_eq!(symbols, validate::check_launch(spec, args, &[]).unwrap());
        symbols
    }

    #[test]
    fn a_repeated_shape_keeps_its_symbols_and_a_new_one_is_checked_again() {
        let (index, spec) = add();
        let mut checked = CheckedShapes::new(callables::ALL.len());
        let first = symbols_of(&mut checked, &add_args(8));
        // Other buffers, the same shapes: the same symbols.
        let mut moved = add_args(8);
        moved[0].buffer = 7;
        assert_eq!(checked.check(index, spec, &moved, &[]).unwrap(), &first);
        // A new width is bound anew.
        let wider = symbols_of(&mut checked, &add_args(16));
        assert_ne!(wider, first);
    }

    #[test]
    fn shapes_in_turn_each_keep_their_symbols_past_the_kept_count() {
        let mut checked = CheckedShapes::new(callables::ALL.len());
        let widths = [8, 16, 24, 8, 16, 24, 32, 40, 48, 56, 8, 56, 16];
        let symbols: Vec<_> = widths
            .iter()
            .map(|&width| symbols_of(&mut checked, &add_args(width)))
            .collect();
        for (i, &width) in widths.iter().enumerate() {
            let first = widths.iter().position(|&w| w == width).unwrap();
            assert_eq!(symbols[i], symbols[first], "width {width}");
        }
    }

    #[test]
    fn a_failed_check_is_never_taken_for_a_passed_one() {
        let (index, spec) = add();
        let mut checked = CheckedShapes::new(callables::ALL.len());
        checked.check(index, spec, &add_args(8), &[]).unwrap();
        let mut mismatched = add_args(8);
        mismatched[1].shape[1] = 9;
        let message = checked
            .check(index, spec, &mismatched, &[])
            .expect_err("widths differ");
        assert_eq!(
            message,
            validate::check_launch(spec, &mismatched, &[]).unwrap_err()
        );
        // Nor does the failure stand in for the launch that passed before it, or after.
        assert!(checked.check(index, spec, &mismatched, &[]).is_err());
        assert!(checked.check(index, spec, &add_args(8), &[]).is_ok());
        let mut retagged = add_args(8);
        retagged[1].tag = ArgTag::Output.code();
        assert!(checked.check(index, spec, &retagged, &[]).is_err());
    }
}
