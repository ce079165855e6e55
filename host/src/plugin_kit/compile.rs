//! `plughost plugin build`: reads a plugin crate's marker, builds its component for wasm32-wasip2 and describes the result.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use super::sdk::write_file;
use super::{PluginKind, PluginKitError};
use crate::plugins::ComponentContract;

const WASM_TARGET: &str = "wasm32-wasip2";

/// A built component and what the checks and the report need to know about it.
#[derive(Debug, Clone)]
pub struct BuiltPlugin {
    pub name: String,
    pub kind: PluginKind,
    pub wasm: PathBuf,
    pub sha256: String,
    /// Versions of the `plughost:plugin` package the component imports or exports.
    pub wit_versions: Vec<String>,
    /// The sample config from `[package.metadata.plughost] config`, as JSON.
    pub config_json: String,
    /// A deployment file naming only this component with its sample config.
    pub deployment: PathBuf,
}

/// The marker of a plugin crate.
struct Marker {
    name: String,
    kind: PluginKind,
    config: toml::Table,
    config_json: String,
}

fn read_marker(manifest: &Path) -> Result<Marker, PluginKitError> {
    let not_a_plugin = |reason: String| PluginKitError::NotAPlugin {
        manifest: manifest.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(manifest).map_err(|e| PluginKitError::io(manifest, e))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| not_a_plugin(format!("does not parse: {e}")))?;
    let package = table
        .get("package")
        .ok_or_else(|| not_a_plugin("has no [package]".into()))?;
    let name = package
        .get("name")
        .and_then(|n| n.as_str())
        .ok_or_else(|| not_a_plugin("has no package name".into()))?
        .to_string();
    let marker = package
        .get("metadata")
        .and_then(|m| m.get("plughost"))
        .ok_or_else(|| {
            not_a_plugin(
                "has no [package.metadata.plughost] table; add `kind = \"scheduler\"` \
                 (or \"sampler\", \"model-glue\") there"
                    .into(),
            )
        })?;
    let world = marker.get("kind").and_then(|k| k.as_str()).unwrap_or("");
    let kind = PluginKind::from_world(world).ok_or_else(|| {
        not_a_plugin(format!(
            "[package.metadata.plughost] kind is {world:?}; it must be \"scheduler\", \
             \"sampler\" or \"model-glue\""
        ))
    })?;
    let config = match marker.get("config") {
        None => toml::Table::new(),
        Some(toml::Value::Table(config)) => config.clone(),
        Some(_) => {
            return Err(not_a_plugin(
                "[package.metadata.plughost] config must be a table".into(),
            ));
        }
    };
    // The JSON a deployment's `config` table becomes, as `init` receives it.
    let config_json = serde_json::to_string(&config)
        .map_err(|e| not_a_plugin(format!("[package.metadata.plughost] config: {e}")))?;
    let is_cdylib = table
        .get("lib")
        .and_then(|l| l.get("crate-type"))
        .and_then(|t| t.as_array())
        .is_some_and(|types| types.iter().any(|t| t.as_str() == Some("cdylib")));
    if !is_cdylib {
        return Err(not_a_plugin(
            "a plugin needs `[lib] crate-type = [\"cdylib\"]`: the component is a cdylib".into(),
        ));
    }
    Ok(Marker {
        name,
        kind,
        config,
        config_json,
    })
}

/// Installs the wasm32-wasip2 target with rustup when it is missing. Without rustup the
/// build goes ahead and cargo reports a missing target itself.
fn ensure_wasm_target() -> Result<(), PluginKitError> {
    let Ok(output) = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
    else {
        return Ok(());
    };
    if String::from_utf8_lossy(&output.stdout)
        .lines()
        .any(|line| line.trim() == WASM_TARGET)
    {
        return Ok(());
    }
    eprintln!("installing the {WASM_TARGET} target with rustup");
    let status = Command::new("rustup")
        .args(["target", "add", WASM_TARGET])
        .status()
        .map_err(|source| PluginKitError::Spawn {
            program: "rustup".into(),
            source,
        })?;
    if !status.success() {
        return Err(PluginKitError::TargetInstall {
            target: WASM_TARGET.into(),
            status: status.to_string(),
        });
    }
    Ok(())
}

/// Builds the crate in `dir` and describes the component. Cargo's diagnostics go to stderr as
/// it prints them; the artifact's path comes from its JSON messages, so any target dir works.
pub fn build(dir: &Path) -> Result<BuiltPlugin, PluginKitError> {
    let manifest = dir.join("Cargo.toml");
    let marker = read_marker(&manifest)?;
    ensure_wasm_target()?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut child = Command::new(&cargo)
        .arg("build")
        .arg("--release")
        .args(["--target", WASM_TARGET])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--message-format=json-render-diagnostics")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|source| PluginKitError::Spawn {
            program: cargo.to_string_lossy().into_owned(),
            source,
        })?;
    let mut wasm = None;
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let Ok(message) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            if message["reason"] != "compiler-artifact" {
                continue;
            }
            let is_cdylib = message["target"]["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "cdylib"));
            let is_this_package = message["target"]["name"]
                .as_str()
                .is_some_and(|n| n.replace('-', "_") == marker.name.replace('-', "_"));
            if !(is_cdylib && is_this_package) {
                continue;
            }
            for file in message["filenames"].as_array().into_iter().flatten() {
                if let Some(file) = file.as_str().filter(|f| f.ends_with(".wasm")) {
                    wasm = Some(PathBuf::from(file));
                }
            }
        }
    }
    let status = child.wait().map_err(|source| PluginKitError::Spawn {
        program: cargo.to_string_lossy().into_owned(),
        source,
    })?;
    if !status.success() {
        return Err(PluginKitError::BuildFailed(status.to_string()));
    }
    let wasm = wasm.ok_or_else(|| PluginKitError::NoComponent(marker.name.clone()))?;
    let bytes = std::fs::read(&wasm).map_err(|e| PluginKitError::io(&wasm, e))?;
    let sha256 = hex(&Sha256::digest(&bytes));
    let contract =
        ComponentContract::read(&bytes).map_err(|reason| PluginKitError::BadComponent {
            path: wasm.clone(),
            reason,
        })?;
    // The same checks the host makes when it loads the component, so a build that passes here
    // loads there.
    contract.check(&wasm.display().to_string(), marker.kind.world())?;
    let wit_versions = contract.versions().to_vec();
    let deployment = wasm.with_extension("deploy.toml");
    write_file(
        &deployment,
        deployment_toml(marker.kind, &wasm, &marker.config).as_bytes(),
    )?;
    Ok(BuiltPlugin {
        name: marker.name,
        kind: marker.kind,
        wasm,
        sha256,
        wit_versions,
        config_json: marker.config_json,
        deployment,
    })
}

/// A deployment file that names the component alone, with its sample config.
fn deployment_toml(kind: PluginKind, wasm: &Path, config: &toml::Table) -> String {
    let mut slot = toml::Table::new();
    slot.insert(
        "component".into(),
        toml::Value::String(wasm.display().to_string()),
    );
    slot.insert("config".into(), toml::Value::Table(config.clone()));
    let mut file = toml::Table::new();
    file.insert(kind.deployment_slot().into(), toml::Value::Table(slot));
    format!(
        "# Written by `plughost plugin build`: this component alone, with its sample config.\n{}",
        toml::to_string(&file).unwrap_or_default()
    )
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_without_the_marker_or_cdylib_is_refused_with_the_fix() {
        let dir = std::env::temp_dir().join(format!("plughost-marker-{}", std::process::id()));
        let manifest = dir.join("Cargo.toml");
        let cases = [
            ("[package]\nname = \"a\"\n", "[package.metadata.plughost]"),
            (
                "[package]\nname = \"a\"\n[package.metadata.plughost]\nkind = \"router\"\n",
                "\"router\"",
            ),
            (
                "[package]\nname = \"a\"\n[package.metadata.plughost]\nkind = \"sampler\"\n",
                "crate-type = [\"cdylib\"]",
            ),
        ];
        for (text, needle) in cases {
            write_file(&manifest, text.as_bytes()).unwrap();
            let error = read_marker(&manifest).err().map(|e| e.to_string());
            assert!(
                error.as_deref().is_some_and(|e| e.contains(needle)),
                "{error:?}"
            );
        }
        let good = "[package]\nname = \"a-b\"\n[package.metadata.plughost]\nkind = \"sampler\"\n\
                    config = { top_k = 3 }\n[lib]\ncrate-type = [\"cdylib\"]\n";
        write_file(&manifest, good.as_bytes()).unwrap();
        let marker = read_marker(&manifest).unwrap();
        assert_eq!(marker.kind, PluginKind::Sampler);
        assert_eq!(marker.config_json, r#"{"top_k":3}"#);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
