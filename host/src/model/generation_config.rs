//! A model folder's `generation_config.json`: the sampling defaults and end tokens its authors chose, used where a request is silent.
//!
//! As vLLM reads it: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and
//! `max_new_tokens` become the defaults of requests that leave them out, and `eos_token_id`
//! adds end-of-sequence tokens. Other keys (`do_sample`, `bos_token_id`, ...) change nothing.
//! A value out of its range is refused at load, naming the key, rather than served.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::ModelError;

const FILE: &str = "generation_config.json";

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Debug, Clone, Deserialize, Default)]
struct RawGenerationConfig {
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    max_new_tokens: Option<u64>,
    eos_token_id: Option<serde_json::Value>,
}

/// Where a deployment takes its generation defaults from (`--generation-config`, named as
/// vLLM names its values).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum GenerationConfigSource {
    /// The model folder's `generation_config.json`.
    #[default]
    Model,
    /// No sampling defaults: requests get OpenAI's. The model folder's file still adds its
    /// end tokens, as in vLLM, since they say where the model's answers end.
    Vllm,
    /// The `generation_config.json` of another folder.
    Folder(PathBuf),
}

impl GenerationConfigSource {
    /// `auto`, `vllm` or a folder.
    pub fn parse(value: &str) -> GenerationConfigSource {
        match value {
            "auto" => GenerationConfigSource::Model,
            "vllm" => GenerationConfigSource::Vllm,
            folder => GenerationConfigSource::Folder(PathBuf::from(folder)),
        }
    }

    /// The defaults for the model in `model_dir`.
    pub fn load(&self, model_dir: &Path) -> Result<GenerationDefaults, ModelError> {
        match self {
            GenerationConfigSource::Model => GenerationDefaults::from_dir(model_dir),
            GenerationConfigSource::Vllm => Ok(GenerationDefaults {
                eos_token_ids: GenerationDefaults::from_dir(model_dir)?.eos_token_ids,
                ..GenerationDefaults::default()
            }),
            GenerationConfigSource::Folder(dir) => {
                if !dir.join(FILE).is_file() {
                    return Err(ModelError::Io {
                        path: dir.join(FILE),
                        source: std::io::Error::new(
                            std::io::ErrorKind::NotFound,
                            "--generation-config names a folder without this file",
                        ),
                    });
                }
                GenerationDefaults::from_dir(dir)
            }
        }
    }
}

/// The defaults a model's authors set; every field `None` when the file is absent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// 0 or absent: no top-k.
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub max_new_tokens: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl GenerationDefaults {
    /// Reads `dir/generation_config.json`; no file means no defaults.
    pub fn from_dir(dir: &Path) -> Result<GenerationDefaults, ModelError> {
        let path = dir.join(FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(GenerationDefaults::default());
            }
            Err(source) => return Err(ModelError::Io { path, source }),
        };
        let raw: RawGenerationConfig =
            serde_json::from_str(&text).map_err(|source| ModelError::Json {
                path: path.clone(),
                what: "generation config",
                source,
            })?;
        let refuse = |key: &str, rule: &str| ModelError::GenerationConfig {
            path: path.clone(),
            message: format!("`{key}` must be {rule}"),
        };
        let check = |key: &str, value: Option<f64>, ok: fn(f64) -> bool, rule: &str| match value {
            Some(v) if !ok(v) => Err(refuse(key, rule)),
            other => Ok(other),
        };
        let eos_token_ids = match raw.eos_token_id {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(value) => match serde_json::from_value::<OneOrMany>(value) {
                Ok(OneOrMany::One(id)) => vec![id],
                Ok(OneOrMany::Many(ids)) => ids,
                Err(_) => return Err(refuse("eos_token_id", "a token id or a list of them")),
            },
        };
        Ok(GenerationDefaults {
            temperature: check(
                "temperature",
                raw.temperature,
                |v| (0.0..=2.0).contains(&v),
                "between 0 and 2",
            )?,
            top_p: check(
                "top_p",
                raw.top_p,
                |v| v > 0.0 && v <= 1.0,
                "greater than 0 and at most 1",
            )?,
            top_k: match raw.top_k {
                Some(k) if k < -1 => return Err(refuse("top_k", "-1, 0 or a positive count")),
                other => other,
            },
            min_p: check(
                "min_p",
                raw.min_p,
                |v| (0.0..=1.0).contains(&v),
                "between 0 and 1",
            )?,
            repetition_penalty: check(
                "repetition_penalty",
                raw.repetition_penalty,
                |v| v > 0.0,
                "greater than 0",
            )?,
            max_new_tokens: match raw.max_new_tokens {
                Some(0) => return Err(refuse("max_new_tokens", "at least 1")),
                Some(n) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
                None => None,
            },
            eos_token_ids,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_drops_the_sampling_defaults_and_keeps_the_end_tokens() {
        let dir = folder(
            "source",
            Some(r#"{"temperature": 0.6, "max_new_tokens": 7, "eos_token_id": [5, 9]}"#),
        );
        let model = GenerationConfigSource::parse("auto")
            .load(&dir)
            .expect("valid");
        assert_eq!(
            (model.temperature, model.max_new_tokens),
            (Some(0.6), Some(7))
        );
        let vllm = GenerationConfigSource::parse("vllm")
            .load(&dir)
            .expect("valid");
        assert_eq!(
            vllm,
            GenerationDefaults {
                eos_token_ids: vec![5, 9],
                ..GenerationDefaults::default()
            }
        );
        let empty = folder("source-empty", None);
        let elsewhere = GenerationConfigSource::parse(dir.to_str().expect("UTF-8 path"))
            .load(&empty)
            .expect("valid");
        assert_eq!(elsewhere, model);
        let error = GenerationConfigSource::parse(empty.to_str().expect("UTF-8 path"))
            .load(&dir)
            .expect_err("no file there");
        assert!(
            error
                .to_string()
                .contains("--generation-config names a folder"),
            "{error}"
        );
    }

    fn folder(name: &str, text: Option<&str>) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("plughost-genconfig-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("folder");
        if let Some(text) = text {
            std::fs::write(dir.join(FILE), text).expect("write");
        }
        dir
    }

    #[test]
    fn qwen3s_defaults_are_read_and_a_missing_file_has_none() {
        let qwen3 = r#"{"bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643],
            "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}"#;
        let d = GenerationDefaults::from_dir(&folder("qwen3", Some(qwen3))).expect("valid");
        assert_eq!(d.temperature, Some(0.6));
        assert_eq!((d.top_k, d.top_p, d.min_p), (Some(20), Some(0.95), None));
        assert_eq!(d.eos_token_ids, vec![151645, 151643]);
        let single = GenerationDefaults::from_dir(&folder(
            "one",
            Some(r#"{"eos_token_id": 2, "max_new_tokens": 64}"#),
        ))
        .expect("valid");
        assert_eq!(
            (single.eos_token_ids, single.max_new_tokens),
            (vec![2], Some(64))
        );
        assert_eq!(
            GenerationDefaults::from_dir(&folder("none", None)).expect("no file"),
            GenerationDefaults::default()
        );
    }

    #[test]
    fn values_out_of_range_are_refused_naming_the_key() {
        for (text, key) in [
            (r#"{"temperature": 7}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_k": -5}"#, "top_k"),
            (r#"{"eos_token_id": "</s>"}"#, "eos_token_id"),
            (r#"{"max_new_tokens": 0}"#, "max_new_tokens"),
        ] {
            let error = GenerationDefaults::from_dir(&folder("bad", Some(text))).expect_err(text);
            assert!(
                error.to_string().contains(&format!("`{key}`")),
                "{text}: {error}"
            );
        }
        let error = GenerationDefaults::from_dir(&folder("json", Some("{"))).expect_err("not JSON");
        assert!(
            error.to_string().contains("generation_config.json"),
            "{error}"
        );
    }
}
