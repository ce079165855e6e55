//! Measuring this machine's memory read bandwidth: the ceiling on decode speed of a model whose
//! weights are streamed from memory once per token.
//!
//! The buffer is far larger than any last-level cache, every page is written before timing so
//! page faults stay out of the measurement, and each thread sums its share with several
//! independent accumulators so the loop waits on memory rather than on one add chain.

use std::hint::black_box;
use std::time::Instant;

use anyhow::{Context, Result, ensure};

/// What one measurement found.
#[derive(Debug, Clone, Copy)]
pub struct Bandwidth {
    /// The best pass, in bytes per second.
    pub bytes_per_second: f64,
    pub buffer_bytes: usize,
    pub threads: usize,
    pub passes: usize,
}

impl Bandwidth {
    pub fn gb_per_second(&self) -> f64 {
        self.bytes_per_second / 1e9
    }
}

/// One measurement's shape, taken as often as the caller needs.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    buffer_bytes: usize,
    threads: usize,
    passes: usize,
}

impl Probe {
    pub fn new(buffer_mib: usize, threads: usize, passes: usize) -> Result<Self> {
        let buffer_bytes = buffer_mib
            .checked_mul(1 << 20)
            .context("the bandwidth buffer is too large")?;
        Ok(Probe {
            buffer_bytes,
            threads,
            passes,
        })
    }

    /// Measures now, saying so on stderr.
    pub fn measure(&self) -> Result<Bandwidth> {
        eprintln!(
            "measuring read bandwidth: {} MiB, {} threads, best of {}",
            self.buffer_bytes >> 20,
            self.threads,
            self.passes
        );
        let bandwidth = measure(self.buffer_bytes, self.threads, self.passes)?;
        eprintln!("read bandwidth {:.1} GB/s", bandwidth.gb_per_second());
        Ok(bandwidth)
    }
}

/// The median of several measurements (the lower middle one of an even count, so the bound
/// it gives is never the more flattering of two); `None` without any.
pub fn median(measurements: &[Bandwidth]) -> Option<Bandwidth> {
    let mut sorted = measurements.to_vec();
    sorted.sort_by(|a, b| a.bytes_per_second.total_cmp(&b.bytes_per_second));
    sorted.get(sorted.len().saturating_sub(1) / 2).copied()
}

/// Independent sums per thread; eight u64 lanes keep two AVX2 adds or one AVX-512 add in flight
/// per loop iteration without a dependency between them.
const LANES: usize = 8;

/// Reads a `buffer_bytes` buffer `passes` times with `threads` threads; returns the best pass.
pub fn measure(buffer_bytes: usize, threads: usize, passes: usize) -> Result<Bandwidth> {
    ensure!(
        threads > 0 && passes > 0,
        "threads and passes must be positive"
    );
    let words = buffer_bytes / size_of::<u64>();
    ensure!(
        words >= threads * LANES,
        "a {buffer_bytes}-byte buffer is too small to split over {threads} threads"
    );
    // Distinct values, so no page can be shared with the zero page.
    let buffer: Vec<u64> = (0..words as u64).collect();
    let chunk = words.div_ceil(threads);
    let mut best = f64::INFINITY;
    let mut total = 0u64;
    for _ in 0..passes {
        let start = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|scope| {
            let handles: Vec<_> = buffer
                .chunks(chunk)
                .map(|part| scope.spawn(move || sum(black_box(part))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect()
        });
        best = best.min(start.elapsed().as_secs_f64());
        total = total.wrapping_add(sums.iter().fold(0, |a, b| a.wrapping_add(*b)));
    }
    // The sums must be used, or the reads could be optimized away.
    black_box(total);
    let bytes = words * size_of::<u64>();
    Ok(Bandwidth {
        bytes_per_second: bytes as f64 / best.max(1e-9),
        buffer_bytes: bytes,
        threads,
        passes,
    })
}

fn sum(words: &[u64]) -> u64 {
    let mut acc = [0u64; LANES];
    let mut blocks = words.chunks_exact(LANES);
    for block in &mut blocks {
        for (a, w) in acc.iter_mut().zip(block) {
            *a = a.wrapping_add(*w);
        }
    }
    let tail = blocks
        .remainder()
        .iter()
        .fold(0u64, |a, w| a.wrapping_add(*w));
    acc.iter().fold(tail, |a, b| a.wrapping_add(*b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sum_covers_every_word_including_the_tail() {
        let words: Vec<u64> = (1..=21).collect();
        assert_eq!(sum(&words), 21 * 22 / 2);
    }

    #[test]
    fn a_small_measurement_is_positive_and_finite() {
        let b = measure(1 << 20, 2, 2).unwrap();
        assert!(b.bytes_per_second.is_finite() && b.bytes_per_second > 0.0);
        assert_eq!(b.buffer_bytes, 1 << 20);
        assert!(measure(16, 4, 1).is_err());
    }

    #[test]
    fn the_median_is_the_middle_measurement_or_the_lower_middle_one() {
        let at = |gb: f64| Bandwidth {
            bytes_per_second: gb * 1e9,
            buffer_bytes: 1,
            threads: 1,
            passes: 1,
        };
        let gb = |b: Option<Bandwidth>| b.map(|b| b.gb_per_second());
        assert_eq!(gb(median(&[at(50.0), at(30.0), at(40.0)])), Some(40.0));
        assert_eq!(gb(median(&[at(50.0), at(30.0)])), Some(30.0));
        assert_eq!(gb(median(&[])), None);
    }
}
