//! Request ids: taken from `X-Request-Id` when it is sane, generated otherwise, echoed in the
//! response, and carried by the tracing span every log line about the request is written in.

use std::fmt;

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

use super::access_log::{AccessLine, AccessRecord, log_at_end};

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest client-chosen id kept; a longer one is replaced, since it ends up in every log line
/// and in the completion id.
pub const MAX_LEN: usize = 128;

/// One request's id: visible ASCII, at most [`MAX_LEN`] bytes. Handlers read it from the
/// request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(String);

impl RequestId {
    /// The client's id if it is printable and short enough, else `None`.
    pub fn from_client(value: &HeaderValue) -> Option<RequestId> {
        let bytes = value.as_bytes();
        let printable = bytes.iter().all(|b| b.is_ascii_graphic());
        (!bytes.is_empty() && bytes.len() <= MAX_LEN && printable)
            .then(|| RequestId(String::from_utf8_lossy(bytes).into_owned()))
    }

    /// A fresh random id: 32 hex digits.
    pub fn generate() -> RequestId {
        RequestId(format!("{:032x}", rand::random::<u128>()))
    }

    fn of(headers: &HeaderMap) -> RequestId {
        match headers.get(X_REQUEST_ID) {
            None => RequestId::generate(),
            Some(value) => RequestId::from_client(value).unwrap_or_else(|| {
                let fresh = RequestId::generate();
                tracing::debug!(id = %fresh, "X-Request-Id is not printable ASCII of at most {MAX_LEN} bytes; replaced");
                fresh
            }),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Probes and scrapes come every few seconds; their lines would drown the requests' own.
fn is_probe(path: &str) -> bool {
    matches!(path, "/health" | "/ready" | "/metrics")
}

/// The outermost middleware: names the request, runs everything inside its span, and echoes
/// the id on every response (errors from the layers inside included).
pub async fn assign(mut request: Request, next: Next) -> Response {
    let id = RequestId::of(request.headers());
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let span = tracing::info_span!("request", id = %id);
    let record = AccessRecord::start();
    request.extensions_mut().insert(id.clone());
    request.extensions_mut().insert(record.clone());
    let mut response = next.run(request).instrument(span.clone()).await;
    if let Ok(value) = HeaderValue::from_str(id.as_str()) {
        response.headers_mut().insert(X_REQUEST_ID, value);
    }
    let line = AccessLine {
        method: method.to_string(),
        status: response.status().as_u16(),
        quiet: is_probe(&path),
        route: path,
        span,
    };
    log_at_end(response, record, line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ids_are_kept_only_when_printable_and_short() {
        let kept = [
            "abc-123",
            "0f1e2d3c",
            "req_01HZX:9/a.b",
            &"x".repeat(MAX_LEN),
        ];
        for id in kept {
            let value = HeaderValue::from_str(id).expect("a header value");
            assert_eq!(
                RequestId::from_client(&value)
                    .as_ref()
                    .map(RequestId::as_str),
                Some(id)
            );
        }
        let refused: [&[u8]; 5] = [
            b"",
            b"has space",
            b"tab\there",
            b"caf\xc3\xa9",
            &[b'x'; MAX_LEN + 1],
        ];
        for bytes in refused {
            let value = HeaderValue::from_bytes(bytes).expect("a header value");
            assert_eq!(RequestId::from_client(&value), None, "{bytes:?}");
        }
        let generated = RequestId::generate();
        assert_eq!(generated.as_str().len(), 32);
        assert_ne!(generated, RequestId::generate());
    }
}
