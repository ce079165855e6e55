//! The callables every device provides: names, argument dtypes, symbolic shapes, access and params.
//!
//! A callable's index in the C ABI is its position in [`ALL`]. Shape symbols: `T` flattened
//! tokens of the step, `S` sequences, `E` emitting rows, `H` hidden, `V` vocab, `D` head_dim,
//! `B` KV blocks, `bs` block size, `M` blocks per sequence in the block table, `Q` and `R` the
//! widths of the query and of the key/value projections.

use crate::abi::{ArgTag, DType};

/// Names a callable so device code can `match` on it instead of comparing strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallableId {
    EmbeddingGather,
    RmsNorm,
    RmsNormHeads,
    Linear,
    Rotary,
    KvWrite,
    PagedAttention,
    SiluMul,
    Add,
    GatherRows,
    AdvanceSeqLens,
    DerivePositions,
    DeriveSlotMapping,
    QkvLinear,
    SiluGateLinear,
    AddRmsNorm,
    BiasAdd,
    /// `paged_attention` within a sliding window: a token attends to the last `window`
    /// positions of its history, itself included.
    PagedAttentionWindow,
}

/// The signature of one callable.
#[derive(Debug)]
pub struct CallableSpec {
    pub id: CallableId,
    pub name: &'static str,
    pub args: &'static [ArgSpec],
    pub params: &'static [ParamSpec],
    pub constraints: &'static [Constraint],
}

impl CallableSpec {
    /// The position of the argument called `name`.
    pub fn arg_index(&self, name: &str) -> Option<usize> {
        self.args.iter().position(|arg| arg.name == name)
    }

    /// The position of the param called `name`.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|param| param.name == name)
    }
}

/// One tensor argument of a callable.
#[derive(Debug)]
pub struct ArgSpec {
    pub name: &'static str,
    pub dtypes: &'static [DType],
    /// One entry per dimension; the rank is `dims.len()`.
    pub dims: &'static [Dim],
    pub access: Access,
}

/// One dimension of an argument's shape, in terms of shape symbols.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dim {
    Sym(&'static str),
    /// The symbol plus one, e.g. `S+1` for query offsets.
    PlusOne(&'static str),
    /// The product of two symbols, e.g. `Hq*D` for heads laid out in one row.
    Product(&'static str, &'static str),
}

/// What a callable does with an argument; decides which tags the argument accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    /// Written without being read (a cache written at some slots also counts: the other
    /// slots keep their contents, which is what OUTPUT_EXISTING promises).
    Write,
    /// Read and written in place.
    ReadWrite,
}

impl Access {
    /// The tags under which dependency tracking stays correct for this access.
    pub const fn allowed_tags(self) -> &'static [ArgTag] {
        match self {
            Access::Read => &[ArgTag::Input, ArgTag::Inout, ArgTag::NoDep],
            Access::Write => &[
                ArgTag::Output,
                ArgTag::OutputExisting,
                ArgTag::Inout,
                ArgTag::NoDep,
            ],
            Access::ReadWrite => &[ArgTag::Inout, ArgTag::NoDep],
        }
    }
}

/// One integer param of a callable.
#[derive(Debug)]
pub struct ParamSpec {
    pub name: &'static str,
    pub kind: ParamKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// The IEEE-754 bits of an f32 (0..=u32::MAX).
    F32Bits,
    /// A positive size that fixes a shape symbol.
    Dim(&'static str),
    /// A table of f32 bits, one per pair of elements along the symbol (fixed by an earlier
    /// param): the last param of a spec, taking every param after the fixed ones. Program
    /// constants computed once by the model glue, such as rotary inverse frequencies, travel so.
    F32PerPair(&'static str),
}

/// A relation between shape symbols that shapes alone do not express.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Constraint {
    /// `value` is a multiple of `factor` (query heads per KV head in GQA).
    MultipleOf {
        value: &'static str,
        factor: &'static str,
    },
    /// The symbol is even (rotate-half needs pairs).
    Even(&'static str),
    /// Two arguments have the same dtype (the key and value caches of one layer), or are both
    /// block-quantized (a quantized file mixes block types within a layer, e.g. Q4_K_M's Q4_K
    /// queries and Q6_K values).
    SameDtype(&'static str, &'static str),
}

const F32: &[DType] = &[DType::F32];
const I32: &[DType] = &[DType::I32];
/// Weights may stay in their checkpoint precision.
const WEIGHT: &[DType] = &[DType::F32, DType::F16, DType::BF16];
/// Matrices the linears multiply, and embedding tables, may also be stored block-quantized.
const MATRIX: &[DType] = &[
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q4_K,
    DType::Q6_K,
];
/// KV caches hold keys and values in f32, or rounded to f16 or bf16 when written.
const KV: &[DType] = &[DType::F32, DType::F16, DType::BF16];

/// The arguments of both attention callables: queries, the paged caches, the step's layout.
const ATTENTION_ARGS: &[ArgSpec] = &[
    arg("q", F32, &[Sym("T"), Product("Hq", "D")], Read),
    arg("key_cache", KV, KV_CACHE, Read),
    arg("value_cache", KV, KV_CACHE, Read),
    arg("block_table", I32, &[Sym("S"), Sym("M")], Read),
    arg("seq_lens", I32, &[Sym("S")], Read),
    arg("query_start", I32, &[PlusOne("S")], Read),
    arg("out", F32, &[Sym("T"), Product("Hq", "D")], Write),
];

/// The params of `paged_attention_window`: those of `paged_attention`, then `window`.
const WINDOW_ATTENTION_PARAMS: &[ParamSpec] = &[
    dim_param("num_heads", "Hq"),
    dim_param("num_kv_heads", "Hk"),
    dim_param("head_dim", "D"),
    dim_param("block_size", "bs"),
    f32_bits("scale"),
    dim_param("window", "W"),
];

/// The params of `paged_attention`: the windowed callable's, without `window`.
const ATTENTION_PARAMS: &[ParamSpec] = WINDOW_ATTENTION_PARAMS
    .split_at(WINDOW_ATTENTION_PARAMS.len() - 1)
    .0;

/// Grouped-query heads, and keys and values of one dtype.
const ATTENTION_CONSTRAINTS: &[Constraint] = &[
    Constraint::MultipleOf {
        value: "Hq",
        factor: "Hk",
    },
    Constraint::SameDtype("key_cache", "value_cache"),
];

const fn arg(
    name: &'static str,
    dtypes: &'static [DType],
    dims: &'static [Dim],
    access: Access,
) -> ArgSpec {
    ArgSpec {
        name,
        dtypes,
        dims,
        access,
    }
}

const fn f32_bits(name: &'static str) -> ParamSpec {
    ParamSpec {
        name,
        kind: ParamKind::F32Bits,
    }
}

const fn f32_per_pair(name: &'static str, symbol: &'static str) -> ParamSpec {
    ParamSpec {
        name,
        kind: ParamKind::F32PerPair(symbol),
    }
}

const fn dim_param(name: &'static str, symbol: &'static str) -> ParamSpec {
    ParamSpec {
        name,
        kind: ParamKind::Dim(symbol),
    }
}

use Access::{Read, ReadWrite, Write};
use Dim::{PlusOne, Product, Sym};

/// A paged KV cache: each block holds each KV head's `bs` rows together, so attention reads a
/// head's rows of a block as one contiguous run.
const KV_CACHE: &[Dim] = &[Sym("B"), Sym("Hk"), Sym("bs"), Sym("D")];

/// The most tensor arguments a callable takes. A launch keeps its per-argument tables inline up
/// to this many, so a launch reaches no allocator: a decode step is hundreds of them.
pub const MAX_ARGS: usize = 12;

const _: () = {
    let mut i = 0;
    while i < ALL.len() {
        assert!(
            ALL[i].args.len() <= MAX_ARGS,
            "a callable takes more than MAX_ARGS arguments"
        );
        i += 1;
    }
};

/// Every callable, in index order.
pub const ALL: &[CallableSpec] = &[
    CallableSpec {
        id: CallableId::EmbeddingGather,
        name: "embedding_gather",
        args: &[
            arg("ids", I32, &[Sym("T")], Read),
            arg("table", MATRIX, &[Sym("V"), Sym("H")], Read),
            arg("out", F32, &[Sym("T"), Sym("H")], Write),
        ],
        params: &[],
        constraints: &[],
    },
    CallableSpec {
        id: CallableId::RmsNorm,
        name: "rms_norm",
        args: &[
            arg("x", F32, &[Sym("T"), Sym("H")], Read),
            arg("weight", WEIGHT, &[Sym("H")], Read),
            arg("out", F32, &[Sym("T"), Sym("H")], Write),
        ],
        params: &[f32_bits("eps")],
        constraints: &[],
    },
    CallableSpec {
        id: CallableId::RmsNormHeads,
        name: "rms_norm_heads",
        args: &[
            arg("x", F32, &[Sym("T"), Product("N", "D")], ReadWrite),
            arg("weight", WEIGHT, &[Sym("D")], Read),
        ],
        params: &[f32_bits("eps"), dim_param("head_dim", "D")],
        constraints: &[],
    },
    CallableSpec {
        id: CallableId::Linear,
        name: "linear",
        args: &[
            arg("x", F32, &[Sym("T"), Sym("K")], Read),
            arg("w", MATRIX, &[Sym("N"), Sym("K")], Read),
            arg("out", F32, &[Sym("T"), Sym("N")], Write),
        ],
        params: &[],
        constraints: &[],
    },
    CallableSpec {
        id: CallableId::Rotary,
        name: "rotary",
        args: &[
            arg("q", F32, &[Sym("T"), Product("Hq", "D")], ReadWrite),
            arg("k", F32, &[Sym("T"), Product("Hk", "D")], ReadWrite),
            arg("positions", I32, &[Sym("T")], Read),
        ],
        params: &[dim_param("head_dim", "D"), f32_per_pair("inv_freq", "D")],
        constraints: &[Constraint::Even("D")],
    },
    CallableSpec {
        id: CallableId::KvWrite,
        name: "kv_write",
        args: &[
            arg("k", F32, &[Sym("T"), Product("Hk", "D")], Read),
            arg("v", F32, &[Sym("T"), Product("Hk", "D")], Read),
            arg("key_cache", KV, KV_CACHE, Write),
            arg("value_cache", KV, KV_CACHE, Write),
            arg("slot_mapping", I32, &[Sym("T")], Read),
        ],
        params: &[],
        constraints: &[Constraint::SameDtype("key_cache", "value_cache")],
    },
    CallableSpec {
        id: CallableId::PagedAttention,
        name: "paged_attention",
        args: ATTENTION_ARGS,
        params: ATTENTION_PARAMS,
        constraints: ATTENTION_CONSTRAINTS,
    },
    CallableSpec {
        id: CallableId::SiluMul,
        name: "silu_mul",
        args: &[
            arg("gate", F32, &[Sym("T"), Sym("I")], Read),
            arg("up", F32, &[Sym("T"), Sym("I")], Read),
            arg("out", F32, &[Sym("T"), Sym("I")], Write),
        ],
        params: &[],
        constraints: &[],
    },
    CallableSpec {
        id: CallableId::Add,
        name: "add",
        args: &[
            arg("x", F32, &[Sym("T"), Sym("H")], ReadWrite),
            arg("y", F32, &[Sym("T"), Sym("H")], Read),
        ],
        params: &[],
        constraints: &[],
    },
    CallableSpec {
        id: CallableId::GatherRows,
        name: "gather_rows",
        args: &[
            arg("x", F32, &[Sym("T"), Sym("H")], Read),
            arg("indices", I32, &[Sym("E")], Read),
            arg("out", F32, &[Sym("E"), Sym("H")], Write),
        ],
        params: &[],
        constraints: &[],
    },
    CallableSpec {
        id: CallableId::AdvanceSeqLens,
        name: "advance_seq_lens",
        args: &[
            arg("seq_lens", I32, &[Sym("S")], ReadWrite),
            arg("query_start", I32, &[PlusOne("S")], Read),
        ],
        params: &[],
        constraints: &[],
    },
    CallableSpec {
        id: CallableId::DerivePositions,
        name: "derive_positions",
        args: &[
            arg("seq_lens", I32, &[Sym("S")], Read),
            arg("query_start", I32, &[PlusOne("S")], Read),
            arg("positions", I32, &[Sym("T")], Write),
        ],
        params: &[],
        constraints: &[],
    },
    CallableSpec {
        id: CallableId::DeriveSlotMapping,
        name: "derive_slot_mapping",
        args: &[
            arg("block_table", I32, &[Sym("S"), Sym("M")], Read),
            arg("seq_lens", I32, &[Sym("S")], Read),
            arg("query_start", I32, &[PlusOne("S")], Read),
            arg("slot_mapping", I32, &[Sym("T")], Write),
        ],
        params: &[dim_param("block_size", "bs")],
        constraints: &[],
    },
    // The fused callables below each do what a sequence of the ones above does, in one launch
    // and with one pass over the shared input: they cut per-launch overhead out of decode,
    // where a step is hundreds of small launches.
    CallableSpec {
        id: CallableId::QkvLinear,
        name: "qkv_linear",
        args: &[
            arg("x", F32, &[Sym("T"), Sym("K")], Read),
            arg("wq", MATRIX, &[Sym("Q"), Sym("K")], Read),
            arg("wk", MATRIX, &[Sym("R"), Sym("K")], Read),
            arg("wv", MATRIX, &[Sym("R"), Sym("K")], Read),
            arg("q", F32, &[Sym("T"), Sym("Q")], Write),
            arg("k", F32, &[Sym("T"), Sym("R")], Write),
            arg("v", F32, &[Sym("T"), Sym("R")], Write),
        ],
        params: &[],
        constraints: &[
            Constraint::SameDtype("wq", "wk"),
            Constraint::SameDtype("wk", "wv"),
        ],
    },
    CallableSpec {
        id: CallableId::SiluGateLinear,
        name: "silu_gate_linear",
        args: &[
            arg("x", F32, &[Sym("T"), Sym("K")], Read),
            arg("w_gate", MATRIX, &[Sym("I"), Sym("K")], Read),
            arg("w_up", MATRIX, &[Sym("I"), Sym("K")], Read),
            arg("out", F32, &[Sym("T"), Sym("I")], Write),
        ],
        params: &[],
        constraints: &[Constraint::SameDtype("w_gate", "w_up")],
    },
    CallableSpec {
        id: CallableId::AddRmsNorm,
        name: "add_rms_norm",
        args: &[
            arg("x", F32, &[Sym("T"), Sym("H")], ReadWrite),
            arg("y", F32, &[Sym("T"), Sym("H")], Read),
            arg("weight", WEIGHT, &[Sym("H")], Read),
            arg("out", F32, &[Sym("T"), Sym("H")], Write),
        ],
        params: &[f32_bits("eps")],
        constraints: &[],
    },
    CallableSpec {
        id: CallableId::BiasAdd,
        name: "bias_add",
        args: &[
            arg("x", F32, &[Sym("T"), Sym("N")], ReadWrite),
            arg("bias", WEIGHT, &[Sym("N")], Read),
        ],
        params: &[],
        constraints: &[],
    },
    CallableSpec {
        id: CallableId::PagedAttentionWindow,
        name: "paged_attention_window",
        args: ATTENTION_ARGS,
        params: WINDOW_ATTENTION_PARAMS,
        constraints: ATTENTION_CONSTRAINTS,
    },
];

/// The callable called `name`, with its index.
pub fn by_name(name: &str) -> Option<(usize, &'static CallableSpec)> {
    ALL.iter().enumerate().find(|(_, spec)| spec.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn names_and_ids_are_unique() {
        let names: HashSet<_> = ALL.iter().map(|spec| spec.name).collect();
        let ids: HashSet<_> = ALL.iter().map(|spec| spec.id).collect();
        assert_eq!(names.len(), ALL.len());
        assert_eq!(ids.len(), ALL.len());
    }

    #[test]
    fn specs_are_well_formed() {
        for spec in ALL {
            let arg_names: HashSet<_> = spec.args.iter().map(|arg| arg.name).collect();
            assert_eq!(arg_names.len(), spec.args.len(), "{}", spec.name);
            for arg in spec.args {
                assert!(
                    !arg.dims.is_empty() && arg.dims.len() <= crate::MAX_RANK,
                    "{}.{}",
                    spec.name,
                    arg.name
                );
                assert!(!arg.dtypes.is_empty(), "{}.{}", spec.name, arg.name);
            }
        }
    }

    #[test]
    fn header_lists_the_callables_in_index_order() {
        let header = include_str!("../include/plughost_device.h");
        for (index, spec) in ALL.iter().enumerate() {
            let line = format!("{index:2} {}(", spec.name);
            assert!(header.contains(&line), "the header lacks `{line}`");
        }
    }

    #[test]
    fn by_name_finds_the_index() {
        let (index, spec) = by_name("linear").unwrap();
        assert_eq!(ALL[index].id, CallableId::Linear);
        assert_eq!(spec.arg_index("w"), Some(1));
        assert!(by_name("nope").is_none());
    }
}
