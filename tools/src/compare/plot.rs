//! The comparison's chart: output tokens/s against concurrency, one line per server, as SVG.
//! `plughost bench --plot` draws one server's sweep; this puts both on one axis.

use std::fmt::Write;

/// One server's line.
pub struct Series<'a> {
    pub label: &'a str,
    pub colour: &'a str,
    /// Output tokens/s per concurrency level; `None` where it was not measured.
    pub values: Vec<Option<f64>>,
}

const W: f64 = 640.0;
const H: f64 = 400.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 610.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 340.0;

/// Escapes text for an SVG text node.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The chart; `levels` are the concurrencies, spaced evenly since they are usually powers of two.
pub fn svg(title: &str, levels: &[usize], series: &[Series]) -> String {
    let max = series
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .copied()
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let top = nice_ceiling(max * 1.1);
    let step = (RIGHT - LEFT) / (levels.len().max(2) - 1) as f64;
    let x = |i: usize| {
        if levels.len() == 1 {
            (LEFT + RIGHT) / 2.0
        } else {
            LEFT + step * i as f64
        }
    };
    let y = |v: f64| BOTTOM - (v / top) * (BOTTOM - TOP);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14">{}</text>"#,
        W / 2.0,
        escape(title)
    );
    for i in 0..=5 {
        let v = top * i as f64 / 5.0;
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{0:.1}" x2="{RIGHT}" y2="{0:.1}" stroke="#ddd"/>"##,
            y(v)
        );
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{v:.0}</text>"#,
            LEFT - 6.0,
            y(v) + 4.0
        );
    }
    let _ = writeln!(
        out,
        r#"<line x1="{LEFT}" y1="{BOTTOM}" x2="{RIGHT}" y2="{BOTTOM}" stroke="black"/>"#
    );
    let _ = writeln!(
        out,
        r#"<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{BOTTOM}" stroke="black"/>"#
    );
    for (i, level) in levels.iter().enumerate() {
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{level}</text>"#,
            x(i),
            BOTTOM + 16.0
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">concurrent streams</text>"#,
        (LEFT + RIGHT) / 2.0,
        BOTTOM + 36.0
    );
    let _ = writeln!(
        out,
        r#"<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {0})">output tokens/s</text>"#,
        (TOP + BOTTOM) / 2.0
    );
    for (n, s) in series.iter().enumerate() {
        let points: Vec<(f64, f64)> = s
            .values
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.filter(|v| v.is_finite()).map(|v| (x(i), y(v))))
            .collect();
        let line: Vec<String> = points
            .iter()
            .map(|(px, py)| format!("{px:.1},{py:.1}"))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
            s.colour,
            line.join(" ")
        );
        for (px, py) in &points {
            let _ = writeln!(
                out,
                r#"<circle cx="{px:.1}" cy="{py:.1}" r="3.5" fill="{}"/>"#,
                s.colour
            );
        }
        let legend_y = TOP - 18.0;
        let legend_x = LEFT + 10.0 + 170.0 * n as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{legend_x}" y1="{0}" x2="{1}" y2="{0}" stroke="{2}" stroke-width="2"/>"#,
            legend_y - 4.0,
            legend_x + 20.0,
            s.colour
        );
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{legend_y}" fill="{}">{}</text>"#,
            legend_x + 26.0,
            s.colour,
            escape(s.label)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// The smallest of 1, 2, 2.5, 5 times a power of ten at or above `v`, so grid lines are round.
fn nice_ceiling(v: f64) -> f64 {
    if !(v.is_finite() && v > 0.0) {
        return 1.0;
    }
    let magnitude = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * magnitude)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_has_both_lines_and_skips_missing_points() {
        let chart = svg(
            "t & t",
            &[1, 4, 16],
            &[
                Series {
                    label: "a",
                    colour: "#000",
                    values: vec![Some(10.0), Some(30.0), Some(50.0)],
                },
                Series {
                    label: "b",
                    colour: "#111",
                    values: vec![Some(8.0), None, Some(f64::NAN)],
                },
            ],
        );
        assert!(chart.starts_with("<svg") && chart.trim_end().ends_with("</svg>"));
        assert_eq!(chart.matches("<polyline").count(), 2);
        assert_eq!(chart.matches("<circle").count(), 4);
        assert!(chart.contains("t &amp; t"));
        assert!(!chart.contains("NaN"));
    }

    #[test]
    fn axis_tops_are_round() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(3.2), 5.0);
        assert_eq!(nice_ceiling(210.0), 250.0);
        assert_eq!(nice_ceiling(1000.0), 1000.0);
    }
}
