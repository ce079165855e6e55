//! A Chrome-trace profile of engine steps: host phases, plugin calls and device time as spans, viewable in Perfetto.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

/// The row a span is drawn on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Track {
    /// The engine thread's own work: scheduling, input refresh, dispatch, sampling, emitting.
    Host = 1,
    /// Time the device reports for the step's launches.
    Device = 2,
}

#[derive(Serialize)]
struct TraceEvent {
    name: &'static str,
    cat: &'static str,
    ph: &'static str,
    ts: f64,
    dur: f64,
    pid: u32,
    tid: u32,
    args: serde_json::Value,
}

#[derive(Serialize)]
struct ThreadName {
    name: &'static str,
    ph: &'static str,
    pid: u32,
    tid: u32,
    args: serde_json::Value,
}

/// Collects spans in memory; written once, at shutdown.
pub struct Profiler {
    origin: Instant,
    events: Vec<TraceEvent>,
}

impl Default for Profiler {
    fn default() -> Self {
        Profiler {
            origin: Instant::now(),
            events: Vec::new(),
        }
    }
}

impl Profiler {
    /// Records a span that started at `start` and lasted `duration`.
    pub fn span(
        &mut self,
        name: &'static str,
        track: Track,
        start: Instant,
        duration: Duration,
        step: u64,
    ) {
        self.span_with(name, track, (start, duration), step, serde_json::Map::new());
    }

    /// As [`Profiler::span`], with more `args` beside the step number: what a trace viewer
    /// shows for the span when it is selected.
    pub fn span_with(
        &mut self,
        name: &'static str,
        track: Track,
        (start, duration): (Instant, Duration),
        step: u64,
        mut args: serde_json::Map<String, serde_json::Value>,
    ) {
        args.insert("step".into(), step.into());
        let ts = start.saturating_duration_since(self.origin).as_secs_f64() * 1e6;
        self.events.push(TraceEvent {
            name,
            cat: match track {
                Track::Host => "host",
                Track::Device => "device",
            },
            ph: "X",
            ts,
            dur: duration.as_secs_f64() * 1e6,
            pid: 1,
            tid: track as u32,
            args: serde_json::Value::Object(args),
        });
    }

    pub fn num_spans(&self) -> usize {
        self.events.len()
    }

    /// Writes `{"traceEvents": [...]}` to `path`.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let names =
            [(Track::Host, "host"), (Track::Device, "device")].map(|(track, name)| ThreadName {
                name: "thread_name",
                ph: "M",
                pid: 1,
                tid: track as u32,
                args: serde_json::json!({ "name": name }),
            });
        let document = serde_json::json!({
            "traceEvents": names.iter().map(|n| serde_json::to_value(n).unwrap_or_default())
                .chain(self.events.iter().map(|e| serde_json::to_value(e).unwrap_or_default()))
                .collect::<Vec<_>>(),
            "displayTimeUnit": "ms",
        });
        let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
        serde_json::to_writer(&mut file, &document)?;
        file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_chrome_trace_json_with_named_tracks() {
        let mut p = Profiler::default();
        let t = Instant::now();
        p.span("schedule", Track::Host, t, Duration::from_micros(30), 0);
        p.span("device", Track::Device, t, Duration::from_micros(500), 0);
        let path = std::env::temp_dir().join(format!("plughost-trace-{}.json", std::process::id()));
        p.write(&path).expect("trace written");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read back"))
                .expect("valid JSON");
        let events = v["traceEvents"].as_array().expect("events");
        assert_eq!(events.len(), 4);
        assert_eq!(events[3]["cat"], "device");
        assert_eq!(events[3]["dur"], 500.0);
        let _ = std::fs::remove_file(path);
    }
}
