//! What else starts a reload: SIGHUP, a rewritten `--config` file and Kubernetes' ConfigMap symlink swap.

use super::*;

async fn wait_for_generation(client: &reqwest::Client, server: &Server, generation: u64) -> Value {
    let started = Instant::now();
    loop {
        let listing = deployment_status(client, &server.base, ADMIN_KEY).await;
        if listing["generation"].as_u64() >= Some(generation) {
            return listing;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "generation {generation} never came: {listing}\n{}",
            server.log()
        );
        tokio::time::sleep(POLL).await;
    }
}

/// SIGHUP reloads (and no longer kills the server); with `--watch-config` a rewritten file
/// reloads by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_and_a_rewritten_file_reload() {
    let dir = scratch("sighup");
    let config = dir.join("deploy.toml");
    write_file(&config, &fcfs());
    let config_arg = config.display().to_string();
    let server = Server::start(&[
        "--config",
        &config_arg,
        "--admin-key",
        ADMIN_KEY,
        "--watch-config",
    ]);
    let client = reqwest::Client::new();
    let status = Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let listing = wait_for_generation(&client, &server, 2).await;
    for slot in ["scheduler", "sampler"] {
        assert_eq!(
            component(&listing, slot)["generation"],
            1,
            "unchanged {slot} is kept: {listing}"
        );
    }
    write_file(&config, &faulty());
    let listing = wait_for_generation(&client, &server, 3).await;
    let scheduler = component(&listing, "scheduler");
    assert!(
        scheduler["file"]
            .as_str()
            .is_some_and(|f| f.ends_with("plughost_scheduler_faulty.wasm")),
        "{listing}"
    );
    assert!(!complete(&client, &server.base, 1).await.is_empty());
}

/// A Kubernetes ConfigMap volume: the file is a symlink through `..data`, which is swapped to
/// a new folder in one rename. The watch sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_symlink_swap_reloads() {
    let dir = scratch("configmap");
    let first = dir.join("..2026_01_01_first");
    std::fs::create_dir_all(&first).expect("first folder");
    std::fs::write(first.join("deploy.toml"), fcfs()).expect("first file");
    std::os::unix::fs::symlink("..2026_01_01_first", dir.join("..data")).expect("..data link");
    std::os::unix::fs::symlink("..data/deploy.toml", dir.join("deploy.toml")).expect("file link");
    let config_arg = dir.join("deploy.toml").display().to_string();
    let server = Server::start(&[
        "--config",
        &config_arg,
        "--admin-key",
        ADMIN_KEY,
        "--watch-config",
    ]);
    let client = reqwest::Client::new();

    let second = dir.join("..2026_01_02_second");
    std::fs::create_dir_all(&second).expect("second folder");
    std::fs::write(second.join("deploy.toml"), faulty()).expect("second file");
    std::os::unix::fs::symlink("..2026_01_02_second", dir.join("..data_tmp")).expect("tmp link");
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).expect("swap ..data");
    let listing = wait_for_generation(&client, &server, 2).await;
    let scheduler = component(&listing, "scheduler");
    assert!(
        scheduler["file"]
            .as_str()
            .is_some_and(|f| f.ends_with("plughost_scheduler_faulty.wasm")),
        "{listing}"
    );
}
