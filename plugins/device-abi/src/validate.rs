//! Checks launch arguments against a callable's spec (counts, dtypes, tags, ranks, consistent shapes, params) and resolves its shape symbols.
//!
//! Buffer ranges are not checked here: they need the device's buffer table.

use std::fmt;

use smallvec::SmallVec;

use crate::abi::{ArgTag, DType, TensorArg};
use crate::callables::{CallableSpec, Constraint, Dim, ParamKind};

/// The value of every shape symbol of one launch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShapeBindings {
    /// Inline: every launch binds a handful of symbols, and a launch allocates nothing.
    bindings: SmallVec<[Binding; BINDINGS_INLINE]>,
}

/// Shape symbols a launch binds without reaching the allocator; more spill to the heap.
const BINDINGS_INLINE: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Binding {
    symbol: &'static str,
    value: u64,
    /// Where the value came from, for messages such as "but H = 4 (argument `x` dimension 1)".
    origin: Origin,
}

/// Where a symbol's value came from. Every launch binds a handful of symbols and only a failed
/// check prints one, so it is kept as plain data and rendered on demand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Param(&'static str),
    Dim(DimRef),
    /// `dim / divisor`: the unknown factor of a product dimension.
    Quotient {
        dim: DimRef,
        divisor: &'static str,
    },
}

/// One dimension of one argument of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DimRef {
    arg: &'static str,
    arg_index: usize,
    dim_index: usize,
}

impl DimRef {
    fn new(spec: &CallableSpec, arg_index: usize, dim_index: usize) -> DimRef {
        DimRef {
            arg: spec.args[arg_index].name,
            arg_index,
            dim_index,
        }
    }
}

impl fmt::Display for DimRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let DimRef {
            arg,
            arg_index,
            dim_index,
        } = self;
        write!(f, "argument `{arg}` (#{arg_index}) dimension {dim_index}")
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Param(name) => write!(f, "param `{name}`"),
            Origin::Dim(dim) => dim.fmt(f),
            Origin::Quotient { dim, divisor } => write!(f, "{dim} / {divisor}"),
        }
    }
}

impl ShapeBindings {
    pub fn get(&self, symbol: &str) -> Option<u64> {
        self.find(symbol).map(|binding| binding.value)
    }

    fn find(&self, symbol: &str) -> Option<&Binding> {
        self.bindings
            .iter()
            .find(|binding| binding.symbol == symbol)
    }

    fn bind(&mut self, symbol: &'static str, value: u64, origin: Origin) {
        self.bindings.push(Binding {
            symbol,
            value,
            origin,
        });
    }

    /// Binds `symbol` to `value`, or checks that it already has that value.
    fn bind_or_check(
        &mut self,
        symbol: &'static str,
        value: u64,
        origin: Origin,
    ) -> Result<(), String> {
        match self.find(symbol) {
            None => {
                self.bind(symbol, value, origin);
                Ok(())
            }
            Some(bound) if bound.value == value => Ok(()),
            Some(bound) => Err(format!(
                "{origin} is {value}, but {symbol} = {} ({})",
                bound.value, bound.origin
            )),
        }
    }
}

/// Checks `args` and `params` against `spec`; the error message names the argument or param.
pub fn check_launch(
    spec: &CallableSpec,
    args: &[TensorArg],
    params: &[i64],
) -> Result<ShapeBindings, String> {
    check_counts(spec, args, params)?;
    let mut bindings = ShapeBindings::default();
    bind_params(spec, params, &mut bindings)?;
    for (index, (arg, arg_spec)) in args.iter().zip(spec.args).enumerate() {
        let label = || format!("argument `{}` (#{index})", arg_spec.name);
        check_dtype(arg, arg_spec.dtypes).map_err(|problem| format!("{}: {problem}", label()))?;
        check_tag(arg, arg_spec.access.allowed_tags())
            .map_err(|problem| format!("{}: {problem}", label()))?;
        if arg.ndim as usize != arg_spec.dims.len() {
            return Err(format!(
                "{}: rank {}, expected {} ({})",
                label(),
                arg.ndim,
                arg_spec.dims.len(),
                describe_dims(arg_spec.dims)
            ));
        }
    }
    bind_simple_dims(spec, args, &mut bindings)?;
    resolve_products(spec, args, &mut bindings)?;
    check_constraints(spec, args, &bindings)?;
    Ok(bindings)
}

fn check_counts(spec: &CallableSpec, args: &[TensorArg], params: &[i64]) -> Result<(), String> {
    if args.len() != spec.args.len() {
        let names: Vec<_> = spec.args.iter().map(|arg| arg.name).collect();
        return Err(format!(
            "takes {} tensor arguments ({}), got {}",
            spec.args.len(),
            names.join(", "),
            args.len()
        ));
    }
    let fixed = fixed_params(spec);
    let count_ok = if fixed < spec.params.len() {
        params.len() >= fixed
    } else {
        params.len() == fixed
    };
    if !count_ok {
        let names: Vec<_> = spec.params.iter().map(|param| param.name).collect();
        return Err(format!(
            "takes {} integer params ({}), got {}",
            spec.params.len(),
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            },
            params.len()
        ));
    }
    Ok(())
}

/// The params before a trailing table (all of them when the spec has none).
fn fixed_params(spec: &CallableSpec) -> usize {
    match spec.params.last() {
        Some(last) if matches!(last.kind, ParamKind::F32PerPair(_)) => spec.params.len() - 1,
        _ => spec.params.len(),
    }
}

/// Checks a trailing table of f32 bits: one entry per pair along `symbol`.
fn check_table(
    name: &str,
    symbol: &str,
    table: &[i64],
    bindings: &ShapeBindings,
) -> Result<(), String> {
    if let Some(value) = table.iter().find(|value| u32::try_from(**value).is_err()) {
        return Err(format!(
            "param `{name}` holds {value}, expected the bits of an f32 (0..=4294967295)"
        ));
    }
    // An odd extent is the Even constraint's to report.
    if let Some(bound) = bindings.find(symbol)
        && bound.value.is_multiple_of(2)
        && table.len() as u64 != bound.value / 2
    {
        return Err(format!(
            "param `{name}` has {} entries, expected one per pair of {symbol} = {} ({}): {}",
            table.len(),
            bound.value,
            bound.origin,
            bound.value / 2
        ));
    }
    Ok(())
}

fn bind_params(
    spec: &CallableSpec,
    params: &[i64],
    bindings: &mut ShapeBindings,
) -> Result<(), String> {
    for (index, param_spec) in spec.params.iter().enumerate() {
        // check_counts has seen every fixed param; a trailing table may be empty.
        let Some(&value) = params.get(index) else {
            if let ParamKind::F32PerPair(symbol) = param_spec.kind {
                check_table(param_spec.name, symbol, &[], bindings)?;
            }
            continue;
        };
        match param_spec.kind {
            ParamKind::F32PerPair(symbol) => {
                check_table(param_spec.name, symbol, &params[index..], bindings)?;
            }
            ParamKind::F32Bits => {
                if u32::try_from(value).is_err() {
                    return Err(format!(
                        "param `{}` is {value}, expected the bits of an f32 (0..=4294967295)",
                        param_spec.name
                    ));
                }
            }
            ParamKind::Dim(symbol) => {
                if value <= 0 {
                    return Err(format!(
                        "param `{}` is {value}, expected a positive size",
                        param_spec.name
                    ));
                }
                bindings.bind_or_check(symbol, value as u64, Origin::Param(param_spec.name))?;
            }
        }
    }
    Ok(())
}

fn check_dtype(arg: &TensorArg, allowed: &[DType]) -> Result<(), String> {
    let allowed_names = || {
        allowed
            .iter()
            .map(|dtype| dtype.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match DType::from_code(arg.dtype) {
        None => Err(format!(
            "unknown dtype code {}, expected one of {}",
            arg.dtype,
            allowed_names()
        )),
        Some(dtype) if !allowed.contains(&dtype) => Err(format!(
            "dtype {dtype} is not allowed, expected one of {}",
            allowed_names()
        )),
        Some(_) => Ok(()),
    }
}

fn check_tag(arg: &TensorArg, allowed: &[ArgTag]) -> Result<(), String> {
    let allowed_names = || {
        allowed
            .iter()
            .map(|tag| tag.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match ArgTag::from_code(arg.tag) {
        None => Err(format!(
            "unknown tag code {}, expected one of {}",
            arg.tag,
            allowed_names()
        )),
        Some(tag) if !allowed.contains(&tag) => Err(format!(
            "tag {tag} does not match how the callable uses it, expected one of {}",
            allowed_names()
        )),
        Some(_) => Ok(()),
    }
}

fn describe_dims(dims: &[Dim]) -> String {
    let parts: Vec<String> = dims
        .iter()
        .map(|dim| match dim {
            Dim::Sym(symbol) => symbol.to_string(),
            Dim::PlusOne(symbol) => format!("{symbol}+1"),
            Dim::Product(left, right) => format!("{left}*{right}"),
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// Binds or checks every `Sym` and `PlusOne` dimension, in argument order.
fn bind_simple_dims(
    spec: &CallableSpec,
    args: &[TensorArg],
    bindings: &mut ShapeBindings,
) -> Result<(), String> {
    for (arg_index, (arg, arg_spec)) in args.iter().zip(spec.args).enumerate() {
        for (dim_index, (&value, dim)) in arg.dims().iter().zip(arg_spec.dims).enumerate() {
            let origin = DimRef::new(spec, arg_index, dim_index);
            match *dim {
                Dim::Sym(symbol) => bindings.bind_or_check(symbol, value, Origin::Dim(origin))?,
                Dim::PlusOne(symbol) => match bindings.find(symbol) {
                    Some(bound) if bound.value.checked_add(1) != Some(value) => {
                        return Err(format!(
                            "{origin} is {value}, but must be {symbol}+1 where {symbol} = {} ({})",
                            bound.value, bound.origin
                        ));
                    }
                    Some(_) => {}
                    None if value == 0 => {
                        return Err(format!("{origin} is 0, but must be {symbol}+1"));
                    }
                    None => bindings.bind(symbol, value - 1, Origin::Dim(origin)),
                },
                Dim::Product(..) => {}
            }
        }
    }
    Ok(())
}

/// A product dimension not yet checked: argument, dimension, its two factors and its value.
type PendingProduct = (usize, usize, &'static str, &'static str, u64);

/// Checks `Product` dimensions; a product with one unknown factor binds it by division.
fn resolve_products(
    spec: &CallableSpec,
    args: &[TensorArg],
    bindings: &mut ShapeBindings,
) -> Result<(), String> {
    let mut pending: SmallVec<[PendingProduct; 4]> = SmallVec::new();
    for (arg_index, (arg, arg_spec)) in args.iter().zip(spec.args).enumerate() {
        for (dim_index, (&value, dim)) in arg.dims().iter().zip(arg_spec.dims).enumerate() {
            if let Dim::Product(left, right) = *dim {
                pending.push((arg_index, dim_index, left, right, value));
            }
        }
    }
    // A factor bound by one product can resolve another, so sweep until nothing changes.
    while !pending.is_empty() {
        let before = pending.len();
        let mut still_pending = SmallVec::new();
        for item in pending {
            if !resolve_product(spec, item, bindings)? {
                still_pending.push(item);
            }
        }
        pending = still_pending;
        if pending.len() == before {
            let (arg_index, dim_index, left, right, _) = pending[0];
            return Err(format!(
                "{}: cannot infer both {left} and {right}",
                DimRef::new(spec, arg_index, dim_index)
            ));
        }
    }
    Ok(())
}

/// Returns whether the product could be checked (both factors known after the call).
fn resolve_product(
    spec: &CallableSpec,
    (arg_index, dim_index, left, right, value): (usize, usize, &'static str, &'static str, u64),
    bindings: &mut ShapeBindings,
) -> Result<bool, String> {
    let origin = DimRef::new(spec, arg_index, dim_index);
    match (bindings.find(left).copied(), bindings.find(right).copied()) {
        (Some(l), Some(r)) => {
            if l.value.checked_mul(r.value) != Some(value) {
                return Err(format!(
                    "{origin} is {value}, but must be {left}*{right} = {}*{} ({}; {})",
                    l.value, r.value, l.origin, r.origin
                ));
            }
            Ok(true)
        }
        (Some(known), None) => bind_factor(right, &known, value, origin, bindings),
        (None, Some(known)) => bind_factor(left, &known, value, origin, bindings),
        (None, None) => Ok(false),
    }
}

/// Binds the unknown factor of `value = known * unknown`.
fn bind_factor(
    unknown: &'static str,
    known: &Binding,
    value: u64,
    origin: DimRef,
    bindings: &mut ShapeBindings,
) -> Result<bool, String> {
    if known.value == 0 || !value.is_multiple_of(known.value) {
        return Err(format!(
            "{origin} is {value}, which is not a multiple of {} = {} ({})",
            known.symbol, known.value, known.origin
        ));
    }
    bindings.bind(
        unknown,
        value / known.value,
        Origin::Quotient {
            dim: origin,
            divisor: known.symbol,
        },
    );
    Ok(true)
}

fn check_constraints(
    spec: &CallableSpec,
    args: &[TensorArg],
    bindings: &ShapeBindings,
) -> Result<(), String> {
    for constraint in spec.constraints {
        match *constraint {
            Constraint::MultipleOf { value, factor } => {
                let (Some(v), Some(f)) = (bindings.find(value), bindings.find(factor)) else {
                    continue;
                };
                if f.value == 0 || !v.value.is_multiple_of(f.value) {
                    return Err(format!(
                        "{value} = {} ({}) must be a multiple of {factor} = {} ({})",
                        v.value, v.origin, f.value, f.origin
                    ));
                }
            }
            Constraint::Even(symbol) => {
                let Some(bound) = bindings.find(symbol) else {
                    continue;
                };
                if !bound.value.is_multiple_of(2) {
                    return Err(format!(
                        "{symbol} = {} ({}) must be even",
                        bound.value, bound.origin
                    ));
                }
            }
            Constraint::SameDtype(first, second) => {
                let dtype_of = |name: &str| {
                    spec.arg_index(name)
                        .and_then(|index| args.get(index))
                        .map(|arg| arg.dtype)
                };
                let blocks = |code| DType::from_code(code).is_some_and(DType::is_block_quantized);
                if let (Some(a), Some(b)) = (dtype_of(first), dtype_of(second))
                    && a != b
                    && !(blocks(a) && blocks(b))
                {
                    let name = |code| DType::from_code(code).map_or("?", |dtype| dtype.name());
                    return Err(format!(
                        "arguments `{first}` ({}) and `{second}` ({}) must have the same dtype",
                        name(a),
                        name(b)
                    ));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::callables;

    fn spec(name: &str) -> &'static CallableSpec {
        callables::by_name(name).unwrap().1
    }

    fn tensor(dtype: DType, shape: &[u64], tag: ArgTag) -> TensorArg {
        TensorArg::new(1, 0, dtype, shape, tag).unwrap()
    }

    fn f32_in(shape: &[u64]) -> TensorArg {
        tensor(DType::F32, shape, ArgTag::Input)
    }

    fn f32_out(shape: &[u64]) -> TensorArg {
        tensor(DType::F32, shape, ArgTag::Output)
    }

    fn f32_inout(shape: &[u64]) -> TensorArg {
        tensor(DType::F32, shape, ArgTag::Inout)
    }

    fn i32_in(shape: &[u64]) -> TensorArg {
        tensor(DType::I32, shape, ArgTag::Input)
    }

    fn attention_args(q_width: u64, query_start_len: u64) -> Vec<TensorArg> {
        vec![
            f32_in(&[3, q_width]),
            f32_in(&[5, 2, 4, 8]),
            f32_in(&[5, 2, 4, 8]),
            i32_in(&[2, 3]),
            i32_in(&[2]),
            i32_in(&[query_start_len]),
            f32_out(&[3, q_width]),
        ]
    }

    const ATTENTION_PARAMS: [i64; 5] = [4, 2, 8, 4, 0x3e80_0000];

    #[test]
    fn valid_launches_resolve_every_symbol() {
        let linear = check_launch(
            spec("linear"),
            &[
                f32_in(&[3, 8]),
                tensor(DType::BF16, &[5, 8], ArgTag::Input),
                f32_out(&[3, 5]),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(
            (linear.get("T"), linear.get("K"), linear.get("N")),
            (Some(3), Some(8), Some(5))
        );

        let attention = check_launch(
            spec("paged_attention"),
            &attention_args(32, 3),
            &ATTENTION_PARAMS,
        )
        .unwrap();
        assert_eq!(attention.get("S"), Some(2));
        assert_eq!(attention.get("M"), Some(3));

        let heads = check_launch(
            spec("rms_norm_heads"),
            &[f32_inout(&[3, 24]), f32_in(&[8])],
            &[0x3727_c5ac, 8],
        )
        .unwrap();
        assert_eq!(heads.get("N"), Some(3));

        let rotary = check_launch(
            spec("rotary"),
            &[f32_inout(&[3, 32]), f32_inout(&[3, 16]), i32_in(&[3])],
            &[8, 0x3f80_0000, 0x3dcc_cccd, 0x3c23_d70a, 0x3a83_126f],
        )
        .unwrap();
        assert_eq!((rotary.get("Hq"), rotary.get("Hk")), (Some(4), Some(2)));
    }

    #[test]
    fn kv_caches_may_be_half_width_but_not_mixed() {
        let with_caches = |key: DType, value: DType| {
            let mut args = attention_args(32, 3);
            args[1] = tensor(key, &[5, 2, 4, 8], ArgTag::Input);
            args[2] = tensor(value, &[5, 2, 4, 8], ArgTag::Input);
            check_launch(spec("paged_attention"), &args, &ATTENTION_PARAMS)
        };
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            assert!(with_caches(dtype, dtype).is_ok(), "{dtype}");
        }
        let error = with_caches(DType::BF16, DType::F16).unwrap_err();
        assert_eq!(
            error,
            "arguments `key_cache` (bf16) and `value_cache` (f16) must have the same dtype"
        );
        assert!(with_caches(DType::I32, DType::I32).is_err());
    }

    #[test]
    fn invalid_launches_name_the_problem() {
        struct Case {
            callable: &'static str,
            args: Vec<TensorArg>,
            params: Vec<i64>,
            expected: &'static [&'static str],
        }
        let cases = [
            Case {
                callable: "linear",
                args: vec![f32_in(&[3, 8]), f32_in(&[5, 8])],
                params: vec![],
                expected: &["takes 3 tensor arguments (x, w, out), got 2"],
            },
            Case {
                callable: "linear",
                args: vec![f32_in(&[3, 8]), i32_in(&[5, 8]), f32_out(&[3, 5])],
                params: vec![],
                expected: &["argument `w` (#1)", "dtype i32", "f32, f16, bf16"],
            },
            Case {
                callable: "linear",
                args: vec![f32_in(&[3, 8]), f32_in(&[5, 8]), f32_out(&[3, 6])],
                params: vec![],
                expected: &["argument `out` (#2) dimension 1 is 6", "N = 5"],
            },
            Case {
                callable: "linear",
                args: vec![f32_in(&[3, 8, 1]), f32_in(&[5, 8]), f32_out(&[3, 5])],
                params: vec![],
                expected: &["argument `x` (#0): rank 3, expected 2 ([T, K])"],
            },
            Case {
                callable: "linear",
                args: vec![f32_in(&[3, 8]), f32_in(&[5, 8]), f32_in(&[3, 5])],
                params: vec![],
                expected: &["argument `out` (#2)", "tag INPUT"],
            },
            Case {
                callable: "rms_norm",
                args: vec![f32_in(&[3, 8]), f32_in(&[8]), f32_out(&[3, 8])],
                params: vec![],
                expected: &["takes 1 integer params (eps), got 0"],
            },
            Case {
                callable: "rms_norm",
                args: vec![f32_in(&[3, 8]), f32_in(&[8]), f32_out(&[3, 8])],
                params: vec![-1],
                expected: &["param `eps` is -1"],
            },
            Case {
                callable: "paged_attention",
                args: attention_args(32, 2),
                params: ATTENTION_PARAMS.to_vec(),
                expected: &["argument `query_start` (#5) dimension 0 is 2", "S+1"],
            },
            Case {
                callable: "paged_attention",
                args: attention_args(24, 3),
                params: ATTENTION_PARAMS.to_vec(),
                expected: &["argument `q` (#0) dimension 1 is 24", "Hq*D = 4*8"],
            },
            Case {
                callable: "paged_attention",
                args: attention_args(24, 3),
                params: vec![3, 2, 8, 4, 0],
                expected: &["Hq = 3", "multiple of Hk = 2"],
            },
            Case {
                callable: "paged_attention",
                args: attention_args(32, 3),
                params: vec![4, 2, 0, 4, 0],
                expected: &["param `head_dim` is 0, expected a positive size"],
            },
            Case {
                callable: "rms_norm_heads",
                args: vec![f32_inout(&[3, 20]), f32_in(&[8])],
                params: vec![0, 8],
                expected: &["dimension 1 is 20, which is not a multiple of D = 8"],
            },
            Case {
                callable: "rotary",
                args: vec![f32_inout(&[3, 15]), f32_inout(&[3, 5]), i32_in(&[3])],
                params: vec![5, 0],
                expected: &["D = 5", "must be even"],
            },
            Case {
                callable: "rotary",
                args: vec![f32_inout(&[3, 16]), f32_inout(&[3, 8]), i32_in(&[3])],
                params: vec![8, 0, 0, 0],
                expected: &[
                    "param `inv_freq` has 3 entries, expected one per pair of D = 8",
                    ": 4",
                ],
            },
            Case {
                callable: "rotary",
                args: vec![f32_inout(&[3, 16]), f32_inout(&[3, 8]), i32_in(&[3])],
                params: vec![8],
                expected: &["param `inv_freq` has 0 entries"],
            },
            Case {
                callable: "rotary",
                args: vec![f32_inout(&[3, 16]), f32_inout(&[3, 8]), i32_in(&[3])],
                params: vec![8, 0, -1, 0, 0],
                expected: &["param `inv_freq` holds -1, expected the bits of an f32"],
            },
            Case {
                callable: "rotary",
                args: vec![f32_inout(&[3, 16]), f32_inout(&[3, 8]), i32_in(&[3])],
                params: vec![],
                expected: &["takes 2 integer params (head_dim, inv_freq), got 0"],
            },
        ];
        for case in cases {
            let error = check_launch(spec(case.callable), &case.args, &case.params)
                .expect_err(case.callable);
            for fragment in case.expected {
                assert!(
                    error.contains(fragment),
                    "{}: `{error}` lacks `{fragment}`",
                    case.callable
                );
            }
        }
    }

    #[test]
    fn unknown_codes_are_refused() {
        let mut bad_dtype = f32_in(&[3, 8]);
        bad_dtype.dtype = 42;
        let error = check_launch(
            spec("linear"),
            &[bad_dtype, f32_in(&[5, 8]), f32_out(&[3, 5])],
            &[],
        )
        .unwrap_err();
        assert!(error.contains("unknown dtype code 42"), "{error}");

        let mut bad_tag = f32_out(&[3, 5]);
        bad_tag.tag = 9;
        let error = check_launch(
            spec("linear"),
            &[f32_in(&[3, 8]), f32_in(&[5, 8]), bad_tag],
            &[],
        )
        .unwrap_err();
        assert!(error.contains("unknown tag code 9"), "{error}");
    }
}
