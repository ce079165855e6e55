//! The mock device's `open` config: comma-separated `key=value` options for fault injection and memory size.

use std::time::Duration;

/// How long an injected hang lasts when `hang_ms` is not given: long enough that only a
/// timeout or cancellation in the host ends the wait.
pub const DEFAULT_HANG: Duration = Duration::from_secs(24 * 60 * 60);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MockConfig {
    /// The launch (1-based, counting every launch that passed the argument checks) that fails.
    pub fail_launch: Option<u64>,
    /// The launch (1-based, counted the same way) that sleeps for `hang` before running.
    pub hang_launch: Option<u64>,
    pub hang: Duration,
    /// Bytes the device can hold at once; unlimited when absent.
    pub memory_bytes: Option<u64>,
}

impl Default for MockConfig {
    fn default() -> MockConfig {
        MockConfig {
            fail_launch: None,
            hang_launch: None,
            hang: DEFAULT_HANG,
            memory_bytes: None,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("mock device option `{option}` is not of the form key=value")]
    NotKeyValue { option: String },
    #[error(
        "unknown mock device option `{key}` (known: fail_launch, hang_launch, hang_ms, memory_bytes)"
    )]
    UnknownKey { key: String },
    #[error("mock device option `{key}` must be a non-negative integer, got `{value}`")]
    NotANumber { key: String, value: String },
    #[error("mock device option `{key}` counts launches from 1, got 0")]
    ZeroLaunch { key: String },
    #[error("mock device option `{key}` is given twice")]
    Duplicate { key: String },
}

impl MockConfig {
    /// Parses e.g. `fail_launch=3,hang_launch=5,hang_ms=200`; the empty string means no options.
    pub fn parse(text: &str) -> Result<MockConfig, ConfigError> {
        let mut config = MockConfig::default();
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
            let number = value.parse::<u64>().map_err(|_| ConfigError::NotANumber {
                key: key.to_string(),
                value: value.to_string(),
            });
            match key {
                "fail_launch" => config.fail_launch = Some(launch_number(key, number?)?),
                "hang_launch" => config.hang_launch = Some(launch_number(key, number?)?),
                "hang_ms" => config.hang = Duration::from_millis(number?),
                "memory_bytes" => config.memory_bytes = Some(number?),
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

fn launch_number(key: &str, number: u64) -> Result<u64, ConfigError> {
    if number == 0 {
        return Err(ConfigError::ZeroLaunch {
            key: key.to_string(),
        });
    }
    Ok(number)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_valid_configs() {
        let cases = [
            ("", MockConfig::default()),
            (
                "fail_launch=3",
                MockConfig {
                    fail_launch: Some(3),
                    ..MockConfig::default()
                },
            ),
            (
                " hang_launch = 5 , hang_ms=200,",
                MockConfig {
                    hang_launch: Some(5),
                    hang: Duration::from_millis(200),
                    ..MockConfig::default()
                },
            ),
            (
                "memory_bytes=4096",
                MockConfig {
                    memory_bytes: Some(4096),
                    ..MockConfig::default()
                },
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(MockConfig::parse(text).as_ref(), Ok(&expected), "{text}");
        }
    }

    #[test]
    fn refuses_invalid_configs() {
        let cases = [
            ("fail_launch", "is not of the form key=value"),
            ("fail_lunch=2", "unknown mock device option `fail_lunch`"),
            ("hang_ms=soon", "must be a non-negative integer, got `soon`"),
            ("fail_launch=0", "counts launches from 1"),
            ("hang_ms=1,hang_ms=2", "`hang_ms` is given twice"),
        ];
        for (text, expected) in cases {
            let message = MockConfig::parse(text).unwrap_err().to_string();
            assert!(message.contains(expected), "{text}: {message}");
        }
    }
}
