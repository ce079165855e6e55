//! The deployment fingerprint (`system_fingerprint`): one short hash of everything that can change a request's tokens, computed at start and again for each reloaded deployment, never per request.
//!
//! It covers the model folder's files (weights, config, tokenizer, templates, generation
//! config) by content, the generation defaults in force (`--generation-config`), the KV
//! cache's dtype and block size, the device library and its numeric
//! options (everything but `threads`, which never changes results, plus the CPU features and
//! `PLUGHOST_CPU_ISA` cap a CPU device picks its kernels by), every component's sha256 and
//! WIT version, and plughost's version. File contents are hashed with BLAKE3 and cached by
//! path, size and modification time, so a restart does not read the weights again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};

use crate::kv::tier::NumericFingerprint;
use crate::model::GenerationDefaults;
use crate::plugins::ComponentStatus;

/// The files of a model folder that decide its tokens.
fn model_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            name.ends_with(".safetensors")
                || name.ends_with(".safetensors.index.json")
                || name.ends_with(".gguf")
                || name.ends_with(".jinja")
                || matches!(
                    name.as_str(),
                    "config.json"
                        | "tokenizer.json"
                        | "tokenizer_config.json"
                        | "generation_config.json"
                        | "chat_template.json"
                )
        })
        .collect();
    files.sort();
    files
}

/// What the fingerprint covers besides the plugin components, fixed when the model loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIdentity {
    /// `file: hash` lines of the model folder, by content.
    files: String,
    kv: String,
    device: String,
}

impl ModelIdentity {
    /// Hashes the model folder (through the cache in `cache_dir`, if any) and records the rest.
    pub fn new(
        model_dir: &Path,
        kv_dtype: &str,
        block_size: u32,
        device_library: &Path,
        device_config: &str,
        cache_dir: Option<&Path>,
    ) -> ModelIdentity {
        let mut cache = HashCache::open(cache_dir);
        let mut files = String::new();
        for path in model_files(model_dir) {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            files.push_str(&format!("{name}: {}\n", cache.hash(&path)));
        }
        cache.save();
        let device = format!(
            "library {}\noptions {}\ncpu {}\ncap {}\n",
            cache.hash(device_library),
            numeric_options(device_config),
            cpu_features(),
            std::env::var("PLUGHOST_CPU_ISA").unwrap_or_default()
        );
        ModelIdentity {
            files,
            kv: format!("kv {kv_dtype} block_size {block_size}\n"),
            device,
        }
    }

    /// Also covers the generation defaults requests get (`--generation-config` may take them
    /// from another folder or leave them out), since a seeded request that leaves its
    /// temperature out samples with them.
    pub fn with_generation_defaults(mut self, defaults: &GenerationDefaults) -> ModelIdentity {
        self.files
            .push_str(&format!("generation defaults: {defaults:?}\n"));
        self
    }

    /// Weights quantized at load change every token: `--quantize` is part of the identity.
    pub fn with_quantization(mut self, quantization: Option<&str>) -> ModelIdentity {
        if let Some(target) = quantization {
            self.files
                .push_str(&format!("quantized at load: {target}\n"));
        }
        self
    }

    /// The fingerprint of this model with its glue (`glue`: its sha256 and WIT version) and
    /// `components`: `fp_` and 16 hex digits.
    pub fn fingerprint(&self, glue: &str, components: &[ComponentStatus]) -> String {
        self.fingerprint_parts(glue, components).0
    }

    /// The fingerprint and its numeric part, in one pass: the numeric part covers what
    /// decides a KV block's numbers (the version, the glue, the model's files, the KV dtype
    /// and block size, the device's numeric options), the fingerprint that and the
    /// components. The KV tiers key blocks by the numeric part, so a change of sampler or
    /// scheduler keeps them and a change of weights or kernels never finds them.
    pub fn fingerprint_parts(
        &self,
        glue: &str,
        components: &[ComponentStatus],
    ) -> (String, NumericFingerprint) {
        let mut hasher = blake3::Hasher::new();
        hasher.update(concat!("plughost ", env!("CARGO_PKG_VERSION"), "\n").as_bytes());
        hasher.update(format!("glue {glue}\n").as_bytes());
        hasher.update(self.files.as_bytes());
        hasher.update(self.kv.as_bytes());
        hasher.update(self.device.as_bytes());
        let mut numeric = [0u8; 16];
        numeric.copy_from_slice(&hasher.finalize().as_bytes()[..16]);
        for c in components {
            let line = format!(
                "{} {} {} {}\n",
                c.slot,
                c.name.as_deref().unwrap_or("-"),
                c.sha256,
                c.wit_version
            );
            hasher.update(line.as_bytes());
        }
        let hash = hasher.finalize();
        (
            format!("fp_{}", &hash.to_hex()[..16]),
            NumericFingerprint::from_bytes(numeric),
        )
    }
}

/// The device options that can change results, in a stable order: all but `threads` and
/// `prefetch` (which lines the caches are asked for early).
fn numeric_options(config: &str) -> String {
    let timing_only = ["threads=", "prefetch="];
    let mut options: Vec<&str> = config
        .split(',')
        .map(str::trim)
        .filter(|o| !o.is_empty() && !timing_only.iter().any(|key| o.starts_with(key)))
        .collect();
    options.sort_unstable();
    options.join(",")
}

/// The x86 feature levels a CPU device may choose its kernels by.
fn cpu_features() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let levels = [
            (
                "avx2",
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma"),
            ),
            (
                "avx512",
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw"),
            ),
            (
                "avx512_vnni",
                std::arch::is_x86_feature_detected!("avx512vnni"),
            ),
            (
                "avx512_bf16",
                std::arch::is_x86_feature_detected!("avx512bf16"),
            ),
        ];
        levels
            .iter()
            .filter(|(_, has)| *has)
            .map(|(name, _)| *name)
            .collect::<Vec<_>>()
            .join(",")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        std::env::consts::ARCH.to_string()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct CachedHash {
    size: u64,
    modified_ns: u128,
    blake3: String,
}

/// File hashes by path, size and modification time, kept in `file-hashes.json` of a folder.
struct HashCache {
    file: Option<PathBuf>,
    entries: BTreeMap<String, CachedHash>,
    changed: bool,
}

impl HashCache {
    fn open(dir: Option<&Path>) -> HashCache {
        let file = dir.map(|d| d.join("file-hashes.json"));
        let entries = file
            .as_ref()
            .and_then(|f| std::fs::read_to_string(f).ok())
            .and_then(|text| serde_json::from_str(&text).ok())
            .unwrap_or_default();
        HashCache {
            file,
            entries,
            changed: false,
        }
    }

    /// The file's BLAKE3 in hex, from the cache when size and modification time match;
    /// `unreadable` when it cannot be read (the fingerprint then says so, it does not fail).
    fn hash(&mut self, path: &Path) -> String {
        let Ok(meta) = std::fs::metadata(path) else {
            return "unreadable".into();
        };
        let modified_ns = meta
            .modified()
            .ok()
            .and_then(|m| m.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let key = path
            .canonicalize()
            .unwrap_or_else(|_| path.to_path_buf())
            .display()
            .to_string();
        if let Some(hit) = self.entries.get(&key)
            && hit.size == meta.len()
            && hit.modified_ns == modified_ns
        {
            return hit.blake3.clone();
        }
        let mut hasher = blake3::Hasher::new();
        let hashed = std::fs::File::open(path).and_then(|mut f| std::io::copy(&mut f, &mut hasher));
        if hashed.is_err() {
            return "unreadable".into();
        }
        let hex = hasher.finalize().to_hex().to_string();
        self.entries.insert(
            key,
            CachedHash {
                size: meta.len(),
                modified_ns,
                blake3: hex.clone(),
            },
        );
        self.changed = true;
        hex
    }

    fn save(&self) {
        let (Some(file), true) = (&self.file, self.changed) else {
            return;
        };
        let Ok(text) = serde_json::to_string_pretty(&self.entries) else {
            return;
        };
        if let Some(dir) = file.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = file.with_extension("json.tmp");
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, file);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_and_prefetch_do_not_count_and_option_order_does_not_matter() {
        assert_eq!(
            numeric_options("threads=2, bf16_products=f32,isa=avx2"),
            numeric_options("isa=avx2,bf16_products=f32,threads=8,prefetch=on")
        );
        assert_ne!(
            numeric_options("bf16_products=f32"),
            numeric_options("bf16_products=bf16")
        );
    }

    #[test]
    fn the_cache_answers_for_an_unchanged_file_and_rehashes_a_changed_one() {
        let dir = std::env::temp_dir().join(format!("plughost-fingerprint-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("folder");
        let file = dir.join("model.safetensors");
        std::fs::write(&file, b"weights one").expect("write");
        let mut cache = HashCache::open(Some(&dir));
        let first = cache.hash(&file);
        assert_eq!(first, blake3::hash(b"weights one").to_hex().to_string());
        cache.save();
        // A cached entry is believed while size and time match; a rewrite changes both.
        let mut reopened = HashCache::open(Some(&dir));
        assert_eq!(reopened.hash(&file), first);
        assert!(!reopened.changed);
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&file, b"weights two!").expect("rewrite");
        assert_eq!(
            reopened.hash(&file),
            blake3::hash(b"weights two!").to_hex().to_string()
        );
    }
}
