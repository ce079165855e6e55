//! Unit tests of the benchmark's options, prompts (random, fixed, shared-prefix) and request bodies.

use super::*;

fn options(args: &[&str]) -> BenchOptions {
    let argv = ["bench", "--base-url", "http://h:1"].iter().chain(args);
    BenchOptions::try_parse_from(argv).expect("the options parse")
}

#[test]
fn random_prompts_are_exact_fresh_and_reproducible() {
    let o = options(&["--input-len", "16", "--max-token-id", "448"]);
    let ids = |run, index| prompt_fields(&o, PromptStream::Run(run), index).1;
    let first = ids(0, 0);
    let list = first.as_array().unwrap();
    assert_eq!(list.len(), 16);
    assert!(
        list.iter()
            .all(|v| (100..448).contains(&v.as_u64().unwrap()))
    );
    assert_eq!(first, ids(0, 0));
    assert_ne!(first, ids(0, 1));
    assert_ne!(first, ids(1, 0));
}

#[test]
fn warm_up_prompts_never_repeat_a_measured_one() {
    for kind in ["random", "fixed"] {
        for endpoint in ["completions", "chat"] {
            let o = options(&[
                "--input-len",
                "8",
                "--max-token-id",
                "448",
                "--prompt-kind",
                kind,
                "--endpoint",
                endpoint,
            ]);
            let measured: Vec<Value> = (0..4)
                .flat_map(|run| (0..64).map(move |i| (run, i)))
                .map(|(run, i)| prompt_fields(&o, PromptStream::Run(run), i).1)
                .collect();
            let warmup: Vec<Value> = (0..8)
                .map(|i| prompt_fields(&o, PromptStream::Warmup, i).1)
                .collect();
            for (i, w) in warmup.iter().enumerate() {
                assert!(
                    !measured.contains(w),
                    "{kind} {endpoint}: warm-up {i} repeats"
                );
                assert!(
                    !warmup[..i].contains(w),
                    "{kind} {endpoint}: warm-up {i} twice"
                );
            }
        }
    }
}

#[test]
fn bodies_follow_the_endpoint_and_flags() {
    let chat = request_body(
        &options(&["--endpoint", "chat", "--ignore-eos"]),
        Some("m"),
        PromptStream::Run(0),
        0,
    );
    assert!(chat["messages"][0]["content"].is_string());
    assert_eq!(chat["ignore_eos"], json!(true));
    assert_eq!(chat["model"], json!("m"));
    let fixed = request_body(
        &options(&["--prompt-kind", "fixed", "--input-len", "3"]),
        None,
        PromptStream::Run(0),
        0,
    );
    assert_eq!(fixed["prompt"], json!("hello hello hello"));
    assert!(fixed.get("ignore_eos").is_none() && fixed.get("model").is_none());
    assert_eq!(fixed["stream_options"]["include_usage"], json!(true));
    assert_eq!(
        (fixed["temperature"].as_f64(), fixed["top_p"].as_f64()),
        (Some(0.0), Some(1.0))
    );
    // top_k is not an OpenAI field: absent unless asked for.
    assert!(fixed.get("top_k").is_none());
    let sampled = request_body(
        &options(&["--temperature", "0.5", "--top-p", "0.75", "--top-k", "-1"]),
        None,
        PromptStream::Run(0),
        0,
    );
    assert_eq!(sampled["temperature"], json!(0.5));
    assert_eq!(sampled["top_p"], json!(0.75));
    assert_eq!(sampled["top_k"], json!(-1));
}

#[test]
fn priorities_cycle_and_the_extra_body_is_merged_last() {
    let o = options(&[
        "--priorities",
        "10,-5",
        "--extra-body",
        r#"{"sampler": "creative", "temperature": 0.25}"#,
    ]);
    assert!(o.validate().is_ok());
    let bodies: Vec<Value> = (0..3)
        .map(|i| request_body(&o, None, PromptStream::Run(0), i))
        .collect();
    let priorities: Vec<&Value> = bodies.iter().map(|b| &b["priority"]).collect();
    assert_eq!(priorities, [&json!(10), &json!(-5), &json!(10)]);
    assert!(bodies.iter().all(|b| b["sampler"] == "creative"));
    assert!(bodies.iter().all(|b| b["temperature"] == json!(0.25)));
    let plain = request_body(&options(&[]), None, PromptStream::Run(0), 0);
    assert!(plain.get("priority").is_none());
    for bad in ["[1]", "{", "7"] {
        let error = options(&["--extra-body", bad]).validate().expect_err(bad);
        assert!(error.to_string().contains("--extra-body"), "{bad}: {error}");
    }
}

#[test]
fn options_are_checked() {
    let cases: &[(&[&str], bool)] = &[
        (&[], true),
        (&["--num-prompts", "0"], false),
        (&["--request-rate", "0"], false),
        (&["--request-rate", "inf"], true),
        (&["--sweep", "1,0"], false),
        (&["--sweep", "1,2,4", "--plot", "x.svg"], true),
        (&["--max-token-id", "50"], false),
        (&["--request-timeout", "0.5"], true),
        (&["--request-timeout", "0"], false),
        (&["--request-timeout", "inf"], false),
        (&["--request-timeout", "NaN"], false),
        (&["--temperature=-1"], false),
        (&["--top-p", "0"], false),
        (&["--top-p", "1.5"], false),
        (&["--top-k", "0"], true),
        (&["--top-k", "-2"], false),
        (&["--warmup", "0"], true),
        (&["--num-warmups", "3"], true),
    ];
    for (args, ok) in cases {
        assert_eq!(options(args).validate().is_ok(), *ok, "{args:?}");
    }
    assert!(BenchOptions::try_parse_from(["bench", "--base-url", "u", "--plot", "x.svg"]).is_err());
}

#[test]
fn defaults_warm_up_once_and_time_out_after_ten_minutes() {
    let o = options(&[]);
    assert_eq!(o.warmup, 1);
    assert_eq!(o.request_timeout(), Duration::from_secs(600));
    assert_eq!(o.top_k, None);
}

#[test]
fn poisson_arrivals_average_the_rate() {
    let o = options(&["--request-rate", "10", "--num-prompts", "2000"]);
    let offsets = arrival_offsets(&o, 0);
    assert_eq!(offsets[0], 0.0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    let rate = (offsets.len() - 1) as f64 / offsets.last().unwrap();
    assert!((rate - 10.0).abs() < 1.0, "rate {rate}");
}

#[test]
fn shared_prefix_prompts_share_their_prefix_and_differ_after_it() {
    let options = options(&[
        "--prompt-kind",
        "shared-prefix",
        "--shared-prefix-len",
        "64",
        "--shared-prefixes",
        "2",
        "--input-len",
        "8",
    ]);
    let ids = |stream, index| -> Vec<u64> {
        let (key, prompt) = prompt_fields(&options, stream, index);
        assert_eq!(key, "prompt");
        let ids: Vec<u64> = prompt
            .as_array()
            .expect("token ids")
            .iter()
            .map(|id| id.as_u64().expect("an id"))
            .collect();
        assert_eq!(ids.len(), 72);
        ids
    };
    let (first, third) = (ids(PromptStream::Run(0), 0), ids(PromptStream::Run(0), 2));
    assert_eq!(first[..64], third[..64], "requests 0 and 2 share prefix 0");
    assert_ne!(first[64..], third[64..], "with distinct suffixes");
    let second = ids(PromptStream::Run(0), 1);
    assert_ne!(first[..64], second[..64], "request 1 takes prefix 1");
    let warmup = ids(PromptStream::Warmup, 0);
    assert_eq!(
        warmup[..64],
        first[..64],
        "the warm-up sends the prefix too"
    );
    assert!(
        options_err(&["--prompt-kind", "shared-prefix", "--shared-prefixes", "0"]),
        "zero prefixes are refused"
    );
}

fn options_err(args: &[&str]) -> bool {
    options(args).validate().is_err()
}
