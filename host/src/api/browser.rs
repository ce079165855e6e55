//! What web pages may do with the server: request bodies must be JSON, which a page can only
//! send cross-origin after a CORS preflight, and CORS answers only the `--allowed-origins`.
//!
//! A plain `<form>` or a `fetch` with `text/plain` reaches a server without a preflight; were
//! such bodies accepted, any site a user visits could drive generation on their local server.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use axum::extract::Request;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER, TRANSFER_ENCODING};
use axum::http::{HeaderMap, HeaderValue, Method, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use super::error::ApiError;
use super::request_id::X_REQUEST_ID;

/// How long a browser may cache a preflight's answer.
const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(60 * 60);

/// Most characters of a refused `Content-Type` repeated in the error.
const MAX_ECHOED_CONTENT_TYPE: usize = 100;

/// Answers 415 to a POST whose body is not declared `application/json` (in UTF-8, the only
/// encoding JSON has).
pub async fn require_json_body(request: Request, next: Next) -> Response {
    if request.method() == Method::POST
        && has_body(request.headers())
        && let Err(error) = check_json_content_type(request.headers())
    {
        return error.into_response();
    }
    next.run(request).await
}

fn has_body(headers: &HeaderMap) -> bool {
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    headers.contains_key(TRANSFER_ENCODING) || declared != Some(0) && declared.is_some()
}

fn check_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(value) = headers.get(CONTENT_TYPE) else {
        return Err(ApiError::UnsupportedMediaType {
            received: "no Content-Type".into(),
        });
    };
    let text = value.to_str().unwrap_or("");
    let is_json = text.parse::<mime::Mime>().is_ok_and(|m| {
        m.type_() == mime::APPLICATION
            && m.subtype() == mime::JSON
            && m.suffix().is_none()
            && m.get_param(mime::CHARSET)
                .is_none_or(|charset| charset == mime::UTF_8)
    });
    if is_json {
        return Ok(());
    }
    let shown: String = String::from_utf8_lossy(value.as_bytes())
        .chars()
        .take(MAX_ECHOED_CONTENT_TYPE)
        .collect();
    Err(ApiError::UnsupportedMediaType {
        received: format!("Content-Type `{shown}`"),
    })
}

/// The origins whose pages may call the API from a browser: `*` or a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowedOrigins {
    Any,
    /// Normalized as browsers send them: `scheme://host[:port]`, lowercase, no trailing `/`.
    List(Vec<HeaderValue>),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OriginError {
    #[error("no origin given: pass `*` or a comma-separated list like `https://app.example`")]
    Empty,
    #[error("`*` allows every origin and cannot be combined with others")]
    WildcardInList,
    #[error("`{0}` is not an origin: write `scheme://host[:port]`, e.g. `http://localhost:3000`")]
    NotAnOrigin(String),
}

impl FromStr for AllowedOrigins {
    type Err = OriginError;

    fn from_str(text: &str) -> Result<AllowedOrigins, OriginError> {
        let items: Vec<&str> = text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        match items.as_slice() {
            [] => Err(OriginError::Empty),
            ["*"] => Ok(AllowedOrigins::Any),
            _ if items.contains(&"*") => Err(OriginError::WildcardInList),
            _ => items
                .iter()
                .map(|item| origin(item))
                .collect::<Result<_, _>>()
                .map(AllowedOrigins::List),
        }
    }
}

fn origin(text: &str) -> Result<HeaderValue, OriginError> {
    let not_origin = || OriginError::NotAnOrigin(text.to_string());
    let uri: Uri = text.parse().map_err(|_| not_origin())?;
    let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return Err(not_origin());
    };
    let bare = uri.path_and_query().is_none_or(|p| p.as_str() == "/");
    if !bare || authority.as_str().contains('@') {
        return Err(not_origin());
    }
    let normalized = format!("{}://{}", scheme, authority).to_ascii_lowercase();
    HeaderValue::from_str(&normalized).map_err(|_| not_origin())
}

impl fmt::Display for AllowedOrigins {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllowedOrigins::Any => f.write_str("*"),
            AllowedOrigins::List(origins) => {
                let names: Vec<&str> = origins.iter().filter_map(|o| o.to_str().ok()).collect();
                f.write_str(&names.join(","))
            }
        }
    }
}

/// CORS for the allowed origins, preflight included. Requests still need their API key: CORS
/// only lets the page read the answer.
pub fn cors_layer(origins: &AllowedOrigins) -> CorsLayer {
    let allow_origin = match origins {
        AllowedOrigins::Any => AllowOrigin::any(),
        AllowedOrigins::List(list) => AllowOrigin::list(list.iter().cloned()),
    };
    CorsLayer::new()
        .allow_origin(allow_origin)
        .allow_methods([Method::GET, Method::POST])
        // OpenAI's browser clients send headers of their own (`x-stainless-*`); the origin is
        // what is checked.
        .allow_headers(AllowHeaders::mirror_request())
        .expose_headers([X_REQUEST_ID, RETRY_AFTER])
        .max_age(PREFLIGHT_MAX_AGE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_json_bodies_pass() {
        let cases = [
            (Some("application/json"), true),
            (Some("application/json; charset=utf-8"), true),
            (Some("Application/JSON;charset=UTF-8"), true),
            (Some("application/json; charset=latin1"), false),
            (Some("text/plain"), false),
            (Some("application/x-www-form-urlencoded"), false),
            (Some("multipart/form-data; boundary=x"), false),
            (Some("application/ld+json"), false),
            (Some("application/jsonx"), false),
            (Some("json"), false),
            (None, false),
        ];
        for (content_type, ok) in cases {
            let mut headers = HeaderMap::new();
            if let Some(value) = content_type {
                headers.insert(CONTENT_TYPE, HeaderValue::from_static(value));
            }
            assert_eq!(
                check_json_content_type(&headers).is_ok(),
                ok,
                "{content_type:?}"
            );
        }
    }

    #[test]
    fn bodies_are_told_by_their_length_or_chunking() {
        let with = |name, value| {
            let mut headers = HeaderMap::new();
            headers.insert(name, HeaderValue::from_static(value));
            has_body(&headers)
        };
        assert!(with(CONTENT_LENGTH, "12"));
        assert!(with(TRANSFER_ENCODING, "chunked"));
        assert!(!with(CONTENT_LENGTH, "0"));
        assert!(!has_body(&HeaderMap::new()));
    }

    #[test]
    fn origins_parse_as_a_wildcard_or_a_list() {
        assert_eq!("*".parse(), Ok(AllowedOrigins::Any));
        let list: AllowedOrigins = " https://App.example , http://localhost:3000/ "
            .parse()
            .expect("two origins");
        assert_eq!(
            list.to_string(),
            "https://app.example,http://localhost:3000"
        );
        let refused = [
            ("", OriginError::Empty),
            (" , ", OriginError::Empty),
            ("*,https://a.example", OriginError::WildcardInList),
            ("a.example", OriginError::NotAnOrigin("a.example".into())),
            (
                "https://a.example/app",
                OriginError::NotAnOrigin("https://a.example/app".into()),
            ),
            (
                "https://a.example?x=1",
                OriginError::NotAnOrigin("https://a.example?x=1".into()),
            ),
            (
                "https://user@a.example",
                OriginError::NotAnOrigin("https://user@a.example".into()),
            ),
        ];
        for (text, error) in refused {
            assert_eq!(text.parse::<AllowedOrigins>(), Err(error), "{text:?}");
        }
    }
}
