//! How much CPU other processes took while a server was being measured: on a small shared
//! machine a concurrent build or benchmark skews one server's numbers and not the other's, and
//! the report should say so rather than let it pass for a difference between the servers.
//!
//! Busy time of the whole machine comes from `/proc/stat`; the server's and this process's own
//! (including the `plughost bench` children it has waited for) from `/proc/<pid>/stat`. Both
//! count in clock ticks, so no tick rate is needed.

use anyhow::{Context, Result};

/// CPU time counters at one instant, in clock ticks.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    machine_busy: u64,
    machine_total: u64,
    server: u64,
    own: u64,
}

impl Snapshot {
    pub fn take(server_pids: &[u32]) -> Result<Self> {
        let (machine_busy, machine_total) =
            machine_ticks(&std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?)
                .context("/proc/stat has no cpu line")?;
        let mut server = 0;
        for pid in server_pids {
            server += process_ticks(&format!("/proc/{pid}/stat"), false)?;
        }
        let own = process_ticks("/proc/self/stat", true)?;
        Ok(Snapshot {
            machine_busy,
            machine_total,
            server,
            own,
        })
    }

    /// The share of the machine's CPU time between `self` and `later` that neither the server
    /// nor this process (with its load generators) used: 0.0 on a quiet machine.
    pub fn others_share(&self, later: &Snapshot) -> f64 {
        let total = later.machine_total.saturating_sub(self.machine_total);
        let busy = later.machine_busy.saturating_sub(self.machine_busy);
        let ours = later.server.saturating_sub(self.server) + later.own.saturating_sub(self.own);
        if total == 0 {
            return 0.0;
        }
        busy.saturating_sub(ours) as f64 / total as f64
    }
}

/// (busy, total) ticks from the aggregate `cpu` line; idle and iowait are not busy, and guest
/// time is already inside user time.
fn machine_ticks(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let total: u64 = fields.iter().sum();
    let idle = fields.get(3)? + fields.get(4)?;
    Some((total - idle, total))
}

/// utime + stime (+ cutime + cstime with `children`) of one process.
fn process_ticks(path: &str, children: bool) -> Result<u64> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    parse_process_ticks(&text, children).with_context(|| format!("cannot parse {path}"))
}

fn parse_process_ticks(text: &str, children: bool) -> Option<u64> {
    // The command name may contain spaces and parentheses; the fields follow the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ')' come state (field 3), ..., utime (14), stime (15), cutime (16), cstime (17).
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let own = field(14)? + field(15)?;
    Some(if children {
        own + field(16)? + field(17)?
    } else {
        own
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_ticks_leave_out_idle_and_iowait() {
        let stat = "cpu  100 5 50 1000 20 3 2 0 0 0\ncpu0 50 2 25 500 10 1 1 0 0 0\n";
        assert_eq!(machine_ticks(stat), Some((160, 1180)));
        assert_eq!(machine_ticks("intr 1 2"), None);
    }

    #[test]
    fn process_ticks_survive_odd_command_names() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 7 3 11 13 20 0 1 0 5 0 0";
        assert_eq!(parse_process_ticks(stat, false), Some(10));
        assert_eq!(parse_process_ticks(stat, true), Some(34));
        assert_eq!(parse_process_ticks("garbage", false), None);
    }

    #[test]
    fn the_share_is_what_nobody_of_ours_used() {
        let a = Snapshot {
            machine_busy: 100,
            machine_total: 1000,
            server: 10,
            own: 5,
        };
        let b = Snapshot {
            machine_busy: 300,
            machine_total: 1400,
            server: 150,
            own: 25,
        };
        // 200 busy ticks, 160 of them ours: 40 of 400.
        assert!((a.others_share(&b) - 0.1).abs() < 1e-9);
        assert!(Snapshot::take(&[std::process::id()]).is_ok());
    }
}
