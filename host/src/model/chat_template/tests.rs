//! Chat templates read from model folders and rendered as Hugging Face renders them.

use super::*;

fn template(source: &str) -> ChatTemplate {
    let tokens = vec![
        ("bos_token", "<s>".to_string()),
        ("eos_token", "</s>".to_string()),
    ];
    ChatTemplate::new(
        PathBuf::from("/m/tokenizer_config.json"),
        source.into(),
        tokens,
    )
    .expect(source)
}

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi <b>&</b> \"you\""),
        ChatMessage {
            reasoning_content: Some("thinking".into()),
            tool_calls: vec![ToolCall {
                id: Some("call_1".into()),
                name: "get_weather".into(),
                arguments: r#"{"city": "Paris", "at": [1, 2.0], "units": null}"#.into(),
            }],
            ..ChatMessage::new("assistant", "Sure")
        },
    ]
}

#[test]
fn renders_like_hugging_face() {
    let cases: &[(&str, &str)] = &[
        // trim_blocks and lstrip_blocks: block lines leave no whitespace behind.
        (
            "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}\n",
            "[Hi <b>&</b> \"you\"]\n",
        ),
        // keep_trailing_newline is off: one trailing newline is dropped.
        ("{{ bos_token }}x\n", "<s>x"),
        (
            "{{ messages[0].content.startswith('Be') }} {{ messages[0].content.split(' ') }}",
            "True ['Be', 'brief.']",
        ),
        (
            "{{ ' pad '.strip() }}|{{ messages[1].content.upper() }}",
            "pad|HI <B>&</B> \"YOU\"",
        ),
        (
            "{% for k, v in {'a': 1, 'b': none}.items() %}{{ k }}={{ v }};{% endfor %}",
            "a=1;b=None;",
        ),
        (
            "{{ messages[1] | tojson }}",
            r#"{"role": "user", "content": "Hi <b>&</b> \"you\""}"#,
        ),
        (
            "{{ messages[2].tool_calls[0].function.arguments | tojson }}",
            r#"{"city": "Paris", "at": [1, 2.0], "units": null}"#,
        ),
        (
            "{{ messages[2].tool_calls[0] | tojson(indent=2) }}",
            "{\n  \"id\": \"call_1\",\n  \"type\": \"function\",\n  \"function\": {\n    \"name\": \"get_weather\",\n    \"arguments\": {\n      \"city\": \"Paris\",\n      \"at\": [\n        1,\n        2.0\n      ],\n      \"units\": null\n    }\n  }\n}",
        ),
        (
            r#"{{ {"b": 1, "a": "é"} | tojson(sort_keys=true, separators=[",", ":"]) }}"#,
            r#"{"a":"é","b":1}"#,
        ),
        (
            "{{ messages[0].reasoning_content is defined }} {{ messages[2].reasoning_content }} {{ messages[0].tool_calls is defined }}",
            "False thinking False",
        ),
        (
            "{{ tools is none }} {{ add_generation_prompt }} {{ eos_token }}",
            "True True </s>",
        ),
        (
            "{% for m in messages[::-1] %}{{ m.role[0] }}{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}",
            "au",
        ),
        (
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
            "3",
        ),
    ];
    for (source, expected) in cases {
        let rendered = template(source)
            .render(&conversation(), true)
            .expect(source);
        assert_eq!(&rendered, expected, "{source}");
    }
}

#[test]
fn templates_are_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ChatTemplate>();
}

#[test]
fn raise_exception_is_a_typed_error_with_the_message() {
    let source = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}";
    match template(source).render(&conversation(), false) {
        Err(ModelError::ChatTemplateRaised { path, message }) => {
            assert_eq!(message, "Conversation roles must alternate");
            assert_eq!(path, Path::new("/m/tokenizer_config.json"));
        }
        other => panic!("expected ChatTemplateRaised, got {other:?}"),
    }
}

#[test]
fn strftime_now_formats_the_local_date() {
    let today = || chrono::Local::now().format("%Y-%m-%d").to_string();
    let before = today();
    let rendered = template("{{ strftime_now('%Y-%m-%d') }}")
        .render(&[], false)
        .expect("render");
    // Either side of midnight is right.
    assert!(rendered == before || rendered == today(), "{rendered}");
    let error = template("{{ strftime_now('%Q') }}")
        .render(&[], false)
        .unwrap_err();
    assert!(matches!(error, ModelError::ChatTemplate { .. }), "{error}");
}

#[test]
fn options_reach_the_template() {
    let source = "{{ tools | tojson }}|{{ enable_thinking }}|{{ enable_thinking is false }}";
    let kwargs = BTreeMap::from([("enable_thinking".to_string(), serde_json::json!(false))]);
    let options = RenderOptions {
        add_generation_prompt: false,
        tools_json: Some(r#"[{"type": "function", "function": {"name": "f"}}]"#),
        kwargs,
    };
    let rendered = template(source).render_with(&[], &options).expect("render");
    assert_eq!(
        rendered,
        r#"[{"type": "function", "function": {"name": "f"}}]|False|True"#
    );
}

#[test]
fn errors_name_the_template_file() {
    let syntax = ChatTemplate::new(
        PathBuf::from("/m/chat_template.jinja"),
        "{% if %}".into(),
        vec![],
    )
    .unwrap_err()
    .to_string();
    assert!(syntax.contains("/m/chat_template.jinja"), "{syntax}");
    let runtime = template("{{ messages | unknown_filter }}")
        .render(&[], false)
        .unwrap_err();
    assert!(
        runtime.to_string().contains("/m/tokenizer_config.json"),
        "{runtime}"
    );
}

/// A folder name, its files as (name, text), and the expected render or error text.
type FolderCase<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str);

fn folder(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("plughost-template-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).expect("create folder");
    for (file, text) in files {
        std::fs::write(dir.join(file), text).expect("write file");
    }
    dir
}

#[test]
fn finds_the_template_and_tokens_in_every_layout() {
    let added_token = r#"{"chat_template": "{{ bos_token }}{{ eos_token }}{{ unk_token is defined }}",
        "bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "unk_token": null}"#;
    let named = r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#;
    let cases: &[FolderCase<'_>] = &[
        (
            "added",
            &[("tokenizer_config.json", added_token)],
            "<s></s>False",
        ),
        ("named", &[("tokenizer_config.json", named)], "D"),
        (
            "jinja",
            &[
                ("tokenizer_config.json", named),
                ("chat_template.jinja", "J"),
            ],
            "J",
        ),
        (
            "legacy",
            &[("chat_template.json", r#"{"chat_template": "L"}"#)],
            "L",
        ),
    ];
    for (name, files, expected) in cases {
        let dir = folder(name, files);
        let rendered = ChatTemplate::from_dir(&dir).and_then(|t| t.render(&[], false));
        assert_eq!(rendered.expect(name), *expected, "{name}");
        std::fs::remove_dir_all(dir).ok();
    }
}

#[test]
fn a_missing_template_is_a_clear_error() {
    let cases: &[FolderCase<'_>] = &[
        (
            "none",
            &[("tokenizer_config.json", r#"{"eos_token": "</s>"}"#)],
            "no chat template in",
        ),
        ("empty", &[], "no chat template in"),
        (
            "nodefault",
            &[(
                "tokenizer_config.json",
                r#"{"chat_template": [{"name": "x", "template": "X"}]}"#,
            )],
            "none named \"default\"",
        ),
        (
            "badjson",
            &[("tokenizer_config.json", "{")],
            "tokenizer_config.json is not a valid tokenizer config",
        ),
    ];
    for (name, files, expected) in cases {
        let dir = folder(name, files);
        let error = ChatTemplate::from_dir(&dir).unwrap_err().to_string();
        assert!(error.contains(expected), "{name}: {error}");
        assert!(
            error.contains(dir.to_str().unwrap_or_default()),
            "{name}: {error}"
        );
        std::fs::remove_dir_all(dir).ok();
    }
}
