//! Validation of completions and chat bodies against a tiny model: refusals name the field, and
//! defaults, constraints, limits and templates apply as documented.

use std::path::Path;
use std::sync::Arc;

use super::*;
use crate::api::body::parse_body;
use crate::grammar::GrammarCompiler;
use crate::model::{ChatTemplate, Tokenizer};

fn model() -> ModelSummary {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-qwen3");
    let tokenizer = Tokenizer::from_dir(&dir).expect("tokenizer");
    ModelSummary {
        name: "tiny".into(),
        root: dir.display().to_string(),
        generation_defaults: Default::default(),
        max_model_len: 64,
        vocab_size: 448,
        eos_token_ids: vec![447],
        grammars: Arc::new(GrammarCompiler::new(tokenizer.clone(), 448, vec![447])),
        tokenizer,
        chat_template: Some(Arc::new(ChatTemplate::from_dir(&dir).expect("template"))),
    }
}

#[test]
fn a_template_without_tools_gets_them_in_a_fallback_system_prompt() {
    // The tiny model's template renders only roles and contents, as SmolLM2's does.
    let body = r#"{"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}"#;
    let roomy = || ModelSummary {
        max_model_len: 4096,
        ..model()
    };
    let validate = |body: &str| {
        validate_chat(
            parse_body(body.as_bytes()).expect("body"),
            &roomy(),
            ReasoningParserChoice::Auto,
        )
        .expect("valid")
    };
    let validated = validate(body);
    let prompt = model()
        .tokenizer
        .decode(&validated.choices()[0].prompt_tokens, false)
        .expect("decodes");
    let system = prompt.find("<|im_start|>system\nYou can call the functions");
    assert_eq!(system, Some(0), "{prompt}");
    assert!(prompt.contains(r#""name":"get_weather""#), "{prompt}");
    assert!(
        prompt.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"),
        "the earlier call is written into its turn: {prompt}"
    );
    assert!(prompt.contains("<|im_start|>tool\nsunny"), "{prompt}");
    // tool_choice "none": no tools shown, the answer is not read for calls.
    let none = body.replace(r#""tools""#, r#""tool_choice": "none", "tools""#);
    let validated = validate(&none);
    let prompt = model()
        .tokenizer
        .decode(&validated.choices()[0].prompt_tokens, false)
        .expect("decodes");
    assert!(!prompt.contains("You can call the functions"), "{prompt}");
}

#[test]
fn chat_fields_beyond_text_are_refused_naming_them() {
    let messages = r#""messages": [{"role": "user", "content": "hi"}]"#;
    for (field, value) in [
        ("modalities", r#"["text", "audio"]"#),
        ("audio", r#"{"voice": "alloy", "format": "wav"}"#),
        ("prediction", r#"{"type": "content", "content": "x"}"#),
        ("reasoning_effort", r#""low""#),
        ("web_search_options", "{}"),
        ("functions", r#"[{"name": "f"}]"#),
        ("function_call", r#""auto""#),
        ("verbosity", r#""low""#),
        ("service_tier", r#""flex""#),
        ("store", "true"),
    ] {
        let body = format!(r#"{{{messages}, "{field}": {value}}}"#);
        let error = chat(&body).expect_err(&body);
        let (status, axum::Json(shown)) = <(
            axum::http::StatusCode,
            axum::Json<super::super::ErrorResponse>,
        )>::from(error);
        assert_eq!(status, 400, "{body}");
        assert_eq!(shown.error.param.as_deref(), Some(field), "{body}");
    }
    for (field, value) in [
        ("modalities", r#"["text"]"#),
        ("service_tier", r#""auto""#),
        ("store", "false"),
        ("audio", "null"),
        ("user", r#""someone""#),
    ] {
        let body = format!(r#"{{{messages}, "{field}": {value}}}"#);
        assert!(chat(&body).is_ok(), "{body}");
    }
}

#[test]
fn generation_config_fills_what_the_request_leaves_out() {
    let mut qwen3_like = model();
    qwen3_like.generation_defaults = GenerationDefaults {
        temperature: Some(0.6),
        top_p: Some(0.95),
        top_k: Some(20),
        max_new_tokens: Some(8),
        ..Default::default()
    };
    let silent = validate_completion(
        parse_body(br#"{"prompt": "hi"}"#).expect("body"),
        &qwen3_like,
    )
    .expect("valid");
    let choice = &silent.choices()[0];
    assert_eq!(choice.sampling.temperature, 0.6);
    assert_eq!((choice.sampling.top_k, choice.sampling.top_p), (20, 0.95));
    assert_eq!(
        choice.max_tokens, 8,
        "max_new_tokens comes before OpenAI's 16"
    );
    let explicit = validate_completion(
        parse_body(br#"{"prompt": "hi", "temperature": 0, "top_k": -1, "max_tokens": 3}"#)
            .expect("body"),
        &qwen3_like,
    )
    .expect("valid");
    let choice = &explicit.choices()[0];
    assert_eq!(
        (choice.sampling.temperature, choice.sampling.top_k),
        (0.0, 0)
    );
    assert_eq!(choice.max_tokens, 3);
    let plain = completion(r#"{"prompt": "hi"}"#).expect("valid");
    assert_eq!(plain.choices()[0].sampling.temperature, 1.0);
    assert_eq!(plain.choices()[0].max_tokens, 16);
}

fn completion(json: &str) -> Result<ValidatedRequest, ApiError> {
    validate_completion(parse_body(json.as_bytes())?, &model())
}

fn chat(json: &str) -> Result<ValidatedRequest, ApiError> {
    validate_chat(
        parse_body(json.as_bytes())?,
        &model(),
        ReasoningParserChoice::Auto,
    )
}

#[test]
fn invalid_parameters_are_refused_with_the_parameter_named() {
    let cases: &[(&str, &str)] = &[
        (r#"{"prompt": "hi", "max_tokens": -1}"#, "max_tokens"),
        (r#"{"prompt": "hi", "temperature": 2.5}"#, "temperature"),
        (r#"{"prompt": "hi", "top_p": 0}"#, "top_p"),
        (r#"{"prompt": "hi", "top_k": -5}"#, "top_k"),
        (r#"{"prompt": "hi", "min_p": 2}"#, "min_p"),
        (r#"{"prompt": "hi", "n": 0}"#, "n"),
        (
            r#"{"prompt": "hi", "presence_penalty": 5}"#,
            "presence_penalty",
        ),
        (
            r#"{"prompt": "hi", "repetition_penalty": 0}"#,
            "repetition_penalty",
        ),
        (r#"{"prompt": "hi", "logprobs": 50}"#, "logprobs"),
        (
            r#"{"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}"#,
            "stop",
        ),
        (r#"{"prompt": "hi", "stop": 3}"#, "stop"),
        (
            r#"{"prompt": "hi", "stop_token_ids": [448]}"#,
            "stop_token_ids",
        ),
        (r#"{"prompt": "hi", "seed": 1.5}"#, "seed"),
        (
            r#"{"prompt": "hi", "stream_options": {"include_usage": true}}"#,
            "stream_options",
        ),
        (r#"{"prompt": []}"#, "prompt"),
        (r#"{"prompt": [""]}"#, "prompt"),
        (r#"{"prompt": [1, 448]}"#, "prompt"),
        (r#"{"prompt": [[1], "a"]}"#, "prompt"),
        (r#"{"prompt": {"a": 1}}"#, "prompt"),
        (r#"{}"#, "prompt"),
    ];
    for (json, param) in cases {
        match completion(json) {
            Err(ApiError::InvalidParam { param: Some(p), .. }) => {
                assert_eq!(p, *param, "{json}")
            }
            other => panic!("{json}: {other:?}"),
        }
    }
}

#[test]
fn output_constraints_are_checked_and_compiled() {
    let ok: &[&str] = &[
        r#"{"prompt": "hi", "response_format": {"type": "text"}}"#,
        r#"{"prompt": "hi", "response_format": {"type": "json_object"}}"#,
        r#"{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}"#,
        r#"{"prompt": "hi", "structured_outputs": {"regex": "[a-c]+"}}"#,
        r#"{"prompt": "hi", "structured_outputs": {"choice": ["yes", "no"]}}"#,
        r#"{"prompt": "hi", "structured_outputs": {"grammar": "start: \"a\" | \"b\""}}"#,
        r#"{"prompt": "hi", "structured_outputs": {"json": "{\"type\": \"string\"}"}}"#,
        r#"{"prompt": "hi", "logit_bias": {"5": -100, "7": 100, "9": 0.5}}"#,
    ];
    for json in ok {
        completion(json).unwrap_or_else(|e| panic!("{json}: {e:?}"));
    }
    let v = completion(r#"{"prompt": "hi", "response_format": {"type": "json_object"}}"#)
        .expect("valid");
    assert!(v.choices()[0].constraint.is_some());
    let text =
        completion(r#"{"prompt": "hi", "response_format": {"type": "text"}}"#).expect("valid");
    assert!(text.choices()[0].constraint.is_none());

    let refused: &[(&str, &str)] = &[
        (
            r#"{"prompt": "hi", "logit_bias": {"5": 101}}"#,
            "logit_bias",
        ),
        (
            r#"{"prompt": "hi", "logit_bias": {"5": "x"}}"#,
            "logit_bias",
        ),
        (
            r#"{"prompt": "hi", "logit_bias": {"448": 1}}"#,
            "logit_bias",
        ),
        (r#"{"prompt": "hi", "logit_bias": {"a": 1}}"#, "logit_bias"),
        (r#"{"prompt": "hi", "logit_bias": [1]}"#, "logit_bias"),
        (
            r#"{"prompt": "hi", "response_format": {"type": "xml"}}"#,
            "response_format.type",
        ),
        (
            r#"{"prompt": "hi", "response_format": {"type": "json_schema"}}"#,
            "response_format.json_schema",
        ),
        (
            r#"{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}"#,
            "response_format.json_schema.schema",
        ),
        (
            r#"{"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}"#,
            "structured_outputs",
        ),
        (
            r#"{"prompt": "hi", "structured_outputs": {}}"#,
            "structured_outputs",
        ),
        (
            r#"{"prompt": "hi", "structured_outputs": {"choice": []}}"#,
            "structured_outputs.choice",
        ),
        (
            r#"{"prompt": "hi", "structured_outputs": {"regex": 5}}"#,
            "structured_outputs.regex",
        ),
    ];
    for (json, param) in refused {
        match completion(json) {
            Err(ApiError::InvalidParam { param: Some(p), .. }) => {
                assert_eq!(p, *param, "{json}")
            }
            other => panic!("{json}: {other:?}"),
        }
    }
    match completion(r#"{"prompt": "hi", "structured_outputs": {"regex": "(a"}}"#) {
        Err(ApiError::Grammar { param, .. }) => assert_eq!(param, "structured_outputs.regex"),
        other => panic!("{other:?}"),
    }
    match completion(
        r#"{"prompt": "hi", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}"#,
    ) {
        Err(ApiError::ConflictingConstraints { first, second }) => {
            assert_eq!(
                (first.as_str(), second.as_str()),
                ("response_format", "structured_outputs.regex")
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn context_limits_cap_or_refuse() {
    let ok = completion(r#"{"prompt": [1, 2, 3, 4]}"#).expect("fits");
    assert_eq!(ok.choices()[0].max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS);
    let near_the_end = format!("{{\"prompt\": {:?}}}", vec![1; 60]);
    let capped = completion(&near_the_end).expect("fits");
    assert_eq!(capped.choices()[0].max_tokens, 4);
    let chat_room =
        chat(r#"{"messages": [{"role": "user", "content": "Hi"}]}"#).expect("valid chat");
    assert_eq!(
        chat_room.choices()[0].max_tokens as usize,
        64 - chat_room.shape.prompt_lens[0] as usize,
        "chat generates until the context ends"
    );
    assert!(matches!(
        completion(r#"{"prompt": [1, 2, 3, 4], "max_tokens": 61}"#),
        Err(ApiError::ContextLengthExceeded { .. })
    ));
    let long = format!("{{\"prompt\": {:?}}}", vec![1; 64]);
    assert!(matches!(
        completion(&long),
        Err(ApiError::ContextLengthExceeded { .. })
    ));
    assert_eq!(
        completion(r#"{"prompt": [1, 2, 3, 4], "max_tokens": 60}"#)
            .expect("fits")
            .choices()[0]
            .max_tokens,
        60
    );
}

#[test]
fn prompts_and_choices_are_laid_out_by_index() {
    let v = completion(r#"{"prompt": [[5, 6, 7], [8]], "n": 2, "seed": 10, "temperature": 0.5, "top_k": -1, "logprobs": 3}"#)
        .expect("valid");
    let seeds: Vec<u64> = v.choices().iter().map(|c| c.sampling.seed).collect();
    assert_eq!(
        seeds,
        [10, 11, 10, 11],
        "choice i of every prompt draws from seed + i"
    );
    assert_eq!(v.choices()[2].prompt_tokens, [8]);
    assert_eq!(v.shape.prompt_lens, [3, 1]);
    assert_eq!(
        (v.shape.n, v.shape.num_choices(), v.shape.logprobs),
        (2, 4, Some(3))
    );
    let c = &v.choices()[0];
    assert_eq!(
        (
            c.sampling.temperature,
            c.sampling.top_k,
            c.sampling.num_top_logprobs,
            c.logprobs
        ),
        (0.5, 0, 3, true)
    );
}

#[test]
fn chat_messages_render_through_the_template() {
    let v = chat(
        r#"{"messages": [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the time?"}]}],
            "max_completion_tokens": 5, "logprobs": true, "top_logprobs": 2}"#,
    )
    .expect("valid");
    let m = model();
    let text = m
        .tokenizer
        .decode(&v.choices()[0].prompt_tokens, false)
        .expect("decode");
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is\nthe time?<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!((v.choices()[0].max_tokens, v.shape.logprobs), (5, Some(2)));

    let refused: &[&str] = &[
        r#"{"messages": []}"#,
        r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#,
        r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#,
        r#"{"messages": [{"role": "user", "content": 5}]}"#,
        r#"{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}"#,
        r#"{"messages": [{"role": "user", "content": "hi"}], "model": "other"}"#,
        r#"{"prompt": "hi"}"#,
    ];
    for json in refused {
        assert!(chat(json).is_err(), "{json}");
    }
    let mut no_template = model();
    no_template.chat_template = None;
    let body = parse_body(br#"{"messages": [{"role": "user", "content": "hi"}]}"#).expect("parse");
    assert!(matches!(
        validate_chat(body, &no_template, ReasoningParserChoice::Auto),
        Err(ApiError::NoChatTemplate { .. })
    ));
}
