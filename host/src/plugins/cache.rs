//! On-disk cache of compiled components, keyed by content hash and engine compatibility.
//!
//! Compiling a component with Cranelift takes far longer than loading the
//! precompiled artifact, so every start after the first only deserializes.
//! A corrupt or stale entry is recompiled and replaced, never trusted.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

use super::PluginError;

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

    fn entry_path(&self, bytes: &[u8]) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let content = hex(&Sha256::digest(bytes)[..16]);
        Some(dir.join(format!("{content}-{}.cwasm", self.engine_key)))
    }

    /// Loads the component at `path`, from the cache when a valid entry exists.
    pub fn load(&self, engine: &Engine, path: &Path) -> Result<Component, PluginError> {
        let bytes = std::fs::read(path).map_err(|source| PluginError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let compile_error = |e: wasmtime::Error| PluginError::Compile {
            path: path.to_path_buf(),
            message: format!("{e:#}"),
        };
        let Some(entry) = self.entry_path(&bytes) else {
            return Component::new(engine, &bytes).map_err(compile_error);
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
        let compiled = engine.precompile_component(&bytes).map_err(compile_error)?;
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
