//! `plughost perplexity`: a text file's perplexity through the same engine `serve` runs, windowed as `llama-perplexity` windows it, with a progress bar.

use std::path::Path;
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use plughost::engine::EngineHandle;
use plughost::metrics::Metrics;
use plughost::perplexity::{Windows, perplexity as score};

use crate::error::CliError;
use crate::options::ModelArgs;

/// `plughost perplexity`: prints the perplexity of `file` under the model, and what was scored.
pub fn perplexity(
    model: &ModelArgs,
    file: &Path,
    context: usize,
    stride: Option<usize>,
) -> Result<(), CliError> {
    let windows = Windows::new(context, stride)?;
    let text = std::fs::read_to_string(file).map_err(|source| CliError::Read {
        path: file.to_path_buf(),
        source,
    })?;
    let engine = EngineHandle::start(model.setup()?, Arc::new(Metrics::new()))?;
    let summary = engine.wait_ready()?;
    // As llama-perplexity tokenizes: with the tokenizer's special tokens, whose leading BOS
    // (if it adds one) then starts every window.
    let tokens = summary.tokenizer.encode(&text, true)?;
    let plain = summary.tokenizer.encode(&text, false)?;
    let bos = (tokens.len() > plain.len())
        .then(|| tokens.first().copied())
        .flatten();
    let num_windows = windows.starts(tokens.len()).len();
    let bar = ProgressBar::with_draw_target(
        Some(num_windows as u64),
        ProgressDrawTarget::stderr_with_hz(4),
    );
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{wide_bar}] {pos}/{len} windows {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let report = score(&engine, &tokens, bos, windows, |done, so_far| {
        bar.set_position(done as u64);
        bar.set_message(format!("PPL {so_far:.4}"));
    });
    bar.finish_and_clear();
    engine.shutdown();
    let report = report?;
    println!(
        "{} tokens, {} windows of {context}{}, {} scored tokens",
        tokens.len(),
        report.windows,
        stride.map_or(String::new(), |s| format!(" every {s}")),
        report.scored_tokens,
    );
    println!("PPL = {:.4}", report.perplexity);
    Ok(())
}
