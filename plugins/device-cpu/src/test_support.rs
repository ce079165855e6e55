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
