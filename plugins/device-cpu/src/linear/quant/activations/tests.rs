//! The activation quantization's tests: blocks, every level against the portable digits, the tiles' layout, and spans against one pass.

use super::*;

#[test]
fn blocks_scale_to_their_largest_magnitude() {
    let mut x: Vec<f32> = (0..64).map(|i| i as f32 - 20.0).collect();
    x[40] = f32::NAN;
    x[3] = -16.9;
    let mut rows = Q8Rows::default();
    rows.quantize(&x, 64, 32, ActivationDigits::Two);
    let row = rows.row(0);
    let d = 20.0f32 / 127.0;
    assert_eq!(row.scales, &[d / 256.0, 43.0 / 127.0 / 256.0]);
    assert_eq!((row.high[0], row.low[0]), (-127, 0));
    assert_eq!(row.high[63], 127);
    assert_eq!((row.high[40], row.low[40]), (0, 0));
    // -16.9 / d = -107.3...: the first digit -107, the second the residual in steps of
    // d / 256.
    let residual = -16.9f32 - d * -107.0;
    assert_eq!(row.high[3], -107);
    assert_eq!(row.low[3], (residual * (256.0 / d)).round() as i8);
    assert!(f32::from(row.low[3]).abs() <= 128.0);
    let sum: i32 = (0..16)
        .map(|k| 256 * i32::from(row.high[k]) + i32::from(row.low[k]))
        .sum();
    assert_eq!(row.sums[0], sum);
    // A zero block has scale 0 and values 0, never a division by zero.
    rows.quantize(&[0.0; 32], 32, 32, ActivationDigits::Two);
    let row = rows.row(0);
    assert_eq!((row.scales[0], row.high[5], row.low[5]), (0.0, 0, 0));
}

#[test]
fn every_level_quantizes_to_the_portable_digits() {
    // Ordinary values, exact ties of the rounding, NaN and infinities, zeros of both
    // signs, subnormals and a zero block, in rows of both block sizes.
    let mut x: Vec<f32> = (0..1536)
        .map(|i| ((i * 7919) % 2001) as f32 / 997.0 - 1.0)
        .collect();
    x[5] = f32::NAN;
    x[70] = f32::INFINITY;
    x[300] = f32::NEG_INFINITY;
    x[301] = -0.0;
    x[400] = f32::MIN_POSITIVE / 8.0;
    x[512..544].fill(0.0);
    // 127 · k / 254 for odd k: halfway between two digits of the block's step.
    for (k, v) in x[600..632].iter_mut().enumerate() {
        *v = (2 * k + 1) as f32 / 254.0 * if k == 31 { 2.0 } else { 1.0 };
    }
    for block in [32, 256] {
        for digits in [ActivationDigits::One, ActivationDigits::Two] {
            let mut portable = Q8Rows::default();
            portable.quantize(&x, 768, block, digits);
            for isa in Isa::every() {
                let mut rows = Q8Rows::default();
                rows.quantize_on(isa, &x, 768, block, digits);
                for t in 0..2 {
                    let (ours, theirs) = (rows.row(t), portable.row(t));
                    let level = isa.level();
                    assert_eq!(ours.high, theirs.high, "{level} {block} {digits:?}");
                    assert_eq!(ours.low, theirs.low, "{level} {block} {digits:?}");
                    assert_eq!(ours.sums, theirs.sums, "{level} {block} {digits:?}");
                    let joined: Vec<i32> = theirs
                        .high
                        .chunks(SUM_SPAN)
                        .zip(theirs.low.chunks(SUM_SPAN))
                        .map(|(h, l)| {
                            h.iter()
                                .zip(l)
                                .map(|(&h, &l)| 256 * i32::from(h) + i32::from(l))
                                .sum()
                        })
                        .collect();
                    assert_eq!(
                        theirs.sums, joined,
                        "{block} {digits:?}: sums of 256 q + q'"
                    );
                    let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(ours.scales), bits(theirs.scales), "{level}");
                }
            }
        }
    }
}

#[test]
fn tiles_hold_four_values_of_each_token_side_by_side() {
    let (tokens, inner, width) = (5, 64, 2);
    let x: Vec<f32> = (0..tokens * inner)
        .map(|i| (i % 97) as f32 - 48.0)
        .collect();
    let mut rows = Q8Rows::default();
    rows.quantize(&x, inner, 32, ActivationDigits::Two);
    let mut tiles = Q8Tiles::default();
    tiles.regroup(&rows, tokens, width);
    for first in (0..tokens).step_by(width) {
        let tile = tiles.tile(first);
        let m = tile.tokens;
        assert_eq!(m, width.min(tokens - first));
        for t in 0..m {
            let row = rows.row(first + t);
            for b in 0..2 {
                for q in 0..8 {
                    let at = (b * 8 + q) * 8 * m + 4 * t;
                    let from = 32 * b + 4 * q..32 * b + 4 * q + 4;
                    assert_eq!(tile.digits[at..at + 4], row.high[from.clone()]);
                    assert_eq!(tile.digits[at + 4 * m..at + 4 * m + 4], row.low[from]);
                }
                assert_eq!(tile.scales[b * m + t], row.scales[b]);
                let sum = row.sums[2 * b] + row.sums[2 * b + 1];
                assert_eq!(tile.sums[b * m + t], sum);
            }
        }
    }
}

#[test]
fn k_tiles_hold_each_sub_blocks_sums_in_pairs() {
    let (tokens, inner) = (3, 512);
    let x: Vec<f32> = (0..tokens * inner)
        .map(|i| ((i * 37) % 101) as f32 - 50.0)
        .collect();
    let mut rows = Q8Rows::default();
    rows.quantize(&x, inner, 256, ActivationDigits::Two);
    let mut tiles = Q8Tiles::default();
    tiles.regroup(&rows, tokens, 2);
    let halves = |word: i32| (word as i16 as i32, word >> 16);
    for first in [0, 2] {
        let tile = tiles.tile(first);
        for t in 0..tile.tokens {
            let row = rows.row(first + t);
            for b in 0..2 {
                let words = &tile.pairs[(b * tile.tokens + t) * K_PAIRS..][..K_PAIRS];
                for (digit, digits) in [row.high, row.low].into_iter().enumerate() {
                    let sum = |from: usize, len: usize| -> i32 {
                        let at = 256 * b + from;
                        digits[at..at + len].iter().map(|&q| i32::from(q)).sum()
                    };
                    // Q4_K's (1, 3): sub-blocks of 32.
                    assert_eq!(halves(words[4 * digit + 1]), (sum(32, 32), sum(96, 32)));
                    // Q6_K's (14, 15): sub-blocks of 16.
                    let word = words[8 + 8 * digit + 7];
                    assert_eq!(halves(word), (sum(224, 16), sum(240, 16)));
                }
            }
        }
    }
}
#[test]
fn spans_filled_in_any_order_hold_what_one_pass_does() {
    let inner = 512;
    for (tokens, width, per_span) in [(1, 1, 1), (5, 1, 2), (16, 4, 4), (37, 4, 8), (37, 16, 16)] {
        let x: Vec<f32> = (0..tokens * inner)
            .map(|i| ((i * 7919) % 2003) as f32 / 1001.0 - 1.0)
            .collect();
        for (block, digits) in [(32, ActivationDigits::Two), (256, ActivationDigits::One)] {
            let case = format!("{tokens} tokens, width {width}, spans of {per_span}, {block}");
            let (mut rows, mut tiles) = (Q8Rows::default(), Q8Tiles::default());
            rows.quantize(&x, inner, block, digits);
            tiles.regroup(&rows, tokens, width);
            // Storage left from a larger launch, and the spans filled last to first.
            let (mut span_rows, mut span_tiles) = (Q8Rows::default(), Q8Tiles::default());
            let wider = vec![3.0; (tokens + 9) * inner];
            span_rows.quantize(&wider, inner, block, ActivationDigits::Two);
            span_tiles.regroup(&span_rows, tokens + 9, width);
            let shape = (tokens, inner, block, digits);
            let tiled = Some((&mut span_tiles, width));
            let mut spans = spans(&mut span_rows, tiled, shape, per_span);
            assert_eq!(spans.len(), tokens.div_ceil(per_span), "{case}");
            for span in spans.iter_mut().rev() {
                span.fill_on(Isa::portable(), &x, digits);
            }
            drop(spans);
            for t in 0..tokens {
                let (ours, theirs) = (span_rows.row(t), rows.row(t));
                assert_eq!((ours.high, ours.low), (theirs.high, theirs.low), "{case}");
                assert_eq!(
                    (ours.scales, ours.sums),
                    (theirs.scales, theirs.sums),
                    "{case}"
                );
            }
            for first in (0..tokens).step_by(width) {
                let (ours, theirs) = (span_tiles.tile(first), tiles.tile(first));
                assert_eq!(
                    (ours.digits, ours.scales),
                    (theirs.digits, theirs.scales),
                    "{case}"
                );
                assert_eq!(
                    (ours.sums, ours.pairs),
                    (theirs.sums, theirs.pairs),
                    "{case}"
                );
            }
        }
    }
}

#[test]
fn span_sums_are_the_digits_sums_at_the_extremes() {
    let runs: [[i8; SUM_SPAN]; 5] = [
        [127; SUM_SPAN],
        [-127; SUM_SPAN],
        [0; SUM_SPAN],
        std::array::from_fn(|i| if i % 2 == 0 { 127 } else { -127 }),
        std::array::from_fn(|i| (i as i8 - 8) * 15),
    ];
    for run in runs {
        let plain: i32 = run.iter().map(|&q| i32::from(q)).sum();
        assert_eq!(span_sum(&run), plain, "{run:?}");
    }
}
