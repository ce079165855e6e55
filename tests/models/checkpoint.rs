//! Opening checkpoint folders: the committed tiny fixtures, and broken copies of them that must fail clearly.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use plughost::model::{Checkpoint, DType, ModelConfig, ModelError};
use safetensors::{Dtype, SafeTensors};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// A scratch folder removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    /// A copy of a fixture's `config.json` and `model.safetensors`.
    fn copy_of(fixture_name: &str) -> Scratch {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "plughost-model-checkpoint-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).expect("create scratch folder");
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture(fixture_name).join(file), dir.join(file)).expect("copy fixture");
        }
        Scratch(dir)
    }

    fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// Every tensor of a fixture as (name, shape): what a model built for it needs.
fn expected_tensors(fixture_name: &str) -> Vec<(String, Vec<u64>)> {
    let checkpoint = Checkpoint::open(fixture(fixture_name)).expect("fixture opens");
    checkpoint
        .tensor_names()
        .into_iter()
        .map(|name| {
            let view = checkpoint.tensor(name).expect("fixture tensor");
            (name.to_string(), view.shape().to_vec())
        })
        .collect()
}

/// Rewrites `model.safetensors` in `dir` after `edit` changed its list of
/// (name, dtype, shape, bytes).
fn rewrite_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read weights");
    let file = SafeTensors::deserialize(&bytes).expect("fixture weights parse");
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data)
                .expect("edited tensor is consistent");
            (name.clone(), view)
        })
        .collect();
    let out = safetensors::serialize(views, None).expect("serialize weights");
    std::fs::write(&path, out).expect("write weights");
}

fn truncate(path: &Path, len: u64) {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open weights");
    file.set_len(len).expect("truncate weights");
}

#[test]
fn tiny_fixtures_open_with_the_expected_dtype_and_config() {
    let cases = [
        ("tiny-qwen3", DType::F32, "Qwen3ForCausalLM", 24),
        ("tiny-qwen3-bf16", DType::BF16, "Qwen3ForCausalLM", 24),
        ("tiny-llama", DType::F32, "LlamaForCausalLM", 30),
    ];
    for (name, dtype, architecture, num_tensors) in cases {
        let checkpoint = Checkpoint::open(fixture(name)).expect(name);
        let config = checkpoint.config();
        assert_eq!(config.architectures, [architecture], "{name}");
        assert_eq!(config.max_position_embeddings, 512, "{name}");
        assert_eq!(config.eos_token_id, [447], "{name}");
        assert_eq!(config.bos_token_id, Some(445), "{name}");
        assert!(
            checkpoint.config_json().contains("\"hidden_size\": 64"),
            "{name}"
        );
        assert_eq!(
            checkpoint.weights_path(),
            fixture(name).join("model.safetensors")
        );
        assert_eq!(checkpoint.num_tensors(), num_tensors, "{name}");
        for tensor_name in checkpoint.tensor_names() {
            let view = checkpoint.tensor(tensor_name).expect(tensor_name);
            assert_eq!(view.name(), tensor_name);
            assert_eq!(view.dtype(), dtype, "{name}: {tensor_name}");
            let num_bytes = view.num_elements() as usize * dtype.size_in_bytes();
            assert_eq!(view.data().len(), num_bytes, "{name}: {tensor_name}");
        }
        checkpoint.check(&expected_tensors(name)).expect(name);
    }
}

#[test]
fn both_config_styles_of_each_fixture_give_the_host_the_same_fields() {
    let cases = [
        ("tiny-qwen3", "float32"),
        ("tiny-qwen3-bf16", "bfloat16"),
        ("tiny-llama", "float32"),
    ];
    for (name, dtype) in cases {
        // `dtype` in config.json (transformers 5), `torch_dtype` in its transformers 4 twin.
        let [current, classic] = ["config.json", "config.transformers4.json"].map(|file| {
            let path = fixture(name).join(file);
            let text = std::fs::read_to_string(&path).expect(name);
            ModelConfig::parse(&text, &path).expect(name)
        });
        assert_eq!(current.torch_dtype.as_deref(), Some(dtype), "{name}");
        assert_eq!(current, classic, "{name}");
    }
}

#[test]
fn bf16_views_are_the_f32_weights_rounded() {
    let f32_checkpoint = Checkpoint::open(fixture("tiny-qwen3")).expect("f32 fixture");
    let bf16_checkpoint = Checkpoint::open(fixture("tiny-qwen3-bf16")).expect("bf16 fixture");
    let name = "model.layers.0.self_attn.q_proj.weight";
    let full = f32_checkpoint.tensor(name).expect("f32 tensor");
    let half = bf16_checkpoint.tensor(name).expect("bf16 tensor");
    assert_eq!(full.shape(), [128, 64]);
    assert_eq!(half.shape(), full.shape());
    let full_values = full
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let half_values = half
        .data()
        .chunks_exact(2)
        .map(|b| f32::from_le_bytes([0, 0, b[0], b[1]]));
    for (i, (x, y)) in full_values.zip(half_values).enumerate() {
        assert!(
            (x - y).abs() <= x.abs() / 128.0,
            "element {i}: f32 {x}, bf16 {y}"
        );
    }
}

#[test]
fn sharded_checkpoints_read_the_same_tensors() {
    let scratch = Scratch::copy_of("tiny-llama");
    let single = Checkpoint::open(fixture("tiny-llama")).expect("fixture");
    let names = single.tensor_names();
    let (first, second) = names.split_at(names.len() / 2);
    let shard_names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let mut weight_map = serde_json::Map::new();
    for (shard, part) in shard_names.iter().zip([first, second]) {
        let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = part
            .iter()
            .map(|&name| {
                let view = single.tensor(name).expect("tensor");
                let shape = view.shape().iter().map(|&d| d as usize).collect();
                let st = safetensors::tensor::TensorView::new(Dtype::F32, shape, view.data())
                    .expect("view");
                (name, st)
            })
            .collect();
        std::fs::write(
            scratch.path(shard),
            safetensors::serialize(views, None).expect("shard"),
        )
        .expect("write shard");
        for &name in part {
            weight_map.insert(name.to_string(), serde_json::json!(shard));
        }
    }
    std::fs::remove_file(scratch.path("model.safetensors")).expect("remove single file");
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(
        scratch.path("model.safetensors.index.json"),
        index.to_string(),
    )
    .expect("index");

    let sharded = Checkpoint::open(&scratch.0).expect("sharded checkpoint opens");
    assert_eq!(sharded.tensor_names(), names);
    for name in &names {
        let (a, b) = (
            single.tensor(name).expect(name),
            sharded.tensor(name).expect(name),
        );
        assert_eq!((a.shape(), a.data()), (b.shape(), b.data()), "{name}");
    }
    let error = sharded.tensor("model.nothing").unwrap_err().to_string();
    assert!(error.contains("model.safetensors.index.json"), "{error}");

    // An index that points a tensor at a shard without it, or at a shard that is gone.
    let mut wrong = weight_map.clone();
    wrong.insert(first[0].to_string(), serde_json::json!(shard_names[1]));
    let index = serde_json::json!({"weight_map": wrong});
    std::fs::write(
        scratch.path("model.safetensors.index.json"),
        index.to_string(),
    )
    .expect("index");
    let error = Checkpoint::open(&scratch.0).unwrap_err().to_string();
    assert!(
        error.contains(first[0]) && error.contains(shard_names[1]),
        "{error}"
    );

    std::fs::remove_file(scratch.path(shard_names[1])).expect("remove shard");
    let index = serde_json::json!({"weight_map": weight_map});
    std::fs::write(
        scratch.path("model.safetensors.index.json"),
        index.to_string(),
    )
    .expect("index");
    let error = Checkpoint::open(&scratch.0).unwrap_err().to_string();
    assert!(error.contains(shard_names[1]), "{error}");
}

/// A broken copy of tiny-qwen3: how it is broken, and what the error must say.
struct BadCase {
    name: &'static str,
    breaks: fn(&Path),
    /// Substrings of the error message; `{dir}` stands for the scratch folder.
    says: &'static [&'static str],
    is_expected: fn(&ModelError) -> bool,
}

const Q_PROJ: &str = "model.layers.0.self_attn.q_proj.weight";

fn bad_cases() -> Vec<BadCase> {
    vec![
        BadCase {
            name: "missing tensor",
            breaks: |dir| {
                rewrite_weights(dir, |t| t.retain(|(name, ..)| name != "model.norm.weight"))
            },
            says: &["tensor model.norm.weight is missing from {dir}/model.safetensors"],
            is_expected: |e| matches!(e, ModelError::MissingTensor { .. }),
        },
        BadCase {
            name: "wrong shape",
            breaks: |dir| {
                rewrite_weights(dir, |tensors| {
                    for (name, _, shape, data) in tensors.iter_mut() {
                        if name == Q_PROJ {
                            *shape = vec![64, 64];
                            data.truncate(64 * 64 * 4);
                        }
                    }
                })
            },
            says: &[
                "tensor model.layers.0.self_attn.q_proj.weight has shape [64, 64], the model needs [128, 64]",
                "{dir}/model.safetensors",
            ],
            is_expected: |e| matches!(e, ModelError::ShapeMismatch { .. }),
        },
        BadCase {
            name: "unsupported dtype",
            breaks: |dir| {
                rewrite_weights(dir, |tensors| {
                    for (name, dtype, ..) in tensors.iter_mut() {
                        if name == "model.norm.weight" {
                            *dtype = Dtype::I32;
                        }
                    }
                })
            },
            says: &[
                "tensor model.norm.weight",
                "has dtype I32",
                "{dir}/model.safetensors",
            ],
            is_expected: |e| matches!(e, ModelError::UnsupportedDtype { .. }),
        },
        BadCase {
            name: "weights cut in half",
            breaks: |dir| {
                let path = dir.join("model.safetensors");
                let len = std::fs::metadata(&path).expect("weights").len();
                truncate(&path, len / 2);
            },
            says: &["{dir}/model.safetensors is not a valid safetensors file: "],
            is_expected: |e| matches!(e, ModelError::Safetensors { .. }),
        },
        BadCase {
            name: "weights cut to 5 bytes",
            breaks: |dir| truncate(&dir.join("model.safetensors"), 5),
            says: &["{dir}/model.safetensors is not a valid safetensors file: "],
            is_expected: |e| matches!(e, ModelError::Safetensors { .. }),
        },
        BadCase {
            name: "empty weights file",
            breaks: |dir| truncate(&dir.join("model.safetensors"), 0),
            says: &["{dir}/model.safetensors is not a valid safetensors file: "],
            is_expected: |e| matches!(e, ModelError::Safetensors { .. }),
        },
        BadCase {
            name: "header length beyond the file",
            breaks: |dir| {
                let path = dir.join("model.safetensors");
                let mut bytes = std::fs::read(&path).expect("weights");
                bytes[..8].copy_from_slice(&1_000_000u64.to_le_bytes());
                std::fs::write(&path, bytes).expect("write weights");
            },
            says: &["{dir}/model.safetensors is not a valid safetensors file: "],
            is_expected: |e| matches!(e, ModelError::Safetensors { .. }),
        },
        BadCase {
            name: "header that is not JSON",
            breaks: |dir| {
                let path = dir.join("model.safetensors");
                let mut bytes = std::fs::read(&path).expect("weights");
                bytes[8..12].copy_from_slice(b"}}}}");
                std::fs::write(&path, bytes).expect("write weights");
            },
            says: &["{dir}/model.safetensors is not a valid safetensors file: "],
            is_expected: |e| matches!(e, ModelError::Safetensors { .. }),
        },
        BadCase {
            name: "no weights",
            breaks: |dir| std::fs::remove_file(dir.join("model.safetensors")).expect("remove"),
            says: &["no weights in {dir}"],
            is_expected: |e| matches!(e, ModelError::NoWeights { .. }),
        },
        BadCase {
            name: "missing config.json",
            breaks: |dir| std::fs::remove_file(dir.join("config.json")).expect("remove"),
            says: &["cannot read {dir}/config.json"],
            is_expected: |e| matches!(e, ModelError::Io { .. }),
        },
        BadCase {
            name: "config.json that is not JSON",
            breaks: |dir| {
                std::fs::write(dir.join("config.json"), "architectures: [Qwen3]").expect("write")
            },
            says: &["{dir}/config.json is not a valid model config: "],
            is_expected: |e| matches!(e, ModelError::Json { .. }),
        },
        BadCase {
            name: "config.json without max_position_embeddings",
            breaks: |dir| {
                std::fs::write(
                    dir.join("config.json"),
                    r#"{"architectures": ["Qwen3ForCausalLM"]}"#,
                )
                .expect("write")
            },
            says: &[
                "{dir}/config.json is not a valid model config: ",
                "max_position_embeddings",
            ],
            is_expected: |e| matches!(e, ModelError::Json { .. }),
        },
    ]
}

/// Opens the checkpoint and checks it against what tiny-qwen3 needs; the first error wins.
fn open_and_check(dir: &Path, expected: &[(String, Vec<u64>)]) -> Result<(), ModelError> {
    Checkpoint::open(dir)?.check(expected)
}

#[test]
fn broken_checkpoints_fail_with_a_clear_error() {
    let expected = expected_tensors("tiny-qwen3");
    let mut failures = Vec::new();
    for case in bad_cases() {
        let scratch = Scratch::copy_of("tiny-qwen3");
        (case.breaks)(&scratch.0);
        let dir = scratch.0.display().to_string();
        match open_and_check(&scratch.0, &expected) {
            Ok(()) => failures.push(format!("{}: opened without an error", case.name)),
            Err(error) => {
                let message = error.to_string();
                if !(case.is_expected)(&error) {
                    failures.push(format!("{}: unexpected error kind {error:?}", case.name));
                }
                for said in case.says {
                    let said = said.replace("{dir}", &dir);
                    if !message.contains(&said) {
                        failures.push(format!("{}: {message:?} does not say {said:?}", case.name));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn check_reports_the_first_problem_in_order() {
    let checkpoint = Checkpoint::open(fixture("tiny-qwen3")).expect("fixture");
    let expected = vec![
        ("model.norm.weight".to_string(), vec![64]),
        (Q_PROJ.to_string(), vec![64, 64]),
        ("lm_head.weight".to_string(), vec![448, 64]),
    ];
    let error = checkpoint.check(&expected).unwrap_err().to_string();
    assert!(
        error.starts_with("tensor model.layers.0.self_attn.q_proj.weight has shape [128, 64], the model needs [64, 64]"),
        "{error}"
    );
    let error = checkpoint.check(&expected[2..]).unwrap_err().to_string();
    assert!(
        error.contains("tensor lm_head.weight is missing from"),
        "{error}"
    );
}
