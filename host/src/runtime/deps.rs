//! Ordering between the tasks of a step program, derived from their argument tags.
//!
//! A task waits for the last writer of every buffer it reads (INPUT, INOUT)
//! and, before writing (OUTPUT, INOUT, OUTPUT_EXISTING), for the last writer
//! and every reader since. NO_DEP arguments are not tracked: weights, which
//! nothing writes during a step. Tasks in the same wave depend on nothing in
//! that wave, so a device with concurrent queues may run them together.

use std::collections::HashMap;
use std::hash::Hash;

use crate::device::ArgTag;

/// The tasks each task waits for, and the wave (longest dependency chain) of each.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskGraph {
    pub dependencies: Vec<Vec<usize>>,
    pub waves: Vec<usize>,
}

#[derive(Default)]
struct BufferUse {
    last_writer: Option<usize>,
    readers_since_write: Vec<usize>,
}

impl TaskGraph {
    /// Builds the graph from each task's (buffer, tag) arguments, in program order.
    pub fn build<'a, B: Hash + Eq + Copy + 'a>(
        tasks: impl IntoIterator<Item = &'a [(B, ArgTag)]>,
    ) -> TaskGraph {
        let mut uses: HashMap<B, BufferUse> = HashMap::new();
        let mut graph = TaskGraph::default();
        for (index, args) in tasks.into_iter().enumerate() {
            let mut deps: Vec<usize> = Vec::new();
            for &(buffer, tag) in args {
                if tag == ArgTag::NoDep {
                    continue;
                }
                let writes = matches!(tag, ArgTag::Output | ArgTag::Inout | ArgTag::OutputExisting);
                let u = uses.entry(buffer).or_default();
                if let Some(writer) = u.last_writer {
                    deps.push(writer);
                }
                if writes {
                    deps.extend(
                        u.readers_since_write
                            .iter()
                            .copied()
                            .filter(|&r| r != index),
                    );
                }
            }
            for &(buffer, tag) in args {
                let u = uses.entry(buffer).or_default();
                match tag {
                    ArgTag::Input => u.readers_since_write.push(index),
                    ArgTag::Output | ArgTag::Inout | ArgTag::OutputExisting => {
                        u.last_writer = Some(index);
                        u.readers_since_write.clear();
                    }
                    ArgTag::NoDep => {}
                }
            }
            deps.sort_unstable();
            deps.dedup();
            let wave = deps.iter().map(|&d| graph.waves[d] + 1).max().unwrap_or(0);
            graph.waves.push(wave);
            graph.dependencies.push(deps);
        }
        graph
    }

    /// The most tasks that share a wave.
    pub fn widest_wave(&self) -> usize {
        let mut counts: HashMap<usize, usize> = HashMap::new();
        for &w in &self.waves {
            *counts.entry(w).or_default() += 1;
        }
        counts.values().copied().max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(n: u64) -> u64 {
        n
    }

    #[test]
    fn reads_wait_for_writers_and_writes_wait_for_readers() {
        use ArgTag::*;
        // 0: normed = norm(hidden, w)   1: q = linear(normed)   2: k = linear(normed)
        // 3: hidden += q (inout)        4: normed = norm(hidden) overwrites what 1 and 2 read
        let tasks: Vec<Vec<(u64, ArgTag)>> = vec![
            vec![(b(1), Input), (b(9), NoDep), (b(2), Output)],
            vec![(b(2), Input), (b(10), NoDep), (b(3), Output)],
            vec![(b(2), Input), (b(11), NoDep), (b(4), Output)],
            vec![(b(1), Inout), (b(3), Input)],
            vec![(b(1), Input), (b(9), NoDep), (b(2), OutputExisting)],
        ];
        let graph = TaskGraph::build(tasks.iter().map(Vec::as_slice));
        assert_eq!(
            graph.dependencies,
            vec![vec![], vec![0], vec![0], vec![0, 1], vec![0, 1, 2, 3]]
        );
        assert_eq!(graph.waves, vec![0, 1, 1, 2, 3]);
        assert_eq!(
            graph.widest_wave(),
            2,
            "the two projections of `normed` are independent"
        );
    }
}
