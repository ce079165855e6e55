//! Who may call and what they may send: API keys (also from the environment, never in `--help`), where the server listens, bad HTTP flags, JSON-only bodies and CORS.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_every_route_but_the_probes() {
    let server = Server::start(&["--api-key", "sk-test-1", "--api-key", "sk-test-2"]);
    let client = reqwest::Client::new();
    struct Case {
        method: Method,
        path: &'static str,
        authorization: Option<&'static str>,
        body: Option<Value>,
        status: u16,
    }
    let case = |method, path, authorization, body, status| Case {
        method,
        path,
        authorization,
        body,
        status,
    };
    let cases = [
        case(Method::GET, "/v1/models", None, None, 401),
        case(
            Method::GET,
            "/v1/models",
            Some("Bearer sk-wrong"),
            None,
            401,
        ),
        case(
            Method::GET,
            "/v1/models",
            Some("Bearer sk-test-1x"),
            None,
            401,
        ),
        case(
            Method::GET,
            "/v1/models",
            Some("Basic c2stdGVzdC0x"),
            None,
            401,
        ),
        case(Method::GET, "/v1/models", Some("sk-test-1"), None, 401),
        case(
            Method::GET,
            "/v1/models",
            Some("Bearer sk-test-1"),
            None,
            200,
        ),
        case(
            Method::GET,
            "/v1/models",
            Some("bearer sk-test-2"),
            None,
            200,
        ),
        case(
            Method::POST,
            "/v1/completions",
            None,
            Some(completion_body(2)),
            401,
        ),
        case(
            Method::POST,
            "/v1/chat/completions",
            Some("Bearer x"),
            Some(chat_body()),
            401,
        ),
        case(
            Method::POST,
            "/v1/completions",
            Some("Bearer sk-test-2"),
            Some(completion_body(2)),
            200,
        ),
        case(
            Method::POST,
            "/v1/chat/completions",
            Some("Bearer sk-test-1"),
            Some(chat_body()),
            200,
        ),
        case(Method::GET, "/v1/engines", None, None, 401),
        case(
            Method::GET,
            "/v1/engines",
            Some("Bearer sk-test-1"),
            None,
            404,
        ),
        case(Method::GET, "/health", None, None, 200),
        case(Method::GET, "/metrics", None, None, 200),
        case(Method::GET, "/health", Some("Bearer sk-wrong"), None, 200),
    ];
    for case in cases {
        let mut request = client.request(case.method.clone(), server.url(case.path));
        if let Some(value) = case.authorization {
            request = request.header("authorization", value);
        }
        if let Some(body) = &case.body {
            request = request.json(body);
        }
        let response = request.send().await.expect("send");
        let what = format!(
            "{} {} with {:?}",
            case.method, case.path, case.authorization
        );
        assert_eq!(response.status().as_u16(), case.status, "{what}");
        if case.status == 401 {
            assert_eq!(
                header(&response, "www-authenticate"),
                Some("Bearer"),
                "{what}"
            );
            let body = assert_error(response, 401, Some("invalid_api_key")).await;
            assert_eq!(body["error"]["type"], "authentication_error", "{what}");
        }
    }
    // Probes are open whether or not /ready exists yet.
    let ready = client
        .get(server.url("/ready"))
        .send()
        .await
        .expect("ready");
    assert_ne!(ready.status(), StatusCode::UNAUTHORIZED);
    assert!(
        !server.log().contains("sk-test-1"),
        "a key reached the log:\n{}",
        server.log()
    );

    let python = std::env::var("PLUGHOST_TEST_PYTHON").unwrap_or_else(|_| {
        panic!("PLUGHOST_TEST_PYTHON is not set: `cargo xtask test` installs the openai client and sets it")
    });
    let output = Command::new(python)
        .arg(workspace().join("tests/clients/openai_api_key_check.py"))
        .args([server.base.as_str(), MODEL, "sk-test-2"])
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.trim() == "ok",
        "openai client check failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_can_come_from_the_environment_and_help_does_not_show_it() {
    let server = Server::launch(Launch {
        env: &[("PLUGHOST_API_KEY", "sk-from-env")],
        ..Launch::default()
    });
    let client = reqwest::Client::new();
    let without = client
        .get(server.url("/v1/models"))
        .send()
        .await
        .expect("send");
    assert_error(without, 401, Some("invalid_api_key")).await;
    let with = client
        .get(server.url("/v1/models"))
        .bearer_auth("sk-from-env")
        .send()
        .await
        .expect("send");
    assert_eq!(with.status(), StatusCode::OK);

    let help = Command::new(env!("CARGO_BIN_EXE_plughost"))
        .args(["serve", "--help"])
        .env("PLUGHOST_API_KEY", "sk-from-env")
        .output()
        .expect("help runs");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("--api-key"), "{text}");
    assert!(!text.contains("sk-from-env"), "{text}");
}

#[test]
fn the_server_listens_on_loopback_unless_told_and_warns_when_open_to_others() {
    let warning = "without an API key";
    let local = Server::start(&[]);
    let log = local.log();
    assert!(
        log.contains(&format!("listening on http://127.0.0.1:{}", local.port)),
        "{log}"
    );
    assert!(!log.contains(warning), "{log}");
    drop(local);
    let open = Server::start(&["--host", "0.0.0.0"]);
    assert!(open.log().contains(warning), "{}", open.log());
    drop(open);
    let keyed = Server::start(&["--host", "0.0.0.0", "--api-key", "k"]);
    assert!(!keyed.log().contains(warning), "{}", keyed.log());
}

#[test]
fn bad_http_flags_stop_the_server_with_the_reason() {
    let cases: [(&[&str], &str); 6] = [
        (&["--api-key", ""], "an API key cannot be empty"),
        (&["--api-key", "two words"], "printable ASCII"),
        (&["--allowed-origins", "app.example"], "is not an origin"),
        (
            &["--allowed-origins", "*,https://a.example"],
            "cannot be combined",
        ),
        (&["--max-waiting-requests", "0"], "--max-waiting-requests"),
        (&["--max-request-body", "12parsecs"], "unknown size unit"),
    ];
    for (args, reason) in cases {
        let (status, stderr) = run_to_exit(args);
        assert!(!status.success(), "{args:?} started");
        assert!(stderr.contains(reason), "{args:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_bodies_must_be_declared_json() {
    let server = Server::start(&[]);
    let client = reqwest::Client::new();
    let body = serde_json::to_vec(&completion_body(1)).expect("json");
    let cases: [(Option<&str>, u16); 9] = [
        (Some("text/plain"), 415),
        (Some("application/x-www-form-urlencoded"), 415),
        (Some("multipart/form-data; boundary=x"), 415),
        (Some("application/json; charset=latin1"), 415),
        (Some("application/jsonp"), 415),
        (None, 415),
        (Some("application/json"), 200),
        (Some("application/json; charset=utf-8"), 200),
        (Some("Application/JSON;charset=UTF-8"), 200),
    ];
    for (content_type, status) in cases {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let body = match path {
                "/v1/completions" => body.clone(),
                _ => serde_json::to_vec(&chat_body()).expect("json"),
            };
            let mut request = client.post(server.url(path)).body(body);
            if let Some(value) = content_type {
                request = request.header("content-type", value);
            }
            let response = request.send().await.expect("send");
            if status == 415 {
                assert_error(response, 415, Some("unsupported_media_type")).await;
            } else {
                assert_eq!(
                    response.status().as_u16(),
                    status,
                    "{content_type:?} {path}"
                );
            }
        }
    }
    // No body: nothing to declare, and the JSON parser says what is missing.
    let empty = client
        .post(server.url("/v1/completions"))
        .header("content-length", "0")
        .send()
        .await
        .expect("send");
    assert_error(empty, 400, Some("invalid_json")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_headers_go_only_to_allowed_origins() {
    let client = reqwest::Client::new();
    let preflight = |server: &Server, origin: &str| {
        client
            .request(Method::OPTIONS, server.url("/v1/chat/completions"))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization, content-type, x-stainless-os",
            )
            .send()
    };
    let post = |server: &Server, origin: &str, key: Option<&str>| {
        let request = client
            .post(server.url("/v1/chat/completions"))
            .header("origin", origin)
            .json(&chat_body());
        match key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
        .send()
    };

    let closed = Server::start(&[]);
    let answer = preflight(&closed, "https://app.example")
        .await
        .expect("send");
    assert_eq!(header(&answer, "access-control-allow-origin"), None);
    let answer = post(&closed, "https://app.example", None)
        .await
        .expect("send");
    assert_eq!(answer.status(), StatusCode::OK);
    assert_eq!(header(&answer, "access-control-allow-origin"), None);
    drop(closed);

    let listed = Server::start(&[
        "--allowed-origins",
        "https://app.example,http://localhost:3000",
        "--api-key",
        "k",
    ]);
    let answer = preflight(&listed, "https://app.example")
        .await
        .expect("send");
    assert!(answer.status().is_success(), "{}", answer.status());
    assert_eq!(
        header(&answer, "access-control-allow-origin"),
        Some("https://app.example")
    );
    let methods = header(&answer, "access-control-allow-methods").unwrap_or("");
    assert!(methods.contains("POST"), "{methods}");
    let headers = header(&answer, "access-control-allow-headers").unwrap_or("");
    assert!(
        headers.contains("authorization") && headers.contains("content-type"),
        "{headers}"
    );
    let answer = preflight(&listed, "https://evil.example")
        .await
        .expect("send");
    assert_eq!(header(&answer, "access-control-allow-origin"), None);
    let answer = post(&listed, "http://localhost:3000", Some("k"))
        .await
        .expect("send");
    assert_eq!(answer.status(), StatusCode::OK);
    assert_eq!(
        header(&answer, "access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    let exposed = header(&answer, "access-control-expose-headers").unwrap_or("");
    assert!(exposed.contains("x-request-id"), "{exposed}");
    // A page of an allowed origin can read why it was refused.
    let answer = post(&listed, "https://app.example", None)
        .await
        .expect("send");
    assert_eq!(
        header(&answer, "access-control-allow-origin"),
        Some("https://app.example")
    );
    assert_error(answer, 401, Some("invalid_api_key")).await;
    let answer = post(&listed, "https://evil.example", Some("k"))
        .await
        .expect("send");
    assert_eq!(header(&answer, "access-control-allow-origin"), None);
    drop(listed);

    let any = Server::start(&["--allowed-origins", "*"]);
    let answer = preflight(&any, "https://anywhere.example")
        .await
        .expect("send");
    assert_eq!(header(&answer, "access-control-allow-origin"), Some("*"));
}
