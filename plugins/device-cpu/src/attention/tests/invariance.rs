//! Batch invariance of attention: a row's bits are the same alone, in a batch of 16, chunked, computed as a lone token, at any thread count, on every path; and launches reuse their scratch.

use super::*;

/// SmolLM2's heads: nine query heads on three KV heads of 64.
const SMOLLM2: Heads = Heads {
    num_heads: 9,
    num_kv_heads: 3,
    head_dim: 64,
    block_size: 16,
    window: usize::MAX,
};

/// Eight query heads on one KV head of 128, blocks of 32.
const WIDE: Heads = Heads {
    num_heads: 8,
    num_kv_heads: 1,
    head_dim: 128,
    block_size: 32,
    window: usize::MAX,
};

/// Fifteen other sequences for a batch of 16: decodes, chunks after cached tokens and fresh
/// prefills, in a different order from the ids.
fn others(decodes_only: bool) -> impl Iterator<Item = Sequence> {
    (1..16u64).map(move |id| {
        let i = id as usize;
        match id % 3 {
            _ if decodes_only => Sequence::new(id, 29 * i, 1),
            0 => Sequence::new(id, 37 * i, 1),
            1 => Sequence::new(id, 11 * i, 9 + i),
            _ => Sequence::new(id, 0, 3 * i),
        }
    })
}

#[test]
fn a_rows_bits_do_not_depend_on_its_batch_its_chunks_or_the_threads() {
    let chunks = [1, 16, 5, 64, 1, 100, 113];
    let probes = [0, 15, 16, 17, 63, 64, 127, 128, 129, 255, 256, 299];
    assert_invariant(&[SMOLLM2, WIDE], &chunks, &probes);
}

#[test]
fn a_sliding_window_keeps_a_rows_bits_invariant() {
    // Windows starting inside tiles and ranges, over a history that crosses ranges.
    let windowed = |heads: Heads, window| Heads { window, ..heads };
    let chunks = [1, 300, 64, 600, 77, 158];
    let probes = [0, 99, 100, 101, 511, 512, 600, 1023, 1199];
    assert_invariant(
        &[windowed(SMOLLM2, 100), windowed(WIDE, 700)],
        &chunks,
        &probes,
    );
}

/// For each of `heads` and every path: a sequence as long as `chunks` together gives each
/// row the same bits alone, in those chunks, in a batch of 16, and at each of `probes` as a
/// lone token alone and among 16 decodes, at 1, 2 and 3 threads.
fn assert_invariant(all_heads: &[Heads], chunks: &[usize], probes: &[usize]) {
    let len: usize = chunks.iter().sum();
    let workers: Vec<Workers> = [1, 2, 3].map(|t| Workers::new(t).unwrap()).into();
    let mut scratch = AttentionScratch::default();
    for &heads in all_heads {
        for path in Path::every() {
            let what = format!("{heads:?}, {path:?}");
            let alone = Step::new(heads, &[Sequence::new(0, 0, len)]);
            let alone_out = alone.run(path, &workers[1], &mut scratch);
            let expected = |position: usize| bits(alone.row(&alone_out, 0, position));

            let mut start = 0;
            for (i, &size) in chunks.iter().enumerate() {
                let step = Step::new(heads, &[Sequence::new(0, start, size)]);
                let out = step.run(path, &workers[i % 3], &mut scratch);
                for position in start..start + size {
                    let got = bits(step.row(&out, 0, position));
                    assert_eq!(
                        got,
                        expected(position),
                        "{what}: chunk {i}, position {position}"
                    );
                }
                start += size;
            }

            let mut batch: Vec<Sequence> = others(false).collect();
            batch.insert(7, Sequence::new(0, 0, len));
            let step = Step::new(heads, &batch);
            let out = step.run(path, &workers[2], &mut scratch);
            for position in 0..len {
                let got = bits(step.row(&out, 7, position));
                assert_eq!(
                    got,
                    expected(position),
                    "{what}: in a batch, position {position}"
                );
            }

            for &position in probes {
                let lone = Step::new(heads, &[Sequence::new(0, position, 1)]);
                let out = lone.run(path, &workers[2], &mut scratch);
                let got = bits(lone.row(&out, 0, position));
                assert_eq!(
                    got,
                    expected(position),
                    "{what}: a lone token at {position}"
                );

                let mut batch: Vec<Sequence> = others(true).collect();
                batch.insert(4, Sequence::new(0, position, 1));
                let step = Step::new(heads, &batch);
                let out = step.run(path, &workers[1], &mut scratch);
                let got = bits(step.row(&out, 4, position));
                assert_eq!(
                    got,
                    expected(position),
                    "{what}: among 16 decodes at {position}"
                );
            }
        }
    }
}

#[test]
fn launches_reuse_the_scratch_of_the_largest_step() {
    let workers = Workers::new(2).unwrap();
    let path = Path::every().pop().unwrap();
    let largest = Step::new(
        SMOLLM2,
        &[
            Sequence::new(0, 500, 1),
            Sequence::new(1, 0, 40),
            Sequence::new(2, 900, 1),
        ],
    );
    let smaller = Step::new(
        SMOLLM2,
        &[Sequence::new(3, 100, 1), Sequence::new(4, 20, 9)],
    );
    let mut scratch = AttentionScratch::default();
    let held = |s: &AttentionScratch| {
        [
            (s.owners.as_ptr() as usize, s.owners.capacity()),
            (s.tasks.as_ptr() as usize, s.tasks.capacity()),
            (s.partials.as_ptr() as usize, s.partials.capacity()),
        ]
    };
    largest.run(path, &workers, &mut scratch);
    let after_first = held(&scratch);
    assert!(after_first.iter().all(|&(_, capacity)| capacity > 0));
    for step in [&largest, &smaller, &largest] {
        step.run(path, &workers, &mut scratch);
        assert_eq!(
            held(&scratch),
            after_first,
            "a later launch grew or moved the scratch"
        );
    }
}

#[test]
fn the_first_launch_sizes_the_range_states_for_the_longest_history() {
    let workers = Workers::new(2).unwrap();
    let path = Path::every().pop().unwrap();
    let columns = 4_200usize.div_ceil(SMOLLM2.block_size);
    let lone_at = |depth| Step::new(SMOLLM2, &[Sequence::new(0, depth, 1)]).with_columns(columns);
    let mut scratch = AttentionScratch::default();
    lone_at(1).run(path, &workers, &mut scratch);
    let held = |s: &AttentionScratch| (s.partials.as_ptr() as usize, s.partials.capacity());
    let after_first = held(&scratch);
    for depth in [100, 600, 2_000, 4_100] {
        lone_at(depth).run(path, &workers, &mut scratch);
        // A lone token alone is split into ranges, each with states of its own, when its
        // history spans more than one; a history of one range is computed whole.
        let expected = depth / RANGE_POSITIONS + 1;
        let split = matches!(
            scratch.owners[0],
            Some(RowOwner::Lone { ranges, .. }) if ranges == expected
        );
        let whole = matches!(scratch.owners[0], Some(RowOwner::Block));
        assert!(if expected > 1 { split } else { whole }, "depth {depth}");
        assert_eq!(held(&scratch), after_first, "depth {depth} grew the states");
    }
}

#[test]
fn lone_tokens_beyond_the_states_room_are_computed_whole_with_the_same_bits() {
    let workers = Workers::new(3).unwrap();
    // Three lone tokens, each a third of the work: all would be split on 3 threads, but the
    // states have room for the longest history's, twice.
    let batch: Vec<Sequence> = [1_500, 1_400, 1_300]
        .into_iter()
        .enumerate()
        .map(|(id, depth)| Sequence::new(id as u64, depth, 1))
        .collect();
    let step = Step::new(SMOLLM2, &batch);
    for path in Path::every() {
        let mut scratch = AttentionScratch::default();
        let out = step.run(path, &workers, &mut scratch);
        let split = (scratch.owners.iter())
            .filter(|owner| matches!(owner, Some(RowOwner::Lone { .. })))
            .count();
        assert_eq!(split, SPLIT_SHARES, "{path:?}");
        for (index, sequence) in batch.iter().enumerate() {
            let alone = Step::new(SMOLLM2, &[*sequence]);
            let alone_out = alone.run(path, &workers, &mut AttentionScratch::default());
            assert_eq!(
                bits(step.row(&out, index, sequence.cached)),
                bits(alone.row(&alone_out, 0, sequence.cached)),
                "{path:?}: sequence {index}"
            );
        }
    }
}

/// A bf16 cache kept in runs of sixteen positions (blocks of 16 and 32 at `avx512_bf16` with
/// bf16 products) gives every row the bits of the same cache kept in rows (blocks of 8, which
/// hold no whole run), whose keys the tile transposes and whose values it pairs itself: a
/// prefill in chunks whose ends fall inside runs, and lone tokens at odd and even lengths.
#[test]
fn a_cache_in_runs_gives_the_bits_of_a_cache_in_rows() {
    let path = Path::every().pop().unwrap();
    if !path.bf16 {
        return;
    }
    let workers = Workers::new(2).unwrap();
    let mut scratch = AttentionScratch::default();
    for heads in [SMOLLM2, WIDE] {
        let rows = Heads {
            block_size: 8,
            ..heads
        };
        let layout = |heads: Heads| CacheLayout {
            block_size: heads.block_size,
            num_kv_heads: heads.num_kv_heads,
            head_dim: heads.head_dim,
        };
        assert_eq!(
            kv_cache::arranged(path.isa, Bf16Products::Bf16, true, &layout(heads)),
            kv_cache::KvOrder::Pairs
        );
        assert_eq!(
            kv_cache::arranged(path.isa, Bf16Products::Bf16, true, &layout(rows)),
            kv_cache::KvOrder::Rows
        );
        let steps: [&[Sequence]; 4] = [
            &[Sequence::new(0, 0, 37)],
            &[Sequence::new(0, 37, 90), Sequence::new(1, 200, 1)],
            &[
                Sequence::new(2, 64, 1),
                Sequence::new(3, 65, 1),
                Sequence::new(4, 130, 1),
            ],
            &[Sequence::new(5, 17, 1), Sequence::new(6, 0, 1)],
        ];
        for sequences in steps {
            let in_runs = Step::new(heads, sequences);
            let in_rows = Step::new(rows, sequences);
            let (runs_out, rows_out) = (
                in_runs.run(path, &workers, &mut scratch),
                in_rows.run(path, &workers, &mut scratch),
            );
            for (index, sequence) in sequences.iter().enumerate() {
                for position in sequence.cached..sequence.len() {
                    assert_eq!(
                        bits(in_runs.row(&runs_out, index, position)),
                        bits(in_rows.row(&rows_out, index, position)),
                        "{heads:?}: sequence {index}, position {position}"
                    );
                }
            }
        }
    }
}
