//! The API's error type and the one table that turns it into an HTTP status and an OpenAI error body.

use std::any::Any;

use axum::Json;
use axum::body::Body;
use axum::extract::rejection::{BytesRejection, JsonRejection};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::engine::EngineError;
use crate::grammar::GrammarError;
use crate::plugins::PluginRejection;

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
    /// A stored response that does not exist, expired, or belongs to another key.
    #[error("No response with id '{id}' was found.")]
    StoredResponseNotFound { id: String, param: Option<String> },
    #[error("Invalid URL ({method} {path})")]
    RouteNotFound { method: String, path: String },
    #[error("Method {method} is not allowed for {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("the request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error(
        "You didn't provide an API key. Send it in an Authorization header using Bearer auth \
         (Authorization: Bearer YOUR_KEY), or as x-api-key: YOUR_KEY."
    )]
    MissingApiKey,
    #[error("Incorrect API key provided.")]
    InvalidApiKey,
    #[error("Unsupported media type ({received}): request bodies must be `application/json`.")]
    UnsupportedMediaType { received: String },
    #[error(
        "The server is overloaded: its {limit} places for waiting or running sequences are taken. \
         Retry after {RETRY_AFTER_SECONDS} s."
    )]
    Overloaded { limit: usize },
    #[error(
        "This request would run {requested} sequences (prompts times `n`); the server runs at \
         most {limit} at once."
    )]
    TooManySequences { requested: usize, limit: usize },
    /// An error from below the handlers (an axum extractor, a layer), keeping its status.
    #[error("{message}")]
    Rejected { status: StatusCode, message: String },
    /// A request head hyper could not parse, answered before any router ran.
    #[error("malformed HTTP request: {detail}")]
    MalformedRequest { detail: String },
    #[error(
        "the request head is too large: at most {max_bytes} bytes and 100 header fields are accepted"
    )]
    RequestHeadTooLarge { max_bytes: usize },
    #[error("the request URI is too long")]
    UriTooLong,
    #[error("HTTP version not supported: this server speaks HTTP/1.0 and HTTP/1.1")]
    HttpVersionNotSupported,
    #[error("the server is shutting down: it finishes the requests it has and takes no new ones")]
    Draining,
    #[error(
        "the device worker is being restarted and the model prepared again; requests in flight resume after it"
    )]
    DeviceRestarting,
    #[error(transparent)]
    Unavailable(#[from] EngineError),
    #[error("generation failed: {message}")]
    GenerationFailed { message: String },
    /// A plugin whose failure policy is `reject` failed the request, or is backed off.
    #[error(transparent)]
    PluginRejected(PluginRejection),
    #[error("internal error: {message}")]
    Internal { message: String },
    /// A constraint llguidance could not compile, or a model whose vocabulary it cannot read.
    #[error("`{param}`: {source}")]
    Grammar { param: String, source: GrammarError },
    /// Two fields each constrain the output; only one may.
    #[error("`{first}` and `{second}` both constrain the output; set only one of them")]
    ConflictingConstraints { first: String, second: String },
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::InvalidParam {
            param: Some(param.into()),
            message: message.into(),
        }
    }

    /// The same error with its parameter renamed, for a route whose body names the field
    /// differently from the chat request it was translated into.
    pub fn with_param_renamed(self, rename: impl Fn(String) -> String) -> ApiError {
        match self {
            ApiError::InvalidParam { param, message } => ApiError::InvalidParam {
                param: param.map(rename),
                message,
            },
            ApiError::Unsupported { param, message } => ApiError::Unsupported {
                param: rename(param),
                message,
            },
            other => other,
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
const AUTHENTICATION: &str = "authentication_error";
const RATE_LIMIT: &str = "rate_limit_error";
const SERVER_ERROR: &str = "server_error";
const UNAVAILABLE: &str = "service_unavailable_error";

/// The `Retry-After` of a 429: a second is long enough for a short request to finish.
pub const RETRY_AFTER_SECONDS: u64 = 1;

/// Most bytes of a plain-text error body (from a layer below the handlers) kept as the message.
const MAX_PLAIN_ERROR_BYTES: usize = 64 << 10;

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
            StoredResponseNotFound { param, .. } => (S::NOT_FOUND, INVALID_REQUEST, Some("not_found"), param),
            RouteNotFound { .. } =>         (S::NOT_FOUND, INVALID_REQUEST, Some("not_found"), None),
            MethodNotAllowed { .. } =>      (S::METHOD_NOT_ALLOWED, INVALID_REQUEST, Some("method_not_allowed"), None),
            BodyTooLarge { .. } =>          (S::PAYLOAD_TOO_LARGE, INVALID_REQUEST, Some("request_too_large"), None),
            MissingApiKey =>                (S::UNAUTHORIZED, AUTHENTICATION, Some("invalid_api_key"), None),
            InvalidApiKey =>                (S::UNAUTHORIZED, AUTHENTICATION, Some("invalid_api_key"), None),
            UnsupportedMediaType { .. } =>  (S::UNSUPPORTED_MEDIA_TYPE, INVALID_REQUEST, Some("unsupported_media_type"), None),
            Overloaded { .. } =>            (S::TOO_MANY_REQUESTS, RATE_LIMIT, Some("server_overloaded"), None),
            TooManySequences { .. } =>      (S::BAD_REQUEST, INVALID_REQUEST, Some("too_many_sequences"), Some("n".into())),
            MalformedRequest { .. } =>      (S::BAD_REQUEST, INVALID_REQUEST, Some("malformed_request"), None),
            RequestHeadTooLarge { .. } =>   (S::REQUEST_HEADER_FIELDS_TOO_LARGE, INVALID_REQUEST, Some("request_head_too_large"), None),
            UriTooLong =>                   (S::URI_TOO_LONG, INVALID_REQUEST, Some("uri_too_long"), None),
            HttpVersionNotSupported =>      (S::HTTP_VERSION_NOT_SUPPORTED, INVALID_REQUEST, Some("http_version_not_supported"), None),
            Rejected { status, .. } if status == S::PAYLOAD_TOO_LARGE =>
                                            (status, INVALID_REQUEST, Some("request_too_large"), None),
            Rejected { status, .. } if status.is_client_error() =>
                                            (status, INVALID_REQUEST, None, None),
            Rejected { status, .. } if status.is_server_error() =>
                                            (status, SERVER_ERROR, None, None),
            Rejected { .. } =>              (S::INTERNAL_SERVER_ERROR, SERVER_ERROR, None, None),
            Draining =>                     (S::SERVICE_UNAVAILABLE, UNAVAILABLE, Some("draining"), None),
            DeviceRestarting =>             (S::SERVICE_UNAVAILABLE, UNAVAILABLE, Some("device_restarting"), None),
            Unavailable(EngineError::NotReady) =>      (S::SERVICE_UNAVAILABLE, UNAVAILABLE, Some("model_loading"), None),
            Unavailable(EngineError::LoadFailed(_)) => (S::SERVICE_UNAVAILABLE, UNAVAILABLE, Some("model_load_failed"), None),
            Unavailable(EngineError::Stopped) =>       (S::SERVICE_UNAVAILABLE, UNAVAILABLE, Some("engine_stopped"), None),
            Unavailable(EngineError::Faulted(_)) =>    (S::SERVICE_UNAVAILABLE, UNAVAILABLE, Some("engine_failed"), None),
            Unavailable(EngineError::UnknownSampler(_)) => (S::BAD_REQUEST, INVALID_REQUEST, Some("unknown_sampler"), Some("sampler".into())),
            GenerationFailed { .. } =>      (S::INTERNAL_SERVER_ERROR, SERVER_ERROR, Some("generation_failed"), None),
            // The plugin failed on this request's input: a server fault, not a retryable one.
            PluginRejected(PluginRejection::Faulted { .. }) =>    (S::INTERNAL_SERVER_ERROR, SERVER_ERROR, Some("plugin_failed"), None),
            // The plugin sits out its back-off: unavailable for that long, Retry-After says.
            PluginRejected(PluginRejection::BackingOff { .. }) => (S::SERVICE_UNAVAILABLE, UNAVAILABLE, Some("plugin_backing_off"), None),
            PluginRejected(PluginRejection::Disabled { .. }) =>   (S::SERVICE_UNAVAILABLE, UNAVAILABLE, Some("plugin_disabled"), None),
            Internal { .. } =>              (S::INTERNAL_SERVER_ERROR, SERVER_ERROR, None, None),
            Grammar { param, source: GrammarError::Invalid(_) } =>
                                            (S::BAD_REQUEST, INVALID_REQUEST, Some("invalid_grammar"), Some(param)),
            Grammar { param, source: GrammarError::Unavailable(_) } =>
                                            (S::BAD_REQUEST, INVALID_REQUEST, Some("unsupported_value"), Some(param)),
            ConflictingConstraints { second, .. } =>
                                            (S::BAD_REQUEST, INVALID_REQUEST, Some("conflicting_constraints"), Some(second)),
        };
        (status, Json(ErrorResponse { error: ErrorBody { message, kind, param, code } }))
    }
}

impl ApiError {
    /// Headers the status calls for besides the body.
    fn headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        match self {
            ApiError::MissingApiKey | ApiError::InvalidApiKey => {
                headers.insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            ApiError::Overloaded { .. } => {
                headers.insert(RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECONDS));
            }
            ApiError::PluginRejected(PluginRejection::BackingOff { retry_after_s, .. }) => {
                headers.insert(RETRY_AFTER, HeaderValue::from(*retry_after_s));
            }
            _ => {}
        }
        headers
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let headers = self.headers();
        let (status, body) = <(StatusCode, Json<ErrorResponse>)>::from(self);
        let message = &body.error.message;
        if status.is_server_error() {
            tracing::error!(status = status.as_u16(), "{message}");
        } else {
            tracing::debug!(status = status.as_u16(), "{message}");
        }
        (status, headers, body).into_response()
    }
}

/// The last word on error bodies, for the errors no handler wrote: any 4xx or 5xx response that
/// is not JSON (from routing, a layer or a future middleware) gets an OpenAI error body with its
/// plain text as the message. Status and other headers are kept.
pub async fn ensure_json_body(response: Response) -> Response {
    let status = response.status();
    let is_error = status.is_client_error() || status.is_server_error();
    if !is_error || is_json(response.headers()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, MAX_PLAIN_ERROR_BYTES)
        .await
        .map(|bytes| String::from_utf8_lossy(&bytes).trim().to_string())
        .unwrap_or_default();
    let message = match text.is_empty() {
        true => status.canonical_reason().unwrap_or("error").to_string(),
        false => text,
    };
    let json = ApiError::Rejected { status, message }.into_response();
    parts.headers.remove(CONTENT_LENGTH);
    parts
        .headers
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Response::from_parts(parts, json.into_body())
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"))
}

/// A handler that panicked answers 500 with a body; the panic is logged, not sent.
pub fn panic_response(panic: Box<dyn Any + Send + 'static>) -> Response<Body> {
    let detail = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    tracing::error!("a request handler panicked: {detail}");
    ApiError::Internal {
        message: "the request handler failed".into(),
    }
    .into_response()
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
    use crate::engine::EngineStartError;
    use std::sync::Arc;

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
                ApiError::Unavailable(EngineError::LoadFailed(Arc::new(
                    EngineStartError::NoBlockSize,
                ))),
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
            (
                ApiError::PluginRejected(PluginRejection::Faulted {
                    slot: crate::plugins::Slot::Sampler,
                    plugin: "s".into(),
                    cause: "trapped".into(),
                }),
                500,
            ),
            (
                ApiError::PluginRejected(PluginRejection::BackingOff {
                    slot: crate::plugins::Slot::Sampler,
                    plugin: "s".into(),
                    retry_after_s: 3,
                }),
                503,
            ),
            (
                ApiError::PluginRejected(PluginRejection::Disabled {
                    slot: crate::plugins::Slot::Scheduler,
                    plugin: "s".into(),
                }),
                503,
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

    #[tokio::test]
    async fn plain_error_responses_get_a_json_body_and_keep_status_and_headers() {
        let plain = Response::builder()
            .status(StatusCode::REQUEST_TIMEOUT)
            .header(CONTENT_TYPE, "text/plain")
            .header(CONTENT_LENGTH, "9")
            .header("x-request-id", "r-1")
            .body(Body::from("timed out"))
            .expect("a response");
        let empty = Response::builder()
            .status(StatusCode::GATEWAY_TIMEOUT)
            .body(Body::empty())
            .expect("a response");
        for (response, status, message) in [
            (plain, 408, "timed out"),
            (empty, 504, "Gateway Timeout"),
            (
                panic_response(Box::new("boom")),
                500,
                "internal error: the request handler failed",
            ),
        ] {
            let response = ensure_json_body(response).await;
            assert_eq!(response.status().as_u16(), status);
            assert!(is_json(response.headers()));
            let keeps_id = status != 408 || response.headers().get("x-request-id").is_some();
            let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .expect("body");
            let body: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
            assert_eq!(body["error"]["message"], message, "{body}");
            assert!(body["error"]["type"].is_string() && keeps_id, "{body}");
        }
        let fine = ensure_json_body(Response::new(Body::from("ok"))).await;
        let bytes = axum::body::to_bytes(fine.into_body(), 16)
            .await
            .expect("body");
        assert_eq!(&bytes[..], b"ok");
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
