//! Finding and building the workspace's plugins into the one folder the host and tests load them from.
//!
//! A package is a plugin when its Cargo.toml has `[package.metadata.plughost]
//! kind = "scheduler" | "sampler" | "model-glue" | "device"`. Components are
//! built one package per cargo invocation: the SDK's world features must not
//! unify across plugins, or a component would claim exports it lacks.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

const WASM_TARGET: &str = "wasm32-wasip2";

pub struct Workspace {
    root: PathBuf,
    target_dir: PathBuf,
    plugins: Vec<Plugin>,
}

struct Plugin {
    package: String,
    /// The library target's name, which names the built artifact.
    lib_name: String,
    is_device: bool,
}

impl Workspace {
    pub fn discover() -> Result<Self> {
        let output = Command::new(cargo())
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .output()
            .context("running cargo metadata")?;
        if !output.status.success() {
            bail!(
                "cargo metadata failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let meta: Value =
            serde_json::from_slice(&output.stdout).context("parsing cargo metadata")?;
        let root = PathBuf::from(
            meta["workspace_root"]
                .as_str()
                .context("no workspace_root")?,
        );
        let target_dir = PathBuf::from(
            meta["target_directory"]
                .as_str()
                .context("no target_directory")?,
        );
        let mut plugins = Vec::new();
        for package in meta["packages"].as_array().into_iter().flatten() {
            let Some(kind) = package["metadata"]["plughost"]["kind"].as_str() else {
                continue;
            };
            let package_name = package["name"]
                .as_str()
                .context("package without a name")?
                .to_string();
            let lib_name = package["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|t| {
                    t["kind"]
                        .as_array()
                        .is_some_and(|k| k.iter().any(|k| k == "cdylib"))
                })
                .and_then(|t| t["name"].as_str())
                .with_context(|| format!("plugin {package_name} has no cdylib target"))?
                .replace('-', "_");
            let is_device = match kind {
                "device" => true,
                "scheduler" | "sampler" | "model-glue" => false,
                other => bail!("plugin {package_name} has unknown kind {other:?}"),
            };
            plugins.push(Plugin {
                package: package_name,
                lib_name,
                is_device,
            });
        }
        plugins.sort_by(|a, b| a.package.cmp(&b.package));
        Ok(Workspace {
            root,
            target_dir,
            plugins,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn target_dir(&self) -> &Path {
        &self.target_dir
    }

    /// Runs cargo in the workspace root with extra environment, failing on a non-zero exit.
    pub fn cargo(&self, args: &[&str], env: &[(&str, &OsStr)]) -> Result<()> {
        eprintln!("$ cargo {}", args.join(" "));
        let mut command = Command::new(cargo());
        command.args(args).current_dir(&self.root);
        for (key, value) in env {
            command.env(key, value);
        }
        let status = command
            .status()
            .with_context(|| format!("running cargo {}", args.join(" ")))?;
        if !status.success() {
            bail!("cargo {} failed ({status})", args.join(" "));
        }
        Ok(())
    }

    /// Builds every plugin in release and copies the artifacts into `target/plugins`.
    pub fn build_plugins(&self) -> Result<PathBuf> {
        self.build_plugins_with(&[])
    }

    /// [`Workspace::build_plugins`], with `also` built in release in the same cargo invocation
    /// as the device libraries. A device library is a cdylib, whose file name carries no hash of
    /// its dependencies' features: built once alone and once beside packages that turn on more
    /// of those features, each build would overwrite the other's file and make the next one
    /// compile it again.
    pub fn build_plugins_with(&self, also: &[&str]) -> Result<PathBuf> {
        ensure_target(WASM_TARGET)?;
        let out = self.target_dir.join("plugins");
        std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
        let total = self.plugins.len();
        for (i, plugin) in self.plugins.iter().filter(|p| !p.is_device).enumerate() {
            eprintln!("[{}/{total}] component {}", i + 1, plugin.package);
            self.cargo(
                &[
                    "build",
                    "--release",
                    "--target",
                    WASM_TARGET,
                    "-p",
                    &plugin.package,
                ],
                &[],
            )?;
            let built = self
                .target_dir
                .join(WASM_TARGET)
                .join("release")
                .join(format!("{}.wasm", plugin.lib_name));
            copy(&built, &out.join(format!("{}.wasm", plugin.lib_name)))?;
        }
        let devices: Vec<&Plugin> = self.plugins.iter().filter(|p| p.is_device).collect();
        if !devices.is_empty() || !also.is_empty() {
            match also {
                [] => eprintln!("[{total}/{total}] device libraries"),
                _ => eprintln!("[{total}/{total}] device libraries, {}", also.join(", ")),
            }
            let mut args = vec!["build", "--release"];
            for package in devices
                .iter()
                .map(|d| d.package.as_str())
                .chain(also.iter().copied())
            {
                args.extend(["-p", package]);
            }
            self.cargo(&args, &[])?;
            for d in devices {
                let file = format!(
                    "{}{}{}",
                    std::env::consts::DLL_PREFIX,
                    d.lib_name,
                    std::env::consts::DLL_SUFFIX
                );
                copy(
                    &self.target_dir.join("release").join(&file),
                    &out.join(&file),
                )?;
            }
        }
        Ok(out)
    }
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string())
}

/// Copies into a temporary file beside `to`, then renames it over `to`: a server that has the
/// old library mapped keeps its (unlinked) copy instead of crashing on a file rewritten in place.
fn copy(from: &Path, to: &Path) -> Result<()> {
    let mut partial = to.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    std::fs::copy(from, &partial)
        .with_context(|| format!("copying {} to {}", from.display(), partial.display()))?;
    std::fs::rename(&partial, to)
        .with_context(|| format!("renaming {} to {}", partial.display(), to.display()))?;
    Ok(())
}

/// Installs a compilation target's standard library with rustup when the toolchain lacks it.
pub fn ensure_target(target: &str) -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .with_context(|| format!("running rustup: the {target} target is installed through it"))?;
    if String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|l| l.trim() == target)
    {
        return Ok(());
    }
    eprintln!("installing the {target} target with rustup");
    let status = Command::new("rustup")
        .args(["target", "add", target])
        .status()
        .context("running rustup target add")?;
    if !status.success() {
        bail!("rustup target add {target} failed ({status})");
    }
    Ok(())
}

/// clippy's compiler driver from the active toolchain, installing the clippy component with
/// rustup if it is missing.
pub fn clippy_driver() -> Result<PathBuf> {
    let sysroot = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .args(["--print", "sysroot"])
        .output()
        .context("running rustc --print sysroot")?;
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_string();
    let driver = Path::new(&sysroot)
        .join("bin")
        .join(format!("clippy-driver{}", std::env::consts::EXE_SUFFIX));
    if driver.is_file() {
        return Ok(driver);
    }
    eprintln!("installing clippy with rustup");
    let status = Command::new("rustup")
        .args(["component", "add", "clippy"])
        .status()
        .context("running rustup component add clippy")?;
    if !status.success() || !driver.is_file() {
        bail!(
            "clippy's driver is missing at {} ({status})",
            driver.display()
        );
    }
    Ok(driver)
}
