//! Row primitives the kernels' inner loops run: dot products (f32·f32, f32·bf16, f32·f16, one row against a few) and `y += a·x`.
//!
//! Each has a portable body that LLVM vectorizes for the baseline target (SSE2 on x86-64) and,
//! on x86-64 CPUs with AVX2, an AVX2 version picked at run time, so a library built for any
//! x86-64 still uses 256-bit vectors: intrinsics for the dot products (the auto-vectorizer
//! handles their reductions poorly; f16 needs F16C anyway), the portable body recompiled for
//! axpy. The AVX2 dot products keep the portable body's 16 partial sums, in the same order and
//! without fused multiply-add, so results do not depend on the CPU.

/// Independent partial sums per dot product: enough to keep the vector units busy and to
/// vectorize at all (a single running sum must be evaluated in order).
const LANES: usize = 16;

/// `Σ a[i]·b[i]` over the common length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { x86::dot_avx2(a, b) };
    }
    dot_with(a, b, |value| value)
}

/// `dot(rows[r], b)` for each of the `R` rows, reading `b` once; for a weight row against a
/// few tokens. Each result is bit-for-bit the one [`dot`] gives.
#[inline]
pub fn dot_rows<const R: usize>(rows: [&[f32]; R], b: &[f32]) -> [f32; R] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { x86::dot_rows_avx2(rows, b) };
    }
    rows.map(|row| dot(row, b))
}

/// `Σ a[i]·b[i]` where `b` holds bf16 bits, widened on the fly.
#[inline]
pub fn dot_bf16(a: &[f32], b: &[u16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { x86::dot_bf16_avx2(a, b) };
    }
    dot_with(a, b, crate::widen::bf16_to_f32)
}

/// `Σ a[i]·b[i]` where `b` holds f16 bits, widened on the fly. Without
/// [`has_fast_f16`] this converts in software, one element at a time: callers then do better
/// to widen whole rows with [`crate::widen::widen_into`] and use [`dot`].
#[inline]
pub fn dot_f16(a: &[f32], b: &[u16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_fast_f16() {
        // SAFETY: the CPU supports AVX2 and F16C (checked just above).
        return unsafe { x86::dot_f16_avx2_f16c(a, b) };
    }
    dot_with(a, b, f16_to_f32)
}

/// Whether [`dot_f16`] has a vectorized conversion on this CPU.
#[inline]
pub fn has_fast_f16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2() && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// `y[i] += alpha · x[i]` over the common length.
#[inline]
pub fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { x86::axpy_avx2(y, alpha, x) };
    }
    axpy_portable(y, alpha, x)
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn has_avx2() -> bool {
    // Cached by std after the first call: one relaxed load.
    std::arch::is_x86_feature_detected!("avx2")
}

/// The shared body: `LANES` partial sums, then a pairwise reduction.
#[inline(always)]
fn dot_with<T: Copy>(a: &[f32], b: &[T], widen: impl Fn(T) -> f32) -> f32 {
    let len = a.len().min(b.len());
    let (a, b) = (&a[..len], &b[..len]);
    let (a_chunks, a_tail) = a.as_chunks::<LANES>();
    let (b_chunks, b_tail) = b.as_chunks::<LANES>();
    let mut partial = [0.0f32; LANES];
    for (a, b) in a_chunks.iter().zip(b_chunks) {
        for (sum, (&a, &b)) in partial.iter_mut().zip(a.iter().zip(b)) {
            *sum += a * widen(b);
        }
    }
    finish_dot(partial, a_tail, b_tail, &widen)
}

/// Adds the elements past the last whole chunk to the first partial sums, then reduces
/// pairwise, so the last additions combine sums of similar size.
///
/// Not inlined: inlined, the reduction's lane pattern leads LLVM's SLP vectorizer to shuffle
/// the partial sums inside the main loop, which then runs at scalar speed.
#[inline(never)]
fn finish_dot<T: Copy>(
    mut partial: [f32; LANES],
    a_tail: &[f32],
    b_tail: &[T],
    widen: impl Fn(T) -> f32,
) -> f32 {
    for (lane, (&a, &b)) in a_tail.iter().zip(b_tail).enumerate() {
        partial[lane] += a * widen(b);
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for lane in 0..width {
            partial[lane] += partial[lane + width];
        }
    }
    partial[0]
}

#[inline(always)]
fn axpy_portable(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 versions of the portable bodies. Dot products keep lanes 0..8 of the partial sums
    //! in `low` and lanes 8..16 in `high`, updated in the portable body's order, then finish
    //! with the same scalar tail and reduction.

    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm256_add_ps, _mm256_castsi256_ps, _mm256_cvtepu16_epi32,
        _mm256_cvtph_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps, _mm256_slli_epi32,
        _mm256_storeu_ps,
    };

    use super::{LANES, finish_dot};

    /// The dot product loop; `$load` turns `$ptr`, the start of 8 elements of `b`, into 8 f32s.
    macro_rules! dot_avx2 {
        ($a:expr, $b:expr, |$ptr:ident| $load:expr, $widen:expr) => {{
            let len = $a.len().min($b.len());
            let (a_chunks, a_tail) = $a[..len].as_chunks::<LANES>();
            let (b_chunks, b_tail) = $b[..len].as_chunks::<LANES>();
            let (mut low, mut high) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for (a, b) in a_chunks.iter().zip(b_chunks) {
                // SAFETY: every load reads 8 elements inside one 16-element chunk, unaligned.
                unsafe {
                    let b_low = {
                        let $ptr = b.as_ptr();
                        $load
                    };
                    let b_high = {
                        let $ptr = b.as_ptr().add(8);
                        $load
                    };
                    let a_low = _mm256_loadu_ps(a.as_ptr());
                    let a_high = _mm256_loadu_ps(a.as_ptr().add(8));
                    low = _mm256_add_ps(low, _mm256_mul_ps(a_low, b_low));
                    high = _mm256_add_ps(high, _mm256_mul_ps(a_high, b_high));
                }
            }
            let mut partial = [0.0f32; LANES];
            // SAFETY: `partial` has room for two 8-lane stores.
            unsafe {
                _mm256_storeu_ps(partial.as_mut_ptr(), low);
                _mm256_storeu_ps(partial.as_mut_ptr().add(8), high);
            }
            finish_dot(partial, a_tail, b_tail, $widen)
        }};
    }

    #[target_feature(enable = "avx2")]
    pub fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        dot_avx2!(a, b, |ptr| _mm256_loadu_ps(ptr), |value| value)
    }

    #[target_feature(enable = "avx2")]
    pub fn dot_bf16_avx2(a: &[f32], b: &[u16]) -> f32 {
        dot_avx2!(
            a,
            b,
            |ptr| {
                let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(ptr.cast::<__m128i>()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
            },
            crate::widen::bf16_to_f32
        )
    }

    #[target_feature(enable = "avx2,f16c")]
    pub fn dot_f16_avx2_f16c(a: &[f32], b: &[u16]) -> f32 {
        dot_avx2!(
            a,
            b,
            |ptr| _mm256_cvtph_ps(_mm_loadu_si128(ptr.cast::<__m128i>())),
            super::f16_to_f32
        )
    }

    /// [`super::dot_rows`]: the loop of `dot_avx2` for `R` rows at once, loading `b` once.
    #[target_feature(enable = "avx2")]
    pub fn dot_rows_avx2<const R: usize>(rows: [&[f32]; R], b: &[f32]) -> [f32; R] {
        let len = rows.iter().fold(b.len(), |len, row| len.min(row.len()));
        let whole = len / LANES * LANES;
        let (mut low, mut high) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
        for base in (0..whole).step_by(LANES) {
            // SAFETY: `base + LANES <= len`, and every row and `b` hold at least `len` elements.
            unsafe {
                let b_low = _mm256_loadu_ps(b.as_ptr().add(base));
                let b_high = _mm256_loadu_ps(b.as_ptr().add(base + 8));
                for r in 0..R {
                    let a = rows[r].as_ptr().add(base);
                    low[r] = _mm256_add_ps(low[r], _mm256_mul_ps(_mm256_loadu_ps(a), b_low));
                    high[r] =
                        _mm256_add_ps(high[r], _mm256_mul_ps(_mm256_loadu_ps(a.add(8)), b_high));
                }
            }
        }
        std::array::from_fn(|r| {
            let mut partial = [0.0f32; LANES];
            // SAFETY: `partial` has room for two 8-lane stores.
            unsafe {
                _mm256_storeu_ps(partial.as_mut_ptr(), low[r]);
                _mm256_storeu_ps(partial.as_mut_ptr().add(8), high[r]);
            }
            finish_dot(partial, &rows[r][whole..len], &b[whole..len], |value| value)
        })
    }

    #[target_feature(enable = "avx2")]
    pub fn axpy_avx2(y: &mut [f32], alpha: f32, x: &[f32]) {
        super::axpy_portable(y, alpha, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn dispatched_and_portable_results_are_identical() {
        for len in [0, 1, 15, 16, 17, 100, 1027] {
            let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
            let b_bf16: Vec<u16> = b.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            let b_f16: Vec<u16> = b.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
            assert_eq!(
                dot_f16(&a, &b_f16),
                dot_with(&a, &b_f16, f16_to_f32),
                "{len}"
            );
            assert_eq!(dot(&a, &b), dot_with(&a, &b, |v| v), "{len}");
            assert_eq!(
                dot_bf16(&a, &b_bf16),
                dot_with(&a, &b_bf16, crate::widen::bf16_to_f32),
                "{len}"
            );
            let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| f64::from(x * y)).sum();
            assert!((f64::from(dot(&a, &b)) - exact).abs() < 1e-4, "{len}");

            let c: Vec<f32> = a.iter().map(|v| v * 0.5 - 0.25).collect();
            assert_eq!(dot_rows([&a, &c], &b), [dot(&a, &b), dot(&c, &b)], "{len}");
            let (mut y, mut y_portable) = (b.clone(), b.clone());
            axpy(&mut y, 0.5, &a);
            axpy_portable(&mut y_portable, 0.5, &a);
            assert_eq!(y, y_portable);
        }
    }

    #[test]
    fn integer_sums_are_exact() {
        for len in [0usize, 1, 15, 16, 17, 100] {
            let a: Vec<f32> = (0..len).map(|i| i as f32).collect();
            let expected = (len * len.saturating_sub(1)) as f32;
            assert_eq!(dot(&a, &vec![2.0; len]), expected, "{len}");
        }
    }
}
