//! The element type of the KV cache, chosen per deployment; `auto` follows the checkpoint's dtype.

use crate::device::DType;

/// What `--kv-cache-dtype` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KvCacheDtype {
    /// The dtype config.json names (`torch_dtype` or `dtype`): a bf16 checkpoint caches keys
    /// and values in bf16, as its reference implementation does; f32 when it names none.
    #[default]
    Auto,
    F32,
    F16,
    Bf16,
}

impl KvCacheDtype {
    /// The dtype the cache is allocated in, for the model whose config.json is `config_json`.
    pub fn resolve(self, config_json: &str) -> DType {
        match self {
            KvCacheDtype::F32 => DType::F32,
            KvCacheDtype::F16 => DType::F16,
            KvCacheDtype::Bf16 => DType::BF16,
            KvCacheDtype::Auto => {
                let config: serde_json::Value =
                    serde_json::from_str(config_json).unwrap_or_default();
                let named = ["torch_dtype", "dtype"]
                    .into_iter()
                    .find_map(|key| config.get(key).and_then(|value| value.as_str()));
                match named {
                    Some("bfloat16") => DType::BF16,
                    Some("float16") => DType::F16,
                    _ => DType::F32,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_follows_the_checkpoint_dtype() {
        let auto = KvCacheDtype::Auto;
        assert_eq!(auto.resolve(r#"{"torch_dtype": "bfloat16"}"#), DType::BF16);
        assert_eq!(auto.resolve(r#"{"dtype": "float16"}"#), DType::F16);
        assert_eq!(auto.resolve(r#"{"torch_dtype": "float32"}"#), DType::F32);
        assert_eq!(auto.resolve(r#"{"hidden_size": 8}"#), DType::F32);
        assert_eq!(auto.resolve("not json"), DType::F32);
    }

    #[test]
    fn an_explicit_dtype_wins() {
        let config = r#"{"torch_dtype": "bfloat16"}"#;
        assert_eq!(KvCacheDtype::F32.resolve(config), DType::F32);
        assert_eq!(KvCacheDtype::F16.resolve(config), DType::F16);
    }
}
