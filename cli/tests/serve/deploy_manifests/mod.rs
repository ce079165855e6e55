//! The deployable artifact checked: every Kubernetes manifest under `deploy/kubernetes/` parses, names kinds the pinned CRDs and core Kubernetes serve, fits the InferencePool CRD's schema, uses only `plughost serve` flags that exist, and its probes answer on a real server; the Dockerfile ships what the build makes, and builds where a container engine runs.

mod image;
mod manifests;
mod replicas;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::serve_support::Server;
use serde::Deserialize;
use serde_json::{Value, json};

/// The apiVersion and kind pairs of core Kubernetes (and kustomize) the manifests may use.
const CORE_KINDS: &[(&str, &str)] = &[
    ("v1", "Namespace"),
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
    ("apps/v1", "Deployment"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
];

/// Where the image keeps its plugins; the deployment ConfigMap names components there.
const IMAGE_PLUGINS_DIR: &str = "/opt/plughost/plugins/";

fn deploy_dir() -> PathBuf {
    crate::serve_support::workspace().join("deploy")
}

/// Every YAML document of the files in `dir` with the file it came from, in file order.
fn documents_in(dir: &Path) -> Vec<(PathBuf, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {}", dir.display());
    let mut documents = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read the manifest");
        for document in serde_yaml_ng::Deserializer::from_str(&text) {
            let value = Value::deserialize(document)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", file.display()));
            if !value.is_null() {
                documents.push((file.clone(), value));
            }
        }
    }
    documents
}

fn manifests() -> Vec<(PathBuf, Value)> {
    documents_in(&deploy_dir().join("kubernetes"))
}

fn crds() -> Vec<Value> {
    documents_in(&deploy_dir().join("crds"))
        .into_iter()
        .map(|(_, crd)| crd)
        .collect()
}

fn text(value: &Value, pointer: &str) -> String {
    value
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer} in {value}"))
        .to_string()
}

/// The one document of `kind` named `name`.
fn find(documents: &[(PathBuf, Value)], kind: &str, name: &str) -> Value {
    let found: Vec<&Value> = documents
        .iter()
        .map(|(_, d)| d)
        .filter(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{kind}/{name} appears {} times",
        found.len()
    );
    found[0].clone()
}

/// The apiVersion and kind pairs the pinned CRDs serve.
fn crd_kinds(crds: &[Value]) -> BTreeSet<(String, String)> {
    let mut kinds = BTreeSet::new();
    for crd in crds {
        assert_eq!(crd["kind"], "CustomResourceDefinition", "{crd}");
        let group = text(crd, "/spec/group");
        let kind = text(crd, "/spec/names/kind");
        for version in crd["spec"]["versions"].as_array().expect("versions") {
            if version["served"] == true {
                kinds.insert((format!("{group}/{}", text(version, "/name")), kind.clone()));
            }
        }
    }
    kinds
}

/// The served schema of `api_version` `kind` among the CRDs.
fn crd_schema(crds: &[Value], api_version: &str, kind: &str) -> Value {
    for crd in crds {
        let group = text(crd, "/spec/group");
        if text(crd, "/spec/names/kind") != kind {
            continue;
        }
        for version in crd["spec"]["versions"].as_array().expect("versions") {
            if format!("{group}/{}", text(version, "/name")) == api_version {
                return version["schema"]["openAPIV3Schema"].clone();
            }
        }
    }
    panic!("no CRD serves {api_version} {kind}");
}

/// Checks `value` against an OpenAPI v3 schema as the API server's structural validation
/// does for what the CRD states: types, required properties, enums, unknown fields,
/// item counts, bounds and string lengths. Returns every violation with its path.
fn validate(schema: &Value, value: &Value, path: &str, errors: &mut Vec<String>) {
    if let Some(expected) = schema["type"].as_str() {
        let fits = match expected {
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            "integer" => value.is_i64() || value.is_u64(),
            "number" => value.is_number(),
            "boolean" => value.is_boolean(),
            _ => true,
        };
        if !fits {
            errors.push(format!("{path}: expected {expected}, found {value}"));
            return;
        }
    }
    if let Some(choices) = schema["enum"].as_array()
        && !choices.contains(value)
    {
        errors.push(format!("{path}: {value} is not one of {choices:?}"));
    }
    if let Some(n) = value.as_f64() {
        if schema["minimum"].as_f64().is_some_and(|min| n < min) {
            errors.push(format!("{path}: {n} is below {}", schema["minimum"]));
        }
        if schema["maximum"].as_f64().is_some_and(|max| n > max) {
            errors.push(format!("{path}: {n} is above {}", schema["maximum"]));
        }
    }
    if let Some(s) = value.as_str() {
        let length = s.chars().count() as u64;
        if schema["minLength"].as_u64().is_some_and(|min| length < min) {
            errors.push(format!(
                "{path}: {s:?} is shorter than {}",
                schema["minLength"]
            ));
        }
        if schema["maxLength"].as_u64().is_some_and(|max| length > max) {
            errors.push(format!(
                "{path}: {s:?} is longer than {}",
                schema["maxLength"]
            ));
        }
    }
    if let Some(items) = value.as_array() {
        let count = items.len() as u64;
        if schema["minItems"].as_u64().is_some_and(|min| count < min) {
            errors.push(format!("{path}: fewer than {} items", schema["minItems"]));
        }
        if schema["maxItems"].as_u64().is_some_and(|max| count > max) {
            errors.push(format!("{path}: more than {} items", schema["maxItems"]));
        }
        for (i, item) in items.iter().enumerate() {
            validate(&schema["items"], item, &format!("{path}[{i}]"), errors);
        }
    }
    if let Some(object) = value.as_object() {
        for required in schema["required"].as_array().into_iter().flatten() {
            let name = required.as_str().expect("a required property name");
            if !object.contains_key(name) {
                errors.push(format!("{path}: required property {name} is missing"));
            }
        }
        let properties = schema["properties"].as_object();
        let open = schema["x-kubernetes-preserve-unknown-fields"] == true;
        for (name, field) in object {
            let field_path = format!("{path}.{name}");
            match properties.and_then(|p| p.get(name)) {
                Some(field_schema) => validate(field_schema, field, &field_path, errors),
                None => match &schema["additionalProperties"] {
                    Value::Object(_) => {
                        validate(&schema["additionalProperties"], field, &field_path, errors)
                    }
                    _ if open || properties.is_none() => {}
                    // metadata is ObjectMeta, which the API server validates itself.
                    _ if path.is_empty() && name == "metadata" => {}
                    _ => errors.push(format!("{field_path}: unknown field")),
                },
            }
        }
    }
}

fn violations(schema: &Value, value: &Value) -> Vec<String> {
    let mut errors = Vec::new();
    validate(schema, value, "", &mut errors);
    errors
}

/// The container named `name` of a Deployment.
fn container(deployment: &Value, name: &str) -> Value {
    deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
        .clone()
}

fn args(container: &Value) -> Vec<String> {
    container["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("a string argument").to_string())
        .collect()
}

/// `--name` of every flag in `args` (`--name=value` or `--name value`).
fn flag_names(args: &[String]) -> Vec<String> {
    args.iter()
        .filter_map(|a| a.strip_prefix("--"))
        .map(|a| a.split('=').next().unwrap_or(a).to_string())
        .collect()
}

/// The value of `--name` in `args`, in either spelling.
fn flag_value(args: &[String], name: &str) -> Option<String> {
    let long = format!("--{name}");
    args.iter().enumerate().find_map(|(i, a)| {
        if let Some(value) = a.strip_prefix(&format!("{long}=")) {
            Some(value.to_string())
        } else if *a == long {
            args.get(i + 1).cloned()
        } else {
            None
        }
    })
}

fn plughost_deployment(documents: &[(PathBuf, Value)]) -> (Value, Value) {
    let deployment = find(documents, "Deployment", "plughost");
    let server = container(&deployment, "plughost");
    (deployment, server)
}

fn serve_help() -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_plughost"))
        .args(["serve", "--help"])
        .output()
        .expect("plughost runs");
    assert!(output.status.success(), "plughost serve --help failed");
    String::from_utf8(output.stdout).expect("UTF-8 help")
}
