//! The replicas' manifests on a real server: their flags serve the ConfigMap and the probes and EPP metrics answer, the ConfigMap passes `plughost check`, and an edit reloads it without a restart.

use super::*;

/// The ConfigMap's deployment file with the image's plugin paths moved to this build's.
fn local_deployment_file(documents: &[(PathBuf, Value)], dir: &Path) -> (PathBuf, String) {
    let config_map = find(documents, "ConfigMap", "plughost-deployment");
    let toml = text(&config_map, "/data/deploy.toml");
    assert!(toml.contains(IMAGE_PLUGINS_DIR), "{toml}");
    let local = format!("{}/", crate::serve_support::plugins_dir().display());
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
    let local = format!("{}/", crate::serve_support::plugins_dir().display());
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
    let deadline = std::time::Instant::now() + crate::serve_support::LOAD_DEADLINE;
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
