//! On-disk cache of compiled components, keyed by content hash and engine compatibility.
//!
//! Compiling a component with Cranelift takes far longer than loading the
//! precompiled artifact, so every start after the first only deserializes.
//! A corrupt or stale entry is recompiled and replaced, never trusted. Components already
//! loaded in this process are kept in memory by content hash, so loading one again (a reload
//! that keeps it, or names a file compiled before) costs a hash of the file, not a compile.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

use super::PluginError;
use super::contract::check_component;
use super::runtime::CompiledComponent;

/// Components compiled in this process, by the file's hex SHA-256. There is one engine per
/// process, so an entry is valid for every runtime.
fn loaded() -> &'static Mutex<HashMap<String, CompiledComponent>> {
    static LOADED: OnceLock<Mutex<HashMap<String, CompiledComponent>>> = OnceLock::new();
    LOADED.get_or_init(Default::default)
}

/// Feeds `Hash` output into SHA-256, so the engine's compatibility hash is stable across runs.
struct Sha256Hasher(Sha256);

impl Hasher for Sha256Hasher {
    fn finish(&self) -> u64 {
        0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

pub struct ComponentCache {
    dir: Option<PathBuf>,
    engine_key: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl ComponentCache {
    /// A cache in `dir`; `None` compiles every time.
    pub fn new(engine: &Engine, dir: Option<PathBuf>) -> Self {
        let mut hasher = Sha256Hasher(Sha256::new());
        engine.precompile_compatibility_hash().hash(&mut hasher);
        let engine_key = hex(&hasher.0.finalize()[..8]);
        ComponentCache { dir, engine_key }
    }

    fn entry_path(&self, sha256: &str) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let content = &sha256[..32];
        Some(dir.join(format!("{content}-{}.cwasm", self.engine_key)))
    }

    /// Loads the component at `path`: from memory when this process compiled it already, else
    /// from the disk cache when a valid entry exists, else by compiling it.
    pub(crate) fn load(
        &self,
        engine: &Engine,
        path: &Path,
    ) -> Result<CompiledComponent, PluginError> {
        let bytes = std::fs::read(path).map_err(|source| PluginError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let sha256 = hex(&Sha256::digest(&bytes));
        if let Some(hit) = loaded().lock().ok().and_then(|t| t.get(&sha256).cloned()) {
            return Ok(hit);
        }
        // A component built for another contract is refused before the costly compile.
        let contract = check_component(&path.display().to_string(), &bytes, None)?;
        let component = self.load_bytes(engine, path, &bytes, &sha256)?;
        let compiled = CompiledComponent {
            wit_version: contract.version().to_string(),
            contract,
            component,
            sha256: sha256.clone(),
        };
        if let Ok(mut table) = loaded().lock() {
            table.insert(sha256, compiled.clone());
        }
        Ok(compiled)
    }

    fn load_bytes(
        &self,
        engine: &Engine,
        path: &Path,
        bytes: &[u8],
        sha256: &str,
    ) -> Result<Component, PluginError> {
        let compile_error = |e: wasmtime::Error| PluginError::Compile {
            path: path.to_path_buf(),
            message: format!("{e:#}"),
        };
        let Some(entry) = self.entry_path(sha256) else {
            return Component::new(engine, bytes).map_err(compile_error);
        };
        if entry.exists() {
            // SAFETY: entries are written only by `store` below from
            // `precompile_component` of an engine with the same compatibility
            // hash (part of the file name); wasmtime re-checks the header.
            match unsafe { Component::deserialize_file(engine, &entry) } {
                Ok(component) => return Ok(component),
                Err(e) => {
                    tracing::warn!(entry = %entry.display(), "discarding unreadable compiled component: {e:#}")
                }
            }
        }
        let compiled = engine.precompile_component(bytes).map_err(compile_error)?;
        if let Err(e) = store(&entry, &compiled) {
            tracing::warn!(entry = %entry.display(), "cannot cache compiled component: {e}");
        }
        // SAFETY: `compiled` was produced just above by this engine.
        unsafe { Component::deserialize(engine, &compiled) }.map_err(compile_error)
    }
}

/// Writes through a temporary file and a rename, so a concurrent reader never sees half an entry.
fn store(entry: &Path, compiled: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = entry.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = entry.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, compiled)?;
    std::fs::rename(&tmp, entry)
}
