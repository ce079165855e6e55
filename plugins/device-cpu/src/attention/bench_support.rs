//! [`AttentionBench`]: paged attention over a bf16 cache as `cargo bench` reaches it, without the device ABI around it.
//!
//! Launches reach attention through the ABI, whose export layer checks every shape; a
//! benchmark of the kernel alone needs a narrower door, and this is it: it checks what the
//! export layer would (a whole number of query rows, caches of whole blocks, one block-table
//! row per sequence) and runs the code every `paged_attention` launch runs, with a scratch
//! kept from launch to launch as the device keeps it.

use crate::isa::Isa;
use crate::linear::{Bf16Bits, Bf16Products, as_wide};
use crate::workers::Workers;

use super::{AttentionScratch, AttentionShape, KvCache, StepLayout, attend};

/// The heads and paging of the model a bench runs attention for.
#[derive(Clone, Copy, Debug)]
pub struct BenchHeads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// A device's worker threads, instruction-set level and attention scratch, for timing
/// attention launches.
pub struct AttentionBench {
    workers: Workers,
    isa: Isa,
    scratch: AttentionScratch,
}

/// One step's sequences: `[S, M]` block table, `S` lengths and `S + 1` query starts.
pub struct BenchLayout<'a> {
    pub block_table: &'a [i32],
    pub seq_lens: &'a [i32],
    pub query_start: &'a [i32],
}

impl AttentionBench {
    pub fn new(isa: Isa, threads: usize) -> Result<AttentionBench, String> {
        Ok(AttentionBench {
            workers: Workers::new(threads)?,
            isa,
            scratch: AttentionScratch::default(),
        })
    }

    /// `out[T, Hq*D]` from `q[T, Hq*D]` over the bf16 caches (`keys` and `values`, each
    /// `[B, Hk, bs, D]` as bf16 bits). With `bf16_products`, at `avx512_bf16` the products
    /// are bf16 (`bf16_products=bf16`); otherwise f32.
    pub fn attend(
        &mut self,
        (heads, bf16_products): (BenchHeads, bool),
        q: &[f32],
        (keys, values): (&[u16], &[u16]),
        layout: &BenchLayout<'_>,
        out: &mut [f32],
    ) -> Result<(), String> {
        let q_width = heads.num_heads * heads.head_dim;
        let block_len = heads.num_kv_heads * heads.block_size * heads.head_dim;
        let sequences = layout.seq_lens.len();
        let shapes_agree = q_width > 0
            && block_len > 0
            && heads.num_heads.is_multiple_of(heads.num_kv_heads)
            && q.len().is_multiple_of(q_width)
            && out.len() == q.len()
            && keys.len() == values.len()
            && keys.len().is_multiple_of(block_len)
            && layout.query_start.len() == sequences + 1
            && layout.block_table.len().is_multiple_of(sequences.max(1));
        if !shapes_agree {
            return Err(format!("the step's shapes disagree with {heads:?}"));
        }
        let shape = AttentionShape {
            num_heads: heads.num_heads,
            num_kv_heads: heads.num_kv_heads,
            head_dim: heads.head_dim,
            block_size: heads.block_size,
            num_blocks: keys.len() / block_len,
            blocks_per_seq: layout.block_table.len() / sequences.max(1),
        };
        let cache = KvCache::<Bf16Bits> {
            keys: as_wide(keys),
            values: as_wide(values),
        };
        let step = StepLayout {
            block_table: layout.block_table,
            seq_lens: layout.seq_lens,
            query_start: layout.query_start,
        };
        let products = if bf16_products {
            Bf16Products::Bf16
        } else {
            Bf16Products::F32
        };
        let scale = 1.0 / (heads.head_dim as f32).sqrt();
        attend(
            ((self.isa, products), &self.workers, &mut self.scratch),
            q,
            &cache,
            &step,
            out,
            (shape, scale, usize::MAX),
        )
    }
}
