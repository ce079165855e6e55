//! API keys: which routes need one, and checking `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) in constant time.

use std::fmt;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::error::ApiError;

/// Routes that probes and scrapers reach without a key.
const OPEN_PATHS: [&str; 3] = ["/health", "/ready", "/metrics"];

/// Routes that need the admin key instead (see `admin`), never an API key.
const ADMIN_PREFIX: &str = "/admin/";

/// The keys the server accepts; none means the API is open.
///
/// Only SHA-256 digests are kept: comparing digests takes the same time whatever the
/// presented key's length or how much of it matches, and the keys never show in a `Debug`.
#[derive(Clone, Default)]
pub struct ApiKeys {
    digests: Vec<[u8; 32]>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiKeyError {
    #[error("an API key cannot be empty")]
    Empty,
    #[error("an API key must be printable ASCII without spaces")]
    Unprintable,
}

impl ApiKeys {
    pub fn new<I, K>(keys: I) -> Result<ApiKeys, ApiKeyError>
    where
        I: IntoIterator<Item = K>,
        K: AsRef<str>,
    {
        let mut digests = Vec::new();
        for key in keys {
            let key = key.as_ref();
            if key.is_empty() {
                return Err(ApiKeyError::Empty);
            }
            // Clients send headers as ASCII and trim spaces: any other key could never match.
            if !key.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ApiKeyError::Unprintable);
            }
            digests.push(digest(key.as_bytes()));
        }
        Ok(ApiKeys { digests })
    }

    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// Whether `presented` is one of the keys; every key is compared, so the time taken does
    /// not tell which one matched.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let presented = digest(presented);
        let matched = self
            .digests
            .iter()
            .fold(subtle::Choice::from(0), |found, key| {
                found | key.ct_eq(&presented)
            });
        matched.into()
    }
}

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ApiKeys({} keys)", self.digests.len())
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The token of `Authorization: Bearer TOKEN` (the scheme is case-insensitive), if present.
pub(crate) fn bearer_token(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = token.trim_ascii();
    (!token.is_empty() && value.get(6) == Some(&b' ')).then_some(token)
}

/// The API key a request presents: `Authorization: Bearer KEY`, else `x-api-key: KEY` as
/// Anthropic's clients send it.
pub(crate) fn presented_key(headers: &HeaderMap) -> Option<&[u8]> {
    bearer_token(headers).or_else(|| {
        let key = headers.get(X_API_KEY)?.as_bytes().trim_ascii();
        (!key.is_empty()).then_some(key)
    })
}

const X_API_KEY: &str = "x-api-key";

/// Who made a stored object: the digest of the key the request presented (`None` without
/// one), so that only requests with the same key see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyOwner(Option<[u8; 32]>);

impl KeyOwner {
    pub fn of(headers: &HeaderMap) -> KeyOwner {
        KeyOwner(presented_key(headers).map(digest))
    }
}

/// Lets a request through when the API is open, the route is a probe's, or it carries a key
/// the server accepts; otherwise answers 401.
pub async fn require_api_key(
    State(keys): State<Arc<ApiKeys>>,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    if keys.is_empty() || OPEN_PATHS.contains(&path) || path.starts_with(ADMIN_PREFIX) {
        return next.run(request).await;
    }
    match presented_key(request.headers()) {
        Some(token) if keys.accepts(token) => next.run(request).await,
        Some(_) => ApiError::InvalidApiKey.into_response(),
        None => ApiError::MissingApiKey.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn only_the_configured_keys_are_accepted() {
        let keys = ApiKeys::new(["sk-one", "second-key"]).expect("valid keys");
        assert!(keys.accepts(b"sk-one"));
        assert!(keys.accepts(b"second-key"));
        for wrong in [
            &b""[..],
            b"sk-on",
            b"sk-one ",
            b"SK-ONE",
            b"sk-one-and-more",
        ] {
            assert!(!keys.accepts(wrong), "{wrong:?}");
        }
        assert!(!ApiKeys::default().accepts(b""));
        assert_eq!(ApiKeys::new([""]).err(), Some(ApiKeyError::Empty));
        for unprintable in ["a\nb", "a b", "clé"] {
            assert_eq!(
                ApiKeys::new([unprintable]).err(),
                Some(ApiKeyError::Unprintable)
            );
        }
        assert_eq!(format!("{keys:?}"), "ApiKeys(2 keys)");
    }

    #[test]
    fn bearer_tokens_are_read_from_the_authorization_header() {
        let cases: [(&str, Option<&[u8]>); 6] = [
            ("Bearer sk-1", Some(b"sk-1")),
            ("bearer  sk-1 ", Some(b"sk-1")),
            ("Basic c2stMQ==", None),
            ("Bearer", None),
            ("Bearer ", None),
            ("Bearersk-1", None),
        ];
        for (header, token) in cases {
            let mut headers = HeaderMap::new();
            headers.insert(AUTHORIZATION, HeaderValue::from_static(header));
            assert_eq!(bearer_token(&headers), token, "{header:?}");
        }
        assert_eq!(bearer_token(&HeaderMap::new()), None);
    }

    #[test]
    fn an_x_api_key_header_presents_a_key_too_and_bearer_wins() {
        let mut headers = HeaderMap::new();
        headers.insert(X_API_KEY, HeaderValue::from_static(" sk-x "));
        assert_eq!(presented_key(&headers), Some(&b"sk-x"[..]));
        headers.insert(AUTHORIZATION, HeaderValue::from_static("Bearer sk-b"));
        assert_eq!(presented_key(&headers), Some(&b"sk-b"[..]));
        assert_ne!(KeyOwner::of(&headers), KeyOwner::of(&HeaderMap::new()));
        headers.insert(X_API_KEY, HeaderValue::from_static(""));
        headers.remove(AUTHORIZATION);
        assert_eq!(presented_key(&headers), None);
    }
}
