//! Connections, time and shutdown of `plughost serve` over real sockets on the mock device: header, body and keep-alive timeouts, a flood, the connection cap, and the shutdown deadline.
//!
//! These run the real binary (only this package's tests know its path), so signals and exit
//! codes are the ones users see. Every wait is bounded, by about ten times what it should take.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::serve_support::{Server, closes_within, get_health, is_closed, read_response};

#[test]
fn a_client_sending_headers_byte_by_byte_is_cut_off_by_the_header_timeout() {
    let server = Server::start(&["--header-read-timeout", "1"]);
    let mut slow = server.connect();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        .expect("the first bytes");
    let started = Instant::now();
    let mut cut_off = false;
    // One byte every 100 ms: always active, never done. 100 bytes is ten times the timeout.
    for _ in 0..100 {
        if slow.write_all(b"a").is_err() || is_closed(&slow) {
            cut_off = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(cut_off, "still connected after {:?}", started.elapsed());
    let health = server
        .try_get("/health")
        .expect("a fresh connection is served");
    assert_eq!(health.status, 200);
}

#[test]
fn an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout() {
    // The header timeout is far longer, so only the keep-alive timeout can close it in time.
    let server = Server::start(&["--keep-alive-timeout", "1", "--header-read-timeout", "100"]);
    let mut idle = server.connect();
    let first = get_health(&mut idle).expect("a response");
    assert_eq!(first.status, 200);
    assert!(!is_closed(&idle), "kept alive after the response");
    assert!(
        closes_within(&idle, Duration::from_secs(10)),
        "an idle connection stayed open 10 s with a 1 s keep-alive timeout"
    );
}

#[test]
fn a_body_slower_than_the_body_read_timeout_gets_408() {
    let server = Server::start(&["--body-read-timeout", "1"]);
    let mut slow = server.connect();
    slow.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    slow.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\
          Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ",
    )
    .expect("the headers and a first part of the body");
    let response = read_response(&mut slow).expect("an answer within 10 s");
    assert_eq!(response.status, 408, "{}", response.body);
    let body: serde_json::Value = serde_json::from_str(&response.body).expect("a JSON error");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("did not arrive within 1 s")),
        "{body}"
    );
}

#[test]
fn health_answers_while_a_flood_of_idle_and_slowloris_connections_is_open() {
    let hard = rlimit::increase_nofile_limit(u64::MAX).expect("raise this test's open-file limit");
    // This process holds one end of every connection and the server the other, each under
    // its own limit; the margin leaves room for everything else both have open.
    let flood = 10_000.min(hard.saturating_sub(512)) as usize;
    assert!(
        flood >= 1000,
        "an open-file limit of {hard} is too small for a flood test"
    );
    let max = (flood + 64).to_string();
    // No connection of the flood may be cut while it is being opened.
    let server = Server::start(&["--max-connections", &max, "--header-read-timeout", "300"]);
    let started = Instant::now();
    let mut connections = Vec::with_capacity(flood);
    for i in 0..flood {
        let mut stream = server.connect();
        if i % 2 == 1 {
            stream
                .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
                .expect("a slowloris start");
        }
        connections.push(stream);
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "opened only {i} connections in 120 s"
        );
    }
    let opened = started.elapsed();
    let probe = Instant::now();
    let health = server.try_get("/health").expect("/health answers");
    let latency = probe.elapsed();
    assert_eq!(health.status, 200);
    assert!(
        latency < Duration::from_secs(10),
        "/health took {latency:?} with {flood} connections open"
    );
    let open = connections.iter().filter(|c| !is_closed(c)).count();
    assert_eq!(
        open, flood,
        "the server let go of connections under its limit"
    );
    eprintln!("{flood} connections opened in {opened:?}; /health answered in {latency:?}");
}

#[test]
fn at_max_connections_the_idle_connection_that_waited_longest_is_closed() {
    let server = Server::start(&["--max-connections", "4"]);
    let mut connections: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut c = server.connect();
            assert_eq!(get_health(&mut c).expect("served").status, 200);
            c
        })
        .collect();
    // Full: a probe gets in by closing connection 0, the one idle longest.
    let mut probe = server.connect();
    assert_eq!(
        get_health(&mut probe).expect("the probe is served").status,
        200
    );
    assert!(
        closes_within(&connections[0], Duration::from_secs(10)),
        "connection 0 stays open"
    );
    // Connection 1 is used again, so 2 has now waited longest.
    assert_eq!(
        get_health(&mut connections[1])
            .expect("still served")
            .status,
        200
    );
    let mut second_probe = server.connect();
    assert_eq!(get_health(&mut second_probe).expect("served").status, 200);
    assert!(
        closes_within(&connections[2], Duration::from_secs(10)),
        "connection 2 stays open"
    );
    for (name, c) in [
        ("1", &connections[1]),
        ("3", &connections[3]),
        ("the probe", &probe),
    ] {
        assert!(!is_closed(c), "connection {name} was closed too");
    }
}

/// A streaming request far larger than the socket buffers, from a client that reads its
/// first bytes and then nothing: the server can never finish writing it.
fn stuck_stream(server: &Server) -> TcpStream {
    let body = serde_json::json!({
        "model": "tiny-qwen3", "prompt": "hello", "max_tokens": 400, "n": 64,
        "logprobs": 5, "ignore_eos": true, "stream": true
    })
    .to_string();
    let mut stream = server.connect();
    stream
        .write_all(
            format!(
                "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\
                 Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .expect("send the request");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    let mut first = [0u8; 512];
    let n = stream.read(&mut first).expect("the response starts");
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&first[..n])
    );
    stream
}

#[test]
fn sigterm_closes_idle_connections_and_cuts_a_stuck_client_at_the_deadline_then_exits_0() {
    let mut server = Server::start(&["--shutdown-timeout", "2"]);
    let _stuck = stuck_stream(&server);
    let mut idle = server.connect();
    assert_eq!(get_health(&mut idle).expect("served").status, 200);
    server.signal("TERM");
    assert!(
        closes_within(&idle, Duration::from_secs(10)),
        "an idle connection was kept open through the drain"
    );
    // The stuck client holds the process for the deadline; meanwhile nothing new gets in.
    let refused = TcpStream::connect(("127.0.0.1", server.port)).is_err();
    let still_running = server.child.try_wait().expect("poll").is_none();
    let (status, after) = server.wait_exit(Duration::from_secs(30));
    assert!(
        status.success(),
        "exit status {status}:\n{}",
        server.stderr()
    );
    assert!(
        server.stderr().contains("shutdown deadline passed"),
        "the stuck client never reached the deadline:\n{}",
        server.stderr()
    );
    assert!(
        refused || !still_running,
        "a new connection was accepted while draining"
    );
    eprintln!("exited 0 {after:?} after SIGTERM with --shutdown-timeout 2");
}

#[test]
fn a_second_signal_exits_at_once() {
    let mut server = Server::start(&["--shutdown-timeout", "600"]);
    let _stuck = stuck_stream(&server);
    server.signal("TERM");
    server.wait_for_log("no longer accepting connections", Duration::from_secs(30));
    server.signal("TERM");
    let (status, after) = server.wait_exit(Duration::from_secs(30));
    assert_eq!(status.code(), Some(143), "{status}:\n{}", server.stderr());
    eprintln!("exited {after:?} after the second SIGTERM, with 600 s of deadline left");
}

/// At the deadline the library's server ends what is still running: a stream with an error
/// event in the shape of every other, a request still in its handler with a 503.
#[tokio::test]
async fn at_the_deadline_streams_end_with_an_error_event_and_pending_requests_get_503() {
    use axum::response::sse::{Event, Sse};
    use futures::StreamExt;
    use plughost::api::{ConnectionLimits, serve_app};

    let endless = || async {
        let first = futures::stream::once(async {
            Ok::<_, std::convert::Infallible>(Event::default().data("first"))
        });
        Sse::new(first.chain(futures::stream::pending()))
    };
    let app = axum::Router::new()
        .route("/stream", axum::routing::get(endless))
        .route(
            "/pending",
            axum::routing::get(std::future::pending::<&'static str>),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    let limits = ConnectionLimits {
        shutdown_timeout: Duration::from_secs(1),
        ..ConnectionLimits::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_app(listener, app, limits, async {
        let _ = stopped.await;
    }));
    let client = reqwest::Client::new();
    let mut stream = client
        .get(format!("{base}/stream"))
        .send()
        .await
        .expect("the stream starts")
        .bytes_stream();
    let first = stream.next().await.expect("a first event").expect("bytes");
    assert!(String::from_utf8_lossy(&first).contains("data: first"));
    let pending = tokio::spawn(client.get(format!("{base}/pending")).send());
    // Give the pending request time to reach its handler before the shutdown begins.
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.send(()).expect("the server waits for the signal");

    let mut rest = String::new();
    let read_rest = async {
        while let Some(chunk) = stream.next().await {
            rest.push_str(&String::from_utf8_lossy(
                &chunk.expect("the stream ends cleanly"),
            ));
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read_rest)
        .await
        .expect("the stream ends at the deadline");
    let event = rest
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .unwrap_or_else(|| panic!("no error event: {rest:?}"));
    let event: serde_json::Value = serde_json::from_str(event).expect("a JSON event");
    assert_eq!(
        event["error"]["type"], "service_unavailable_error",
        "{event}"
    );

    let response = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .expect("the pending request is answered")
        .expect("join")
        .expect("a response");
    assert_eq!(response.status(), 503);
    let body: serde_json::Value = response.json().await.expect("a JSON error");
    assert_eq!(body["error"]["type"], "service_unavailable_error", "{body}");
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("serve returns after the deadline")
        .expect("join")
        .expect("serve");
}

/// A client that stops reading a response that never ends cannot even take the error event:
/// its connection is closed a moment after the deadline and `serve_app` returns.
#[tokio::test]
async fn a_client_that_stopped_reading_is_closed_after_the_deadline() {
    use plughost::api::{ConnectionLimits, serve_app};

    let firehose = || async {
        let chunk = axum::body::Bytes::from(vec![b'x'; 64 << 10]);
        let chunks = futures::stream::repeat(Ok::<_, std::convert::Infallible>(chunk));
        axum::body::Body::from_stream(chunks)
    };
    let app = axum::Router::new().route("/firehose", axum::routing::get(firehose));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    let limits = ConnectionLimits {
        shutdown_timeout: Duration::from_secs(1),
        ..ConnectionLimits::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_app(listener, app, limits, async {
        let _ = stopped.await;
    }));
    let mut client = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    tokio::io::AsyncWriteExt::write_all(
        &mut client,
        b"GET /firehose HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    )
    .await
    .expect("send the request");
    // Long enough for the socket buffers to fill; the client never reads.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.send(()).expect("the server waits for the signal");
    tokio::time::timeout(Duration::from_secs(20), server)
        .await
        .expect("serve returns within the deadline and the grace after it")
        .expect("join")
        .expect("serve");
    drop(client);
}
