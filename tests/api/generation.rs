//! Generation over HTTP: completions and chat, JSON and streamed, against the model's reference outputs.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::api::{MODEL, reference_prompts, server, sse_data, tokenizer};

async fn post(path: &str, body: Value) -> Value {
    let response = reqwest::Client::new()
        .post(format!("{}{path}", server().base))
        .json(&body)
        .send()
        .await
        .expect("send");
    let status = response.status();
    let text = response.text().await.expect("body");
    assert_eq!(status, StatusCode::OK, "{body} → {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

/// The chunks of a streamed response (as JSON) and whether it ended in `[DONE]`.
async fn post_stream(path: &str, body: Value) -> (Vec<Value>, bool) {
    let response = reqwest::Client::new()
        .post(format!("{}{path}", server().base))
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::OK);
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let data = sse_data(&response.text().await.expect("body"));
    let done = data.last().is_some_and(|d| d == "[DONE]");
    let chunks = data
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect();
    (chunks, done)
}

fn usage_of(body: &Value) -> (u64, u64, u64) {
    let u = &body["usage"];
    let get = |k: &str| {
        u[k].as_u64()
            .unwrap_or_else(|| panic!("usage.{k} in {body}"))
    };
    assert!(
        u["prompt_tokens_details"]["cached_tokens"].is_u64(),
        "{body}"
    );
    (
        get("prompt_tokens"),
        get("completion_tokens"),
        get("total_tokens"),
    )
}

fn greedy(prompt: Value, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": true, "max_tokens": max_tokens})
}

#[tokio::test]
async fn greedy_completions_equal_the_reference_continuations() {
    let tokenizer = tokenizer();
    let prompts = reference_prompts();
    let all: Vec<&Vec<u32>> = prompts.iter().map(|p| &p.token_ids).collect();
    let mut body = greedy(json!(all), 32);
    body["logprobs"] = json!(0);
    let response = post("/v1/completions", body).await;
    assert_eq!(response["object"], "text_completion");
    assert!(
        response["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("cmpl-")),
        "{response}"
    );
    let choices = response["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), prompts.len());
    for (i, (choice, reference)) in choices.iter().zip(&prompts).enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["finish_reason"], "length", "{}", reference.name);
        let expected_tokens: Vec<String> = reference
            .generated_token_ids
            .iter()
            .map(|&id| tokenizer.decode(&[id], false).expect("decode"))
            .collect();
        let tokens: Vec<String> =
            serde_json::from_value(choice["logprobs"]["tokens"].clone()).expect("logprobs.tokens");
        assert_eq!(tokens, expected_tokens, "{}", reference.name);
        let expected_text = tokenizer
            .decode(&reference.generated_token_ids, true)
            .expect("decode");
        assert_eq!(choice["text"], expected_text, "{}", reference.name);
        let logprobs = choice["logprobs"]["token_logprobs"]
            .as_array()
            .expect("token_logprobs");
        assert!(
            logprobs
                .iter()
                .all(|l| l.as_f64().is_some_and(|l| l <= 0.0)),
            "{}",
            reference.name
        );
        assert_eq!(choice["logprobs"]["text_offset"][0], 0);
    }
    let prompt_tokens: usize = prompts.iter().map(|p| p.token_ids.len()).sum();
    let n = prompts.len() as u64;
    assert_eq!(
        usage_of(&response),
        (prompt_tokens as u64, 32 * n, prompt_tokens as u64 + 32 * n)
    );
}

#[tokio::test]
async fn a_streamed_completion_matches_the_json_one_and_reports_usage() {
    let reference = &reference_prompts()[0];
    let body = greedy(json!(reference.token_ids), 12);
    let whole = post("/v1/completions", body.clone()).await;
    let mut streamed = body;
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (chunks, done) = post_stream("/v1/completions", streamed).await;
    assert!(done, "the stream ends in [DONE]");
    let (usage_chunk, chunks) = chunks.split_last().expect("chunks");
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_of(usage_chunk), usage_of(&whole));
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().expect("text"))
        .collect();
    assert_eq!(text, whole["choices"][0]["text"].as_str().expect("text"));
    let reasons: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|r| !r.is_null())
        .collect();
    assert_eq!(reasons, [&json!("length")]);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "text_completion" && c["id"] == chunks[0]["id"])
    );

    // Without include_usage there is no usage chunk.
    let mut plain = greedy(json!(reference.token_ids), 4);
    plain["stream"] = json!(true);
    let (chunks, done) = post_stream("/v1/completions", plain).await;
    assert!(
        done && chunks
            .iter()
            .all(|c| c.get("usage").is_none()
                && c["choices"].as_array().is_some_and(|a| a.len() == 1))
    );
}

fn chat_body(max_tokens: u32) -> Value {
    json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "What is the time?"}]}
        ],
        "temperature": 0,
        "ignore_eos": true,
        "max_tokens": max_tokens
    })
}

#[tokio::test]
async fn chat_answers_as_json_and_as_a_stream() {
    let whole = post("/v1/chat/completions", chat_body(10)).await;
    assert_eq!(whole["object"], "chat.completion");
    assert!(
        whole["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("chatcmpl-")),
        "{whole}"
    );
    let choice = &whole["choices"][0];
    assert_eq!(
        (
            choice["message"]["role"].as_str(),
            choice["finish_reason"].as_str()
        ),
        (Some("assistant"), Some("length"))
    );
    // OpenAI's schema requires `refusal`, null when the model did not refuse.
    assert_eq!(
        choice["message"].get("refusal"),
        Some(&serde_json::Value::Null),
        "{whole}"
    );
    let (prompt_tokens, completion_tokens, total) = usage_of(&whole);
    // The ChatML rendering of both messages plus the generation prompt.
    let rendered = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is the time?<|im_end|>\n<|im_start|>assistant\n";
    let expected_prompt = tokenizer().encode(rendered, false).expect("encode").len() as u64;
    assert_eq!(
        (prompt_tokens, completion_tokens, total),
        (expected_prompt, 10, expected_prompt + 10)
    );

    let mut body = chat_body(10);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (chunks, done) = post_stream("/v1/chat/completions", body).await;
    assert!(done);
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    let (usage_chunk, chunks) = chunks.split_last().expect("chunks");
    assert_eq!(
        usage_of(usage_chunk),
        (prompt_tokens, completion_tokens, total)
    );
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        content,
        choice["message"]["content"].as_str().expect("content")
    );
    let last = chunks.last().expect("a final chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn chat_logprobs_have_the_openai_shape() {
    let mut body = chat_body(6);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let mut streamed = body.clone();
    let response = post("/v1/chat/completions", body).await;
    let logprobs = &response["choices"][0]["logprobs"];
    assert_eq!(
        logprobs.get("refusal"),
        Some(&serde_json::Value::Null),
        "{logprobs}"
    );
    let content = logprobs["content"].as_array().expect("logprobs.content");
    assert_eq!(content.len(), 6);
    streamed["stream"] = json!(true);
    let (chunks, _) = post_stream("/v1/chat/completions", streamed).await;
    let with_logprobs: Vec<_> = chunks
        .iter()
        .map(|c| &c["choices"][0]["logprobs"])
        .filter(|l| !l.is_null())
        .collect();
    assert!(!with_logprobs.is_empty(), "{chunks:?}");
    for logprobs in with_logprobs {
        assert_eq!(
            logprobs.get("refusal"),
            Some(&serde_json::Value::Null),
            "{logprobs}"
        );
    }
    for entry in content {
        let top = entry["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(top.len(), 3, "{entry}");
        assert!(
            entry["bytes"].is_array() && entry["token"].is_string(),
            "{entry}"
        );
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], entry["token"], "{entry}");
        assert!(entry["logprob"].as_f64().is_some_and(|l| l <= 0.0));
    }
}

#[tokio::test]
async fn n_choices_per_prompt_are_indexed_and_a_seed_repeats() {
    let body = json!({
        "model": MODEL, "prompt": [[39, 68, 299], [370, 365]], "n": 2, "temperature": 1.0,
        "seed": 1234, "ignore_eos": true, "max_tokens": 16
    });
    let first = post("/v1/completions", body.clone()).await;
    let second = post("/v1/completions", body.clone()).await;
    let texts = |r: &Value| -> Vec<String> {
        r["choices"]
            .as_array()
            .expect("choices")
            .iter()
            .map(|c| c["text"].as_str().expect("text").to_string())
            .collect()
    };
    let indices: Vec<u64> = first["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| c["index"].as_u64().expect("index"))
        .collect();
    assert_eq!(indices, [0, 1, 2, 3]);
    assert_eq!(texts(&first), texts(&second), "a seed repeats");
    assert_ne!(
        texts(&first)[0],
        texts(&first)[1],
        "the choices of one prompt differ"
    );
    assert_eq!(usage_of(&first), (5, 64, 69));

    let mut chat = chat_body(8);
    chat["n"] = json!(2);
    chat["temperature"] = json!(1.0);
    chat["stream"] = json!(true);
    let (chunks, done) = post_stream("/v1/chat/completions", chat).await;
    assert!(done);
    let finished: Vec<u64> = chunks
        .iter()
        .map(|c| &c["choices"][0])
        .filter(|c| !c["finish_reason"].is_null())
        .map(|c| c["index"].as_u64().expect("index"))
        .collect();
    let mut sorted = finished.clone();
    sorted.sort();
    assert_eq!(sorted, [0, 1], "each choice finishes once: {finished:?}");
}

#[tokio::test]
async fn stop_strings_stop_tokens_and_max_tokens() {
    let reference = &reference_prompts()[2];
    let full = post("/v1/completions", greedy(json!(reference.token_ids), 32)).await;
    let text = full["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    // A stop string from the middle of the greedy text: the text ends before its first occurrence.
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    assert!(chars.len() > 12, "{text:?}");
    let stop: String = text[chars[8].0..chars[11].0].to_string();
    let expected = &text[..text.find(&stop).expect("the stop string occurs")];
    let mut body = greedy(json!(reference.token_ids), 32);
    body["stop"] = json!([stop]);
    let stopped = post("/v1/completions", body).await;
    assert_eq!(stopped["choices"][0]["text"], expected, "stop {stop:?}");
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");

    // A stop token ends generation at its first occurrence.
    let stop_token = reference.generated_token_ids[5];
    let first = reference
        .generated_token_ids
        .iter()
        .position(|&t| t == stop_token)
        .expect("present") as u64;
    let mut body = greedy(json!(reference.token_ids), 32);
    body["stop_token_ids"] = json!([stop_token]);
    let stopped = post("/v1/completions", body).await;
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(usage_of(&stopped).1, first + 1);

    let short = post("/v1/completions", greedy(json!(reference.token_ids), 5)).await;
    assert_eq!(short["choices"][0]["finish_reason"], "length");
    assert_eq!(usage_of(&short).1, 5);
}

#[tokio::test]
async fn without_max_tokens_a_completion_gets_16_tokens_or_the_rest_of_the_context() {
    // 500 prompt tokens leave 12 of the 512-token context, fewer than OpenAI's default of 16.
    let prompt: Vec<u32> = (0..500).map(|i| 10 + (i * 7) % 400).collect();
    let body = json!({"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": true});
    let response = post("/v1/completions", body).await;
    assert_eq!(response["choices"][0]["finish_reason"], "length");
    assert_eq!(usage_of(&response), (500, 12, 512));
}
