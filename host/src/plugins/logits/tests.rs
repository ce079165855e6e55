//! Tests of the logits operations against plain definitions: the fast exponential, argmax, top-k, log-softmax, the nucleus draw and the penalties.

use super::*;

#[test]
fn the_fast_exponential_is_within_a_few_ulp() {
    let mut worst = 0.0f64;
    for i in 0..=200_000 {
        let x = -87.0 * f64::from(i) / 200_000.0;
        let got = f64::from(exp_below_zero(x as f32));
        let want = f64::from(x as f32).exp();
        worst = worst.max((got - want).abs() / want);
    }
    assert!(
        worst < 4.0 * f64::from(f32::EPSILON),
        "relative error {worst}"
    );
    assert_eq!(exp_below_zero(-1000.0), 0.0);
    assert_eq!(
        exp_below_zero(f32::NEG_INFINITY),
        0.0,
        "a masked token weighs nothing"
    );
    assert!(exp_below_zero(f32::NAN) < 1e-37);
}

#[test]
fn argmax_ignores_nan_and_prefers_lowest_index_on_ties() {
    assert_eq!(argmax(&[f32::NAN, 1.0, 3.0, 3.0]), 2);
    assert_eq!(argmax(&[]), 0);
    // Rows past one search chunk: the first of tied maxima in the same chunk, in a later
    // chunk, in the tail after the last whole chunk; NaN, and only -inf.
    let plain = |row: &[f32]| {
        let best = row
            .iter()
            .copied()
            .map(key)
            .fold(f32::NEG_INFINITY, f32::max);
        row.iter().position(|&v| v == best).unwrap_or(0) as u32
    };
    for len in [63, 64, 65, 200, 151_936] {
        for (first, second) in [(0, 1), (5, 63), (64, 130), (len - 2, len - 1), (1, len - 1)] {
            let mut row: Vec<f32> = (0..len).map(|i| ((i * 7919) % 1000) as f32).collect();
            row[first.min(len - 1)] = 2000.0;
            row[second.min(len - 1)] = 2000.0;
            row[len / 2] = f32::NAN;
            assert_eq!(
                argmax(&row),
                plain(&row),
                "{len} values, maxima at {first}, {second}"
            );
        }
        let mut lowest = vec![f32::NEG_INFINITY; len];
        lowest[0] = f32::NAN;
        assert_eq!(argmax(&lowest), 1, "{len} values of -inf after a NaN");
        assert_eq!(argmax(&vec![f32::NAN; len]), 0, "{len} NaN");
    }
}

#[test]
fn top_k_matches_a_full_sort_for_small_and_large_k() {
    let row: Vec<f32> = (0..2000)
        .map(|i| ((i * 7919) % 1013) as f32 * 0.01)
        .collect();
    let mut sorted: Vec<(u32, f32)> = row
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, v))
        .collect();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    for k in [1u32, 5, 256, 257, 1500, 2000, 5000] {
        let got: Vec<(u32, f32)> = top_k(&row, k).iter().map(|c| (c.id, c.value)).collect();
        let want: Vec<(u32, f32)> = sorted.iter().take(k as usize).copied().collect();
        assert_eq!(got, want, "k = {k}");
    }
    // Signs, zeros of both signs, infinities, NaN (as -inf) and many ties.
    let mixed: Vec<f32> = (0..3000)
        .map(|i| match i % 11 {
            0 => -0.0,
            1 => 0.0,
            2 => f32::NAN,
            3 => f32::NEG_INFINITY,
            4 => f32::INFINITY,
            5 => 1.5,
            _ => ((i * 7919) % 2003) as f32 * -0.37 + 300.0,
        })
        .collect();
    let mut sorted: Vec<(u32, f32)> = mixed
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, key(v)))
        .collect();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    for k in [300u32, 1000, 2999, 3000] {
        let got: Vec<(u32, f32)> = top_k(&mixed, k).iter().map(|c| (c.id, c.value)).collect();
        let want: Vec<(u32, f32)> = sorted.iter().take(k as usize).copied().collect();
        assert_eq!(got, want, "mixed, k = {k}");
    }
}

#[test]
fn log_softmax_is_normalised() {
    let row = [1.0f32, 2.0, 3.0, -1.0];
    let lp = log_softmax(&row, &[0, 1, 2, 3], 0.7);
    let total: f32 = lp.iter().map(|v| v.exp()).sum();
    assert!((total - 1.0).abs() < 1e-5, "{total}");
    assert_eq!(log_softmax(&row, &[99], 1.0), vec![f32::NEG_INFINITY]);
}

/// The nucleus by its definition: sort, take the most likely until the mass reaches
/// `top_p`. Returns each token's weight and whether it is in.
fn nucleus_by_sorting(row: &[f32], temperature: f32, top_p: f32) -> (Vec<f64>, Vec<bool>) {
    let max = row
        .iter()
        .map(|&v| key(v))
        .fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = row
        .iter()
        .map(|&v| f64::from(exp_below_zero((key(v) - max) * (1.0 / temperature))))
        .collect();
    let as_f32: Vec<f32> = weights.iter().map(|&w| w as f32).collect();
    let total = total_weight(&as_f32);
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| key(row[b]).total_cmp(&key(row[a])).then(a.cmp(&b)));
    let (mut member, mut mass) = (vec![false; row.len()], 0.0);
    for &i in &order {
        member[i] = true;
        mass += weights[i];
        if mass >= f64::from(top_p) * total {
            break;
        }
    }
    (weights, member)
}

/// The inverse CDF with `u` over the members, in index order.
fn draw_in_index_order(weights: &[f64], member: &[bool], u: f32) -> u32 {
    let mass: f64 = weights
        .iter()
        .zip(member)
        .filter(|(_, m)| **m)
        .map(|(w, _)| w)
        .sum();
    let (target, mut cumulative, mut last) = (f64::from(u) * mass, 0.0, 0);
    for (i, &w) in weights.iter().enumerate().filter(|&(i, _)| member[i]) {
        cumulative += w;
        if w > 0.0 {
            last = i as u32;
            if cumulative > target {
                return i as u32;
            }
        }
    }
    last
}

#[test]
fn the_nucleus_draw_matches_its_definition() {
    let noise = |seed: u64, i: usize| {
        let x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
        (x.wrapping_mul(0xBF58_476D_1CE4_E5B9) >> 40) as f32 / (1u64 << 24) as f32
    };
    let flat: Vec<f32> = (0..20_000).map(|i| noise(1, i) * 2.0).collect();
    let peaked: Vec<f32> = (0..5000)
        .map(|i| {
            if i == 17 {
                30.0
            } else {
                noise(2, i) * 12.0 - 6.0
            }
        })
        .collect();
    // Ties (the cut falls inside a run of equal logits), -inf, NaN and a negative zero.
    let ties: Vec<f32> = (0..3000)
        .map(|i| match i % 7 {
            0 => 2.0,
            1 => f32::NEG_INFINITY,
            2 => f32::NAN,
            3 => -0.0,
            _ => (i % 13) as f32 * 0.25,
        })
        .collect();
    for (name, row) in [("flat", &flat), ("peaked", &peaked), ("ties", &ties)] {
        for (temperature, top_p) in [(0.8, 0.95), (1.0, 0.5), (0.3, 0.9), (1.5, 0.999)] {
            let (weights, member) = nucleus_by_sorting(row, temperature, top_p);
            for step in 0..300 {
                let u = (step as f32 + 0.5) / 300.0;
                assert_eq!(
                    sample_top_p(row, temperature, top_p, u),
                    draw_in_index_order(&weights, &member, u),
                    "{name}: temperature {temperature}, top-p {top_p}, u {u}"
                );
            }
        }
    }
    assert_eq!(sample_top_p(&[f32::NEG_INFINITY; 3], 1.0, 0.9, 0.5), 0);
}

#[test]
fn sample_full_follows_the_cdf() {
    let row = [0.0f32, 0.0, 0.0, 0.0];
    assert_eq!(sample_full(&row, 1.0, 0.0), 0);
    assert_eq!(sample_full(&row, 1.0, 0.3), 1);
    assert_eq!(sample_full(&row, 1.0, 0.99), 3);
    assert_eq!(sample_full(&[0.0, f32::NEG_INFINITY], 1.0, 0.999_999), 0);
}

#[test]
fn penalties_follow_the_openai_and_hf_definitions() {
    let history = TokenHistory {
        prompt: Arc::from(vec![0u32]),
        output: vec![1, 1, 2],
    };
    let mut row = vec![2.0f32, 2.0, -2.0, 2.0];
    let p = Penalties {
        presence: 0.5,
        frequency: 0.25,
        repetition: 2.0,
    };
    apply_penalties(&mut row, &SeenTokens::from(&history), &p);
    assert_eq!(
        row,
        vec![1.0, 2.0 / 2.0 - 0.5 - 0.5, -2.0 * 2.0 - 0.75, 2.0]
    );
}
