//! Device time by callable: what each step spent in every kind of launch (attention, linears, norms...), read from the device's running totals after each step.
//!
//! The device keeps the totals since it opened; a step's share is the difference from the
//! previous reading. A device restarted in a worker process starts again from zero, so the
//! readings are reset with it.

use crate::device::Device;

/// The previous reading and the last step's differences.
#[derive(Debug, Default)]
pub struct CallableTimes {
    /// Nanoseconds per callable at the previous reading; empty before the first.
    previous: Vec<u64>,
    current: Vec<u64>,
    /// (callable index, nanoseconds) of the callables that ran since the previous reading.
    step: Vec<(usize, u64)>,
}

impl CallableTimes {
    /// Reads the device's totals and keeps what changed since the previous reading. Returns
    /// false, keeping nothing, when the device does not report them or the reading fails.
    pub fn read(&mut self, device: &Device) -> bool {
        self.step.clear();
        if !matches!(device.callable_device_ns(&mut self.current), Ok(true)) {
            return false;
        }
        differences(&self.previous, &self.current, &mut self.step);
        std::mem::swap(&mut self.previous, &mut self.current);
        true
    }

    /// Forgets the previous reading: the device was opened again.
    pub fn reset(&mut self) {
        self.previous.clear();
        self.step.clear();
    }

    /// (callable index, nanoseconds) of each callable that ran since the previous reading.
    pub fn step(&self) -> &[(usize, u64)] {
        &self.step
    }
}

/// Appends to `out` (callable index, nanoseconds) for each callable whose total grew from
/// `previous` to `current`.
fn differences(previous: &[u64], current: &[u64], out: &mut Vec<(usize, u64)>) {
    for (index, &now) in current.iter().enumerate() {
        let before = previous.get(index).copied().unwrap_or(0);
        // Totals only grow while the device lives; a smaller one is a new device's.
        let spent = if now >= before { now - before } else { now };
        if spent > 0 {
            out.push((index, spent));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn differences_of(previous: &[u64], current: &[u64]) -> Vec<(usize, u64)> {
        let mut out = Vec::new();
        differences(previous, current, &mut out);
        out
    }

    #[test]
    fn a_step_keeps_the_callables_that_ran() {
        assert_eq!(differences_of(&[], &[5, 0, 7]), vec![(0, 5), (2, 7)]);
        assert_eq!(differences_of(&[5, 0, 7], &[5, 3, 9]), vec![(1, 3), (2, 2)]);
        // A restarted device's totals start from zero again.
        assert_eq!(differences_of(&[50, 9], &[4, 9]), vec![(0, 4)]);
    }
}
