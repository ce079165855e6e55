//! The standard sampler as a `plughost:plugin@0.1.0` component: the algorithm of `sampler-standard`, exported through the 0.1 contract.
//!
//! It is a fixture: the host speaks 0.2 and runs this component through its 0.1 adapter, and
//! the tests check that it samples the tokens the 0.2 build of the same algorithm does.

#![cfg(target_arch = "wasm32")]

#[path = "../../sampler-standard/src/sample.rs"]
mod sample;

use plughost::plugin::sampling as wit;

wit_bindgen::generate!({
    path: "../../wit/0.1",
    world: "sampler",
});

/// The SDK's conversions, over this component's 0.1 records.
mod adapter {
    use super::plughost::plugin::sampling as wit;

    plughost_sdk::__sampling_adapter!();
}

struct Standard;

impl Guest for Standard {
    fn init(config: String) -> Result<(), String> {
        match config.trim() {
            "" | "{}" => Ok(()),
            other => Err(format!(
                "the standard sampler takes no options, got {other}"
            )),
        }
    }

    fn sample(
        logits: &wit::LogitsBatch,
        batch: Vec<wit::Sequence>,
    ) -> Result<Vec<wit::Sampled>, String> {
        if usize::try_from(logits.rows()).ok() != Some(batch.len()) {
            return Err(format!(
                "batch of {} sequences but {} logits rows",
                batch.len(),
                logits.rows()
            ));
        }
        let mut sampled = Vec::with_capacity(batch.len());
        for (row, s) in (0u32..).zip(batch) {
            let row = adapter::Row { batch: logits, row };
            if plughost_sdk::sampler::LogitsRow::is_empty(&row) {
                return Err(format!("request {}: the logits row is empty", s.request));
            }
            let params = adapter::params(s.params);
            let token = sample::sample_sequence(&row, &params, s.request, s.position);
            sampled.push(adapter::sampled(token));
        }
        Ok(sampled)
    }
}

export!(Standard);
