//! `plughost perplexity`'s scoring through the engine against `transformers`: the tiny Qwen3 fixture in f32, llama-perplexity's windows back to back and strided, within 1%.
//!
//! References: `tests/reference/evaluation_reference.py` → `tests/fixtures/tiny-qwen3/evaluation.json`.

use plughost::perplexity::{Windows, perplexity};
use serde::Deserialize;

use crate::common::api::{model_dir, start_engine, tokenizer};

#[derive(Deserialize)]
struct References {
    perplexity: Reference,
}

#[derive(Deserialize)]
struct Reference {
    text: String,
    num_tokens: usize,
    runs: Vec<Run>,
}

#[derive(Deserialize)]
struct Run {
    context: usize,
    stride: Option<usize>,
    windows: usize,
    scored_tokens: usize,
    perplexity: f64,
}

#[test]
fn perplexity_through_the_engine_matches_transformers_within_one_percent() {
    let text = std::fs::read_to_string(model_dir().join("evaluation.json")).expect("references");
    let reference: References = serde_json::from_str(&text).expect("they parse");
    let reference = reference.perplexity;
    let tokens = tokenizer()
        .encode(&reference.text, true)
        .expect("the text tokenizes");
    assert_eq!(tokens.len(), reference.num_tokens);
    let engine = start_engine();
    for run in &reference.runs {
        let windows = Windows::new(run.context, run.stride).expect("valid windows");
        let mut reported = Vec::new();
        let report = perplexity(&engine, &tokens, None, windows, |done, _| {
            reported.push(done)
        })
        .expect("scored");
        assert_eq!(report.windows, run.windows);
        assert_eq!(report.scored_tokens, run.scored_tokens);
        assert_eq!(reported, (1..=run.windows).collect::<Vec<_>>());
        let ratio = report.perplexity / run.perplexity;
        assert!(
            (ratio - 1.0).abs() < 0.01,
            "context {} stride {:?}: {} vs transformers {}",
            run.context,
            run.stride,
            report.perplexity,
            run.perplexity
        );
    }
    let too_long = Windows::new(tokens.len() + 1, None).expect("valid");
    assert!(perplexity(&engine, &tokens, None, too_long, |_, _| {}).is_err());
    engine.shutdown();
}
