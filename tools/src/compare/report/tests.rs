//! Tests of the comparison page: the targets judged against the faster peer, their thresholds, and failed requests.

use super::*;
use crate::compare::loads::Distribution;

fn summary(tput: f64, ttft_p99: f64, tpot_p50: f64) -> Summary {
    Summary {
        num_successful: 4,
        num_failed: 0,
        first_error: None,
        duration_s: 1.0,
        output_throughput: tput,
        ttft: Distribution {
            p50_ms: ttft_p99 / 2.0,
            p99_ms: ttft_p99,
        },
        tpot: Distribution {
            p50_ms: tpot_p50,
            p99_ms: tpot_p50,
        },
        itl: Distribution::default(),
    }
}

fn server(name: &'static str, runs: [(f64, f64, f64); 3], rss: u64) -> ServerResult {
    ServerResult {
        name,
        command: "x".into(),
        rounds: Vec::new(),
        decode_time: Vec::new(),
        summaries: [SINGLE, GREEDY, SAMPLED]
            .into_iter()
            .zip(runs)
            .map(|(k, (a, b, c))| (k.to_string(), summary(a, b, c)))
            .collect(),
        peak_rss: rss,
        others_cpu: 0.0,
        weights_bytes: 100,
        kv_bytes: 100,
        memory_note: String::new(),
    }
}

fn facts() -> ModelFacts {
    ModelFacts {
        layers: 1,
        kv_heads: 1,
        head_dim: 1,
        vocab_size: 1,
        tied_embeddings: true,
        file_bytes: 1000,
        tensor_bytes: 1000,
        embedding_bytes: 100,
    }
}

/// A machine whose bandwidth probe measured `bytes_per_second`, one figure per measurement.
fn machine(bytes_per_second: &[f64]) -> Machine {
    let at = |bytes_per_second: f64| Bandwidth {
        bytes_per_second,
        buffer_bytes: 1 << 30,
        threads: 2,
        passes: 5,
    };
    Machine::new(
        "cpu".into(),
        IsaLevel::Avx2,
        bytes_per_second.iter().copied().map(at).collect(),
    )
    .unwrap()
}

/// The loads' shape of both target tests.
fn shape() -> Shape {
    Shape {
        input_len: 256,
        output_len: 128,
        max_token_id: 100,
    }
}

/// plughost at 40 tok/s decode (25 ms), 300 tok/s batched with TTFT p99 90 ms, 280 sampling.
fn plughost_at_40() -> ServerResult {
    server(
        "plughost",
        [(30.0, 50.0, 25.0), (300.0, 90.0, 40.0), (280.0, 95.0, 41.0)],
        250,
    )
}

/// A bf16 page of `plughost` against `peers` with no loads of its own.
fn page_of<'a>(
    machine: &'a Machine,
    model: &'a ModelFacts,
    shape: &'a Shape,
    plughost: &'a ServerResult,
    peers: &'a [ServerResult],
) -> Report<'a> {
    Report {
        written: "now".into(),
        machine,
        model,
        model_source: "m".into(),
        loads: &[],
        shape,
        sweep: &[],
        depths: &[],
        format: "bf16",
        model_title: "SmolLM2-135M",
        plughost,
        peers,
        bench_commands: vec![],
        counters: vec![],
        svg_file: "b.svg".into(),
        raw_dir: "target/compare".into(),
        disturbed: 0.05,
    }
}

#[test]
fn targets_pass_and_fail_on_their_thresholds() {
    // A median of 50 000 bytes/s over 1000 bytes per token: a 50 tok/s bound.
    let machine = machine(&[90_000.0, 50_000.0, 20_000.0]);
    let model = facts();
    let shape = shape();
    let p = plughost_at_40();
    let l = server(
        "llama.cpp",
        [
            (30.0, 50.0, 30.0),
            (180.0, 100.0, 60.0),
            (170.0, 100.0, 60.0),
        ],
        400,
    );
    let report = page_of(&machine, &model, &shape, &p, std::slice::from_ref(&l));
    let t = targets(&report);
    let passes: Vec<bool> = t.iter().map(|t| t.pass).collect();
    // decode 40 ≥ 33.3; 300/180 = 1.67 and 90 ≤ 100; 280/300 = 93%; 40/50 = 80%; 250/200 = 1.25.
    assert_eq!(passes, [true, true, true, true, true], "{t:?}");

    let slow = server(
        "plughost",
        [
            (30.0, 50.0, 50.0),
            (200.0, 120.0, 40.0),
            (150.0, 95.0, 41.0),
        ],
        400,
    );
    let report = Report {
        plughost: &slow,
        ..report
    };
    let passes: Vec<bool> = targets(&report).iter().map(|t| t.pass).collect();
    assert_eq!(passes, [false, false, false, false, false]);
    let page = markdown(&report);
    assert!(page.contains("| Target | Measured | Goal | Result |"));
    assert!(page.contains("FAIL"));
}

#[test]
fn targets_are_judged_against_the_faster_peer() {
    let machine = machine(&[50_000.0]);
    let model = facts();
    let shape = shape();
    // plughost decodes at 40 tok/s; llama.cpp at 20, ik_llama.cpp at 38.
    let p = plughost_at_40();
    let peers = [
        server(
            "llama.cpp",
            [
                (30.0, 50.0, 50.0),
                (100.0, 100.0, 60.0),
                (90.0, 100.0, 60.0),
            ],
            400,
        ),
        server(
            "ik_llama.cpp",
            [(30.0, 50.0, 26.3), (150.0, 80.0, 60.0), (140.0, 80.0, 60.0)],
            400,
        ),
    ];
    let report = page_of(&machine, &model, &shape, &p, &peers);
    let t = targets(&report);
    // 40 ≥ 1.00 × 38.0 passes; 300 tok/s is 2× ik_llama.cpp's 150, but its TTFT p99 (80
    // ms) beats plughost's 90.
    assert!(t[0].pass && t[0].measured.contains("ik_llama.cpp"), "{t:?}");
    assert!(
        !t[1].pass && t[1].measured.contains("ik_llama.cpp"),
        "{t:?}"
    );
    // Quantized weights must beat the faster peer by a tenth: 40 / 38 = 1.05 falls short.
    let q8 = Report {
        format: "Q8_0",
        ..report
    };
    assert!(!targets(&q8)[0].pass);
    let page = markdown(&q8);
    assert!(
        page.contains("# Benchmarks: plughost, llama.cpp and ik_llama.cpp (SmolLM2-135M, Q8_0)")
    );
    assert!(page.contains("ik_llama.cpp:\n\n```sh"));
}

/// A quantized page names the activation digits plughost ran with; a bf16 page does not.
#[test]
fn the_machine_line_names_the_activation_digits() {
    let (model, shape, plughost) = (facts(), shape(), plughost_at_40());
    let mut machine = machine(&[50_000.0]);
    let line = |machine: &Machine, format| {
        let report = Report {
            format,
            ..page_of(machine, &model, &shape, &plughost, &[])
        };
        let page = markdown(&report);
        let start = page.find("**Machine:**").expect("a machine line");
        page[start..].lines().next().unwrap_or_default().to_string()
    };
    assert!(line(&machine, "Q8_0").contains("two int8 digits (`activation_digits=2`"));
    assert!(!line(&machine, "bf16").contains("activation_digits"));
    machine.activation_digits = ActivationDigits::One;
    assert!(line(&machine, "Q4_K_M").contains("one int8 digit (`activation_digits=1`"));
}

#[test]
fn failed_requests_fail_their_target() {
    let mut s = summary(1.0, 1.0, 1.0);
    assert!(clean(&[Some(&s)]));
    s.num_failed = 1;
    assert!(!clean(&[Some(&s)]));
    assert!(!clean(&[None]));
}

/// `server` with `(ttft p50, tpot p50)` for each round of load `key`.
fn with_rounds(mut server: ServerResult, key: &str, rounds: &[(f64, f64)]) -> ServerResult {
    let summaries = rounds
        .iter()
        .map(|&(ttft, tpot)| summary(10.0, 2.0 * ttft, tpot))
        .collect();
    server.rounds.push((key.to_string(), summaries));
    server
}

/// The single-stream load of four prompts.
fn single_stream() -> Load {
    Load {
        key: SINGLE.into(),
        title: "single stream".into(),
        concurrency: 1,
        num_prompts: 4,
        sampling: None,
        seed: 1,
        lengths: None,
        warm_up: true,
    }
}

#[test]
fn the_rounds_are_judged_against_each_rounds_best_peer() {
    let machine = machine(&[50_000.0]);
    let (model, shape) = (facts(), shape());
    let single = single_stream();
    let p = with_rounds(
        plughost_at_40(),
        SINGLE,
        &[(100.0, 25.0), (100.0, 30.0), (100.0, 20.0), (100.0, 40.0)],
    );
    // The best peer of a round is the one with the lower time: llama.cpp in rounds 1 and 3,
    // ik_llama.cpp in round 2; round 4 has only llama.cpp's.
    let llama = with_rounds(
        plughost_at_40(),
        SINGLE,
        &[(110.0, 30.0), (95.0, 36.0), (100.0, 30.0), (80.0, 40.0)],
    );
    let ik = with_rounds(
        plughost_at_40(),
        SINGLE,
        &[(120.0, 31.0), (90.0, 30.0), (130.0, 33.0)],
    );
    let peers = [
        ServerResult {
            name: "llama.cpp",
            ..llama
        },
        ServerResult {
            name: "ik_llama.cpp",
            ..ik
        },
    ];
    let loads = [single];
    let report = Report {
        loads: &loads,
        ..page_of(&machine, &model, &shape, &p, &peers)
    };
    let section = rounds_section(&report);
    assert!(
        section.contains("| 2 | 100 / 30.00 | 95 / 36.00 | 90 / 30.00 | 0.90× | 1.00× |"),
        "{section}"
    );
    assert!(
        section.contains("| 4 | 100 / 40.00 | 80 / 40.00 | — | 0.80× | 1.00× |"),
        "{section}"
    );
    // TTFT ratios 1.10, 0.90, 1.00, 0.80 and decode 1.20, 1.00, 1.50, 1.00: the lower middles.
    assert!(
        section.contains(
            "| median of the rounds | | | | **0.90×** (0.80–1.10) | **1.00×** (1.00–1.50) |"
        ),
        "{section}"
    );
    let page = markdown(&report);
    assert!(page.contains("## By round"));
    assert!(
        page.contains("(1.00×; 1.00× by the median of the rounds, 1.00–1.50)"),
        "{page}"
    );

    // One round says nothing a pooled figure does not.
    let once = with_rounds(plughost_at_40(), SINGLE, &[(100.0, 25.0)]);
    let report = Report {
        plughost: &once,
        ..report
    };
    assert_eq!(rounds_section(&report), "");
}

#[test]
fn the_decode_split_gives_each_callable_per_step_and_the_linear_launches_rate() {
    // 1000 weight bytes per step at 50 000 bytes/s: 20 ms at the measured bandwidth.
    let machine = machine(&[50_000.0]);
    let (model, shape) = (facts(), shape());
    let single = single_stream();
    let time = DecodeTime::parse(
        "plughost_decode_steps_total 10\n\
         plughost_device_callable_seconds_total{callable=\"paged_attention\",step=\"decode\"} 0.03\n\
         plughost_device_callable_seconds_total{callable=\"qkv_linear\",step=\"decode\"} 0.1\n\
         plughost_device_callable_seconds_total{callable=\"linear\",step=\"decode\"} 0.3\n\
         plughost_device_callable_seconds_total{callable=\"linear\",step=\"prefill\"} 7\n\
         plughost_device_callable_seconds_total{callable=\"rotary\",step=\"decode\"} 0.002\n\
         plughost_device_callable_seconds_total{callable=\"rms_norm\",step=\"decode\"} 0.001\n",
    )
    .unwrap();
    let mut p = plughost_at_40();
    p.decode_time = vec![(SINGLE.to_string(), time)];
    let loads = [single];
    let report = Report {
        loads: &loads,
        ..page_of(&machine, &model, &shape, &p, &[])
    };
    let page = markdown(&report);
    let rows: Vec<&str> = page
        .lines()
        .skip_while(|l| !l.starts_with("## Where plughost's decode time goes"))
        .filter(|l| l.starts_with("| "))
        .collect();
    assert_eq!(
        rows,
        [
            "| ms per decode step | single stream |",
            "| `linear` | 30.00 |",
            "| `qkv_linear` | 10.00 |",
            "| `paged_attention` | 3.00 |",
            "| the other 2 kinds | 0.30 |",
            "| all launches | 43.30 |",
            "| TPOT p50 | 25.00 |",
            "| decode steps | 10 |",
            "| weights' GB/s in the linear launches (measured bandwidth 0.0) | 0.0 (50%) |",
        ],
        "{page}"
    );
    // Without decode counters there is no section.
    let report = Report {
        plughost: &plughost_at_40(),
        ..report
    };
    assert!(!markdown(&report).contains("decode time goes"));
}

/// A judged figure never reads as meeting its goal when it misses it, however close.
#[test]
fn a_near_miss_shows_the_digits_that_make_it_one() {
    let cases: [(f64, f64, Passes, usize, &str); 6] = [
        (1.0991, 1.1, Passes::AtLeast, 2, "1.099"),
        (1.104, 1.1, Passes::AtLeast, 2, "1.10"),
        (1.0951, 1.1, Passes::AtLeast, 2, "1.095"),
        (1.5004, 1.5, Passes::AtMost, 2, "1.5004"),
        (69.96, 70.0, Passes::AtLeast, 1, "69.96"),
        (f64::NAN, 1.1, Passes::AtLeast, 2, "NaN"),
    ];
    for (value, threshold, passes, digits, shown) in cases {
        assert_eq!(judged(value, threshold, passes, digits), shown, "{value}");
    }

    // The page's own line: 40 tok/s against ik_llama.cpp's 36.39 is 1.0991× of a 1.10× goal.
    let (machine, model, shape, p) = (machine(&[50_000.0]), facts(), shape(), plughost_at_40());
    let peer = |tpot: f64| {
        server(
            "ik_llama.cpp",
            [(30.0, 50.0, tpot), (150.0, 80.0, 60.0), (140.0, 80.0, 60.0)],
            400,
        )
    };
    for (tpot, shown, pass) in [(27.4775, "(1.099×", false), (27.6, "(1.10×", true)] {
        let peers = [peer(tpot)];
        let report = Report {
            format: "Q8_0",
            ..page_of(&machine, &model, &shape, &p, &peers)
        };
        let decode = &targets(&report)[0];
        assert_eq!(decode.pass, pass, "{decode:?}");
        assert!(decode.measured.contains(shown), "{decode:?}");
    }
}
