//! The API's error type and the one table that turns it into an HTTP status and an OpenAI error body.

use axum::Json;
use axum::extract::rejection::{BytesRejection, JsonRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::engine::EngineError;

/// Everything a request can fail with. [`From<ApiError> for (StatusCode, Json<ErrorResponse>)`]
/// is the only place that decides statuses, for plain responses and stream error events alike.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    InvalidJson { message: String },
    #[error("the request body is not valid UTF-8: {message}")]
    InvalidEncoding { message: String },
    /// A parameter has the wrong type or is out of range; `param` names it when known.
    #[error("{message}")]
    InvalidParam {
        param: Option<String>,
        message: String,
    },
    /// A valid request for something this server does not do (image parts, `echo`).
    #[error("{message}")]
    Unsupported { param: String, message: String },
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested \
         {requested} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion). \
         Please reduce the length of the prompt or of the completion."
    )]
    ContextLengthExceeded {
        max_model_len: u32,
        requested: u64,
        prompt_tokens: u32,
        max_tokens: u64,
    },
    /// A prompt so long that only a prefix of it was tokenized to tell.
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, the prompt is \
         longer: its first {prefix_bytes} bytes alone are {prefix_tokens} tokens. Please reduce \
         the length of the prompt."
    )]
    PromptTooLong {
        max_model_len: u32,
        prefix_bytes: usize,
        prefix_tokens: usize,
    },
    #[error("the model `{model}` has no chat template; use /v1/completions")]
    NoChatTemplate { model: String },
    #[error("the chat template rejected the conversation: {message}")]
    ChatTemplate { message: String },
    #[error("The model `{model}` does not exist.")]
    ModelNotFound { model: String },
    #[error("Invalid URL ({method} {path})")]
    RouteNotFound { method: String, path: String },
    #[error("Method {method} is not allowed for {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("the request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// One of axum's own extractor rejections, keeping its status.
    #[error("{message}")]
    Rejected { status: StatusCode, message: String },
    #[error(transparent)]
    Unavailable(#[from] EngineError),
    #[error("generation failed: {message}")]
    GenerationFailed { message: String },
    #[error("internal error: {message}")]
    Internal { message: String },
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::InvalidParam {
            param: Some(param.into()),
            message: message.into(),
        }
    }

    /// A body that is not JSON, or JSON of the wrong shape, with the path of the bad field.
    pub fn from_json_error(error: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
        let path = error.path().to_string();
        let inner = error.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::InvalidJson {
                message: format!("the request body is not valid JSON: {inner}"),
            };
        }
        if path == "." {
            return ApiError::InvalidParam {
                param: None,
                message: format!("invalid request: {inner}"),
            };
        }
        ApiError::InvalidParam {
            message: format!("invalid value for `{path}`: {inner}"),
            param: Some(path),
        }
    }
}

/// The OpenAI error envelope: `{"error": {...}}`.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

const INVALID_REQUEST: &str = "invalid_request_error";
const SERVER_ERROR: &str = "server_error";
const UNAVAILABLE: &str = "service_unavailable_error";

impl From<ApiError> for (StatusCode, Json<ErrorResponse>) {
    // One row per variant: status, OpenAI error type, code, param.
    #[rustfmt::skip]
    fn from(error: ApiError) -> Self {
        use ApiError::*;
        use StatusCode as S;
        let message = error.to_string();
        let (status, kind, code, param) = match error {
            InvalidJson { .. } =>           (S::BAD_REQUEST, INVALID_REQUEST, Some("invalid_json"), None),
            InvalidEncoding { .. } =>       (S::BAD_REQUEST, INVALID_REQUEST, Some("invalid_encoding"), None),
            InvalidParam { param, .. } =>   (S::BAD_REQUEST, INVALID_REQUEST, Some("invalid_value"), param),
            Unsupported { param, .. } =>    (S::BAD_REQUEST, INVALID_REQUEST, Some("unsupported_value"), Some(param)),
            ContextLengthExceeded { .. } => (S::BAD_REQUEST, INVALID_REQUEST, Some("context_length_exceeded"), None),
            PromptTooLong { .. } =>         (S::BAD_REQUEST, INVALID_REQUEST, Some("context_length_exceeded"), None),
            NoChatTemplate { .. } =>        (S::BAD_REQUEST, INVALID_REQUEST, Some("no_chat_template"), None),
            ChatTemplate { .. } =>          (S::BAD_REQUEST, INVALID_REQUEST, Some("chat_template_error"), Some("messages".into())),
            ModelNotFound { .. } =>         (S::NOT_FOUND, INVALID_REQUEST, Some("model_not_found"), Some("model".into())),
            RouteNotFound { .. } =>         (S::NOT_FOUND, INVALID_REQUEST, Some("not_found"), None),
            MethodNotAllowed { .. } =>      (S::METHOD_NOT_ALLOWED, INVALID_REQUEST, Some("method_not_allowed"), None),
            BodyTooLarge { .. } =>          (S::PAYLOAD_TOO_LARGE, INVALID_REQUEST, Some("request_too_large"), None),
            Rejected { status, .. } if status == S::PAYLOAD_TOO_LARGE =>
                                            (status, INVALID_REQUEST, Some("request_too_large"), None),
            Rejected { status, .. } if status.is_client_error() =>
                                            (status, INVALID_REQUEST, None, None),
            Rejected { .. } =>              (S::INTERNAL_SERVER_ERROR, SERVER_ERROR, None, None),
            Unavailable(EngineError::NotReady) =>      (S::SERVICE_UNAVAILABLE, UNAVAILABLE, Some("model_loading"), None),
            Unavailable(EngineError::LoadFailed(_)) => (S::SERVICE_UNAVAILABLE, UNAVAILABLE, Some("model_load_failed"), None),
            Unavailable(EngineError::Stopped) =>       (S::SERVICE_UNAVAILABLE, UNAVAILABLE, Some("engine_stopped"), None),
            GenerationFailed { .. } =>      (S::INTERNAL_SERVER_ERROR, SERVER_ERROR, Some("generation_failed"), None),
            Internal { .. } =>              (S::INTERNAL_SERVER_ERROR, SERVER_ERROR, None, None),
        };
        (status, Json(ErrorResponse { error: ErrorBody { message, kind, param, code } }))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, body) = <(StatusCode, Json<ErrorResponse>)>::from(self);
        let message = &body.error.message;
        if status.is_server_error() {
            tracing::error!(status = status.as_u16(), "{message}");
        } else {
            tracing::debug!(status = status.as_u16(), "{message}");
        }
        (status, body).into_response()
    }
}

impl From<BytesRejection> for ApiError {
    fn from(rejection: BytesRejection) -> Self {
        ApiError::Rejected {
            status: rejection.status(),
            message: rejection.body_text(),
        }
    }
}

/// For handlers that use axum's `Json` extractor: its rejections get the same body as ours.
impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            JsonRejection::JsonSyntaxError(e) => ApiError::InvalidJson {
                message: e.body_text(),
            },
            JsonRejection::JsonDataError(e) => ApiError::InvalidParam {
                param: None,
                message: e.body_text(),
            },
            other => ApiError::Rejected {
                status: other.status(),
                message: other.body_text(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_of(error: ApiError) -> (u16, ErrorBody) {
        let (status, Json(body)) = error.into();
        (status.as_u16(), body.error)
    }

    #[test]
    fn every_error_has_a_status_type_and_message() {
        let cases = [
            (
                ApiError::InvalidJson {
                    message: "x".into(),
                },
                400,
            ),
            (ApiError::invalid("temperature", "too hot"), 400),
            (ApiError::ModelNotFound { model: "m".into() }, 404),
            (ApiError::BodyTooLarge { limit: 8 }, 413),
            (ApiError::Unavailable(EngineError::NotReady), 503),
            (
                ApiError::Unavailable(EngineError::LoadFailed("no weights".into())),
                503,
            ),
            (
                ApiError::GenerationFailed {
                    message: "device".into(),
                },
                500,
            ),
            (
                ApiError::MethodNotAllowed {
                    method: "GET".into(),
                    path: "/v1/completions".into(),
                },
                405,
            ),
        ];
        for (error, want) in cases {
            let (status, body) = status_of(error);
            assert_eq!(status, want, "{body:?}");
            assert!(
                !body.message.is_empty() && !body.kind.is_empty(),
                "{body:?}"
            );
        }
        let (_, body) = status_of(ApiError::invalid("temperature", "too hot"));
        assert_eq!(body.param.as_deref(), Some("temperature"));
    }

    #[test]
    fn json_errors_name_the_field() {
        let text = r#"{"max_tokens": "ten"}"#;
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct R {
            max_tokens: Option<i64>,
        }
        let de = &mut serde_json::Deserializer::from_str(text);
        let error = serde_path_to_error::deserialize::<_, R>(de).unwrap_err();
        let (status, body) = status_of(ApiError::from_json_error(error));
        assert_eq!((status, body.param.as_deref()), (400, Some("max_tokens")));
        let de = &mut serde_json::Deserializer::from_str("{\"max_tokens\": ");
        let error = serde_path_to_error::deserialize::<_, R>(de).unwrap_err();
        assert_eq!(
            status_of(ApiError::from_json_error(error)).1.code,
            Some("invalid_json")
        );
    }
}
