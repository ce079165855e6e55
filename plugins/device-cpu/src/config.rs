//! The CPU device's `open` config: comma-separated `key=value` options (`threads`, `bf16_products`).

use std::num::NonZeroUsize;
use std::thread;

use plughost_device_abi::config::{ConfigError, ConfigSpec};

use crate::linear::Bf16Products;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuConfig {
    /// Worker threads for one launch; 1 runs every kernel on the calling thread.
    pub threads: NonZeroUsize,
    /// `bf16_products=f32|bf16`: what bf16 weights are multiplied with (see [`Bf16Products`]).
    pub bf16_products: Bf16Products,
}

impl Default for CpuConfig {
    fn default() -> CpuConfig {
        CpuConfig {
            threads: thread::available_parallelism().unwrap_or(NonZeroUsize::MIN),
            bf16_products: Bf16Products::default(),
        }
    }
}

/// The options `CpuConfig::parse` understands.
const SPEC: ConfigSpec = ConfigSpec {
    device: "cpu",
    known_keys: &["threads", "bf16_products"],
};

impl CpuConfig {
    /// Parses e.g. `threads=2`; the empty string keeps the defaults.
    pub fn parse(text: &str) -> Result<CpuConfig, ConfigError> {
        let mut config = CpuConfig::default();
        for option in SPEC.parse(text)? {
            match option.key {
                "threads" => config.threads = option.parse("a positive integer")?,
                "bf16_products" => config.bf16_products = option.parse("`f32` or `bf16`")?,
                key => unreachable!("`ConfigSpec::parse` refuses `{key}`, which is not in SPEC"),
            }
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn threads(count: usize) -> CpuConfig {
        CpuConfig {
            threads: NonZeroUsize::new(count).unwrap(),
            ..CpuConfig::default()
        }
    }

    #[test]
    fn parses_threads_and_refuses_the_rest() {
        let cases: [(&str, Result<CpuConfig, &str>); 7] = [
            ("", Ok(CpuConfig::default())),
            ("threads=1", Ok(threads(1))),
            (" threads = 3 ,", Ok(threads(3))),
            (
                "threads=0",
                Err("cpu device option `threads` must be a positive integer, got `0`"),
            ),
            (
                "threads=many",
                Err("cpu device option `threads` must be a positive integer, got `many`"),
            ),
            (
                "thread=2",
                Err("unknown cpu device option `thread` (known: threads, bf16_products)"),
            ),
            (
                "threads=1,threads=2",
                Err("cpu device option `threads` is given twice"),
            ),
        ];
        for (text, expected) in cases {
            let parsed = CpuConfig::parse(text).map_err(|error| error.to_string());
            assert_eq!(parsed, expected.map_err(str::to_string), "{text}");
        }
    }
}
