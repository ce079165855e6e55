//! Where plughost's decode steps spend their device time: its per-callable decode counters,
//! read around each of its one-stream runs, and the page's table of them.

use std::fmt::Write;

use super::report::{Report, decode_tok_s};
use super::rounds::samples;

/// Device seconds per callable in decode steps, and the count of those steps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeTime {
    steps: f64,
    /// Seconds by callable name, in the order `/metrics` listed them.
    by_callable: Vec<(String, f64)>,
}

impl DecodeTime {
    /// The decode counters in a `/metrics` body: `decode_steps_total` and
    /// `device_callable_seconds_total{callable="…",step="decode"}`. `None` without the step
    /// counter (a server that does not count decode steps).
    pub fn parse(metrics: &str) -> Option<DecodeTime> {
        let mut steps = None;
        let mut by_callable = Vec::new();
        for (name, labels, value) in samples(metrics) {
            if name.ends_with("decode_steps_total") {
                steps = Some(value);
            } else if name.ends_with("device_callable_seconds_total")
                && labels.contains("step=\"decode\"")
                && let Some(callable) = label(labels, "callable")
            {
                by_callable.push((callable.to_string(), value));
            }
        }
        Some(DecodeTime {
            steps: steps?,
            by_callable,
        })
    }

    /// What accrued from `before` to `self`: counters only grow, so this is one run's share.
    pub fn since(&self, before: &DecodeTime) -> DecodeTime {
        let earlier = |name: &str| {
            before
                .by_callable
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0.0, |(_, s)| *s)
        };
        DecodeTime {
            steps: self.steps - before.steps,
            by_callable: self
                .by_callable
                .iter()
                .map(|(name, s)| (name.clone(), s - earlier(name)))
                .collect(),
        }
    }

    /// Adds `other`'s steps and seconds to these.
    pub fn add(&mut self, other: &DecodeTime) {
        self.steps += other.steps;
        for (name, s) in &other.by_callable {
            match self.by_callable.iter_mut().find(|(n, _)| n == name) {
                Some((_, mine)) => *mine += s,
                None => self.by_callable.push((name.clone(), *s)),
            }
        }
    }

    /// Milliseconds per decode step in `callable`; `None` when it never ran in one.
    fn ms_per_step(&self, callable: &str) -> Option<f64> {
        let (_, s) = self.by_callable.iter().find(|(n, _)| n == callable)?;
        (self.steps > 0.0).then(|| s * 1e3 / self.steps)
    }

    /// Milliseconds per decode step in every callable whose name passes `which`.
    fn ms_where(&self, which: impl Fn(&str) -> bool) -> f64 {
        self.by_callable
            .iter()
            .filter(|(n, _)| which(n))
            .filter_map(|(n, _)| self.ms_per_step(n))
            .sum()
    }
}

/// A launch kind below this share of every load's decode step gets no row of its own.
const MINOR_SHARE: f64 = 0.01;

/// The value of label `name` in `a="x",b="y"`.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let start = labels.find(&format!("{name}=\""))? + name.len() + 2;
    let rest = &labels[start..];
    Some(&rest[..rest.find('"')?])
}

/// Whether `callable` multiplies by weights: every weight byte is read once per decode step
/// in these launches.
fn is_linear(callable: &str) -> bool {
    callable.ends_with("linear")
}

/// The page's section: for each one-stream load plughost has decode counters of, the
/// milliseconds per decode step in each callable, their sum against TPOT p50 (the rest is
/// the host's and the gaps between launches), and the weights' streaming rate in the linear
/// launches against the measured bandwidth. Empty when there are none.
pub fn section(r: &Report) -> String {
    let loads: Vec<(&str, &DecodeTime)> = r
        .loads
        .iter()
        .filter_map(|load| {
            let time = r.plughost.decode_time_of(&load.key)?;
            (time.steps > 0.0).then_some((load.title.as_str(), time))
        })
        .collect();
    let Some((_, first)) = loads.first() else {
        return String::new();
    };
    // Rows by the first load's time, largest first; callables absent there follow.
    let mut callables: Vec<&str> = loads
        .iter()
        .flat_map(|(_, t)| t.by_callable.iter().map(|(n, _)| n.as_str()))
        .collect();
    callables.sort_unstable();
    callables.dedup();
    callables.sort_by(|a, b| {
        let ms = |n: &str| first.ms_per_step(n).unwrap_or(0.0);
        ms(b).total_cmp(&ms(a)).then(a.cmp(b))
    });
    let mut out = String::from(
        "\n## Where plughost's decode time goes\n\nDevice time per decode step in each kind of \
         launch, from plughost's `/metrics` (`plughost_device_callable_seconds_total{step=\"decode\"}` \
         over `plughost_decode_steps_total`), read before and after each of its runs of the \
         load and added over the rounds (warm-ups included). TPOT p50 less the launches is the \
         host's share and the gaps between launches.\n\n| ms per decode step |",
    );
    for (title, _) in &loads {
        let _ = write!(out, " {title} |");
    }
    out.push_str("\n|---|");
    out.push_str(&"---:|".repeat(loads.len()));
    out.push('\n');
    let mut row = |name: &str, cell: &dyn Fn(&str, &DecodeTime) -> String| {
        let _ = write!(out, "| {name} |");
        for (title, time) in &loads {
            let _ = write!(out, " {} |", cell(title, time));
        }
        out.push('\n');
    };
    let ms = |v: f64| format!("{v:.2}");
    // Launches that take under a percent of every load's step share one row.
    let minor = |callable: &str| {
        loads.iter().all(|(_, t)| {
            t.ms_per_step(callable).unwrap_or(0.0) < MINOR_SHARE * t.ms_where(|_| true)
        })
    };
    let (minor_callables, major): (Vec<&str>, Vec<&str>) =
        callables.iter().partition(|&&c| minor(c));
    for &callable in &major {
        row(&format!("`{callable}`"), &|_, t| {
            t.ms_per_step(callable).map_or("—".into(), ms)
        });
    }
    if !minor_callables.is_empty() {
        row(
            &format!("the other {} kinds", minor_callables.len()),
            &|_, t| ms(t.ms_where(|n| minor_callables.contains(&n))),
        );
    }
    row("all launches", &|_, t| ms(t.ms_where(|_| true)));
    let tpot = |title: &str| {
        let load = r.loads.iter().find(|l| l.title == title)?;
        r.plughost.get(&load.key).map(|s| 1000.0 / decode_tok_s(s))
    };
    row("TPOT p50", &|title, _| tpot(title).map_or("—".into(), ms));
    row("decode steps", &|_, t| format!("{:.0}", t.steps));
    let bandwidth = r.machine.bandwidth.gb_per_second();
    let bytes = r.model.tensor_bytes as f64;
    row(
        &format!("weights' GB/s in the linear launches (measured bandwidth {bandwidth:.1})"),
        &|_, t| {
            let linear = t.ms_where(is_linear);
            if linear > 0.0 {
                let gb_s = bytes / (linear * 1e-3) / 1e9;
                format!("{gb_s:.1} ({:.0}%)", 100.0 * gb_s / bandwidth)
            } else {
                "—".into()
            }
        },
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: &str = "# HELP plughost_decode_steps_total x\n\
        plughost_decode_steps_total 10\n\
        plughost_device_callable_seconds_total{callable=\"linear\",step=\"decode\"} 0.5\n\
        plughost_device_callable_seconds_total{callable=\"linear\",step=\"prefill\"} 9\n\
        plughost_device_callable_seconds_total{callable=\"paged_attention\",step=\"decode\"} 0.1\n";

    #[test]
    fn decode_counters_leave_prefill_out_and_difference_by_callable() {
        let before = DecodeTime::parse(METRICS).unwrap();
        assert_eq!(before.steps, 10.0);
        assert_eq!(
            before.by_callable,
            [("linear".to_string(), 0.5), ("paged_attention".into(), 0.1)]
        );
        let after = DecodeTime::parse(
            "plughost_decode_steps_total 30\n\
             plughost_device_callable_seconds_total{callable=\"linear\",step=\"decode\"} 1.5\n\
             plughost_device_callable_seconds_total{callable=\"paged_attention\",step=\"decode\"} 0.3\n\
             plughost_device_callable_seconds_total{callable=\"rms_norm\",step=\"decode\"} 0.02\n",
        )
        .unwrap();
        let run = after.since(&before);
        assert_eq!(run.steps, 20.0);
        assert_eq!(run.ms_per_step("linear"), Some(50.0));
        let close = |v: Option<f64>, expected: f64| v.is_some_and(|v| (v - expected).abs() < 1e-9);
        assert!(close(run.ms_per_step("paged_attention"), 10.0));
        assert!(close(run.ms_per_step("rms_norm"), 1.0));
        let mut total = run.clone();
        total.add(&run);
        assert_eq!(total.steps, 40.0);
        assert!(close(total.ms_per_step("linear"), 50.0));
        assert!(close(Some(total.ms_where(is_linear)), 50.0));
        assert!(close(Some(total.ms_where(|_| true)), 61.0));
    }

    #[test]
    fn a_server_without_the_step_counter_has_no_decode_time() {
        assert_eq!(
            DecodeTime::parse(
                "plughost_device_callable_seconds_total{callable=\"linear\",step=\"decode\"} 1\n"
            ),
            None
        );
    }
}
