//! Helpers shared by the unit tests: deterministic inputs and tolerance checks.

/// A deterministic pseudo-random value in [-1, 1) for index `i` of stream `seed` (splitmix64).
pub fn noise(seed: u64, i: usize) -> f32 {
    let mut z = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(i as u64)
        .wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^= z >> 31;
    z = z.wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 29;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// `inv_freq` for `head_dim` and `theta`, as `LlamaRotaryEmbedding` computes it (the model
/// glue passes this table to `rotary`).
pub fn inverse_frequencies(head_dim: usize, theta: f32) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
        .collect()
}

/// Table params of `rotary` for `head_dim` and `theta`: `head_dim`, then the f32 bits.
pub fn rotary_params(head_dim: usize, theta: f32) -> Vec<i64> {
    std::iter::once(head_dim as i64)
        .chain(
            inverse_frequencies(head_dim, theta)
                .into_iter()
                .map(|f| i64::from(f.to_bits())),
        )
        .collect()
}

/// Asserts `|got - expected| <= tolerance * max(1, |expected|)` element by element.
pub fn assert_close(got: &[f32], expected: &[f64], tolerance: f64, what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths");
    for (i, (&got, &want)) in got.iter().zip(expected).enumerate() {
        let bound = tolerance * want.abs().max(1.0);
        assert!(
            (f64::from(got) - want).abs() <= bound,
            "{what}: element {i} is {got}, expected {want} (tolerance {bound:e})"
        );
    }
}
