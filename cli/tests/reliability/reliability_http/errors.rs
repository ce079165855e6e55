//! An OpenAI-style JSON error body on every error the HTTP layer answers, from routing to body limits.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_has_an_openai_json_body() {
    let limit = 64 << 10;
    let server = Server::start(&["--max-request-body", "64KiB", "--api-key", "k"]);
    let client = reqwest::Client::new();
    let json_body = |bytes: Vec<u8>| {
        client
            .post(server.url("/v1/completions"))
            .bearer_auth("k")
            .header("content-type", "application/json")
            .body(bytes)
    };
    let mut oversize = br#"{"prompt": ""#.to_vec();
    oversize.resize(limit + 1000, b'a');
    oversize.extend_from_slice(br#""}"#);
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..40).map(|_| Ok(vec![b' '; 4096])).collect();
    let cases: Vec<(&str, reqwest::RequestBuilder, u16, Option<&str>)> = vec![
        (
            "malformed JSON",
            json_body(br#"{"prompt": "#.to_vec()),
            400,
            Some("invalid_json"),
        ),
        (
            "a JSON array",
            json_body(b"[1, 2]".to_vec()),
            400,
            Some("invalid_json"),
        ),
        (
            "bad UTF-8",
            json_body(b"{\"prompt\": \"caf\xe9\"}".to_vec()),
            400,
            Some("invalid_encoding"),
        ),
        (
            "a field of the wrong type",
            json_body(br#"{"prompt": "a", "max_tokens": "ten"}"#.to_vec()),
            400,
            Some("invalid_value"),
        ),
        (
            "an unknown model",
            json_body(br#"{"model": "gpt-17", "prompt": "a"}"#.to_vec()),
            404,
            Some("model_not_found"),
        ),
        (
            "a body over the limit",
            json_body(oversize),
            413,
            Some("request_too_large"),
        ),
        (
            "a chunked body over the limit",
            client
                .post(server.url("/v1/completions"))
                .bearer_auth("k")
                .header("content-type", "application/json")
                .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks))),
            413,
            Some("request_too_large"),
        ),
        (
            "text/plain",
            client
                .post(server.url("/v1/completions"))
                .bearer_auth("k")
                .header("content-type", "text/plain")
                .body("{}"),
            415,
            Some("unsupported_media_type"),
        ),
        (
            "an unknown route",
            client.get(server.url("/v1/engines")).bearer_auth("k"),
            404,
            Some("not_found"),
        ),
        (
            "an unknown POST route",
            client
                .post(server.url("/v2/completions"))
                .bearer_auth("k")
                .json(&json!({})),
            404,
            Some("not_found"),
        ),
        (
            "GET on a POST route",
            client.get(server.url("/v1/completions")).bearer_auth("k"),
            405,
            Some("method_not_allowed"),
        ),
        (
            "DELETE on a GET route",
            client.delete(server.url("/v1/models")).bearer_auth("k"),
            405,
            Some("method_not_allowed"),
        ),
        (
            "OPTIONS without CORS",
            client
                .request(Method::OPTIONS, server.url("/v1/models"))
                .bearer_auth("k"),
            405,
            Some("method_not_allowed"),
        ),
        (
            "no API key",
            client.get(server.url("/v1/models")),
            401,
            Some("invalid_api_key"),
        ),
        (
            "a wrong API key",
            client.get(server.url("/v1/models")).bearer_auth("j"),
            401,
            Some("invalid_api_key"),
        ),
    ];
    let mut failures = Vec::new();
    for (name, request, status, code) in cases {
        match request.send().await {
            Ok(response) => {
                let (problems, body) = error_problems(response, status, code).await;
                failures.extend(problems.into_iter().map(|p| format!("{name}: {p}; {body}")));
            }
            Err(e) => failures.push(format!("{name}: request failed: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // At the limit is allowed: JSON may carry trailing spaces.
    let mut at_limit = serde_json::to_vec(&completion_body(1)).expect("json");
    at_limit.resize(limit, b' ');
    let response = json_body(at_limit).send().await.expect("send");
    assert_eq!(response.status(), StatusCode::OK);

    // Below what reqwest can send: a declared gigabyte, and broken chunk framing.
    let declared = raw_exchange(
        server.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n\
          Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{\"prompt\"",
    );
    assert!(declared.starts_with("HTTP/1.1 413"), "{declared}");
    assert!(
        declared.contains("\"code\":\"request_too_large\""),
        "{declared}"
    );
    let framing = raw_exchange(
        server.port,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n\
          Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    );
    assert!(framing.starts_with("HTTP/1.1 400"), "{framing}");
    assert!(
        framing.contains("content-type: application/json"),
        "{framing}"
    );
    assert!(framing.contains("\"error\":{"), "{framing}");
}
