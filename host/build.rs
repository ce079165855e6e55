//! Packs the plugin SDK (`plugins/sdk` with its WIT contract) into the binary, so `plughost plugin new` writes a copy that builds on its own.
//!
//! The SDK's manifest inherits from the workspace; the packed one has every
//! inherited key resolved, since the copy lives outside this workspace.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn main() {
    let manifest_dir =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let root = manifest_dir
        .parent()
        .expect("host/ sits in the workspace root");
    let sdk = root.join("plugins").join("sdk");
    println!("cargo::rerun-if-changed={}", sdk.display());
    println!("cargo::rerun-if-changed={}", root.join("wit").display());
    println!(
        "cargo::rerun-if-changed={}",
        root.join("Cargo.toml").display()
    );

    let mut files = Vec::new();
    for dir in ["src", "wit"] {
        collect(&sdk, &sdk.join(dir), &mut files);
    }
    files.sort();
    let manifest = standalone_manifest(&sdk.join("Cargo.toml"), &root.join("Cargo.toml"));

    let mut out = String::new();
    out.push_str("/// The SDK's files, relative to its crate folder, and their contents.\n");
    out.push_str("pub const SDK_FILES: &[(&str, &[u8])] = &[\n");
    for (relative, absolute) in &files {
        writeln!(out, "    ({relative:?}, include_bytes!({absolute:?})),").unwrap();
    }
    out.push_str("];\n");
    writeln!(
        out,
        "/// The SDK's Cargo.toml with every workspace key resolved."
    )
    .unwrap();
    writeln!(out, "pub const SDK_MANIFEST: &str = {manifest:?};").unwrap();
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it"));
    std::fs::write(out_dir.join("plugin_sdk.rs"), out).expect("writing plugin_sdk.rs");
}

/// Every file under `dir` (following links, as the SDK's `wit` is one) as (path relative to
/// `base` with `/` separators, absolute path).
fn collect(base: &Path, dir: &Path, files: &mut Vec<(String, String)>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let metadata = std::fs::metadata(&path).expect("metadata of an SDK file");
        if metadata.is_dir() {
            collect(base, &path, files);
        } else {
            let relative = path.strip_prefix(base).expect("under the SDK folder");
            let relative: Vec<String> = relative
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let absolute = std::fs::canonicalize(&path).expect("an SDK file's path");
            files.push((relative.join("/"), absolute.to_string_lossy().into_owned()));
        }
    }
}

/// The SDK manifest with `key.workspace = true` replaced by the workspace's values.
fn standalone_manifest(sdk_manifest: &Path, workspace_manifest: &Path) -> String {
    let read = |path: &Path| -> toml::Table {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        text.parse()
            .unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
    };
    let mut sdk = read(sdk_manifest);
    let workspace = read(workspace_manifest);
    let shared = &workspace["workspace"];
    if let Some(toml::Value::Table(package)) = sdk.get_mut("package") {
        for (key, value) in package.iter_mut() {
            if is_inherited(value) {
                *value = shared["package"]
                    .get(key)
                    .unwrap_or_else(|| panic!("the workspace has no package.{key}"))
                    .clone();
            }
        }
    }
    for section in ["dependencies", "dev-dependencies", "build-dependencies"] {
        let Some(toml::Value::Table(dependencies)) = sdk.get_mut(section) else {
            continue;
        };
        for (name, value) in dependencies.iter_mut() {
            if !is_inherited(value) {
                continue;
            }
            let mut resolved = match shared["dependencies"].get(name) {
                Some(toml::Value::String(version)) => {
                    let mut table = toml::Table::new();
                    table.insert("version".into(), toml::Value::String(version.clone()));
                    table
                }
                Some(toml::Value::Table(table)) => table.clone(),
                _ => panic!("the workspace has no dependency {name}"),
            };
            assert!(
                !resolved.contains_key("path"),
                "the SDK's dependency {name} must come from a registry to be copied"
            );
            let toml::Value::Table(local) = value else {
                unreachable!()
            };
            for (key, local_value) in local.iter() {
                match key.as_str() {
                    "workspace" => {}
                    "features" => {
                        let mut features = resolved
                            .get("features")
                            .and_then(|f| f.as_array().cloned())
                            .unwrap_or_default();
                        features.extend(local_value.as_array().cloned().unwrap_or_default());
                        resolved.insert("features".into(), toml::Value::Array(features));
                    }
                    _ => {
                        resolved.insert(key.clone(), local_value.clone());
                    }
                }
            }
            *value = toml::Value::Table(resolved);
        }
    }
    let package = sdk
        .remove("package")
        .expect("the SDK manifest has a [package]");
    let mut package_table = toml::Table::new();
    package_table.insert("package".into(), package);
    format!(
        "# plughost-sdk, as shipped in the plughost binary that wrote this folder.\n{}\n{}",
        toml::to_string(&package_table).expect("a TOML table serializes"),
        toml::to_string(&sdk).expect("a TOML table serializes")
    )
}

fn is_inherited(value: &toml::Value) -> bool {
    value
        .get("workspace")
        .and_then(toml::Value::as_bool)
        .unwrap_or(false)
}
