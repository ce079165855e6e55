//! How one launch is cut into tasks, panels and token groups ([`Plan`]): which thread computes an output changes where, never how.

use std::ops::Range;

use super::{Kernel, NR, WeightOrder, portable};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512, panels};
use crate::isa::{Isa, Vectors};
use crate::workers::Workers;

/// Most tokens one pass over a panel serves: their activation rows (`64 × K`) stay in L2
/// while the panels of a task stream past them.
const MC: usize = 64;

/// Below this many multiply-adds (64 KiB of bf16 weights for one token) a launch runs as one
/// task on the calling thread: handing half of it to a worker would save less than it costs.
/// Above it, even a decode's small projections stream their weights faster on every core.
const MIN_PARALLEL_WORK: usize = 32 * 1024;

/// Tokens per tile of the tiles in `vectors`.
pub(super) fn tile_tokens(vectors: Vectors) -> usize {
    match vectors {
        #[cfg(target_arch = "x86_64")]
        Vectors::Avx512 => avx512::MR,
        #[cfg(target_arch = "x86_64")]
        Vectors::Avx2 => avx2::MR,
        Vectors::Portable => portable::MR,
    }
}

/// Tokens and weight rows of one tile.
fn tile_shape(isa: Isa, order: WeightOrder) -> (usize, usize) {
    match order {
        #[cfg(target_arch = "x86_64")]
        WeightOrder::Panels => (panels::MR, panels::ROWS),
        _ => (tile_tokens(isa.vectors()), NR),
    }
}

/// How one launch is cut into tasks, panels and token groups: a value the dispatch and the
/// sinks read, fixed when the launch starts.
pub(super) struct Plan<'w> {
    pub(super) tokens: usize,
    pub(super) inner: usize,
    /// Outputs of each panel space: one per output matrix (`qkv_linear` has three), one for
    /// a gate and up pair.
    pub(super) widths: &'w [usize],
    /// Weight matrices a panel reads: two for a gate and up pair.
    matrices_per_panel: usize,
    pub(super) tile_tokens: usize,
    /// Weight rows per panel: [`NR`], or 32 for weights in panels.
    pub(super) panel_rows: usize,
    /// The level the gated epilogue runs at.
    pub(super) isa: Isa,
}

impl<'w> Plan<'w> {
    pub(super) fn new(
        (isa, _, order, _): Kernel,
        tokens: usize,
        inner: usize,
        widths: &'w [usize],
        matrices_per_panel: usize,
    ) -> Plan<'w> {
        let (tile_tokens, panel_rows) = tile_shape(isa, order);
        Plan {
            tokens,
            inner,
            widths,
            matrices_per_panel,
            tile_tokens,
            panel_rows,
            isa,
        }
    }

    /// Whether every panel meets all the tokens in one pass (one token block), so its weights
    /// are read once, from memory, rather than again from cache for later blocks.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn reads_panels_once(&self) -> bool {
        self.tokens <= MC
    }

    /// Calls `tile(part, tokens, n0, columns)` for every token group and run of up to
    /// `run_panels` panels of every panel space, spread over the workers by panels: each task
    /// owns the columns of its panels. The panel spaces are laid end to end, so one task may
    /// finish one and start the next.
    pub(super) fn run(
        &self,
        workers: &Workers,
        run_panels: usize,
        tile: impl Fn(usize, Range<usize>, usize, usize) + Sync,
    ) {
        let tokens = self.tokens;
        let rows = self.panel_rows;
        let panel_counts = self.widths.iter().map(|w| w.div_ceil(rows));
        let num_panels: usize = panel_counts.clone().sum();
        let work =
            tokens * self.inner * self.widths.iter().sum::<usize>() * self.matrices_per_panel;
        let body = |panels: Range<usize>| {
            for block in token_blocks(tokens, self.tile_tokens) {
                // Cut once per block: the panel loop below is the hot path of decode.
                let groups = token_groups(block, self.tile_tokens);
                let mut space_start = 0;
                for (part, count) in panel_counts.clone().enumerate() {
                    let width = self.widths[part];
                    let own = panels.start.max(space_start)..panels.end.min(space_start + count);
                    for panel in own.clone().step_by(run_panels.max(1)) {
                        let n0 = (panel - space_start) * rows;
                        let panels = run_panels.max(1).min(own.end - panel);
                        let columns = (panels * rows).min(width - n0);
                        for group in groups.clone() {
                            tile(part, group, n0, columns);
                        }
                    }
                    space_start += count;
                }
            }
        };
        // The split decides only which thread computes a panel, never how (see the module docs).
        if work < MIN_PARALLEL_WORK {
            body(0..num_panels);
        } else {
            workers.for_each_range(num_panels, body);
        }
    }
}

/// `0..T` cut into at most [`MC`]-token blocks of nearly equal size (multiples of
/// `tile_tokens` but the last).
fn token_blocks(tokens: usize, tile_tokens: usize) -> impl Iterator<Item = Range<usize>> {
    let block = token_block_len(tokens, tile_tokens);
    (0..tokens)
        .step_by(block)
        .map(move |start| start..(start + block).min(tokens))
}

/// The length of every block of [`token_blocks`] but the last.
pub(super) fn token_block_len(tokens: usize, tile_tokens: usize) -> usize {
    let num_blocks = tokens.div_ceil(MC);
    tokens
        .div_ceil(num_blocks.max(1))
        .div_ceil(tile_tokens)
        .max(1)
        * tile_tokens
}

/// `tokens` cut into the fewest groups of at most `tile_tokens`, of sizes differing by at most
/// one: 13 tokens in tiles of 4 make 4, 3, 3, 3 rather than 4, 4, 4, 1, whose one-token tile
/// would read its weights for a single token.
fn token_groups(
    tokens: Range<usize>,
    tile_tokens: usize,
) -> impl Iterator<Item = Range<usize>> + Clone {
    let num_groups = tokens.len().div_ceil(tile_tokens);
    let (size, larger) = match num_groups {
        0 => (0, 0),
        _ => (tokens.len() / num_groups, tokens.len() % num_groups),
    };
    (0..num_groups).map(move |group| {
        let first = tokens.start + group * size + group.min(larger);
        first..first + size + usize::from(group < larger)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_groups_cover_the_block_evenly() {
        type Groups = &'static [Range<usize>];
        let cases: [(Range<usize>, Groups); 4] = [
            (0..0, &[]),
            (3..4, &[Range { start: 3, end: 4 }]),
            (0..7, &[0..4, 4..7]),
            (10..23, &[10..14, 14..17, 17..20, 20..23]),
        ];
        for (tokens, groups) in cases {
            assert_eq!(
                token_groups(tokens.clone(), 4).collect::<Vec<_>>(),
                groups,
                "{tokens:?}"
            );
        }
        let sizes: Vec<usize> = token_groups(0..130, 4).map(|group| group.len()).collect();
        assert_eq!((sizes.len(), sizes.iter().sum::<usize>()), (33, 130));
        assert!(sizes.iter().all(|&size| size == 3 || size == 4));
    }
}
