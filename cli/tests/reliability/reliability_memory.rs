//! Memory of `plughost serve` around eight concurrent multi-megabyte chat bodies: a bounded peak, and RSS back near where it was.
//!
//! Generous bounds only, far above what `tests/reliability/measure_memory.py` measures (see
//! docs/reliability.md): this guards against a return of the causes (tokenizing a prompt that
//! cannot fit, an allocator that keeps what was freed), not against small changes.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::serve_support::{Server, read_response};

/// Under the default body limit, which is 8 MiB or more.
const BODY_BYTES: usize = (8 << 20) - (4 << 10);
const CONCURRENCY: usize = 8;
const MAX_PEAK_GROWTH_MIB: f64 = 600.0;
const MAX_RETAINED_MIB: f64 = 200.0;

fn status_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map(|kib| kib / 1024.0)
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// One user message of plain words filling `bytes`.
fn chat_body(bytes: usize) -> Vec<u8> {
    let head = br#"{"model":"tiny-qwen3","max_tokens":4,"messages":[{"role":"user","content":""#;
    let tail = br#""}]}"#;
    let words = b"the quick brown fox jumps over a lazy dog. ";
    let mut body = head.to_vec();
    while body.len() + words.len() + tail.len() <= bytes {
        body.extend_from_slice(words);
    }
    body.extend_from_slice(tail);
    body
}

fn post_chat(port: u16, body: &[u8]) -> u16 {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .expect("read timeout");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("send the head");
    stream.write_all(body).expect("send the body");
    read_response(&mut stream).expect("a response").status
}

#[test]
fn eight_concurrent_big_chat_bodies_raise_memory_boundedly_and_it_comes_back() {
    let server = Server::start(&[]);
    let pid = server.child.id();
    // The first requests allocate what the server keeps for good.
    assert_eq!(post_chat(server.port, &chat_body(200)), 200);
    std::thread::sleep(Duration::from_millis(500));
    let before = status_mib(pid, "VmRSS");
    // Writing 5 to clear_refs starts VmHWM again from the current RSS.
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset the peak");

    let body = chat_body(BODY_BYTES);
    let statuses: Vec<u16> = std::thread::scope(|scope| {
        let requests: Vec<_> = (0..CONCURRENCY)
            .map(|_| scope.spawn(|| post_chat(server.port, &body)))
            .collect();
        requests
            .into_iter()
            .map(|r| r.join().expect("a request thread"))
            .collect()
    });
    let peak = status_mib(pid, "VmHWM");
    assert!(
        statuses.iter().all(|&s| s == 400),
        "a prompt of megabytes cannot fit the context: {statuses:?}"
    );
    assert!(
        peak - before < MAX_PEAK_GROWTH_MIB,
        "RSS rose from {before:.0} to {peak:.0} MiB while {CONCURRENCY} bodies of {BODY_BYTES} bytes were in flight"
    );

    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = status_mib(pid, "VmRSS");
    while after - before >= MAX_RETAINED_MIB && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        after = status_mib(pid, "VmRSS");
    }
    assert!(
        after - before < MAX_RETAINED_MIB,
        "RSS stayed at {after:.0} MiB, {before:.0} before the requests"
    );
    eprintln!("RSS {before:.0} MiB before, peak {peak:.0} MiB, {after:.0} MiB after");
}
