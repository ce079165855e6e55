//! The admin routes: a failed reload answers 422 and changes nothing, named samplers are listed, chosen and reloaded, and every `/admin` route needs the admin key.

use super::startup::other_version_deployment;
use super::*;

/// Reloads that cannot work answer 422 naming the component and the cause, and the running
/// deployment goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_reload_answers_422_and_changes_nothing() {
    let dir = scratch("failures");
    let config = dir.join("deploy.toml");
    write_file(&config, &fcfs());
    let config_arg = config.display().to_string();
    let server = Server::start(&["--config", &config_arg, "--admin-key", ADMIN_KEY]);
    let client = reqwest::Client::new();
    let base = server.base.clone();
    let before = deployment_status(&client, &base, ADMIN_KEY).await;

    let cases: [(&str, String, &str, &[&str]); 6] = [
        (
            "init trap",
            deployment(
                "plughost_scheduler_faulty.wasm",
                "{ trap_in_init = true }",
                "plughost_sampler_standard.wasm",
            ),
            "component_failed",
            &["[scheduler]", "plughost_scheduler_faulty.wasm", "trap"],
        ),
        (
            "wrong world",
            deployment(
                "plughost_scheduler_fcfs.wasm",
                "{}",
                "plughost_scheduler_fcfs.wasm",
            ),
            "component_failed",
            &[
                "[sampler]",
                "plughost_scheduler_fcfs.wasm exports the scheduler world; \
                 the [sampler] slot needs sampler",
            ],
        ),
        (
            "other contract version",
            other_version_deployment(&dir),
            "component_failed",
            &[
                "[sampler]",
                "was built for plughost:plugin@0.3.0; this host speaks 0.1.x or 0.2.x",
            ],
        ),
        (
            "missing file",
            deployment(
                "plughost_scheduler_nowhere.wasm",
                "{}",
                "plughost_sampler_standard.wasm",
            ),
            "component_failed",
            &[
                "[scheduler]",
                "plughost_scheduler_nowhere.wasm",
                "cannot read",
            ],
        ),
        (
            "TOML error",
            "[scheduler\ncomponent = 1".to_string(),
            "invalid_deployment_file",
            &["deploy.toml"],
        ),
        (
            "glue change",
            format!(
                "{}\n[glue]\ncomponent = \"{}\"\n",
                fcfs(),
                plugin("plughost_sampler_standard.wasm")
            ),
            "glue_changed",
            &["model glue", "restart"],
        ),
    ];
    for (n, (name, text, code, needles)) in cases.iter().enumerate() {
        write_file(&config, text);
        let (status, body) = reload(&client, &base, ADMIN_KEY).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{name}: {body}");
        assert_eq!(body["error"]["code"], *code, "{name}: {body}");
        let message = body["error"]["message"].as_str().unwrap_or("");
        for needle in *needles {
            assert!(
                message.contains(needle),
                "{name}: {needle:?} not in {message:?}"
            );
        }
        let text = metrics(&client, &base).await;
        assert_eq!(
            metric(&text, "plughost_deployment_reloads_total{result=\"error\"}"),
            Some((n + 1) as f64),
            "{name}"
        );
        let now = deployment_status(&client, &base, ADMIN_KEY).await;
        assert_eq!(now["generation"], 1, "{name}");
        assert_eq!(
            component(&now, "scheduler")["sha256"],
            component(&before, "scheduler")["sha256"]
        );
        assert!(
            !complete(&client, &base, n).await.is_empty(),
            "{name}: still serving"
        );
    }
    assert!(
        server.log().contains("deployment reload failed"),
        "{}",
        server.log()
    );
}

/// `/admin` is closed (403, saying how to open it) without an admin key, and needs that key,
/// not an API key, with one; a reload without `--config` says how to enable it.
/// A completion that names `sampler`: the status and the JSON body.
async fn complete_with_sampler(
    client: &reqwest::Client,
    base: &str,
    sampler: &str,
) -> (StatusCode, Value) {
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt(0), "max_tokens": 4, "sampler": sampler}))
        .send()
        .await
        .expect("completion sent");
    let status = response.status();
    (status, response.json().await.expect("a JSON body"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_samplers_are_listed_chosen_by_requests_and_reloaded() {
    let dir = scratch("named-samplers");
    let config = dir.join("deploy.toml");
    let banned = format!(
        "[samplers.no-repeat]\ncomponent = \"{}\"\nconfig = {{ banned_token_ids = [1] }}\n",
        plugin("plughost_sampler_banned.wasm")
    );
    write_file(&config, &format!("{}\n{banned}", fcfs()));
    let config_arg = config.display().to_string();
    let server = Server::start(&["--config", &config_arg, "--admin-key", ADMIN_KEY]);
    let client = reqwest::Client::new();
    let base = server.base.clone();

    let listing = deployment_status(&client, &base, ADMIN_KEY).await;
    assert_eq!(
        listing["samplers"],
        json!(["default", "no-repeat"]),
        "{listing}"
    );
    assert_eq!(listing["default_sampler"], "default");
    let named: Vec<&Value> = listing["components"]
        .as_array()
        .expect("components")
        .iter()
        .filter(|c| c["slot"] == "sampler")
        .collect();
    assert_eq!(named.len(), 2, "{listing}");
    assert_eq!(named[0]["name"], "default");
    assert_eq!(named[0]["default"], true);
    assert_eq!(named[1]["name"], "no-repeat");
    assert!(
        named[1]["file"]
            .as_str()
            .is_some_and(|f| f.ends_with("plughost_sampler_banned.wasm"))
    );

    for name in ["default", "no-repeat"] {
        let (status, body) = complete_with_sampler(&client, &base, name).await;
        assert_eq!(status, StatusCode::OK, "{name}: {body}");
    }
    let (status, body) = complete_with_sampler(&client, &base, "creative").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["code"], "unknown_sampler");
    assert_eq!(body["error"]["param"], "sampler");
    assert_eq!(
        body["error"]["message"],
        "unknown sampler `creative`; this deployment has: default, no-repeat"
    );

    // A reload adds a sampler and makes it the default; requests may name it at once.
    let creative = banned.replace("no-repeat", "creative");
    write_file(
        &config,
        &format!(
            "default_sampler = \"creative\"\n{}\n{banned}\n{creative}",
            fcfs()
        ),
    );
    let (status, report) = reload(&client, &base, ADMIN_KEY).await;
    assert_eq!(status, StatusCode::OK, "{report}");
    let listing = deployment_status(&client, &base, ADMIN_KEY).await;
    assert_eq!(
        listing["samplers"],
        json!(["default", "creative", "no-repeat"]),
        "{listing}"
    );
    assert_eq!(listing["default_sampler"], "creative");
    let (status, body) = complete_with_sampler(&client, &base, "creative").await;
    assert_eq!(status, StatusCode::OK, "{body}");

    // A file whose default names no sampler is refused, naming it; nothing changes.
    write_file(&config, &format!("default_sampler = \"bold\"\n{}", fcfs()));
    let (status, error) = reload(&client, &base, ADMIN_KEY).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{error}");
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("default_sampler = \"bold\" names no sampler"),
        "{message}"
    );
    let after = deployment_status(&client, &base, ADMIN_KEY).await;
    assert_eq!(after["default_sampler"], "creative");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_routes_need_the_admin_key() {
    let client = reqwest::Client::new();
    {
        let server = Server::start(&[]);
        for (method, path) in [
            (reqwest::Method::GET, "/admin/deployment"),
            (reqwest::Method::POST, "/admin/reload"),
        ] {
            let response = client
                .request(method, format!("{}{path}", server.base))
                .bearer_auth(ADMIN_KEY)
                .send()
                .await
                .expect("sent");
            assert_eq!(response.status(), StatusCode::FORBIDDEN, "{path}");
            let body: Value = response.json().await.expect("JSON");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("--admin-key")),
                "{body}"
            );
        }
    }
    let server = Server::start(&["--admin-key", ADMIN_KEY, "--api-key", "sk-api"]);
    let url = format!("{}/admin/deployment", server.base);
    for key in [None, Some("wrong"), Some("sk-api")] {
        let mut request = client.get(&url);
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.expect("sent");
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{key:?}");
        let body: Value = response.json().await.expect("JSON");
        assert_eq!(body["error"]["type"], "authentication_error");
    }
    let listing = deployment_status(&client, &server.base, ADMIN_KEY).await;
    assert_eq!(listing["generation"], 1);
    for slot in ["scheduler", "sampler"] {
        let c = component(&listing, slot);
        assert_eq!(c["world"], slot);
        assert_eq!(c["wit_version"], "0.2.0");
        assert_eq!(c["sha256"].as_str().map(str::len), Some(64));
        assert_eq!(c["state"], "active");
    }
    // The admin key does not open the API.
    let response = client
        .get(format!("{}/v1/models", server.base))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let (status, body) = reload(&client, &server.base, ADMIN_KEY).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--config")),
        "{body}"
    );
    assert!(
        server.log().contains("loaded plugin component"),
        "{}",
        server.log()
    );
}
