//! SmolLM2-135M-Instruct as `cargo xtask fetch-model` converts it: the host opens the folder, and the weights match `transformers`' dequantized, un-permuted GGUF.

use plughost::model::{Checkpoint, DType};

use crate::common::smollm2;

const LAYERS: u64 = 30;

/// Every tensor of HF `LlamaForCausalLM` with tied embeddings, as (name, shape).
fn llama_tensors() -> Vec<(String, Vec<u64>)> {
    let (hidden, intermediate, vocab, kv) = (576, 1536, 49152, 3 * 64);
    let mut tensors = vec![
        ("model.embed_tokens.weight".to_string(), vec![vocab, hidden]),
        ("model.norm.weight".to_string(), vec![hidden]),
    ];
    for layer in 0..LAYERS {
        let leaves: [(&str, Vec<u64>); 9] = [
            ("input_layernorm", vec![hidden]),
            ("self_attn.q_proj", vec![hidden, hidden]),
            ("self_attn.k_proj", vec![kv, hidden]),
            ("self_attn.v_proj", vec![kv, hidden]),
            ("self_attn.o_proj", vec![hidden, hidden]),
            ("post_attention_layernorm", vec![hidden]),
            ("mlp.gate_proj", vec![intermediate, hidden]),
            ("mlp.up_proj", vec![intermediate, hidden]),
            ("mlp.down_proj", vec![hidden, intermediate]),
        ];
        for (leaf, shape) in leaves {
            tensors.push((format!("model.layers.{layer}.{leaf}.weight"), shape));
        }
    }
    tensors
}

#[test]
fn the_folder_opens_as_a_tied_llama_checkpoint() {
    let checkpoint = Checkpoint::open(smollm2::model_dir()).expect("checkpoint opens");
    let expected = llama_tensors();
    checkpoint.check(&expected).expect("every Llama tensor");
    assert_eq!(
        checkpoint.num_tensors(),
        expected.len(),
        "no lm_head: embeddings are tied"
    );
    let config = checkpoint.config();
    assert_eq!(config.architectures, ["LlamaForCausalLM"]);
    assert_eq!(config.max_position_embeddings, 8192);
    assert_eq!(config.eos_token_id, [2]);
    assert_eq!(config.bos_token_id, Some(1));
    let json: serde_json::Value = serde_json::from_str(checkpoint.config_json()).expect("json");
    let fields = [
        ("hidden_size", 576.0),
        ("intermediate_size", 1536.0),
        ("num_hidden_layers", 30.0),
        ("num_attention_heads", 9.0),
        ("num_key_value_heads", 3.0),
        ("head_dim", 64.0),
        ("vocab_size", 49152.0),
        ("rms_norm_eps", 1e-5),
        ("rope_theta", 100000.0),
    ];
    for (key, value) in fields {
        assert_eq!(json[key].as_f64(), Some(value), "{key}");
    }
    assert_eq!(json["tie_word_embeddings"], true);
}

#[test]
fn weights_match_the_reference_probes() {
    let reference = smollm2::reference();
    let checkpoint = Checkpoint::open(smollm2::model_dir()).expect("checkpoint opens");
    for probe in &reference.weight_probes {
        let view = checkpoint.tensor(&probe.name).expect(&probe.name);
        assert_eq!(
            view.dtype(),
            DType::F32,
            "{}: fetch-model writes f32 by default",
            probe.name
        );
        assert_eq!(view.shape(), probe.shape.as_slice(), "{}", probe.name);
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let cols = *probe.shape.last().expect("shape") as usize;
        for row in &probe.rows {
            let values = &values[row.row * cols..(row.row + 1) * cols];
            let case = format!("{} row {}", probe.name, row.row);
            assert_eq!(&values[..row.first.len()], row.first.as_slice(), "{case}");
            let sum: f64 = values.iter().map(|&v| f64::from(v)).sum();
            assert!(
                (sum - row.sum).abs() <= 1e-9 * row.sum.abs().max(1.0),
                "{case}: sum {sum}, reference {}",
                row.sum
            );
        }
    }
}
