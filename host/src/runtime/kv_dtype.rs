//! The element type of the KV cache, chosen per deployment; `auto` follows the checkpoint's dtype.

use crate::device::DType;

/// What `--kv-cache-dtype` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KvCacheDtype {
    /// The checkpoint's dtype (config.json's `torch_dtype` or `dtype`): a bf16 checkpoint caches keys
    /// and values in bf16, as its reference implementation does; f32 when it names none.
    #[default]
    Auto,
    F32,
    F16,
    Bf16,
}

impl KvCacheDtype {
    /// The dtype the cache is allocated in, for a checkpoint whose config.json names
    /// `checkpoint_dtype` ([`ModelConfig::torch_dtype`]).
    ///
    /// [`ModelConfig::torch_dtype`]: crate::model::ModelConfig::torch_dtype
    pub fn resolve(self, checkpoint_dtype: Option<&str>) -> DType {
        match self {
            KvCacheDtype::F32 => DType::F32,
            KvCacheDtype::F16 => DType::F16,
            KvCacheDtype::Bf16 => DType::BF16,
            KvCacheDtype::Auto => match checkpoint_dtype {
                Some("bfloat16") => DType::BF16,
                Some("float16") => DType::F16,
                _ => DType::F32,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_follows_the_checkpoint_dtype() {
        let auto = KvCacheDtype::Auto;
        assert_eq!(auto.resolve(Some("bfloat16")), DType::BF16);
        assert_eq!(auto.resolve(Some("float16")), DType::F16);
        assert_eq!(auto.resolve(Some("float32")), DType::F32);
        assert_eq!(auto.resolve(None), DType::F32);
    }

    #[test]
    fn an_explicit_dtype_wins() {
        let checkpoint = Some("bfloat16");
        assert_eq!(KvCacheDtype::F32.resolve(checkpoint), DType::F32);
        assert_eq!(KvCacheDtype::F16.resolve(checkpoint), DType::F16);
    }
}
