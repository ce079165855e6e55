//! `plughost plugin new`: writes a plugin crate with an example policy, its unit tests, a README and the SDK.

use std::path::PathBuf;

use super::sdk::{SdkSource, write_file};
use super::{PluginKind, PluginKitError};

/// What `plugin new` is asked to create.
#[derive(Debug, Clone)]
pub struct NewPlugin {
    pub kind: PluginKind,
    pub name: String,
    /// The folder the crate's folder is created in.
    pub parent: PathBuf,
    pub sdk: SdkSource,
}

/// Creates the crate and returns its folder.
pub fn create(request: &NewPlugin) -> Result<PathBuf, PluginKitError> {
    check_name(&request.name)?;
    let dir = request.parent.join(&request.name);
    match std::fs::read_dir(&dir) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(PluginKitError::TargetNotEmpty(dir));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(PluginKitError::io(&dir, e)),
    }
    let name = request.name.as_str();
    write_file(
        &dir.join("Cargo.toml"),
        manifest(request.kind, name, &request.sdk).as_bytes(),
    )?;
    write_file(
        &dir.join("src/lib.rs"),
        source(request.kind, name).as_bytes(),
    )?;
    write_file(
        &dir.join("README.md"),
        readme(request.kind, name, &request.sdk).as_bytes(),
    )?;
    write_file(&dir.join(".gitignore"), b"/target\n")?;
    request.sdk.write_into(&dir)?;
    Ok(dir)
}

const RESERVED: &[&str] = &[
    "test",
    "core",
    "std",
    "alloc",
    "proc_macro",
    "self",
    "super",
    "crate",
    "Self",
    "fn",
    "mod",
    "struct",
    "enum",
    "impl",
    "trait",
    "type",
    "use",
    "let",
    "match",
    "loop",
    "while",
    "for",
    "if",
    "else",
    "return",
    "async",
    "await",
    "dyn",
    "move",
    "ref",
    "mut",
    "pub",
    "where",
    "unsafe",
    "extern",
    "static",
    "const",
    "true",
    "false",
    "in",
    "as",
    "break",
    "continue",
    "plughost-sdk",
    "plughost_sdk",
];

/// The rules cargo applies to a package name, checked up front so the error names the cause.
fn check_name(name: &str) -> Result<(), PluginKitError> {
    let invalid = |reason| PluginKitError::InvalidName {
        name: name.to_string(),
        reason,
    };
    let Some(first) = name.chars().next() else {
        return Err(invalid("it is empty"));
    };
    if name.len() > 64 {
        return Err(invalid("a crate name has at most 64 characters"));
    }
    if !first.is_ascii_alphabetic() {
        return Err(invalid("a crate name starts with an ASCII letter"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(invalid(
            "a crate name has only ASCII letters, digits, `-` and `_`",
        ));
    }
    if RESERVED.contains(&name) {
        return Err(invalid("the name is reserved"));
    }
    Ok(())
}

fn sample_config(kind: PluginKind) -> &'static str {
    match kind {
        PluginKind::Scheduler => "{ max_prefill_chunk = 512 }",
        PluginKind::Sampler => "{ top_k = 40 }",
        PluginKind::ModelGlue => "{ architecture = \"BigramForCausalLM\" }",
    }
}

fn manifest(kind: PluginKind, name: &str, sdk: &SdkSource) -> String {
    // Model glue returns the WIT records themselves, so its native tests need the bindings
    // too; schedulers and samplers test natively against the SDK's plain types.
    let sdk_dependencies = if kind == PluginKind::ModelGlue {
        format!(
            "[dependencies.plughost-sdk]\n{}\n",
            inline_to_table(&sdk.dependency(kind, true))
        )
    } else {
        format!(
            "[target.'cfg(not(target_arch = \"wasm32\"))'.dependencies]\n\
             plughost-sdk = {}\n\n\
             [target.'cfg(target_arch = \"wasm32\")'.dependencies]\n\
             plughost-sdk = {}\n",
            sdk.dependency(kind, false),
            sdk.dependency(kind, true)
        )
    };
    format!(
        r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2024"
publish = false

# Marks a plughost plugin. `plughost plugin build` builds it for wasm32-wasip2 and checks it
# by loading the component in its world and running `init` with `config`, the sample config
# (the same keys go into a deployment file's `config` table).
[package.metadata.plughost]
kind = "{kind}"
config = {config}

# cdylib: the WebAssembly component the host loads.
[lib]
crate-type = ["cdylib"]

[dependencies]
serde = {{ version = "1", features = ["derive"] }}
serde_json = "1"

{sdk_dependencies}
# An empty workspace: this crate builds on its own, even inside another project's workspace.
[workspace]
"#,
        kind = kind.world(),
        config = sample_config(kind),
    )
}

/// `{ a = 1, b = 2 }` as the lines of a table body.
fn inline_to_table(inline: &str) -> String {
    let table: toml::Table = format!("x = {inline}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|t| t.get("x").and_then(|x| x.as_table()).cloned())
        .unwrap_or_default();
    toml::to_string(&table).unwrap_or_default()
}

fn source(kind: PluginKind, name: &str) -> String {
    let template = match kind {
        PluginKind::Scheduler => include_str!("templates/scheduler.rs"),
        PluginKind::Sampler => include_str!("templates/sampler.rs"),
        PluginKind::ModelGlue => include_str!("templates/model_glue.rs"),
    };
    template.replace("__NAME__", name)
}

fn readme(kind: PluginKind, name: &str, sdk: &SdkSource) -> String {
    let policy = match kind {
        PluginKind::Scheduler => {
            "a shortest-prompt-first scheduler: running requests decode first, then waiting \
             requests are admitted shortest prompt first, in prefill chunks of at most \
             `max_prefill_chunk` tokens"
        }
        PluginKind::Sampler => {
            "a top-k sampler: greedy at temperature 0, otherwise a seeded draw among the \
             `top_k` most likely tokens (the request's own `top_k` wins)"
        }
        PluginKind::ModelGlue => {
            "model glue for a bigram model (embedding, then the LM head): the shape of a model \
             family's glue, to grow into a real one"
        }
    };
    let sdk_note = match sdk {
        SdkSource::Bundled => "`plughost-sdk/` is the SDK, copied from the `plughost` binary \
                               that created this crate; keep it with the crate."
            .to_string(),
        SdkSource::Path(path) => format!("The SDK is the crate at `{}`.", path.display()),
        SdkSource::Version(version) => {
            format!("The SDK is `plughost-sdk` {version} from the crate registry.")
        }
    };
    let slot = kind.deployment_slot();
    let lib = name.replace('-', "_");
    format!(
        r#"# {name}

A plughost {world} plugin: {policy}.

- `src/lib.rs`: the policy, as plain Rust over the SDK's types, with its unit tests.
- `Cargo.toml`: `crate-type = ["cdylib"]` (the host loads a WebAssembly component),
  `[package.metadata.plughost] kind = "{world}"` and the sample `config` that
  `plughost plugin build` checks `init` with.
- {sdk_note}

## Test, build, deploy

```sh
cargo test                      # runs the policy natively
plughost plugin build .         # wasm32-wasip2 release build, checked in its world
```

`plugin build` prints the component's path (`target/wasm32-wasip2/release/{lib}.wasm`), its
sha256 and the WIT version it was built for. Name it in a deployment file:

```toml
[{slot}]
component = "target/wasm32-wasip2/release/{lib}.wasm"   # relative to this file
config = {config}
```

and serve with `plughost serve --model DIR --config deploy.toml`. Try a policy against the
mock device with `plughost bench` before a real model: see plughost's `docs/plugins.md`.
"#,
        world = kind.world(),
        config = sample_config(kind),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_cargo_rules() {
        for good in ["my-scheduler", "a", "ban_list2"] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "2fast",
            "my scheduler",
            "über",
            "a.b",
            "test",
            "plughost-sdk",
        ] {
            assert!(
                matches!(check_name(bad), Err(PluginKitError::InvalidName { .. })),
                "{bad}"
            );
        }
        assert!(check_name(&"a".repeat(65)).is_err());
    }

    #[test]
    fn every_manifest_parses_and_marks_its_kind() {
        let sdks = [
            SdkSource::Bundled,
            SdkSource::Path(PathBuf::from("/opt/plughost/plugins/sdk")),
            SdkSource::Version("0.1.0".into()),
        ];
        for kind in [
            PluginKind::Scheduler,
            PluginKind::Sampler,
            PluginKind::ModelGlue,
        ] {
            for sdk in &sdks {
                let text = manifest(kind, "my-plugin", sdk);
                let table: toml::Table = text.parse().unwrap_or_else(|e| panic!("{e}\n{text}"));
                let marker = &table["package"]["metadata"]["plughost"];
                assert_eq!(marker["kind"].as_str(), Some(kind.world()));
                assert!(marker["config"].is_table());
                assert_eq!(table["lib"]["crate-type"][0].as_str(), Some("cdylib"));
                assert!(table["workspace"].as_table().is_some_and(|w| w.is_empty()));
                assert!(text.contains("plughost-sdk"), "{text}");
            }
        }
    }

    #[test]
    fn an_existing_folder_with_files_is_refused() {
        let parent = std::env::temp_dir().join(format!("plughost-kit-{}", std::process::id()));
        let existing = parent.join("taken");
        std::fs::create_dir_all(&existing).unwrap();
        std::fs::write(existing.join("keep.txt"), "mine").unwrap();
        let request = NewPlugin {
            kind: PluginKind::Sampler,
            name: "taken".into(),
            parent: parent.clone(),
            sdk: SdkSource::Bundled,
        };
        assert!(matches!(
            create(&request),
            Err(PluginKitError::TargetNotEmpty(_))
        ));
        assert_eq!(
            std::fs::read_to_string(existing.join("keep.txt")).unwrap(),
            "mine"
        );
        let fresh = NewPlugin {
            name: "fresh".into(),
            ..request
        };
        let dir = create(&fresh).unwrap();
        assert!(dir.join("plughost-sdk/src/lib.rs").is_file());
        assert!(dir.join("src/lib.rs").is_file());
        std::fs::remove_dir_all(&parent).unwrap();
    }
}
