//! Request ids in the engine thread's log lines: a request the engine fails is named by its `X-Request-Id` on the engine's own line, not only on the API's.
//!
//! Runs the real `plughost serve` binary on the mock device with an injected launch fault.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::serve_support::{Server, read_response};

/// A launch a few steps into the first generation (loading launches far fewer); two failures
/// in a row outlast the engine's one retry, so the step's requests fail.
const FAULT: &str = "fail_launch=200,fail_launch_count=2";

#[test]
fn the_engine_names_the_request_id_when_it_fails_a_request() {
    let server = Server::start(&["--device-config", FAULT]);
    let body = r#"{"model": "tiny-qwen3", "prompt": "hello world hello", "max_tokens": 300, "ignore_eos": true, "temperature": 0}"#;
    let mut stream = server.connect();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("read timeout");
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-Id: abc-123\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("the request");
    let response = read_response(&mut stream).expect("an answer within 60 s");
    assert_eq!(response.status, 500, "{}", response.body);
    assert!(
        response.body.contains("engine step failed"),
        "{}",
        response.body
    );
    // The engine writes its line before it sends the failure; the log pipe may lag behind the
    // socket, so give it ten seconds.
    let deadline = Instant::now() + Duration::from_secs(10);
    let engine_line = loop {
        let log = server.stderr();
        let found = log
            .lines()
            .find(|line| {
                line.contains("plughost::engine")
                    && line.contains("request failed: engine step failed")
            })
            .map(str::to_string);
        if let Some(line) = found {
            break line;
        }
        assert!(
            Instant::now() < deadline,
            "no engine line about the failed request:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(engine_line.contains("abc-123"), "{engine_line}");
}
