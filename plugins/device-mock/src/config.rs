//! The mock device's `open` config: comma-separated `key=value` options for fault injection and memory size.

use std::time::Duration;

use plughost_device_abi::config::{ConfigError, ConfigOption, ConfigSpec};

/// How long an injected hang lasts when `hang_ms` is not given: long enough that only a
/// timeout or cancellation in the host ends the wait.
pub const DEFAULT_HANG: Duration = Duration::from_secs(24 * 60 * 60);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MockConfig {
    /// The launch (1-based, counting every launch that passed the argument checks) that fails.
    pub fail_launch: Option<u64>,
    /// How many launches in a row fail from `fail_launch` on: 1 is a transient fault, more
    /// outlast a retry.
    pub fail_launch_count: u64,
    /// The launch (1-based, counted the same way) that sleeps for `hang` before running.
    pub hang_launch: Option<u64>,
    pub hang: Duration,
    /// The launch (1-based, counted the same way) that aborts the process.
    pub crash_launch: Option<u64>,
    /// Whether the faults above fire in every device worker process rather than only in the
    /// first one a server starts: repeated faults, to spend a restart budget.
    pub faults_every_worker: bool,
    /// Bytes the device can hold at once; unlimited when absent.
    pub memory_bytes: Option<u64>,
    /// How long every launch takes at least: a slow device, whose steps can outlast the
    /// host's device timeout while each launch stays well within it.
    pub launch_time: Duration,
    /// How long the background copy thread waits before each copy out (ABI revision 1.2): a
    /// copy that spans several engine steps.
    pub copy_time: Duration,
    /// The copy out (1-based) during which the copy thread aborts the process.
    pub crash_copy: Option<u64>,
}

impl Default for MockConfig {
    fn default() -> MockConfig {
        MockConfig {
            fail_launch: None,
            fail_launch_count: 1,
            hang_launch: None,
            hang: DEFAULT_HANG,
            crash_launch: None,
            faults_every_worker: false,
            memory_bytes: None,
            launch_time: Duration::ZERO,
            copy_time: Duration::ZERO,
            crash_copy: None,
        }
    }
}

/// The options `MockConfig::parse` understands; every value is a number.
const SPEC: ConfigSpec = ConfigSpec {
    device: "mock",
    known_keys: &[
        "fail_launch",
        "fail_launch_count",
        "hang_launch",
        "hang_ms",
        "crash_launch",
        "faults_every_worker",
        "memory_bytes",
        "launch_ms",
        "copy_ms",
        "crash_copy",
    ],
};

impl MockConfig {
    /// Parses e.g. `fail_launch=3,hang_launch=5,hang_ms=200`; the empty string means no options.
    /// `fail_launch_count` without `fail_launch` changes nothing.
    pub fn parse(text: &str) -> Result<MockConfig, ConfigError> {
        let mut config = MockConfig::default();
        for option in SPEC.parse(text)? {
            let number = option.parse::<u64>("a non-negative integer")?;
            match option.key {
                "fail_launch" => config.fail_launch = Some(launch_number(&option, number)?),
                "fail_launch_count" => {
                    config.fail_launch_count = launch_number(&option, number)?;
                }
                "hang_launch" => config.hang_launch = Some(launch_number(&option, number)?),
                "hang_ms" => config.hang = Duration::from_millis(number),
                "crash_launch" => config.crash_launch = Some(launch_number(&option, number)?),
                "faults_every_worker" => config.faults_every_worker = number != 0,
                "memory_bytes" => config.memory_bytes = Some(number),
                "launch_ms" => config.launch_time = Duration::from_millis(number),
                "copy_ms" => config.copy_time = Duration::from_millis(number),
                "crash_copy" => config.crash_copy = Some(launch_number(&option, number)?),
                key => unreachable!("`ConfigSpec::parse` refuses `{key}`, which is not in SPEC"),
            }
        }
        Ok(config)
    }
}

fn launch_number(option: &ConfigOption<'_>, number: u64) -> Result<u64, ConfigError> {
    if number == 0 {
        let counted = if option.key == "crash_copy" {
            "copies"
        } else {
            "launches"
        };
        return Err(option.invalid(format!("counts {counted} from 1, got 0")));
    }
    Ok(number)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fault_injection_and_memory_options() {
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
                "fail_launch=7,fail_launch_count=2",
                MockConfig {
                    fail_launch: Some(7),
                    fail_launch_count: 2,
                    ..MockConfig::default()
                },
            ),
            (
                "crash_launch=4,faults_every_worker=1",
                MockConfig {
                    crash_launch: Some(4),
                    faults_every_worker: true,
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
            (
                "launch_ms=150",
                MockConfig {
                    launch_time: Duration::from_millis(150),
                    ..MockConfig::default()
                },
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(MockConfig::parse(text), Ok(expected), "{text}");
        }
    }

    #[test]
    fn refuses_bad_options_naming_the_mock_device() {
        let cases = [
            (
                "fail_launch",
                "mock device option `fail_launch` is not of the form key=value",
            ),
            (
                "fail_lunch=2",
                "unknown mock device option `fail_lunch` \
                 (known: fail_launch, fail_launch_count, hang_launch, hang_ms, crash_launch, \
                 faults_every_worker, memory_bytes, launch_ms, copy_ms, crash_copy)",
            ),
            (
                "hang_ms=soon",
                "mock device option `hang_ms` must be a non-negative integer, got `soon`",
            ),
            (
                "fail_launch=0",
                "mock device option `fail_launch` counts launches from 1, got 0",
            ),
            (
                "hang_ms=1,hang_ms=2",
                "mock device option `hang_ms` is given twice",
            ),
        ];
        for (text, expected) in cases {
            let error = MockConfig::parse(text).unwrap_err();
            assert_eq!(error.to_string(), expected, "{text}");
        }
    }
}
