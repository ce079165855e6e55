//! Request heads hyper cannot parse, sent over raw sockets to `plughost serve` on the mock device: each gets its status, an OpenAI-style JSON error and `connection: close`, while good requests around them are served.
//!
//! Every read is bounded by a 10 s socket timeout.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::serve_support::{Server, get_health, read_response};

/// Everything the server sends until it closes the connection, as (head, body) pairs.
fn read_until_closed(stream: &mut TcpStream) -> Vec<(String, String)> {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let mut data = Vec::new();
    let mut buf = [0u8; 16 << 10];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => data.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => panic!(
                "the server neither answered nor closed within 10 s ({e}); got {:?}",
                String::from_utf8_lossy(&data)
            ),
        }
    }
    split_responses(&String::from_utf8_lossy(&data))
}

fn split_responses(mut text: &str) -> Vec<(String, String)> {
    let mut responses = Vec::new();
    // A response per round; a connection answers far fewer than 10.
    for _ in 0..10 {
        let Some((head, rest)) = text.split_once("\r\n\r\n") else {
            assert!(text.is_empty(), "a partial response: {text:?}");
            break;
        };
        let length: usize = header(head, "content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no content-length in {head:?}"));
        assert!(rest.len() >= length, "a short body after {head:?}");
        responses.push((head.to_string(), rest[..length].to_string()));
        text = &rest[length..];
    }
    responses
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().skip(1).find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.trim().eq_ignore_ascii_case(name).then(|| value.trim())
    })
}

fn status(head: &str) -> u16 {
    head.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"))
}

/// Asserts that `(head, body)` is the JSON error for a rejected head, and returns its message.
fn assert_json_rejection(
    (head, body): &(String, String),
    expected_status: u16,
    expected_code: &str,
) -> String {
    assert_eq!(status(head), expected_status, "{head}\n{body}");
    assert_eq!(
        header(head, "content-type"),
        Some("application/json"),
        "{head}"
    );
    assert_eq!(header(head, "connection"), Some("close"), "{head}");
    let json: serde_json::Value = serde_json::from_str(body).expect("a JSON error body");
    assert_eq!(json["error"]["type"], "invalid_request_error", "{json}");
    assert_eq!(json["error"]["code"], expected_code, "{json}");
    json["error"]["message"]
        .as_str()
        .expect("a message")
        .to_string()
}

/// Sends `request` on a fresh connection, in pieces of `piece` bytes, and reads everything
/// until the server closes. A write the server cuts short (it stops reading a head it has
/// rejected) is no failure: the answer is what counts.
fn send_raw(server: &Server, request: &[u8], piece: usize) -> Vec<(String, String)> {
    let mut stream = server.connect();
    for chunk in request.chunks(piece) {
        if stream.write_all(chunk).is_err() {
            break;
        }
        if piece < request.len() {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    read_until_closed(&mut stream)
}

/// A malformed request, how it is sent, and what it must get.
struct Case {
    name: &'static str,
    request: Vec<u8>,
    /// Bytes per write: a head split across many reads must be recognised all the same.
    piece: usize,
    status: u16,
    code: &'static str,
    message: &'static str,
}

#[test]
fn malformed_request_heads_get_their_status_and_a_json_error() {
    let server = Server::start(&[]);
    let huge_header = [
        &b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "[..],
        &vec![b'a'; 500_000],
        b"\r\n\r\n",
    ]
    .concat();
    let long_uri = [
        &b"GET /"[..],
        &vec![b'a'; 70_000],
        b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    ]
    .concat();
    let cases = [
        Case {
            name: "a malformed request line",
            request: b"GARBAGE\r\n\r\n".to_vec(),
            piece: usize::MAX,
            status: 400,
            code: "malformed_request",
            message: "malformed HTTP request: invalid HTTP method",
        },
        Case {
            name: "a header without a colon",
            request: b"GET /health HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n".to_vec(),
            piece: usize::MAX,
            status: 400,
            code: "malformed_request",
            message: "malformed HTTP request: invalid HTTP header",
        },
        Case {
            name: "a header without a colon, three bytes per write",
            request: b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-No-Colon\r\n\r\n".to_vec(),
            piece: 3,
            status: 400,
            code: "malformed_request",
            message: "malformed HTTP request: invalid HTTP header",
        },
        Case {
            name: "an HTTP version other than 1.0 and 1.1",
            request: b"GET /health HTTP/3.0\r\nHost: 127.0.0.1\r\n\r\n".to_vec(),
            piece: usize::MAX,
            status: 505,
            code: "http_version_not_supported",
            message: "HTTP version not supported",
        },
        Case {
            name: "headers too large",
            request: huge_header,
            piece: 64 << 10,
            status: 431,
            code: "request_head_too_large",
            message: "the request head is too large",
        },
        Case {
            name: "a URI too long",
            request: long_uri,
            piece: usize::MAX,
            status: 414,
            code: "uri_too_long",
            message: "URI is too long",
        },
    ];
    for case in cases {
        let responses = send_raw(&server, &case.request, case.piece);
        assert_eq!(responses.len(), 1, "{}: {responses:?}", case.name);
        let got = assert_json_rejection(&responses[0], case.status, case.code);
        assert!(got.contains(case.message), "{}: {got:?}", case.name);
    }
    let health = server
        .try_get("/health")
        .expect("a fresh connection is served");
    assert_eq!(health.status, 200, "{}", health.body);
}

#[test]
fn a_keep_alive_request_is_answered_before_the_malformed_one_after_it() {
    let server = Server::start(&[]);
    let mut stream = server.connect();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let first = get_health(&mut stream).expect("an answer to the good request");
    assert_eq!(first.status, 200, "{}", first.body);
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n")
        .expect("the malformed request");
    let responses = read_until_closed(&mut stream);
    assert_eq!(responses.len(), 1, "{responses:?}");
    assert_json_rejection(&responses[0], 400, "malformed_request");
}

#[test]
fn pipelined_requests_are_answered_in_order_up_to_the_malformed_one() {
    let server = Server::start(&[]);
    let mut stream = server.connect();
    // A HEAD of an unknown route first: its 404 head goes out without its JSON body, which must
    // not be taken for hyper's own bodiless answer.
    stream
        .write_all(
            b"HEAD /v1/nothing-here HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n\
              GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n\
              GET /health HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n\
              GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        )
        .expect("four pipelined requests");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let mut data = Vec::new();
    let mut buf = [0u8; 16 << 10];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => data.extend_from_slice(&buf[..n]),
            Err(e) => panic!("no close within 10 s: {e}"),
        }
    }
    let text = String::from_utf8_lossy(&data);
    let (head_404, rest) = text.split_once("\r\n\r\n").expect("the HEAD answer");
    assert_eq!(status(head_404), 404, "{text}");
    let responses = split_responses(rest);
    assert_eq!(responses.len(), 2, "{text}");
    assert_eq!(status(&responses[0].0), 200, "{text}");
    assert_json_rejection(&responses[1], 400, "malformed_request");
}

#[test]
fn after_a_rejected_head_a_fresh_connection_serves_keep_alive_requests() {
    let server = Server::start(&[]);
    let rejected = send_raw(&server, b"BAD\r\n\r\n", usize::MAX);
    assert_json_rejection(&rejected[0], 400, "malformed_request");
    let mut stream = server.connect();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    for _ in 0..3 {
        let health = get_health(&mut stream).expect("a keep-alive answer");
        assert_eq!(health.status, 200, "{}", health.body);
    }
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .expect("a last request");
    let last = read_response(&mut stream).expect("the last answer");
    assert_eq!(last.status, 200, "{}", last.body);
}
