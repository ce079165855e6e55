//! The manifests on their own: the kinds they name, the kustomization, the InferencePool against the pinned CRD schema, the serve flags, and the grace period.

use super::*;

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
    let dockerfile = std::fs::read_to_string(crate::serve_support::workspace().join("Dockerfile"))
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
