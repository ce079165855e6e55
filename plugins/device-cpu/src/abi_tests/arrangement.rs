//! Weights the linears keep in the device's own arrangement: read, gathered and overwritten as the host wrote them, and refused rather than misread when an arrangement stops part-way.

use half::bf16;
use plughost_device_abi::{DType, status};

use super::device::{Device, IN, OUT, levels_and_products, random, to_bytes};
use crate::isa::IsaLevel;
use crate::linear::Bf16Products;
use crate::linear::faults;

/// A tied embedding: the output projection (a `linear` over the table) may keep the table in
/// the device's own arrangement; gathers from it, later projections and the host's reads and
/// writes see the table as written. At every level and with each bf16 product: the panels of
/// `avx2` and up, and the rows of `vdpbf16ps`, which meets the activations rounded to bf16.
#[test]
fn a_table_the_linears_rearrange_reads_and_gathers_as_written() {
    for ((_, products), level_config) in levels_and_products() {
        let device = Device::open(&format!("{level_config},threads=2")).unwrap();
        let seen = |x: f32| match products {
            Bf16Products::Bf16 => bf16::from_f32(x).to_f32(),
            Bf16Products::F32 => x,
        };
        check_tied_table(&device, seen, &level_config);
    }
}

/// The checks of the test above on one device, whose linears multiply the bf16 table by the
/// activations as `seen` rounds them.
fn check_tied_table(device: &Device, seen: impl Fn(f32) -> f32, what: &str) {
    // 64 rows fill two panels of 32; 40 columns are no multiple of any vector width.
    let (rows, width, tokens) = (64usize, 40usize, 3usize);
    let values = random(31, rows * width, 1.0);
    let bits: Vec<u16> = values
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect();
    let table_bytes = to_bytes(&bits, u16::to_le_bytes);
    let embedding = device.upload(DType::BF16, &[rows as u64, width as u64], &table_bytes);
    let x_values = random(32, tokens * width, 1.0);
    let x_seen: Vec<f64> = x_values.iter().map(|&x| f64::from(seen(x))).collect();
    let x = device.f32s(&[tokens as u64, width as u64], &x_values);
    let ids = device.i32s(&[tokens as u64], &[63, 0, 33]);
    let hidden = device.zeros(&[tokens as u64, width as u64]);
    let logits = device.zeros(&[tokens as u64, rows as u64]);
    let gather = || {
        device
            .launch(
                "embedding_gather",
                &[ids.arg(IN), embedding.arg(IN), hidden.arg(OUT)],
                &[],
            )
            .unwrap();
        device.read_f32(&hidden)
    };
    let project = || {
        device
            .launch(
                "linear",
                &[x.arg(IN), embedding.arg(IN), logits.arg(OUT)],
                &[],
            )
            .unwrap();
        device.read_f32(&logits)
    };
    let exact: Vec<f32> = bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
    let expected_rows: Vec<f32> = [63, 0, 33]
        .iter()
        .flat_map(|&r| exact[r * width..(r + 1) * width].to_vec())
        .collect();
    // Each product rounds at most once in f32, and `width` f32 additions in any order are off
    // by at most `width · ε` of the sum of the magnitudes.
    let check_row = |got: f32, t: usize, weights: &[f32], case: &str| {
        let terms = (0..width).map(|k| x_seen[t * width + k] * f64::from(weights[k]));
        let (want, magnitude) = terms.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
        let bound = width as f64 * f64::from(f32::EPSILON) * magnitude;
        assert!(
            (f64::from(got) - want).abs() <= bound,
            "{what}: {case}: {got} vs {want} (bound {bound:e})"
        );
    };

    assert_eq!(gather(), expected_rows, "{what}");
    let first = project();
    for (i, &got) in first.iter().enumerate() {
        let (t, n) = (i / rows, i % rows);
        check_row(
            got,
            t,
            &exact[n * width..(n + 1) * width],
            &format!("logit {i}"),
        );
    }
    assert_eq!(
        gather(),
        expected_rows,
        "{what}: gathered after the projection"
    );
    assert_eq!(project(), first, "{what}: a second projection");
    assert_eq!(
        device.read_bytes(&embedding, 2),
        table_bytes,
        "{what}: the host's read"
    );
    assert_eq!(
        project(),
        first,
        "{what}: a projection after the host's read"
    );

    // A host write into part of the table lands on the row it names.
    let row_five: Vec<u16> = vec![bf16::from_f32(0.5).to_bits(); width];
    let bytes = to_bytes(&row_five, u16::to_le_bytes);
    device
        .write_at(&embedding, (5 * width * 2) as u64, &bytes)
        .unwrap();
    let after = project();
    for t in 0..tokens {
        check_row(
            after[t * rows + 5],
            t,
            &vec![0.5; width],
            "row 5 after the write",
        );
        assert_eq!(after[t * rows + 6], first[t * rows + 6], "{what}");
    }
}

/// Arms the arrangement fault on this thread for as long as it lives.
struct ArmedFault;

impl ArmedFault {
    fn at_task(task: usize) -> ArmedFault {
        faults::panic_at_task(Some(task));
        ArmedFault
    }
}

impl Drop for ArmedFault {
    fn drop(&mut self) {
        faults::panic_at_task(None);
    }
}

/// A panic part-way through arranging a weight in panels leaves it half in each order: every
/// later launch and read of it fails, rather than computing with it, until the host writes it
/// whole again; then it computes what a device that never failed computes. At every level with
/// panels (`avx2` and up, f32 products); one thread, so every task of the arrangement runs on
/// this thread, where the fault is armed.
#[test]
fn a_weight_whose_arrangement_panics_is_refused_until_written_whole() {
    // 64 rows are two panels of 32: the arrangement's second task panics after the first
    // panel is arranged.
    let (rows, width) = (64usize, 40usize);
    let bits: Vec<u16> = random(35, rows * width, 1.0)
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect();
    let bytes = to_bytes(&bits, u16::to_le_bytes);
    let x_values = random(36, width, 1.0);
    let mut levels = 0;
    for ((isa, products), level_config) in levels_and_products() {
        if products != Bf16Products::F32 || !isa.has(IsaLevel::Avx2) {
            continue;
        }
        levels += 1;
        let config = format!("{level_config},threads=1");
        let device = Device::open(&config).unwrap();
        let weights = device.upload(DType::BF16, &[rows as u64, width as u64], &bytes);
        let x = device.f32s(&[1, width as u64], &x_values);
        let out = device.zeros(&[1, rows as u64]);
        let project = || device.launch("linear", &[x.arg(IN), weights.arg(IN), out.arg(OUT)], &[]);

        let failed = {
            let _armed = ArmedFault::at_task(1);
            project()
        };
        let (code, message) = failed.unwrap_err();
        assert_eq!(code, status::INTERNAL, "{config}: {message}");
        assert!(
            message.contains("arrangement task 1 panicked"),
            "{config}: {message}"
        );

        let (code, message) = project().unwrap_err();
        assert_eq!(code, status::INTERNAL, "{config}: {message}");
        assert!(
            message.starts_with("launch `linear`: argument `w` (#1): buffer ")
                && message.contains(" is poisoned"),
            "{config}: {message}"
        );
        let (code, message) = device.try_read_bytes(&weights, 2).unwrap_err();
        assert_eq!(code, status::INTERNAL, "{config}: {message}");
        assert!(message.contains(" is poisoned"), "{config}: {message}");
        let (code, message) = device
            .write_at(&weights, 0, &bytes[..2 * width])
            .unwrap_err();
        assert_eq!(code, status::INTERNAL, "{config}: {message}");
        assert_eq!(device.stats().launches, 0, "{config}");

        device.write_at(&weights, 0, &bytes).unwrap();
        project().unwrap();
        let healthy = Device::open(&config).unwrap();
        let healthy_weights = healthy.upload(DType::BF16, &[rows as u64, width as u64], &bytes);
        let healthy_x = healthy.f32s(&[1, width as u64], &x_values);
        let healthy_out = healthy.zeros(&[1, rows as u64]);
        healthy
            .launch(
                "linear",
                &[
                    healthy_x.arg(IN),
                    healthy_weights.arg(IN),
                    healthy_out.arg(OUT),
                ],
                &[],
            )
            .unwrap();
        assert_eq!(
            device.read_widened_bits(&out),
            healthy.read_widened_bits(&healthy_out),
            "{config}"
        );
        assert_eq!(device.read_bytes(&weights, 2), bytes, "{config}");
    }
    #[cfg(target_arch = "x86_64")]
    if crate::isa::Isa::detect().has(IsaLevel::Avx2) {
        assert!(levels > 0, "no level arranges weights in panels");
    }
    let _ = levels;
}
