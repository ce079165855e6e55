//! Reading a request body into a typed request: the size limit, UTF-8, JSON, and the path of a bad field.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::http::header::CONTENT_LENGTH;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::AppState;
use super::error::ApiError;
use super::openai::{GenerationBody, SamplingFields};
use super::server::BodyReadTimeout;

/// A body parsed as JSON into `T`; every failure is an [`ApiError`], never axum's plain text.
pub struct ApiJson<T>(pub T);

/// Types that can be read from a request's JSON object.
pub trait FromJsonBody: Sized {
    fn from_json(value: &Value) -> Result<Self, ApiError>;
}

impl<R: DeserializeOwned> FromJsonBody for GenerationBody<R> {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        Ok(GenerationBody {
            request: typed(value)?,
            sampling: typed::<SamplingFields>(value)?,
        })
    }
}

pub(super) fn typed<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(ApiError::from_json_error)
}

/// Most bytes of an oversize body read and thrown away before answering 413. Answering while
/// the client still sends makes the connection reset under it, and most clients then report
/// the reset instead of the 413; beyond this the connection is cut all the same.
const MAX_DRAIN_BYTES: u64 = 64 << 20;

impl<T: FromJsonBody> FromRequest<Arc<AppState>> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        let limit = state.config.max_body_bytes;
        let declared = request
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|len| len > MAX_DRAIN_BYTES) {
            return Err(ApiError::BodyTooLarge { limit });
        }
        let capacity = declared.map_or(0, |len| len.min(limit as u64) as usize);
        let bytes = read_limited(request.into_body(), limit, capacity).await?;
        parse_body(&bytes).map(ApiJson)
    }
}

/// The whole body, or [`ApiError::BodyTooLarge`] once it passes `limit` (after draining it).
/// `capacity` is the declared length: reserved once the body starts, a large body is neither
/// copied as it grows nor held with up to twice its size.
async fn read_limited(body: Body, limit: usize, capacity: usize) -> Result<Vec<u8>, ApiError> {
    let mut chunks = body.into_data_stream();
    let mut bytes = Vec::new();
    let mut total = 0u64;
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| match BodyReadTimeout::find(&e) {
            Some(timeout) => ApiError::Rejected {
                status: StatusCode::REQUEST_TIMEOUT,
                message: timeout.to_string(),
            },
            None => ApiError::InvalidParam {
                param: None,
                message: format!("cannot read the request body: {e}"),
            },
        })?;
        total += chunk.len() as u64;
        if total > MAX_DRAIN_BYTES {
            break;
        }
        if total <= limit as u64 {
            if bytes.is_empty() {
                bytes.reserve(capacity);
            }
            bytes.extend_from_slice(&chunk);
        }
    }
    if total > limit as u64 {
        return Err(ApiError::BodyTooLarge { limit });
    }
    Ok(bytes)
}

/// Parses a body that must be one JSON object.
pub fn parse_body<T: FromJsonBody>(bytes: &[u8]) -> Result<T, ApiError> {
    let text = std::str::from_utf8(bytes).map_err(|e| ApiError::InvalidEncoding {
        message: e.to_string(),
    })?;
    let value: Value = serde_json::from_str(text).map_err(|e| ApiError::InvalidJson {
        message: format!("the request body is not valid JSON: {e}"),
    })?;
    if !value.is_object() {
        return Err(ApiError::InvalidJson {
            message: "the request body must be a JSON object".into(),
        });
    }
    T::from_json(&value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::openai::CompletionRequest;

    fn parse(body: &[u8]) -> Result<GenerationBody<CompletionRequest>, ApiError> {
        parse_body(body)
    }

    #[test]
    fn bodies_parse_or_fail_with_the_field_named() {
        let ok =
            parse(br#"{"prompt": "hi", "max_tokens": 5, "unknown_extra": {"a": 1}, "seed": null}"#)
                .expect("valid");
        assert_eq!(ok.sampling.max_tokens, Some(5));
        assert_eq!(ok.request.prompt, Some(Value::from("hi")));
        let cases: &[(&[u8], Option<&str>)] = &[
            (br#"{"max_tokens": "ten"}"#, Some("max_tokens")),
            (br#"{"temperature": "hot"}"#, Some("temperature")),
            (br#"{"model": 5}"#, Some("model")),
            (
                br#"{"stream_options": {"include_usage": 1}}"#,
                Some("stream_options.include_usage"),
            ),
            (b"{\"prompt\": \"\xff\"}", None),
            (b"{", None),
            (b"[1, 2]", None),
            (b"", None),
        ];
        for (body, param) in cases {
            let error = parse(body)
                .err()
                .unwrap_or_else(|| panic!("{:?} parsed", String::from_utf8_lossy(body)));
            let (status, axum::Json(response)) = <(axum::http::StatusCode, _)>::from(error);
            assert_eq!(status, 400);
            assert_eq!(
                response.error.param.as_deref(),
                *param,
                "{}",
                response.error.message
            );
        }
    }
}
