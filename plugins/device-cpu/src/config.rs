//! The CPU device's `open` config: comma-separated `key=value` options (`threads`, `isa`, `bf16_products`, `activation_digits`, `prefetch`).

use std::num::NonZeroUsize;
use std::thread;

use plughost_device_abi::config::{ConfigError, ConfigSpec};

use crate::isa::{Isa, IsaLevel};
use crate::linear::{ActivationDigits, Bf16Products, RowPrefetch};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuConfig {
    /// Worker threads for one launch; 1 runs every kernel on the calling thread.
    pub threads: NonZeroUsize,
    /// `isa=portable|avx2|avx512|avx512_vnni|avx512_bf16`: the highest instruction-set level the
    /// kernels use; by default the highest this CPU has.
    pub isa: Isa,
    /// `bf16_products=f32|bf16`: what bf16 weights are multiplied with (see [`Bf16Products`]);
    /// by default bf16 where `isa` has AVX-512 BF16, f32 elsewhere.
    pub bf16_products: Bf16Products,
    /// `activation_digits=1|2`: the int8 digits each activation keeps when it meets
    /// block-quantized weights (see [`ActivationDigits`]); by default two.
    pub activation_digits: ActivationDigits,
    /// `prefetch=auto|on|groups|groups_batched|off`: which tiles hint their lines ahead (see
    /// [`RowPrefetch`]): all, the quantized group tiles, those of several tokens, or none;
    /// `auto`, the default, picks all on Intel CPUs, the group tiles of several tokens on AMD
    /// Zen 4 and the group tiles elsewhere.
    pub prefetch: RowPrefetch,
}

impl Default for CpuConfig {
    fn default() -> CpuConfig {
        let isa = Isa::detect();
        CpuConfig {
            threads: thread::available_parallelism().unwrap_or(NonZeroUsize::MIN),
            isa,
            bf16_products: default_products(isa),
            activation_digits: ActivationDigits::default(),
            prefetch: RowPrefetch::for_this_cpu(),
        }
    }
}

fn default_products(isa: Isa) -> Bf16Products {
    if isa.has(IsaLevel::Avx512Bf16) {
        Bf16Products::Bf16
    } else {
        Bf16Products::F32
    }
}

/// The options `CpuConfig::parse` understands.
const SPEC: ConfigSpec = ConfigSpec {
    device: "cpu",
    known_keys: &[
        "threads",
        "isa",
        "bf16_products",
        "activation_digits",
        "prefetch",
    ],
};

impl CpuConfig {
    /// Parses e.g. `threads=2,isa=avx2`; the empty string keeps the defaults. A level this CPU
    /// lacks, or bf16 products below `avx512_bf16`, is refused rather than quietly lowered.
    pub fn parse(text: &str) -> Result<CpuConfig, ConfigError> {
        let mut config = CpuConfig::default();
        let mut products = None;
        let mut prefetch_option = None;
        for option in SPEC.parse(text)? {
            match option.key {
                "threads" => config.threads = option.parse("a positive integer")?,
                "isa" => {
                    let names: Vec<&str> = IsaLevel::ALL.iter().map(|l| l.name()).collect();
                    let level: IsaLevel = option.parse(&format!("one of {}", names.join(", ")))?;
                    config.isa = Isa::at(level).map_err(|missing| {
                        option.invalid(format!("asks for {level}, but {missing}"))
                    })?;
                }
                "bf16_products" => products = Some((option.parse("`f32` or `bf16`")?, option)),
                "activation_digits" => config.activation_digits = option.parse("`1` or `2`")?,
                "prefetch" => {
                    config.prefetch =
                        option.parse("`auto`, `on`, `groups`, `groups_batched` or `off`")?;
                    prefetch_option = Some(option);
                }
                key => unreachable!("`ConfigSpec::parse` refuses `{key}`, which is not in SPEC"),
            }
        }
        // Only the x86-64 tiles take hints: below them any choice but `off` would do nothing.
        if !config.isa.has(IsaLevel::Avx2) {
            if let Some(option) = prefetch_option
                && config.prefetch != RowPrefetch::Hardware
                && option.value != "auto"
            {
                return Err(option.invalid(format!(
                    "is `{}`, which needs isa {}; the device runs at {}",
                    option.value,
                    IsaLevel::Avx2,
                    config.isa.level()
                )));
            }
            config.prefetch = RowPrefetch::Hardware;
        }
        // Resolved after the loop: `isa` may come after `bf16_products`.
        config.bf16_products = match products {
            Some((Bf16Products::Bf16, option)) if !config.isa.has(IsaLevel::Avx512Bf16) => {
                return Err(option.invalid(format!(
                    "is `bf16`, which needs isa {}; the device runs at {}",
                    IsaLevel::Avx512Bf16,
                    config.isa.level()
                )));
            }
            Some((products, _)) => products,
            None => default_products(config.isa),
        };
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
                Err(
                    "unknown cpu device option `thread` (known: threads, isa, bf16_products, \
                     activation_digits, prefetch)",
                ),
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

    #[test]
    fn activation_digits_are_one_or_two_and_two_by_default() {
        assert_eq!(
            CpuConfig::default().activation_digits,
            ActivationDigits::Two
        );
        for (text, digits) in [("1", ActivationDigits::One), ("2", ActivationDigits::Two)] {
            let config = CpuConfig::parse(&format!("activation_digits={text}")).unwrap();
            assert_eq!(config.activation_digits, digits);
        }
        assert_eq!(
            CpuConfig::parse("activation_digits=8")
                .unwrap_err()
                .to_string(),
            "cpu device option `activation_digits` must be `1` or `2`, got `8`"
        );
    }

    #[test]
    fn prefetch_is_auto_or_a_choice_of_tiles_and_follows_the_cpu_by_default() {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            let (_, value) = info
                .lines()
                .filter_map(|line| line.split_once(':'))
                .find(|(key, _)| key.trim() == name)?;
            Some(value.trim().to_string())
        };
        let hints = Isa::detect().has(IsaLevel::Avx2);
        if let (Some(vendor), Some(family), Some(flags)) =
            (field("vendor_id"), field("cpu family"), field("flags"))
        {
            let zen_4 = vendor == "AuthenticAMD"
                && family == "25"
                && flags.split_whitespace().any(|flag| flag == "avx512f");
            let expected = match (hints, vendor.as_str()) {
                (false, _) => RowPrefetch::Hardware,
                (true, "GenuineIntel") => RowPrefetch::Software,
                (true, _) if zen_4 => RowPrefetch::BatchedGroupTiles,
                (true, _) => RowPrefetch::GroupTiles,
            };
            assert_eq!(CpuConfig::default().prefetch, expected, "{vendor} {family}");
            assert_eq!(
                CpuConfig::parse("prefetch=auto").unwrap().prefetch,
                expected
            );
        }
        for (text, prefetch) in [
            ("on", RowPrefetch::Software),
            ("groups", RowPrefetch::GroupTiles),
            ("groups_batched", RowPrefetch::BatchedGroupTiles),
            ("off", RowPrefetch::Hardware),
        ] {
            match CpuConfig::parse(&format!("prefetch={text}")) {
                Ok(config) => assert_eq!(config.prefetch, prefetch),
                Err(error) => assert!(
                    !hints && text != "off" && error.to_string().contains("needs isa avx2;"),
                    "{error}"
                ),
            }
        }
        for text in ["on", "groups", "groups_batched"] {
            let low = CpuConfig::parse(&format!("prefetch={text},isa=portable"));
            assert_eq!(
                low.unwrap_err().to_string(),
                format!(
                    "cpu device option `prefetch` is `{text}`, which needs isa avx2; \
                     the device runs at portable"
                )
            );
        }
        assert_eq!(
            CpuConfig::parse("prefetch=yes").unwrap_err().to_string(),
            "cpu device option `prefetch` must be `auto`, `on`, `groups`, `groups_batched` or \
             `off`, got `yes`"
        );
    }

    #[test]
    fn isa_caps_the_detected_level_and_refuses_what_the_cpu_lacks() {
        let detected = Isa::detect().level();
        for level in IsaLevel::ALL {
            let parsed = CpuConfig::parse(&format!("isa={level}"));
            if level <= detected {
                let config = parsed.unwrap();
                assert_eq!(config.isa.level(), level);
                // Products follow the level unless asked for.
                let bf16 = level == IsaLevel::Avx512Bf16;
                assert_eq!(config.bf16_products == Bf16Products::Bf16, bf16, "{level}");
                let explicit = CpuConfig::parse(&format!("bf16_products=bf16,isa={level}"));
                match explicit {
                    Ok(config) => assert!(bf16 && config.bf16_products == Bf16Products::Bf16),
                    Err(error) => assert_eq!(
                        error.to_string(),
                        format!(
                            "cpu device option `bf16_products` is `bf16`, which needs isa \
                             avx512_bf16; the device runs at {level}"
                        )
                    ),
                }
            } else {
                let message = parsed.unwrap_err().to_string();
                let prefix = format!("cpu device option `isa` asks for {level}, but this CPU");
                assert!(message.starts_with(&prefix), "{message}");
                assert!(message.ends_with(detected.name()), "{message}");
            }
        }
        assert_eq!(
            CpuConfig::parse("isa=sse4").unwrap_err().to_string(),
            "cpu device option `isa` must be one of portable, avx2, avx512, avx512_vnni, \
             avx512_bf16, got `sse4`"
        );
    }
}
