//! The plugin contract a component names: the `plughost:plugin` version and world it was built for, and whether this host speaks them.
//!
//! Both are read from the component's binary before it is compiled or instantiated, so a
//! component built for another contract is refused with what it was built for instead of a
//! linker error about a missing import.

use semver::Version;

/// The versions of the WIT package this host speaks, oldest first. Components of the newest
/// run natively; older ones through an adapter that gives them the records they know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ContractVersion {
    /// `plughost:plugin@0.1.0`: the first contract.
    V0_1,
    /// `plughost:plugin@0.2.0`: adds the engine step number to the scheduler's inputs.
    V0_2,
}

impl ContractVersion {
    /// Every version this host speaks, oldest first.
    pub const ALL: [ContractVersion; 2] = [ContractVersion::V0_1, ContractVersion::V0_2];
    /// The version the SDK, the templates and the in-tree plugins are built for.
    pub const CURRENT: ContractVersion = ContractVersion::V0_2;

    /// The release this host implements, as `major.minor.patch`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ContractVersion::V0_1 => "0.1.0",
            ContractVersion::V0_2 => "0.2.0",
        }
    }

    /// The version's WIT, as the host's bindings of it were generated from.
    pub(crate) const fn wit(self) -> &'static str {
        match self {
            ContractVersion::V0_1 => include_str!("../../../wit/0.1/plugin.wit"),
            ContractVersion::V0_2 => include_str!("../../../wit/0.2/plugin.wit"),
        }
    }

    /// The version of this host that speaks `version` under semver: before 1.0 the minor
    /// version must match (`0.2.x` is 0.2), from 1.0 on the major must.
    pub fn of(version: &str) -> Option<ContractVersion> {
        let version = Version::parse(version).ok()?;
        ContractVersion::ALL.into_iter().find(|ours| {
            let ours = Version::parse(ours.as_str()).unwrap_or_else(|_| Version::new(0, 0, 0));
            if ours.major == 0 {
                version.major == 0 && version.minor == ours.minor
            } else {
                version.major == ours.major && version.minor <= ours.minor
            }
        })
    }
}

impl std::fmt::Display for ContractVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The package whose interfaces a component imports and exports.
const CONTRACT_PACKAGE: &str = "plughost:plugin/";

/// Each world and the export that only it has.
const WORLD_EXPORTS: [(&str, &str); 3] = [
    ("scheduler", "schedule"),
    ("sampler", "sample"),
    ("model-glue", "build-program"),
];

/// What a component says about the contract it was built for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentContract {
    versions: Vec<String>,
    world: Option<&'static str>,
}

/// Why a component does not fit this host or the slot it was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    #[error("component {component} is not a readable component: {reason}")]
    Unreadable { component: String, reason: String },
    #[error(
        "component {component} was built for plughost:plugin@{version}; this host speaks {speaks}"
    )]
    Version {
        component: String,
        version: String,
        speaks: String,
    },
    #[error(
        "component {component} names plughost:plugin@{}; a component is built for one version",
        versions.join(" and @")
    )]
    Mixed {
        component: String,
        versions: Vec<String>,
    },
    #[error("{component} exports the {world} world; the [{slot}] slot needs {needs}")]
    World {
        component: String,
        world: &'static str,
        slot: &'static str,
        needs: &'static str,
    },
    #[error("{component} exports no plughost:plugin world; the [{slot}] slot needs {needs}")]
    NoWorld {
        component: String,
        slot: &'static str,
        needs: &'static str,
    },
}

impl ComponentContract {
    /// Reads the contract from a component's bytes: the versions in its `plughost:plugin/…@X`
    /// import and export names, and its world from the functions it exports.
    pub fn read(component: &[u8]) -> Result<ComponentContract, String> {
        use wasmparser::{Parser, Payload};
        let mut imports = Vec::new();
        let mut exports = Vec::new();
        let mut outermost = true;
        let mut depth = 0usize;
        for payload in Parser::new(0).parse_all(component) {
            match payload.map_err(|e| e.to_string())? {
                // Core modules nest inside a component; only the outermost header says what it is.
                Payload::Version { encoding, .. } => {
                    if outermost {
                        outermost = false;
                        if encoding != wasmparser::Encoding::Component {
                            return Err(
                                "a core module, not a component (build for wasm32-wasip2)".into()
                            );
                        }
                    } else {
                        depth += 1;
                    }
                }
                Payload::End(_) => depth = depth.saturating_sub(1),
                Payload::ComponentImportSection(reader) if depth == 0 => {
                    for import in reader {
                        imports.push(import.map_err(|e| e.to_string())?.name.name.to_string());
                    }
                }
                Payload::ComponentExportSection(reader) if depth == 0 => {
                    for export in reader {
                        exports.push(export.map_err(|e| e.to_string())?.name.name.to_string());
                    }
                }
                _ => {}
            }
        }
        let mut versions: Vec<String> = imports
            .iter()
            .chain(&exports)
            .filter_map(|name| name.strip_prefix(CONTRACT_PACKAGE))
            .filter_map(|rest| rest.split_once('@'))
            .map(|(_, version)| version.to_string())
            .collect();
        versions.sort();
        versions.dedup();
        let world = WORLD_EXPORTS
            .iter()
            .find(|(_, export)| exports.iter().any(|name| name == export))
            .map(|(world, _)| *world);
        Ok(ComponentContract { versions, world })
    }

    /// Versions of `plughost:plugin` the component names, sorted and without repeats.
    pub fn versions(&self) -> &[String] {
        &self.versions
    }

    /// The version the component was built for, or the host's newest when it names none.
    pub fn version(&self) -> &str {
        self.versions
            .iter()
            .find(|v| ContractVersion::of(v).is_none())
            .or(self.versions.first())
            .map_or(ContractVersion::CURRENT.as_str(), String::as_str)
    }

    /// The host's version that runs the component: the one it names (the newest when it
    /// names none), if the host speaks it.
    pub fn speaks(&self) -> Option<ContractVersion> {
        ContractVersion::of(self.version())
    }

    /// The world the component exports, when its exports match one.
    pub fn world(&self) -> Option<&'static str> {
        self.world
    }

    /// Refuses a component built for a contract version this host does not speak, or for two
    /// of them at once.
    pub fn check_version(&self, component: &str) -> Result<(), ContractError> {
        if let Some(version) = self
            .versions
            .iter()
            .find(|v| ContractVersion::of(v).is_none())
        {
            return Err(ContractError::Version {
                component: component.to_string(),
                version: version.clone(),
                speaks: host_speaks(),
            });
        }
        let mut spoken: Vec<ContractVersion> = self
            .versions
            .iter()
            .filter_map(|v| ContractVersion::of(v))
            .collect();
        spoken.dedup();
        if spoken.len() > 1 {
            return Err(ContractError::Mixed {
                component: component.to_string(),
                versions: self.versions.clone(),
            });
        }
        Ok(())
    }

    /// Refuses a component whose world is not `needs`, the world of the slot it was given.
    pub fn check_world(&self, component: &str, needs: &'static str) -> Result<(), ContractError> {
        let slot = slot_of(needs);
        match self.world {
            Some(world) if world == needs => Ok(()),
            Some(world) => Err(ContractError::World {
                component: component.to_string(),
                world,
                slot,
                needs,
            }),
            None => Err(ContractError::NoWorld {
                component: component.to_string(),
                slot,
                needs,
            }),
        }
    }

    /// Both checks, version first.
    pub fn check(&self, component: &str, needs: &'static str) -> Result<(), ContractError> {
        self.check_version(component)?;
        self.check_world(component, needs)
    }
}

/// Reads and checks the contract of a component file's bytes in one go.
pub fn check_component(
    component: &str,
    bytes: &[u8],
    needs: Option<&'static str>,
) -> Result<ComponentContract, ContractError> {
    let contract = ComponentContract::read(bytes).map_err(|reason| ContractError::Unreadable {
        component: component.to_string(),
        reason,
    })?;
    contract.check_version(component)?;
    if let Some(needs) = needs {
        contract.check_world(component, needs)?;
    }
    Ok(contract)
}

/// The deployment-file slot that holds a component of `world`.
fn slot_of(world: &'static str) -> &'static str {
    match world {
        "model-glue" => "glue",
        other => other,
    }
}

/// The versions this host speaks, as people write them: `0.1.x or 0.2.x`.
fn host_speaks() -> String {
    let series: Vec<String> = ContractVersion::ALL
        .iter()
        .map(|v| match v.as_str().rsplit_once('.') {
            Some((series, _)) => format!("{series}.x"),
            None => v.as_str().to_string(),
        })
        .collect();
    series.join(" or ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_compatible_under_semver() {
        assert_eq!(ContractVersion::of("0.1.0"), Some(ContractVersion::V0_1));
        assert_eq!(ContractVersion::of("0.1.7"), Some(ContractVersion::V0_1));
        assert_eq!(ContractVersion::of("0.2.3"), Some(ContractVersion::V0_2));
        assert_eq!(ContractVersion::of("0.3.0"), None);
        assert_eq!(ContractVersion::of("1.1.0"), None);
        assert_eq!(ContractVersion::of("zero"), None);
        assert_eq!(host_speaks(), "0.1.x or 0.2.x");
    }

    #[test]
    fn each_version_has_its_wit() {
        for version in ContractVersion::ALL {
            assert!(
                version
                    .wit()
                    .contains(&format!("package plughost:plugin@{version};")),
                "{version}"
            );
        }
    }

    #[test]
    fn the_messages_name_what_the_component_was_built_for() {
        let contract = ComponentContract {
            versions: vec!["0.2.0".into(), "0.3.0".into()],
            world: Some("scheduler"),
        };
        assert_eq!(contract.version(), "0.3.0");
        assert_eq!(contract.speaks(), None);
        assert_eq!(
            contract.check("x.wasm", "sampler").unwrap_err().to_string(),
            "component x.wasm was built for plughost:plugin@0.3.0; this host speaks 0.1.x or 0.2.x"
        );
        let contract = ComponentContract {
            versions: vec!["0.1.0".into(), "0.2.0".into()],
            world: Some("scheduler"),
        };
        assert_eq!(
            contract
                .check("x.wasm", "scheduler")
                .unwrap_err()
                .to_string(),
            "component x.wasm names plughost:plugin@0.1.0 and @0.2.0; a component is built for \
             one version"
        );
        let contract = ComponentContract {
            versions: vec!["0.1.0".into()],
            world: Some("scheduler"),
        };
        assert_eq!(contract.speaks(), Some(ContractVersion::V0_1));
        assert_eq!(
            contract.check("x.wasm", "sampler").unwrap_err().to_string(),
            "x.wasm exports the scheduler world; the [sampler] slot needs sampler"
        );
        assert_eq!(
            contract
                .check("x.wasm", "model-glue")
                .unwrap_err()
                .to_string(),
            "x.wasm exports the scheduler world; the [glue] slot needs model-glue"
        );
        assert!(contract.check("x.wasm", "scheduler").is_ok());
    }

    #[test]
    fn the_contract_is_read_from_built_components() {
        let plugins = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/plugins");
        for (file, world) in [
            ("plughost_scheduler_fcfs.wasm", "scheduler"),
            ("plughost_sampler_standard.wasm", "sampler"),
            ("plughost_model_qwen3.wasm", "model-glue"),
        ] {
            let path = plugins.join(file);
            let bytes = std::fs::read(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e}; run `cargo xtask build-plugins` first",
                    path.display()
                )
            });
            let contract = ComponentContract::read(&bytes).unwrap();
            assert_eq!(contract.world(), Some(world), "{file}");
            assert_eq!(
                contract.versions(),
                [ContractVersion::CURRENT.as_str()],
                "{file}"
            );
        }
        assert!(
            ComponentContract::read(b"\0asm\x01\0\0\0").is_err(),
            "a core module"
        );
    }
}
