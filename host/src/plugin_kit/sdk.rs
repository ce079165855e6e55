//! The plugin SDK a new crate depends on: the copy this binary ships, a local crate, or a registry version.

use std::path::{Path, PathBuf};

use super::{PluginKind, PluginKitError};

mod bundled {
    include!(concat!(env!("OUT_DIR"), "/plugin_sdk.rs"));
}

/// The folder, inside a new crate, the shipped SDK is written to.
pub const BUNDLED_DIR: &str = "plughost-sdk";

/// Where a new plugin crate gets `plughost-sdk` from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SdkSource {
    /// The copy shipped in this binary, written into the crate's `plughost-sdk/` folder.
    Bundled,
    /// An existing `plughost-sdk` crate (e.g. `plugins/sdk` of a plughost checkout).
    Path(PathBuf),
    /// A version requirement resolved from the crate registry.
    Version(String),
}

impl SdkSource {
    /// Reads `--sdk`: an existing folder is a path; something shaped like a version is a
    /// version; anything else is an error rather than a guess.
    pub fn parse(value: Option<&str>) -> Result<SdkSource, PluginKitError> {
        let Some(value) = value else {
            return Ok(SdkSource::Bundled);
        };
        let path = Path::new(value);
        if path.is_dir() {
            let manifest = path.join("Cargo.toml");
            let text = std::fs::read_to_string(&manifest).map_err(|e| {
                PluginKitError::BadSdk(value.into(), format!("no readable Cargo.toml: {e}"))
            })?;
            let table: toml::Table = text.parse().map_err(|e| {
                PluginKitError::BadSdk(value.into(), format!("Cargo.toml does not parse: {e}"))
            })?;
            let name = table
                .get("package")
                .and_then(|p| p.get("name"))
                .and_then(|n| n.as_str());
            if name != Some("plughost-sdk") {
                return Err(PluginKitError::BadSdk(
                    value.into(),
                    format!("the crate there is {name:?}, not plughost-sdk"),
                ));
            }
            let absolute = std::fs::canonicalize(path).map_err(|e| PluginKitError::io(path, e))?;
            return Ok(SdkSource::Path(absolute));
        }
        let looks_like_version = value
            .trim_start_matches(['=', '^', '~'])
            .split('.')
            .all(|part| !part.is_empty() && part.chars().all(|c| c.is_ascii_digit()));
        if looks_like_version {
            Ok(SdkSource::Version(value.to_string()))
        } else {
            Err(PluginKitError::BadSdk(
                value.into(),
                "neither an existing folder nor a version such as 0.1.0".into(),
            ))
        }
    }

    /// The dependency's value in the new crate's Cargo.toml, with the world's feature when
    /// `with_feature`.
    pub fn dependency(&self, kind: PluginKind, with_feature: bool) -> String {
        let source = match self {
            SdkSource::Bundled => format!("path = {:?}", BUNDLED_DIR),
            SdkSource::Path(path) => format!("path = {:?}", path.display().to_string()),
            SdkSource::Version(version) => format!("version = {version:?}"),
        };
        if with_feature {
            format!("{{ {source}, features = [{:?}] }}", kind.world())
        } else {
            format!("{{ {source} }}")
        }
    }

    /// Writes the shipped SDK into `crate_dir` when this source is the bundled copy.
    pub fn write_into(&self, crate_dir: &Path) -> Result<(), PluginKitError> {
        if *self != SdkSource::Bundled {
            return Ok(());
        }
        let root = crate_dir.join(BUNDLED_DIR);
        write_file(&root.join("Cargo.toml"), bundled::SDK_MANIFEST.as_bytes())?;
        for (relative, contents) in bundled::SDK_FILES {
            let mut path = root.clone();
            path.extend(relative.split('/'));
            write_file(&path, contents)?;
        }
        Ok(())
    }
}

pub(super) fn write_file(path: &Path, contents: &[u8]) -> Result<(), PluginKitError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| PluginKitError::io(parent, e))?;
    }
    std::fs::write(path, contents).map_err(|e| PluginKitError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_sdk_has_its_sources_and_the_contract() {
        let files: Vec<&str> = bundled::SDK_FILES.iter().map(|(path, _)| *path).collect();
        assert!(files.contains(&"src/lib.rs"), "{files:?}");
        let package = format!(
            "package plughost:plugin@{};",
            crate::plugins::ContractVersion::CURRENT
        );
        assert!(
            bundled::SDK_FILES.iter().any(|(path, contents)| {
                path.starts_with("wit/")
                    && path.ends_with(".wit")
                    && String::from_utf8_lossy(contents).contains(&package)
            }),
            "no WIT file with `{package}` in {files:?}"
        );
        let manifest: toml::Table = bundled::SDK_MANIFEST.parse().unwrap();
        assert_eq!(manifest["package"]["name"].as_str(), Some("plughost-sdk"));
        assert!(
            !bundled::SDK_MANIFEST.contains("workspace"),
            "{}",
            bundled::SDK_MANIFEST
        );
    }

    #[test]
    fn sdk_sources_parse() {
        assert_eq!(SdkSource::parse(None).unwrap(), SdkSource::Bundled);
        assert_eq!(
            SdkSource::parse(Some("0.1.0")).unwrap(),
            SdkSource::Version("0.1.0".into())
        );
        assert_eq!(
            SdkSource::parse(Some("=0.1")).unwrap(),
            SdkSource::Version("=0.1".into())
        );
        assert!(SdkSource::parse(Some("no/such/folder")).is_err());
        let sdk = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/sdk");
        assert!(matches!(
            SdkSource::parse(Some(sdk.to_str().unwrap())).unwrap(),
            SdkSource::Path(_)
        ));
        let host = env!("CARGO_MANIFEST_DIR");
        assert!(SdkSource::parse(Some(host)).is_err(), "not the SDK crate");
    }
}
