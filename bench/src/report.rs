//! Presenting a bench report: the text table, the result JSON and the SVG sweep chart.

use std::fmt::Write;
use std::path::Path;

use crate::stats::{Distribution, Summary};
use crate::{BenchError, BenchReport};

const WIDTH: usize = 50;

fn row(out: &mut String, label: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{:<40}{:>10}", label, value);
}

fn latency(out: &mut String, title: &str, name: &str, d: &Distribution) {
    let _ = writeln!(out, "{:-^WIDTH$}", title);
    row(
        out,
        &format!("Mean {name} (ms):"),
        format!("{:.2}", d.mean_ms),
    );
    row(
        out,
        &format!("Median {name} (ms):"),
        format!("{:.2}", d.p50_ms),
    );
    row(
        out,
        &format!("P99 {name} (ms):"),
        format!("{:.2}", d.p99_ms),
    );
}

/// One run as `vllm bench serve` prints it.
pub fn table(summary: &Summary) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:=^WIDTH$}", " Serving Benchmark Result ");
    row(&mut out, "Successful requests:", summary.num_successful);
    row(&mut out, "Failed requests:", summary.num_failed);
    let concurrency = summary
        .max_concurrency
        .map_or("inf".to_string(), |c| c.to_string());
    row(&mut out, "Maximum request concurrency:", concurrency);
    let rate = summary
        .request_rate
        .map_or("inf".to_string(), |r| r.to_string());
    row(&mut out, "Request rate configured (RPS):", rate);
    row(
        &mut out,
        "Benchmark duration (s):",
        format!("{:.2}", summary.duration_s),
    );
    row(&mut out, "Total input tokens:", summary.total_input_tokens);
    row(
        &mut out,
        "Total generated tokens:",
        summary.total_output_tokens,
    );
    let per_second = |v: f64| format!("{v:.2}");
    row(
        &mut out,
        "Request throughput (req/s):",
        per_second(summary.request_throughput),
    );
    row(
        &mut out,
        "Output token throughput (tok/s):",
        per_second(summary.output_throughput),
    );
    row(
        &mut out,
        "Total token throughput (tok/s):",
        per_second(summary.total_token_throughput),
    );
    latency(&mut out, "Time to First Token", "TTFT", &summary.ttft);
    latency(
        &mut out,
        "Time per Output Token (excl. 1st token)",
        "TPOT",
        &summary.tpot,
    );
    latency(&mut out, "Inter-token Latency", "ITL", &summary.itl);
    // From sending the request to the end of its stream, queueing in the server included.
    latency(&mut out, "End-to-end Latency", "E2EL", &summary.e2el);
    if !summary.by_priority.is_empty() {
        let _ = writeln!(out, "{:-^WIDTH$}", "By priority (p50 TTFT / E2EL)");
        for p in &summary.by_priority {
            row(
                &mut out,
                &format!(
                    "priority {} ({} requests) (ms):",
                    p.priority, p.num_successful
                ),
                format!("{:.2} / {:.2}", p.ttft.p50_ms, p.e2el.p50_ms),
            );
        }
    }
    let _ = writeln!(out, "{:=^WIDTH$}", "");
    if let Some(error) = &summary.first_error {
        let _ = writeln!(out, "First error: {error}");
    }
    out
}

/// One row per concurrency level.
pub fn sweep_table(summaries: &[Summary]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>11} {:>4} {:>6} {:>9} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "concurrency",
        "ok",
        "failed",
        "req/s",
        "out tok/s",
        "tot tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "ITL p50",
        "ITL p99",
        "E2EL p50",
        "E2EL p99"
    );
    for s in summaries {
        let concurrency = s.max_concurrency.map_or("inf".into(), |c| c.to_string());
        let _ = writeln!(
            out,
            "{:>11} {:>4} {:>6} {:>9.2} {:>10.2} {:>10.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            concurrency,
            s.num_successful,
            s.num_failed,
            s.request_throughput,
            s.output_throughput,
            s.total_token_throughput,
            s.ttft.p50_ms,
            s.ttft.p99_ms,
            s.tpot.p50_ms,
            s.tpot.p99_ms,
            s.itl.p50_ms,
            s.itl.p99_ms,
            s.e2el.p50_ms,
            s.e2el.p99_ms
        );
    }
    if let Some(error) = summaries.iter().find_map(|s| s.first_error.as_ref()) {
        let _ = writeln!(out, "First error: {error}");
    }
    out
}

/// What `plughost bench` prints: the full table for one run, a row per level for a sweep.
pub fn text(report: &BenchReport) -> String {
    let summaries: Vec<Summary> = report.runs.iter().map(|r| r.summary.clone()).collect();
    match summaries.as_slice() {
        [one] if report.options.sweep.is_none() => table(one),
        many => sweep_table(many),
    }
}

fn write(path: &Path, contents: &str) -> Result<(), BenchError> {
    std::fs::write(path, contents).map_err(|source| BenchError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes `--result-json` and `--plot` when they were asked for.
pub fn write_files(report: &BenchReport) -> Result<(), BenchError> {
    if let Some(path) = &report.options.result_json {
        let json = serde_json::to_string_pretty(report).map_err(|e| BenchError::Write {
            path: path.clone(),
            source: e.into(),
        })?;
        write(path, &json)?;
    }
    if let Some(path) = &report.options.plot {
        let summaries: Vec<Summary> = report.runs.iter().map(|r| r.summary.clone()).collect();
        write(path, &svg(&summaries))?;
    }
    Ok(())
}

/// Plot geometry: the plotting area inside the margins.
const SVG_W: f64 = 640.0;
const SVG_H: f64 = 400.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 570.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 340.0;

/// One series drawn against its own y axis (left or right).
struct Series<'a> {
    label: &'a str,
    colour: &'a str,
    values: Vec<f64>,
    axis_x: f64,
    anchor: &'a str,
}

impl Series<'_> {
    fn max(&self) -> f64 {
        let max = self.values.iter().copied().fold(0.0, f64::max);
        if max > 0.0 { max * 1.1 } else { 1.0 }
    }

    fn draw(&self, out: &mut String, xs: &[f64]) {
        let max = self.max();
        let y = |v: f64| BOTTOM - (v / max) * (BOTTOM - TOP);
        let points: Vec<String> = xs
            .iter()
            .zip(&self.values)
            .map(|(x, v)| format!("{x:.1},{:.1}", y(*v)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
            self.colour,
            points.join(" ")
        );
        for (x, v) in xs.iter().zip(&self.values) {
            let _ = writeln!(
                out,
                r#"<circle cx="{x:.1}" cy="{:.1}" r="3" fill="{}"/>"#,
                y(*v),
                self.colour
            );
        }
        let offset = if self.anchor == "end" { -6.0 } else { 6.0 };
        for i in 0..=4 {
            let v = max * i as f64 / 4.0;
            let _ = writeln!(
                out,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="{}" fill="{}">{v:.1}</text>"#,
                self.axis_x + offset,
                y(v) + 4.0,
                self.anchor,
                self.colour
            );
        }
        let _ = writeln!(
            out,
            r#"<line x1="{0}" y1="{TOP}" x2="{0}" y2="{BOTTOM}" stroke="{1}"/>"#,
            self.axis_x, self.colour
        );
    }
}

/// Output tokens/s (left axis) and TTFT p50 (right axis) against concurrency, as SVG.
pub fn svg(summaries: &[Summary]) -> String {
    let levels: Vec<String> = summaries
        .iter()
        .map(|s| s.max_concurrency.map_or("inf".into(), |c| c.to_string()))
        .collect();
    // Sweeps are usually powers of two, so points are spaced evenly by position, not value.
    let step = (RIGHT - LEFT) / (summaries.len().max(2) - 1) as f64;
    let xs: Vec<f64> = (0..summaries.len())
        .map(|i| LEFT + step * i as f64)
        .collect();
    let throughput = Series {
        label: "output tokens/s",
        colour: "#1f77b4",
        values: summaries.iter().map(|s| s.output_throughput).collect(),
        axis_x: LEFT,
        anchor: "end",
    };
    let ttft = Series {
        label: "TTFT p50 (ms)",
        colour: "#d62728",
        values: summaries.iter().map(|s| s.ttft.p50_ms).collect(),
        axis_x: RIGHT,
        anchor: "start",
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{SVG_W}" height="{SVG_H}" viewBox="0 0 {SVG_W} {SVG_H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14">Throughput and TTFT against concurrency</text>"#,
        SVG_W / 2.0
    );
    let _ = writeln!(
        out,
        r#"<line x1="{LEFT}" y1="{BOTTOM}" x2="{RIGHT}" y2="{BOTTOM}" stroke="black"/>"#
    );
    for (x, level) in xs.iter().zip(&levels) {
        let _ = writeln!(
            out,
            r#"<text x="{x:.1}" y="{}" text-anchor="middle">{level}</text>"#,
            BOTTOM + 16.0
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">max concurrency</text>"#,
        (LEFT + RIGHT) / 2.0,
        BOTTOM + 36.0
    );
    for (i, series) in [&throughput, &ttft].into_iter().enumerate() {
        series.draw(&mut out, &xs);
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" fill="{}">{}</text>"#,
            LEFT + 10.0 + 160.0 * i as f64,
            TOP - 6.0,
            series.colour,
            series.label
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{RunShape, summarize};

    fn summary(concurrency: usize) -> Summary {
        let shape = RunShape {
            max_concurrency: Some(concurrency),
            request_rate: f64::INFINITY,
            duration_s: 1.0,
        };
        summarize(&[], shape)
    }

    #[test]
    fn the_table_names_every_metric() {
        let text = table(&summary(4));
        for label in [
            "Successful requests:",
            "Failed requests:",
            "Benchmark duration (s):",
            "Request throughput (req/s):",
            "Output token throughput (tok/s):",
            "Total token throughput (tok/s):",
            "Median TTFT (ms):",
            "P99 TPOT (ms):",
            "Mean ITL (ms):",
            "Mean E2EL (ms):",
            "Median E2EL (ms):",
            "P99 E2EL (ms):",
        ] {
            assert!(text.contains(label), "missing {label} in\n{text}");
        }
    }

    #[test]
    fn the_sweep_table_has_end_to_end_latency_columns() {
        let text = sweep_table(&[summary(1), summary(2)]);
        let header = text.lines().next().unwrap_or_default();
        assert!(
            header.contains("E2EL p50") && header.contains("E2EL p99"),
            "{header}"
        );
        assert_eq!(text.lines().count(), 3);
    }

    #[test]
    fn the_chart_has_a_point_per_level_even_with_zero_values() {
        let summaries: Vec<Summary> = [1, 2, 4].into_iter().map(summary).collect();
        let chart = svg(&summaries);
        assert!(chart.starts_with("<svg"));
        assert!(chart.trim_end().ends_with("</svg>"));
        assert_eq!(chart.matches("<circle").count(), 6);
        assert!(!chart.contains("NaN"));
        assert!(svg(&summaries[..1]).starts_with("<svg"));
    }
}
