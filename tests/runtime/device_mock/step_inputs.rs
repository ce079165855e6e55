//! The inputs a step derives on the device: positions and slot mappings with their real values, KV writes rounded into a bf16 cache, and a block table too short for a sequence.

use plughost::device::{ArgTag, DType, TensorArg, status};

use super::{
    arg, download_i32, expect_call_error, launch, open_mock, upload, upload_f32, upload_i32,
};

#[test]
fn device_maintained_step_inputs_have_the_real_values() {
    struct Case {
        description: &'static str,
        seq_lens_before: Vec<i32>,
        query_start: Vec<i32>,
        num_tokens: usize,
        block_table: Vec<i32>,
        blocks_per_seq: usize,
        block_size: i64,
        seq_lens_after: Vec<i32>,
        positions: Vec<i32>,
        slot_mapping: Vec<i32>,
    }
    let cases = [
        Case {
            description: "a 2-token prefill chunk, a decode and a padding row",
            seq_lens_before: vec![3, 5],
            query_start: vec![0, 2, 3],
            num_tokens: 4,
            block_table: vec![7, 2, 1, 9],
            blocks_per_seq: 2,
            block_size: 4,
            seq_lens_after: vec![5, 6],
            positions: vec![3, 4, 5, 0],
            slot_mapping: vec![7 * 4 + 3, 2 * 4, 9 * 4 + 1, -1],
        },
        Case {
            description: "two decodes, one crossing into a new block",
            seq_lens_before: vec![1, 8],
            query_start: vec![0, 1, 2],
            num_tokens: 2,
            block_table: vec![0, 3, 0, 5, 6, 4],
            blocks_per_seq: 3,
            block_size: 4,
            seq_lens_after: vec![2, 9],
            positions: vec![1, 8],
            slot_mapping: vec![1, 4 * 4],
        },
    ];
    for case in cases {
        let mut device = open_mock("");
        let num_seqs = case.seq_lens_before.len() as u64;
        let num_tokens = case.num_tokens as u64;
        let seq_lens = upload_i32(&mut device, &case.seq_lens_before);
        let query_start = upload_i32(&mut device, &case.query_start);
        let block_table = upload_i32(&mut device, &case.block_table);
        let positions = device.alloc(num_tokens * 4).unwrap();
        let slot_mapping = device.alloc(num_tokens * 4).unwrap();
        let query_start_arg = arg(query_start, DType::I32, &[num_seqs + 1], ArgTag::Input);
        let block_table_arg = arg(
            block_table,
            DType::I32,
            &[num_seqs, case.blocks_per_seq as u64],
            ArgTag::Input,
        );

        launch(
            &mut device,
            "advance_seq_lens",
            &[
                arg(seq_lens, DType::I32, &[num_seqs], ArgTag::Inout),
                query_start_arg,
            ],
            &[],
        );
        let seq_lens_arg = arg(seq_lens, DType::I32, &[num_seqs], ArgTag::Input);
        launch(
            &mut device,
            "derive_positions",
            &[
                seq_lens_arg,
                query_start_arg,
                arg(positions, DType::I32, &[num_tokens], ArgTag::Output),
            ],
            &[],
        );
        launch(
            &mut device,
            "derive_slot_mapping",
            &[
                block_table_arg,
                seq_lens_arg,
                query_start_arg,
                arg(slot_mapping, DType::I32, &[num_tokens], ArgTag::Output),
            ],
            &[case.block_size],
        );

        let description = case.description;
        let seqs = num_seqs as usize;
        assert_eq!(
            download_i32(&mut device, seq_lens, seqs),
            case.seq_lens_after,
            "{description}"
        );
        assert_eq!(
            download_i32(&mut device, positions, case.num_tokens),
            case.positions,
            "{description}"
        );
        assert_eq!(
            download_i32(&mut device, slot_mapping, case.num_tokens),
            case.slot_mapping,
            "{description}"
        );
    }
}

#[test]
fn kv_write_rounds_into_a_bf16_cache_and_mixed_caches_are_refused() {
    use ArgTag::{Input, Output, OutputExisting};
    let mut device = open_mock("");
    // Two blocks of one KV head of 2 slots of width 4; the row goes to slot 3.
    let row = [1.0f32, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.5];
    let k = upload_f32(&mut device, &row);
    let v = upload_f32(&mut device, &row.map(|x| -x));
    let cache_bytes = 2 * 2 * 4 * 2;
    let key_cache = upload(&mut device, &vec![0; cache_bytes]);
    let value_cache = upload(&mut device, &vec![0; cache_bytes]);
    let slots = upload_i32(&mut device, &[3]);
    let cache_shape = [2, 1, 2, 4];
    // The launch's arguments with `value_cache` as given.
    let kv_write_args = |value_cache: TensorArg| {
        [
            arg(k, DType::F32, &[1, 4], Input),
            arg(v, DType::F32, &[1, 4], Input),
            arg(key_cache, DType::BF16, &cache_shape, OutputExisting),
            value_cache,
            arg(slots, DType::I32, &[1], Input),
        ]
    };
    let bf16_values = arg(value_cache, DType::BF16, &cache_shape, OutputExisting);
    launch(&mut device, "kv_write", &kv_write_args(bf16_values), &[]);
    let mut bytes = vec![0; cache_bytes];
    device.read(key_cache, 0, &mut bytes).unwrap();
    let bits: Vec<u16> = bytes
        .chunks_exact(2)
        .map(|pair| u16::from_le_bytes([pair[0], pair[1]]))
        .collect();
    // 1 + 2^-8 and 1 + 3 * 2^-8 lie halfway between bf16 values: ties go to the even one.
    assert_eq!(&bits[12..], &[0x3f80, 0x3f80, 0x3f82, 0xc020]);
    assert!(bits[..12].iter().all(|&b| b == 0), "{bits:?}");
    // A mixed pair of caches is refused before the device runs anything.
    let f32_cache = upload(&mut device, &vec![0; 2 * cache_bytes]);
    let callable = device.callable_index("kv_write").unwrap();
    let f32_values = arg(f32_cache, DType::F32, &cache_shape, Output);
    let (_, message) = expect_call_error(device.launch(callable, &kv_write_args(f32_values), &[]));
    assert!(message.contains("must have the same dtype"), "{message}");
}

#[test]
fn a_short_block_table_fails_the_slot_mapping() {
    let mut device = open_mock("");
    let seq_lens = upload_i32(&mut device, &[9]);
    let query_start = upload_i32(&mut device, &[0, 1]);
    let block_table = upload_i32(&mut device, &[3, 4]);
    let slot_mapping = device.alloc(4).unwrap();
    let callable = device.callable_index("derive_slot_mapping").unwrap();
    let (code, message) = expect_call_error(device.launch(
        callable,
        &[
            arg(block_table, DType::I32, &[1, 2], ArgTag::Input),
            arg(seq_lens, DType::I32, &[1], ArgTag::Input),
            arg(query_start, DType::I32, &[2], ArgTag::Input),
            arg(slot_mapping, DType::I32, &[1], ArgTag::Output),
        ],
        &[4],
    ));
    assert_eq!(code, status::LAUNCH_FAILED);
    assert_eq!(
        message,
        "launch `derive_slot_mapping`: sequence 0: position 8 needs block 2, \
         but the block table has 2 columns"
    );
}
