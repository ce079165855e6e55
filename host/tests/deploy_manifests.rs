//! The deployable artifact checked: every Kubernetes manifest under `deploy/kubernetes/` parses, names kinds the pinned CRDs and core Kubernetes serve, fits the InferencePool CRD's schema, uses only `plughost serve` flags that exist, and its probes answer on a real server; the Dockerfile ships what the build makes, and builds where a container engine runs.

mod serve_support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Deserialize;
use serde_json::{Value, json};
use serve_support::Server;

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
    serve_support::workspace().join("deploy")
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

#[test]
fn every_manifest_parses_and_names_a_kind_the_pinned_release_or_kubernetes_serves() {
    let documents = manifests();
    let mut served: BTreeSet<(String, String)> = CORE_KINDS
        .iter()
        .map(|(v, k)| (v.to_string(), k.to_string()))
        .collect();
    let crds = crds();
    let from_crds = crd_kinds(&crds);
    assert!(
        from_crds.contains(&(
            "inference.networking.k8s.io/v1".to_string(),
            "InferencePool".to_string()
        )),
        "the pinned CRDs serve {from_crds:?}"
    );
    served.extend(from_crds);
    let mut kinds = BTreeSet::new();
    for (file, document) in &documents {
        let pair = (text(document, "/apiVersion"), text(document, "/kind"));
        assert!(
            served.contains(&pair),
            "{}: {} {} is not served by the pinned release or core Kubernetes",
            file.display(),
            pair.0,
            pair.1
        );
        kinds.insert(pair.1.clone());
        if pair.1 == "Kustomization" {
            continue;
        }
        text(document, "/metadata/name");
        if pair.1 != "Namespace" {
            assert_eq!(
                document["metadata"]["namespace"],
                "plughost",
                "{}: {} outside the plughost namespace",
                file.display(),
                pair.1
            );
        }
    }
    for kind in [
        "Deployment",
        "Service",
        "ConfigMap",
        "InferencePool",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    ] {
        assert!(kinds.contains(kind), "no {kind} among {kinds:?}");
    }
}

#[test]
fn the_kustomization_lists_every_manifest() {
    let documents = manifests();
    let kustomization = documents
        .iter()
        .find(|(_, d)| d["kind"] == "Kustomization")
        .map(|(_, d)| d.clone())
        .expect("a kustomization");
    let listed: BTreeSet<String> = kustomization["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|r| r.as_str().expect("a file name").to_string())
        .collect();
    let files: BTreeSet<String> = documents
        .iter()
        .filter(|(_, d)| d["kind"] != "Kustomization")
        .map(|(file, _)| {
            file.file_name()
                .expect("a file name")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(listed, files);
}

#[test]
fn the_inference_pool_fits_the_pinned_crd_schema_and_points_at_the_replicas_and_the_epp() {
    let documents = manifests();
    let crds = crds();
    let pool = find(&documents, "InferencePool", "plughost");
    let schema = crd_schema(&crds, &text(&pool, "/apiVersion"), "InferencePool");
    // What the CRD requires is really required, and checked: the validator is not vacuous.
    let required = schema["properties"]["spec"]["required"]
        .as_array()
        .expect("spec.required");
    assert!(required.contains(&json!("selector")) && required.contains(&json!("targetPorts")));
    let errors = violations(&schema, &pool);
    assert!(
        errors.is_empty(),
        "the InferencePool violates its CRD: {errors:?}"
    );
    for (broken, expected) in [
        (
            "/spec/targetPorts",
            "required property targetPorts is missing",
        ),
        (
            "/spec/selector/matchLabels",
            "required property matchLabels is missing",
        ),
    ] {
        let mut pool = pool.clone();
        let (parent, name) = broken.rsplit_once('/').expect("a pointer");
        pool.pointer_mut(parent)
            .and_then(Value::as_object_mut)
            .expect("the parent object")
            .remove(name);
        let errors = violations(&schema, &pool);
        assert!(
            errors.iter().any(|e| e.contains(expected)),
            "removing {broken} gave {errors:?}"
        );
    }
    let mut mistyped = pool.clone();
    mistyped["spec"]["targetPorts"][0]["number"] = json!("8000");
    assert!(!violations(&schema, &mistyped).is_empty());
    let mut unknown = pool.clone();
    unknown["spec"]["endpointPickerRef"]["failureMode"] = json!("Sometimes");
    assert!(!violations(&schema, &unknown).is_empty());

    // The pool selects the replicas' pods on the port they serve.
    let (deployment, server) = plughost_deployment(&documents);
    let pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        .as_object()
        .expect("pod labels");
    for (key, value) in pool["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels")
    {
        assert_eq!(pod_labels.get(key), Some(value), "pods lack {key}={value}");
    }
    let container_ports: Vec<&Value> = server["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| &p["containerPort"])
        .collect();
    for port in pool["spec"]["targetPorts"].as_array().expect("targetPorts") {
        assert!(
            container_ports.contains(&&port["number"]),
            "pool port {port} is not a container port"
        );
    }
    // Its endpoint picker is the EPP Service, on a port that Service exposes and the EPP listens on.
    let epp_service = find(
        &documents,
        "Service",
        &text(&pool, "/spec/endpointPickerRef/name"),
    );
    let epp_port = &pool["spec"]["endpointPickerRef"]["port"]["number"];
    assert!(
        epp_service["spec"]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| &p["port"] == epp_port),
        "the EPP Service does not expose {epp_port}"
    );
    let epp = find(&documents, "Deployment", "plughost-epp");
    let epp_args = args(&container(&epp, "epp"));
    assert_eq!(
        flag_value(&epp_args, "pool-name").as_deref(),
        pool["metadata"]["name"].as_str()
    );
    assert_eq!(
        flag_value(&epp_args, "pool-namespace").as_deref(),
        pool["metadata"]["namespace"].as_str()
    );
}

#[test]
fn every_serve_flag_in_the_manifests_and_the_image_exists_and_the_epp_flags_are_its_releases() {
    let documents = manifests();
    let help = serve_help();
    let (_, server) = plughost_deployment(&documents);
    let server_args = args(&server);
    assert_eq!(server_args.first().map(String::as_str), Some("serve"));
    let dockerfile = std::fs::read_to_string(serve_support::workspace().join("Dockerfile"))
        .expect("read the Dockerfile");
    let cmd_line = dockerfile
        .lines()
        .find(|l| l.starts_with("CMD "))
        .expect("a CMD line");
    let cmd: Vec<String> =
        serde_json::from_str(cmd_line.trim_start_matches("CMD ")).expect("CMD in exec form");
    for flag in flag_names(&server_args).into_iter().chain(flag_names(&cmd)) {
        let listed = help.lines().any(|l| {
            l.trim_start().starts_with(&format!("--{flag} ")) || l.trim() == format!("--{flag}")
        });
        assert!(
            listed,
            "--{flag} is not in `plughost serve --help`:\n{help}"
        );
    }
    for required in [
        "config",
        "watch-config",
        "metrics-names",
        "shutdown-timeout",
    ] {
        assert!(
            flag_value(&server_args, required).is_some()
                || server_args.contains(&format!("--{required}")),
            "the replicas run without --{required}"
        );
    }
    assert_eq!(
        flag_value(&server_args, "metrics-names").as_deref(),
        Some("vllm")
    );

    let accepted: BTreeSet<String> =
        std::fs::read_to_string(deploy_dir().join("crds/epp-flags-v0.10.0.txt"))
            .expect("the EPP's flag list")
            .lines()
            .map(str::to_string)
            .collect();
    let epp = find(&documents, "Deployment", "plughost-epp");
    let epp_container = container(&epp, "epp");
    assert!(text(&epp_container, "/image").ends_with(":v0.10.0"));
    for flag in flag_names(&args(&epp_container)) {
        assert!(accepted.contains(&flag), "the pinned EPP has no --{flag}");
    }
}

#[test]
fn the_grace_period_covers_the_pre_stop_pause_and_the_drain() {
    let documents = manifests();
    let (deployment, server) = plughost_deployment(&documents);
    let grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("terminationGracePeriodSeconds");
    let shutdown: u64 = flag_value(&args(&server), "shutdown-timeout")
        .expect("--shutdown-timeout")
        .parse()
        .expect("seconds");
    let pre_stop = server["lifecycle"]["preStop"]["exec"]["command"]
        .as_array()
        .expect("a preStop command");
    assert_eq!(pre_stop[0], "/bin/sleep", "{pre_stop:?}");
    let pause: u64 = pre_stop[1]
        .as_str()
        .expect("seconds")
        .parse()
        .expect("seconds");
    // After its deadline the server exits within a second; the grace period must outlast that.
    assert!(
        grace > pause + shutdown + 1,
        "terminationGracePeriodSeconds {grace} does not cover preStop {pause} s + --shutdown-timeout {shutdown} s + 1 s"
    );
    assert_eq!(
        text(&server, "/readinessProbe/httpGet/path"),
        "/ready",
        "readiness must follow draining"
    );
    assert_eq!(text(&server, "/livenessProbe/httpGet/path"), "/health");
    assert_eq!(text(&server, "/startupProbe/httpGet/path"), "/health");
    assert!(
        server["resources"]["requests"].is_object() && server["resources"]["limits"].is_object()
    );
}

/// The ConfigMap's deployment file with the image's plugin paths moved to this build's.
fn local_deployment_file(documents: &[(PathBuf, Value)], dir: &Path) -> (PathBuf, String) {
    let config_map = find(documents, "ConfigMap", "plughost-deployment");
    let toml = text(&config_map, "/data/deploy.toml");
    assert!(toml.contains(IMAGE_PLUGINS_DIR), "{toml}");
    let local = format!("{}/", serve_support::plugins_dir().display());
    let path = dir.join("deploy.toml");
    std::fs::write(&path, toml.replace(IMAGE_PLUGINS_DIR, &local)).expect("write deploy.toml");
    (path, toml)
}

#[test]
fn the_replicas_flags_serve_the_config_map_and_the_probes_and_epp_metrics_answer() {
    let documents = manifests();
    let (deployment, server) = plughost_deployment(&documents);
    let dir =
        std::env::temp_dir().join(format!("plughost-deploy-manifests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let (deployment_file, _) = local_deployment_file(&documents, &dir);

    // The mounted path is where --config points.
    let mount = server["volumeMounts"]
        .as_array()
        .expect("volume mounts")
        .iter()
        .find(|m| m["name"] == "deployment")
        .expect("the deployment mount")
        .clone();
    assert!(
        mount["subPath"].is_null(),
        "a subPath mount never sees ConfigMap updates"
    );
    let server_args = args(&server);
    assert_eq!(
        flag_value(&server_args, "config"),
        Some(format!("{}/deploy.toml", text(&mount, "/mountPath")))
    );
    let volume = deployment["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "deployment")
        .expect("the deployment volume")
        .clone();
    assert_eq!(volume["configMap"]["name"], "plughost-deployment");

    let flags = local_serve_flags(&server_args, &deployment_file);
    let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let running = Server::start(&flag_refs);

    // The probes' ports name the container port the server listens on.
    let port_number = |name: &Value| -> u64 {
        server["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .find(|p| &p["name"] == name)
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("no container port {name}"))
    };
    let listen: u64 = flag_value(&server_args, "port")
        .expect("--port")
        .parse()
        .expect("a port");
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let get = &server[probe]["httpGet"];
        assert_eq!(
            port_number(&get["port"]),
            listen,
            "{probe} probes another port"
        );
        let path = text(get, "/path");
        let response = running.try_get(&path).expect("the probe answers");
        assert_eq!(response.status, 200, "{probe} {path}: {}", response.body);
    }
    let service = find(&documents, "Service", "plughost");
    for port in service["spec"]["ports"].as_array().expect("ports") {
        assert_eq!(port_number(&port["targetPort"]), listen);
    }

    // The ConfigMap's components are the ones loaded, and every metric the EPP reads is there
    // under the name its engine config gives, with the labels it reads.
    let metrics = running.try_get("/metrics").expect("metrics answer").body;
    let config_map = find(&documents, "ConfigMap", "plughost-deployment");
    for line in text(&config_map, "/data/deploy.toml").lines() {
        if let Some(component) = line.strip_prefix("component = ") {
            let file = Path::new(component.trim_matches('"'))
                .file_name()
                .expect("a file")
                .to_string_lossy()
                .into_owned();
            assert!(
                metrics
                    .lines()
                    .any(|l| l.starts_with("plughost_plugin_info") && l.contains(&file)),
                "{file} is not loaded:\n{metrics}"
            );
        }
    }
    let epp_config_map = find(&documents, "ConfigMap", "plughost-epp");
    let epp_config: Value =
        serde_yaml_ng::from_str(&text(&epp_config_map, "/data/plughost-epp.yaml"))
            .expect("the EPP config parses");
    let extractor = epp_config["plugins"]
        .as_array()
        .expect("plugins")
        .iter()
        .find(|p| p["type"] == "core-metrics-extractor")
        .expect("a core-metrics-extractor")
        .clone();
    let engine = text(&extractor, "/parameters/defaultEngine");
    assert_eq!(
        deployment["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"],
        engine.as_str()
    );
    let specs = extractor["parameters"]["engineConfigs"]
        .as_array()
        .expect("engine configs")
        .iter()
        .find(|c| c["name"] == engine.as_str())
        .expect("the engine's config")
        .clone();
    let series: BTreeMap<&str, Vec<&str>> = metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let name_end = l.find(['{', ' '])?;
            Some((&l[..name_end], l))
        })
        .fold(BTreeMap::new(), |mut map, (name, line)| {
            map.entry(name).or_insert_with(Vec::new).push(line);
            map
        });
    for key in [
        "queuedRequestsSpec",
        "runningRequestsSpec",
        "kvUsageSpec",
        "cacheInfoSpec",
    ] {
        let name = text(&specs, &format!("/{key}"));
        assert!(
            series.contains_key(name.as_str()),
            "{key} {name} is not exported:\n{metrics}"
        );
    }
    let cache_info = series[text(&specs, "/cacheInfoSpec").as_str()][0];
    for label in ["cacheBlockSizeLabelName", "cacheNumBlocksLabelName"] {
        let label = text(&specs, &format!("/{label}"));
        assert!(
            cache_info.contains(&format!("{label}=\"")),
            "{cache_info} lacks {label}"
        );
    }
    // The built-in vllm engine config reads the mirrored names.
    for name in [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    ] {
        assert!(series.contains_key(name), "{name} is not exported");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_config_map_deployment_passes_plughost_check() {
    let documents = manifests();
    let dir = std::env::temp_dir().join(format!("plughost-deploy-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let (path, _) = local_deployment_file(&documents, &dir);
    let output = Command::new(env!("CARGO_BIN_EXE_plughost"))
        .args(["check", "--config"])
        .arg(&path)
        .arg("--cache-dir")
        .arg(std::env::temp_dir().join("plughost-test-component-cache"))
        .output()
        .expect("plughost check runs");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        output.status.success(),
        "plughost check refused the ConfigMap's deployment:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The manifest's `serve` flags with the model, device, address, port and deployment file of
/// this machine instead of the pod's (the test server adds its own model, device and port).
fn local_serve_flags(server_args: &[String], deployment_file: &Path) -> Vec<String> {
    let local_only = ["model", "host", "port", "device-config", "config"];
    let mut flags: Vec<String> = server_args[1..]
        .iter()
        .filter(|a| {
            !local_only
                .iter()
                .any(|f| a.starts_with(&format!("--{f}=")) || **a == format!("--{f}"))
        })
        .cloned()
        .collect();
    flags.push("--config".into());
    flags.push(deployment_file.display().to_string());
    flags
}

/// Writes `deploy.toml` into `dir` as the kubelet lays out a ConfigMap volume: the file is a
/// symlink through `..data`, which points at a timestamped folder and is swapped in one
/// rename when the ConfigMap changes.
fn project_config_map(dir: &Path, generation: u32, toml: &str) {
    let data = format!("..2026_01_01_00_00_0{generation}.000000000");
    std::fs::create_dir_all(dir.join(&data)).expect("a data folder");
    std::fs::write(dir.join(&data).join("deploy.toml"), toml).expect("write deploy.toml");
    let staged = dir.join("..data_tmp");
    std::os::unix::fs::symlink(&data, &staged).expect("stage ..data");
    std::fs::rename(&staged, dir.join("..data")).expect("swap ..data");
    if generation == 1 {
        std::os::unix::fs::symlink("..data/deploy.toml", dir.join("deploy.toml"))
            .expect("link deploy.toml");
    }
}

fn metric_value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn an_edited_config_map_reloads_the_replicas_plugins_without_a_restart() {
    let documents = manifests();
    let (_, server) = plughost_deployment(&documents);
    let config_map = find(&documents, "ConfigMap", "plughost-deployment");
    let local = format!("{}/", serve_support::plugins_dir().display());
    let toml = text(&config_map, "/data/deploy.toml").replace(IMAGE_PLUGINS_DIR, &local);
    let dir = std::env::temp_dir().join(format!("plughost-config-map-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a mount folder");
    project_config_map(&dir, 1, &toml);
    let flags = local_serve_flags(&args(&server), &dir.join("deploy.toml"));
    assert!(flags.iter().any(|f| f == "--watch-config"), "{flags:?}");
    let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let running = Server::start(&flag_refs);
    let metrics = running.try_get("/metrics").expect("metrics").body;
    assert_eq!(
        metric_value(&metrics, "plughost_deployment_generation"),
        Some(1.0)
    );

    // The edit an operator makes: another scheduler.
    assert!(toml.contains("plughost_scheduler_priority.wasm"), "{toml}");
    let edited = toml
        .replace(
            "plughost_scheduler_priority.wasm",
            "plughost_scheduler_fcfs.wasm",
        )
        .replace(
            "config = { aging_rate = 0.05, max_prefill_chunk = 512 }",
            "config = {}",
        );
    project_config_map(&dir, 2, &edited);
    let deadline = std::time::Instant::now() + serve_support::LOAD_DEADLINE;
    loop {
        let metrics = running.try_get("/metrics").expect("metrics").body;
        if metric_value(&metrics, "plughost_deployment_generation") == Some(2.0) {
            assert!(
                metrics
                    .lines()
                    .any(|l| l.starts_with("plughost_plugin_info")
                        && l.contains("plughost_scheduler_fcfs.wasm")
                        && l.contains("slot=\"scheduler\"")),
                "{metrics}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the ConfigMap swap never reloaded:\n{}",
            running.stderr()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let health = running.try_get("/ready").expect("ready answers");
    assert_eq!(health.status, 200);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_image_ships_built_plugins_runs_unprivileged_and_builds_where_an_engine_runs() {
    let workspace = serve_support::workspace();
    let dockerfile =
        std::fs::read_to_string(workspace.join("Dockerfile")).expect("read the Dockerfile");
    let plugins = serve_support::plugins_dir();
    let shipped: Vec<&str> = dockerfile
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("target/plugins/"))
        .collect();
    assert!(shipped.len() >= 4, "{shipped:?}");
    for file in &shipped {
        assert!(
            plugins.join(file).is_file(),
            "the image copies {file}, which the build does not make"
        );
    }
    // Every component the ConfigMap names is in the image.
    let documents = manifests();
    let config_map = find(&documents, "ConfigMap", "plughost-deployment");
    for component in text(&config_map, "/data/deploy.toml")
        .split('"')
        .filter_map(|s| s.strip_prefix(IMAGE_PLUGINS_DIR))
    {
        assert!(shipped.contains(&component), "the image lacks {component}");
    }
    let user = dockerfile
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER line");
    let uid: u32 = user
        .split(':')
        .next()
        .unwrap_or(user)
        .trim()
        .parse()
        .expect("a numeric user");
    assert_ne!(uid, 0, "the image runs as root");
    let (_, server) = plughost_deployment(&documents);
    assert_eq!(
        server
            .pointer("/securityContext/runAsUser")
            .or(find(&documents, "Deployment", "plughost")
                .pointer("/spec/template/spec/securityContext/runAsUser")),
        Some(&json!(uid))
    );
    let ignore =
        std::fs::read_to_string(workspace.join(".dockerignore")).expect("read .dockerignore");
    assert!(
        ignore.lines().any(|l| l.trim() == "target/"),
        "the build context would carry target/"
    );

    let engine = ["docker", "podman"].into_iter().find(|engine| {
        Command::new(engine)
            .arg("info")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    // Written past the test harness's capture, so a skipped build shows in every run.
    let mut stderr = std::io::stderr();
    let Some(engine) = engine else {
        let _ = writeln!(
            stderr,
            "deploy_manifests: SKIPPED the image build: no docker or podman with a reachable daemon here"
        );
        return;
    };
    let _ = writeln!(stderr, "deploy_manifests: building the image with {engine}");
    let status = Command::new(engine)
        .args(["build", "-t", "plughost:test", "."])
        .current_dir(&workspace)
        .status()
        .expect("the build runs");
    assert!(status.success(), "{engine} build failed");
}
