//! The CPU device's `open` config: comma-separated `key=value` options (today only `threads`).

use std::num::NonZeroUsize;
use std::thread;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuConfig {
    /// Worker threads for one launch; 1 runs every kernel on the calling thread.
    pub threads: NonZeroUsize,
}

impl Default for CpuConfig {
    fn default() -> CpuConfig {
        CpuConfig {
            threads: thread::available_parallelism().unwrap_or(NonZeroUsize::MIN),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("cpu device option `{option}` is not of the form key=value")]
    NotKeyValue { option: String },
    #[error("unknown cpu device option `{key}` (known: threads)")]
    UnknownKey { key: String },
    #[error("cpu device option `{key}` must be a positive integer, got `{value}`")]
    NotAPositiveNumber { key: String, value: String },
    #[error("cpu device option `{key}` is given twice")]
    Duplicate { key: String },
}

impl CpuConfig {
    /// Parses e.g. `threads=2`; the empty string keeps the defaults.
    pub fn parse(text: &str) -> Result<CpuConfig, ConfigError> {
        let mut config = CpuConfig::default();
        let mut seen_keys: Vec<&str> = Vec::new();
        for option in text.split(',').map(str::trim).filter(|o| !o.is_empty()) {
            let (key, value) = option
                .split_once('=')
                .ok_or_else(|| ConfigError::NotKeyValue {
                    option: option.to_string(),
                })?;
            let (key, value) = (key.trim(), value.trim());
            if seen_keys.contains(&key) {
                return Err(ConfigError::Duplicate {
                    key: key.to_string(),
                });
            }
            seen_keys.push(key);
            match key {
                "threads" => {
                    config.threads =
                        value.parse().map_err(|_| ConfigError::NotAPositiveNumber {
                            key: key.to_string(),
                            value: value.to_string(),
                        })?;
                }
                _ => {
                    return Err(ConfigError::UnknownKey {
                        key: key.to_string(),
                    });
                }
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
        }
    }

    #[test]
    fn parses_valid_configs() {
        let cases = [
            ("", CpuConfig::default()),
            ("threads=1", threads(1)),
            (" threads = 3 ,", threads(3)),
        ];
        for (text, expected) in cases {
            assert_eq!(CpuConfig::parse(text).as_ref(), Ok(&expected), "{text}");
        }
    }

    #[test]
    fn refuses_invalid_configs() {
        let cases = [
            ("threads", "is not of the form key=value"),
            ("thread=2", "unknown cpu device option `thread`"),
            ("threads=0", "must be a positive integer, got `0`"),
            ("threads=many", "must be a positive integer, got `many`"),
            ("threads=1,threads=2", "`threads` is given twice"),
        ];
        for (text, expected) in cases {
            let message = CpuConfig::parse(text).unwrap_err().to_string();
            assert!(message.contains(expected), "{text}: {message}");
        }
    }
}
