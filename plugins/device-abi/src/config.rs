//! Parsing a device's `open` config string: comma-separated `key=value` options, each key known to the device and given at most once.
//!
//! The parser owns the form (splitting, whitespace, empty items, duplicate and unknown keys);
//! the device owns what each value means. A device matches on [`ConfigOption::key`] and
//! parses the value with [`ConfigOption::parse`], so every message names the device, the key
//! and what was wrong:
//!
//! ```
//! use plughost_device_abi::config::ConfigSpec;
//!
//! const SPEC: ConfigSpec = ConfigSpec { device: "demo", known_keys: &["threads"] };
//!
//! let mut threads = 1;
//! for option in SPEC.parse(" threads = 4 ,").unwrap() {
//!     match option.key {
//!         "threads" => threads = option.parse("a positive integer").unwrap(),
//!         _ => unreachable!("SPEC.parse refuses keys outside SPEC.known_keys"),
//!     }
//! }
//! assert_eq!(threads, 4);
//! let error = SPEC.parse("threads=1,thread=2").unwrap_err();
//! assert_eq!(error.to_string(), "unknown demo device option `thread` (known: threads)");
//! ```

use std::fmt;
use std::str::FromStr;

/// What a device accepts in its config string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConfigSpec {
    /// Names the device in messages: `"{device} device option ..."`.
    pub device: &'static str,
    pub known_keys: &'static [&'static str],
}

/// One `key=value` option, trimmed, with a key from the spec's `known_keys`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConfigOption<'a> {
    device: &'static str,
    pub key: &'a str,
    pub value: &'a str,
}

/// Why a config string is refused. Devices report it as INVALID_ARGUMENT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigError {
    NotKeyValue {
        device: &'static str,
        option: String,
    },
    UnknownKey {
        device: &'static str,
        key: String,
        known_keys: &'static [&'static str],
    },
    Duplicate {
        device: &'static str,
        key: String,
    },
    /// `problem` completes "{device} device option `{key}` ...".
    InvalidValue {
        device: &'static str,
        key: String,
        problem: String,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::NotKeyValue { device, option } => write!(
                f,
                "{device} device option `{option}` is not of the form key=value"
            ),
            ConfigError::UnknownKey {
                device,
                key,
                known_keys,
            } => write!(
                f,
                "unknown {device} device option `{key}` (known: {})",
                known_keys.join(", ")
            ),
            ConfigError::Duplicate { device, key } => {
                write!(f, "{device} device option `{key}` is given twice")
            }
            ConfigError::InvalidValue {
                device,
                key,
                problem,
            } => write!(f, "{device} device option `{key}` {problem}"),
        }
    }
}

impl std::error::Error for ConfigError {}

impl ConfigSpec {
    /// The options of `text` in order. Whitespace around options, keys and values is ignored,
    /// and so are empty items, so `""` has no options and a trailing comma is fine.
    pub fn parse<'a>(&self, text: &'a str) -> Result<Vec<ConfigOption<'a>>, ConfigError> {
        let device = self.device;
        let mut options: Vec<ConfigOption<'a>> = Vec::new();
        for option in text.split(',').map(str::trim).filter(|o| !o.is_empty()) {
            let (key, value) = option
                .split_once('=')
                .ok_or_else(|| ConfigError::NotKeyValue {
                    device,
                    option: option.to_string(),
                })?;
            let (key, value) = (key.trim(), value.trim());
            if options.iter().any(|seen| seen.key == key) {
                return Err(ConfigError::Duplicate {
                    device,
                    key: key.to_string(),
                });
            }
            if !self.known_keys.contains(&key) {
                return Err(ConfigError::UnknownKey {
                    device,
                    key: key.to_string(),
                    known_keys: self.known_keys,
                });
            }
            options.push(ConfigOption { device, key, value });
        }
        Ok(options)
    }
}

impl ConfigOption<'_> {
    /// The value as a `T`; `expected` says what it must be ("a positive integer") for the
    /// message when it is not.
    pub fn parse<T: FromStr>(&self, expected: &str) -> Result<T, ConfigError> {
        self.value
            .parse()
            .map_err(|_| self.invalid(format!("must be {expected}, got `{}`", self.value)))
    }

    /// The error for a value the device does not allow; `problem` completes
    /// "{device} device option `{key}` ...".
    pub fn invalid(&self, problem: impl Into<String>) -> ConfigError {
        ConfigError::InvalidValue {
            device: self.device,
            key: self.key.to_string(),
            problem: problem.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: ConfigSpec = ConfigSpec {
        device: "test",
        known_keys: &["alpha", "beta"],
    };

    #[test]
    fn parses_options_in_order() {
        let cases: [(&str, &[(&str, &str)]); 5] = [
            ("", &[]),
            (" , ,", &[]),
            ("alpha=1", &[("alpha", "1")]),
            (
                " beta = two words , alpha=,",
                &[("beta", "two words"), ("alpha", "")],
            ),
            ("alpha=a=b", &[("alpha", "a=b")]),
        ];
        for (text, expected) in cases {
            let options = SPEC.parse(text).unwrap();
            let pairs: Vec<(&str, &str)> = options.iter().map(|o| (o.key, o.value)).collect();
            assert_eq!(pairs, expected, "{text}");
        }
    }

    #[test]
    fn refuses_malformed_repeated_and_unknown_options() {
        let cases = [
            (
                "alpha",
                "test device option `alpha` is not of the form key=value",
            ),
            (
                "alpha=1,beta",
                "test device option `beta` is not of the form key=value",
            ),
            (
                "gamma=1",
                "unknown test device option `gamma` (known: alpha, beta)",
            ),
            (
                "alpha=1, alpha =2",
                "test device option `alpha` is given twice",
            ),
            // Options are checked in order: the repeat comes before the unknown key.
            (
                "beta=1,beta=2,gamma=3",
                "test device option `beta` is given twice",
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(
                SPEC.parse(text).unwrap_err().to_string(),
                expected,
                "{text}"
            );
        }
    }

    #[test]
    fn values_parse_or_say_what_they_must_be() {
        let options = SPEC.parse("alpha=12,beta=soon").unwrap();
        assert_eq!(options[0].parse::<u64>("a number"), Ok(12));
        let error = options[1].parse::<u64>("a number").unwrap_err();
        assert_eq!(
            error.to_string(),
            "test device option `beta` must be a number, got `soon`"
        );
        assert_eq!(
            options[0].invalid("is too large").to_string(),
            "test device option `alpha` is too large"
        );
    }
}
