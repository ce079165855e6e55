//! How the page's figures are computed and written: ratios, the median of the rounds, and a judged value that never reads as meeting a goal it misses.

pub(super) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}

/// Which side of a target's threshold passes.
#[derive(Clone, Copy)]
pub(super) enum Passes {
    AtLeast,
    AtMost,
}

impl Passes {
    /// Whether `value` meets `threshold`: the one comparison both a target's verdict and its
    /// written figure use.
    pub(super) fn holds(self, value: f64, threshold: f64) -> bool {
        match self {
            Passes::AtLeast => value >= threshold,
            Passes::AtMost => value <= threshold,
        }
    }
}

/// `value` with `digits` decimals, or as many more as it takes for the text to fall on the
/// same side of `threshold` as the value: 1.0991 against "≥ 1.10" reads 1.099, never 1.10
/// next to a FAIL.
pub(super) fn judged(value: f64, threshold: f64, passes: Passes, digits: usize) -> String {
    let side = |v: f64| passes.holds(v, threshold);
    let text = |digits: usize| format!("{value:.digits$}");
    if !value.is_finite() {
        return text(digits);
    }
    (digits..digits + 6)
        .map(text)
        .find(|shown| {
            shown
                .parse()
                .is_ok_and(|shown: f64| side(shown) == side(value))
        })
        .unwrap_or_else(|| value.to_string())
}

/// The lower middle of the finite `values` (never the more flattering of two middles), with
/// their least and greatest; `None` without any.
pub(super) fn median_and_range(values: &[f64]) -> Option<(f64, f64, f64)> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let median = *sorted.get(sorted.len().checked_sub(1)? / 2)?;
    Some((median, sorted[0], sorted[sorted.len() - 1]))
}
