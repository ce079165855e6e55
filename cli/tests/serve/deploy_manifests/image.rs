//! The container image: the Dockerfile ships the built plugins, runs unprivileged, and builds where a container engine runs.

use super::*;

#[test]
fn the_image_ships_built_plugins_runs_unprivileged_and_builds_where_an_engine_runs() {
    let workspace = crate::serve_support::workspace();
    let dockerfile =
        std::fs::read_to_string(workspace.join("Dockerfile")).expect("read the Dockerfile");
    let plugins = crate::serve_support::plugins_dir();
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
