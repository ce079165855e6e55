//! The instruction-set levels the kernels run at (`isa=` in the device config), and [`Isa`], the proof that this CPU has one.
//!
//! Levels are ordered, each implying the ones below it, so a device capped at a level runs
//! only instructions of that level and lower: `isa=avx2` on an AVX-512 machine runs exactly
//! what an AVX2-only machine runs. That is what lets the tests cover every kernel path a
//! machine has, whichever one it would pick by itself.
//!
//! [`CAP_VARIABLE`] lowers what detection finds, for the whole process: with
//! `PLUGHOST_CPU_ISA=avx2` every test and every device default behaves as on an AVX2-only CPU.

use std::fmt;
use std::str::FromStr;

/// An instruction-set level, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IsaLevel {
    /// No instruction beyond the compilation target's baseline (SSE2 on x86-64).
    Portable,
    /// AVX2, FMA and F16C.
    Avx2,
    /// AVX-512 F, BW, DQ and VL.
    Avx512,
    /// AVX-512 VNNI (integer dot products).
    Avx512Vnni,
    /// AVX-512 BF16 (`vdpbf16ps`).
    Avx512Bf16,
}

impl IsaLevel {
    /// Every level, lowest first.
    pub const ALL: [IsaLevel; 5] = [
        IsaLevel::Portable,
        IsaLevel::Avx2,
        IsaLevel::Avx512,
        IsaLevel::Avx512Vnni,
        IsaLevel::Avx512Bf16,
    ];

    /// The name `isa=` takes.
    pub fn name(self) -> &'static str {
        match self {
            IsaLevel::Portable => "portable",
            IsaLevel::Avx2 => "avx2",
            IsaLevel::Avx512 => "avx512",
            IsaLevel::Avx512Vnni => "avx512_vnni",
            IsaLevel::Avx512Bf16 => "avx512_bf16",
        }
    }

    /// Whether this CPU has this level's own features (those below are asked separately).
    fn features_present(self) -> bool {
        match self {
            IsaLevel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            IsaLevel::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            IsaLevel::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "x86_64")]
            IsaLevel::Avx512Vnni => std::arch::is_x86_feature_detected!("avx512vnni"),
            #[cfg(target_arch = "x86_64")]
            IsaLevel::Avx512Bf16 => std::arch::is_x86_feature_detected!("avx512bf16"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

impl fmt::Display for IsaLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for IsaLevel {
    type Err = String;

    fn from_str(text: &str) -> Result<IsaLevel, String> {
        IsaLevel::ALL
            .into_iter()
            .find(|level| level.name() == text)
            .ok_or_else(|| {
                let names: Vec<&str> = IsaLevel::ALL.iter().map(|l| l.name()).collect();
                format!("`{text}` is none of {}", names.join(", "))
            })
    }
}

/// The environment variable that caps [`Isa::detect`] at a level, as if the CPU had nothing
/// above it.
pub const CAP_VARIABLE: &str = "PLUGHOST_CPU_ISA";

/// The level [`CAP_VARIABLE`] names, if it is set.
pub fn environment_cap() -> Result<Option<IsaLevel>, String> {
    match std::env::var(CAP_VARIABLE) {
        Ok(text) => text
            .trim()
            .parse()
            .map(Some)
            .map_err(|problem| format!("{CAP_VARIABLE}: {problem}")),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{CAP_VARIABLE} is not UTF-8")),
    }
}

/// A level this CPU has: a capability token. Only detection ([`Isa::detect`], [`Isa::every`])
/// and the config check ([`Isa::at`]) make one, and its field is private to this module, so no
/// other module or crate can make one from a bare [`IsaLevel`]: a kernel handed an `Isa` may
/// run every instruction its level implies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Isa(IsaLevel);

/// `isa=` asked for a level this CPU lacks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingIsa {
    pub requested: IsaLevel,
    pub available: IsaLevel,
}

impl fmt::Display for MissingIsa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = IsaLevel::ALL
            .iter()
            .filter(|&&level| level <= self.available)
            .map(|level| level.name())
            .collect();
        write!(
            f,
            "this CPU has no {}; its levels are {}",
            self.requested,
            names.join(", ")
        )
    }
}

impl std::error::Error for MissingIsa {}

impl Isa {
    /// The highest level this CPU has, no higher than [`CAP_VARIABLE`] says. (The device
    /// refuses to open with a cap it cannot read, see [`environment_cap`].)
    pub fn detect() -> Isa {
        let cap = environment_cap()
            .ok()
            .flatten()
            .unwrap_or(IsaLevel::Avx512Bf16);
        let mut highest = IsaLevel::Portable;
        for level in IsaLevel::ALL.into_iter().skip(1) {
            if level > cap || !level.features_present() {
                break;
            }
            highest = level;
        }
        Isa(highest)
    }

    /// The portable level, which every CPU has.
    pub fn portable() -> Isa {
        Isa(IsaLevel::Portable)
    }

    /// `level`, if this CPU has it.
    pub fn at(level: IsaLevel) -> Result<Isa, MissingIsa> {
        let available = Isa::detect().level();
        if level <= available {
            Ok(Isa(level))
        } else {
            Err(MissingIsa {
                requested: level,
                available,
            })
        }
    }

    /// Every level this CPU has, lowest first: what the tests run each kernel at.
    pub fn every() -> Vec<Isa> {
        let available = Isa::detect().level();
        IsaLevel::ALL
            .into_iter()
            .filter(|&level| level <= available)
            .map(Isa)
            .collect()
    }

    pub fn level(self) -> IsaLevel {
        self.0
    }

    /// Whether this level includes `level`'s instructions.
    pub fn has(self, level: IsaLevel) -> bool {
        self.0 >= level
    }

    /// The vector instructions this level's kernels are written in.
    pub(crate) fn vectors(self) -> Vectors {
        #[cfg(target_arch = "x86_64")]
        {
            if self.has(IsaLevel::Avx512) {
                return Vectors::Avx512;
            }
            if self.has(IsaLevel::Avx2) {
                return Vectors::Avx2;
            }
        }
        Vectors::Portable
    }
}

/// The vector instructions a kernel family has a body in: 16-lane AVX-512, 8-lane AVX2, or
/// portable code. Kernels take a value only from [`Isa::vectors`], so its instructions are
/// the CPU's; the type is private to the crate, so no other crate can make one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Vectors {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for level in IsaLevel::ALL {
            assert_eq!(level.name().parse::<IsaLevel>(), Ok(level));
        }
        assert_eq!(
            "avx512bf16".parse::<IsaLevel>(),
            Err("`avx512bf16` is none of portable, avx2, avx512, avx512_vnni, avx512_bf16".into())
        );
    }

    #[test]
    fn the_levels_a_cpu_has_are_those_up_to_the_detected_one() {
        let detected = Isa::detect().level();
        let every = Isa::every();
        assert_eq!(
            every.first().map(|isa| isa.level()),
            Some(IsaLevel::Portable)
        );
        assert_eq!(every.last().map(|isa| isa.level()), Some(detected));
        for level in IsaLevel::ALL {
            match Isa::at(level) {
                Ok(isa) => {
                    assert!(level <= detected);
                    assert!(isa.has(level) && isa.has(IsaLevel::Portable));
                    assert!(!isa.has(IsaLevel::Avx512Bf16) || level == IsaLevel::Avx512Bf16);
                }
                Err(missing) => {
                    assert!(level > detected);
                    let message = missing.to_string();
                    assert!(message.contains(level.name()), "{message}");
                    assert!(message.contains(detected.name()), "{message}");
                }
            }
        }
    }

    /// The detection agrees with the kernel's own view of the machine: the feature flags the
    /// kernels' `target_feature` attributes name.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn detection_follows_the_cpu_flags() {
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            return; // not Linux: nothing independent to compare with
        };
        let flags: Vec<&str> = info
            .lines()
            .filter(|line| line.starts_with("flags"))
            .flat_map(str::split_whitespace)
            .collect();
        let flag = |name: &str| flags.contains(&name);
        if environment_cap() != Ok(None) {
            return; // the detection is capped below what the flags say
        }
        let isa = Isa::detect();
        assert_eq!(
            isa.has(IsaLevel::Avx2),
            flag("avx2") && flag("fma") && flag("f16c")
        );
        let avx512 = ["avx512f", "avx512bw", "avx512dq", "avx512vl"];
        assert_eq!(
            isa.has(IsaLevel::Avx512),
            isa.has(IsaLevel::Avx2) && avx512.into_iter().all(flag)
        );
        assert_eq!(
            isa.has(IsaLevel::Avx512Bf16),
            isa.has(IsaLevel::Avx512) && flag("avx512_vnni") && flag("avx512_bf16")
        );
    }
}
