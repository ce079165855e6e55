//! The quantities shapes scale with, and resolving a symbolic shape against them.

use super::program::{Dim, Extent};

/// The values of every extent for one step (or, at prepare time, their maxima).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Extents {
    pub tokens: u64,
    pub sequences: u64,
    pub emitting: u64,
    pub kv_blocks: u64,
    pub block_size: u64,
    pub blocks_per_sequence: u64,
}

impl Extents {
    fn value(&self, extent: Extent) -> u64 {
        match extent {
            Extent::One => 1,
            Extent::Tokens => self.tokens,
            Extent::Sequences => self.sequences,
            Extent::Emitting => self.emitting,
            Extent::KvBlocks => self.kv_blocks,
            Extent::BlockSize => self.block_size,
            Extent::BlocksPerSequence => self.blocks_per_sequence,
        }
    }

    /// `factor * extent + offset` for one dimension.
    pub fn resolve(&self, dim: &Dim) -> u64 {
        dim.factor
            .saturating_mul(self.value(dim.extent))
            .saturating_add(dim.offset)
    }

    /// Resolves a whole shape into `out`, returning the element count.
    pub fn resolve_shape(&self, dims: &[Dim], out: &mut [u64]) -> u64 {
        let mut elements = 1u64;
        for (dim, slot) in dims.iter().zip(out.iter_mut()) {
            *slot = self.resolve(dim);
            elements = elements.saturating_mul(*slot);
        }
        elements
    }
}
