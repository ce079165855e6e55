//! Evaluation through the API: lm-evaluation-harness's loglikelihood requests (`echo`, `logprobs`, `max_tokens` 0 or 1), vLLM's `prompt_logprobs`, and echoed completions, against `transformers` references of the tiny fixture.
//!
//! References: `tests/reference/evaluation_reference.py` → `tests/fixtures/tiny-qwen3/evaluation.json`.
//! The shared server runs at most 8 sequences a step, so its logits buffer holds 8 rows and
//! every prompt here (longer than 8 tokens) is scored over several steps.

use reqwest::blocking::Client;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::common::api::{MODEL, model_dir, server, sse_data};

/// Logprobs of the CPU device against `transformers`, both f32.
const TOLERANCE: f64 = 2e-3;

#[derive(Deserialize)]
struct References {
    loglikelihood: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    token_ids: Vec<u32>,
    ctxlen: usize,
    token_logprobs: Vec<Option<f64>>,
    top_ids: Vec<Option<u32>>,
    continuation_logprob: f64,
    is_greedy: bool,
}

fn references() -> References {
    let path = model_dir().join("evaluation.json");
    let text = std::fs::read_to_string(&path).expect("evaluation.json");
    serde_json::from_str(&text).expect("evaluation.json parses")
}

fn post(body: &Value, path: &str) -> (u16, Value) {
    let response = Client::new()
        .post(format!("{}{path}", server().base))
        .json(body)
        .send()
        .expect("sent");
    let status = response.status().as_u16();
    let text = response.text().expect("a body");
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, value)
}

fn completion(body: &Value) -> Value {
    let (status, value) = post(body, "/v1/completions");
    assert_eq!(status, 200, "{body} → {value}");
    value
}

/// lm-evaluation-harness's `parse_logprobs`: the summed logprobs of `scored` tokens, and
/// whether each is the most likely at its position (its logprob is the top one's).
fn harness_score(choice: &Value, scored: std::ops::Range<usize>) -> (f64, bool) {
    let logprobs = &choice["logprobs"];
    let mut sum = 0.0;
    let mut greedy = true;
    for i in scored {
        let token = logprobs["token_logprobs"][i].as_f64().expect("a logprob");
        let best = logprobs["top_logprobs"][i]
            .as_object()
            .expect("top logprobs")
            .values()
            .map(|v| v.as_f64().expect("a logprob"))
            .fold(f64::NEG_INFINITY, f64::max);
        sum += token;
        greedy &= token == best;
    }
    (sum, greedy)
}

#[test]
fn loglikelihood_requests_as_the_harness_sends_them_match_transformers() {
    let cases = references().loglikelihood;
    let prompts: Vec<&Vec<u32>> = cases.iter().map(|c| &c.token_ids).collect();
    // The harness's payload today (one generated token, dropped by `[ctxlen:-1]`), and the
    // older one with nothing generated.
    for max_tokens in [1, 0] {
        let body = json!({
            "model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "seed": 1234, "echo": true,
        });
        let response = completion(&body);
        let choices = response["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), cases.len());
        for (case, choice) in cases.iter().zip(choices) {
            let logprobs = &choice["logprobs"];
            let len = case.token_ids.len();
            assert_eq!(
                logprobs["tokens"].as_array().expect("tokens").len(),
                len + max_tokens
            );
            assert!(logprobs["token_logprobs"][0].is_null(), "{logprobs}");
            assert!(logprobs["top_logprobs"][0].is_null(), "{logprobs}");
            for (i, expected) in case.token_logprobs.iter().enumerate().skip(1) {
                let got = logprobs["token_logprobs"][i].as_f64().expect("a logprob");
                let expected = expected.expect("a reference logprob");
                assert!(
                    (got - expected).abs() < TOLERANCE,
                    "position {i}: {got} vs {expected}"
                );
            }
            let (sum, greedy) = harness_score(choice, case.ctxlen..len);
            assert!(
                (sum - case.continuation_logprob).abs() < TOLERANCE,
                "{sum} vs {}",
                case.continuation_logprob
            );
            assert_eq!(greedy, case.is_greedy);
            let finish = choice["finish_reason"].as_str();
            assert_eq!(finish, Some("length"), "{choice}");
        }
        let usage = &response["usage"];
        assert_eq!(usage["completion_tokens"], json!(max_tokens * cases.len()));
    }
}

#[test]
fn prompt_logprobs_rank_every_prompt_token_on_both_endpoints() {
    let cases = references().loglikelihood;
    let case = &cases[0];
    let body = json!({
        "model": MODEL, "prompt": case.token_ids, "max_tokens": 2, "temperature": 0,
        "prompt_logprobs": 3,
    });
    let response = completion(&body);
    let choice = &response["choices"][0];
    assert!(choice["logprobs"].is_null(), "{choice}");
    let entries = choice["prompt_logprobs"]
        .as_array()
        .expect("prompt_logprobs");
    assert_eq!(entries.len(), case.token_ids.len());
    assert!(entries[0].is_null());
    for (i, entry) in entries.iter().enumerate().skip(1) {
        let entry = entry.as_object().expect("an entry");
        let token = case.token_ids[i].to_string();
        let own = &entry[&token];
        let expected = case.token_logprobs[i].expect("a reference");
        let got = own["logprob"].as_f64().expect("a logprob");
        assert!(
            (got - expected).abs() < TOLERANCE,
            "{i}: {got} vs {expected}"
        );
        let top = case.top_ids[i].expect("a reference").to_string();
        assert_eq!(entry[&top]["rank"], json!(1), "position {i}: {entry:?}");
        assert_eq!(own["rank"] == json!(1), top == token, "{i}: {entry:?}");
        // The prompt token and the three most likely, one entry each.
        assert!((3..=4).contains(&entry.len()), "{entry:?}");
        assert!(own["decoded_token"].is_string());
    }

    let chat = json!({
        "model": MODEL, "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 2, "prompt_logprobs": 0,
    });
    let (status, response) = post(&chat, "/v1/chat/completions");
    assert_eq!(status, 200, "{response}");
    let entries = response["prompt_logprobs"]
        .as_array()
        .expect("prompt_logprobs");
    let prompt_tokens = response["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert_eq!(entries.len() as u64, prompt_tokens);
    assert!(entries[0].is_null());
    assert!(
        entries[1..]
            .iter()
            .all(|e| e.as_object().is_some_and(|e| !e.is_empty()))
    );
}

#[test]
fn a_cached_prompt_is_computed_again_for_its_logprobs() {
    let case = &references().loglikelihood[2];
    let plain = json!({"model": MODEL, "prompt": case.token_ids, "max_tokens": 1});
    completion(&plain);
    let cached = completion(&plain);
    assert!(
        cached["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .is_some_and(|c| c > 0),
        "the prompt is in the prefix cache: {cached}"
    );
    let scored = json!({
        "model": MODEL, "prompt": case.token_ids, "max_tokens": 0, "echo": true, "logprobs": 0,
    });
    let response = completion(&scored);
    assert_eq!(
        response["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(0)
    );
    let logprobs = &response["choices"][0]["logprobs"]["token_logprobs"];
    for (i, expected) in case.token_logprobs.iter().enumerate().skip(1) {
        let got = logprobs[i].as_f64().expect("a logprob");
        assert!((got - expected.expect("a reference")).abs() < TOLERANCE);
    }
}

#[test]
fn echo_puts_the_prompt_before_the_output_streamed_or_not() {
    let prompt = "Once upon a time there was a little robot";
    let body = json!({
        "model": MODEL, "prompt": [prompt, "The quick brown fox"], "max_tokens": 5,
        "temperature": 0, "echo": true, "logprobs": 2, "ignore_eos": true,
    });
    let whole = completion(&body);
    let mut streamed_body = body.clone();
    streamed_body["stream"] = json!(true);
    let response = Client::new()
        .post(format!("{}/v1/completions", server().base))
        .json(&streamed_body)
        .send()
        .expect("sent");
    assert_eq!(response.status().as_u16(), 200);
    let text = response.text().expect("a body");
    let mut texts = vec![String::new(); 2];
    let mut tokens = vec![Vec::new(); 2];
    let mut token_logprobs = vec![Vec::new(); 2];
    let mut offsets = vec![Vec::new(); 2];
    for data in sse_data(&text).iter().filter(|d| *d != "[DONE]") {
        let chunk: Value = serde_json::from_str(data).expect("a chunk");
        for choice in chunk["choices"].as_array().expect("choices") {
            let i = choice["index"].as_u64().expect("index") as usize;
            texts[i].push_str(choice["text"].as_str().expect("text"));
            if let Some(l) = choice["logprobs"].as_object() {
                tokens[i].extend(l["tokens"].as_array().expect("tokens").clone());
                token_logprobs[i].extend(l["token_logprobs"].as_array().expect("lps").clone());
                offsets[i].extend(l["text_offset"].as_array().expect("offsets").clone());
            }
        }
    }
    for (i, choice) in whole["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .enumerate()
    {
        let text = choice["text"].as_str().expect("text");
        let sent = body["prompt"][i].as_str().expect("a prompt");
        assert!(text.starts_with(sent), "{text:?}");
        assert!(text.len() > sent.len(), "{text:?}");
        assert_eq!(texts[i], text);
        let logprobs = &choice["logprobs"];
        assert_eq!(&tokens[i], logprobs["tokens"].as_array().expect("tokens"));
        assert_eq!(
            &token_logprobs[i],
            logprobs["token_logprobs"].as_array().expect("logprobs")
        );
        assert_eq!(
            &offsets[i],
            logprobs["text_offset"].as_array().expect("offsets")
        );
        assert!(token_logprobs[i][0].is_null());
        // The output's offsets start where the echoed prompt ends.
        let prompt_tokens = tokens[i].len() - 5;
        assert_eq!(offsets[i][prompt_tokens], json!(sent.chars().count()));
    }
}

#[test]
fn evaluation_fields_out_of_range_are_refused_by_name() {
    let cases = [
        (
            json!({"model": MODEL, "prompt": "Hi", "max_tokens": 0}),
            "/v1/completions",
            "max_tokens",
        ),
        (
            json!({"model": MODEL, "prompt": "Hi", "prompt_logprobs": 21}),
            "/v1/completions",
            "prompt_logprobs",
        ),
        (
            json!({"model": MODEL, "prompt": "Hi", "prompt_logprobs": 1, "stream": true}),
            "/v1/completions",
            "prompt_logprobs",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                   "prompt_logprobs": -1}),
            "/v1/chat/completions",
            "prompt_logprobs",
        ),
        (
            json!({"model": MODEL, "prompt": "Hi", "echo": true, "max_tokens": -1}),
            "/v1/completions",
            "max_tokens",
        ),
    ];
    for (body, path, param) in cases {
        let (status, response) = post(&body, path);
        assert_eq!(status, 400, "{body} → {response}");
        assert_eq!(response["error"]["param"], json!(param), "{response}");
    }
}
