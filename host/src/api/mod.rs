//! The OpenAI-compatible HTTP API: the router, its shared state, and `serve`.
//!
//! A request flows body → [`body::ApiJson`] (size, UTF-8, JSON) → [`validation`] (a
//! [`validation::ValidatedRequest`], the only source of engine requests) → [`submit`] (one
//! engine request per choice, merged into one event stream) → a JSON response or
//! [`stream`]'s server-sent events. Every failure is an [`ApiError`], turned into a status and
//! an OpenAI error body by the one table in [`error`].
//!
//! Anthropic's Messages API ([`anthropic`]) and OpenAI's Responses API ([`responses`])
//! translate their bodies into chat requests and take the same path; the Messages routes
//! answer errors in Anthropic's shape.
//!
//! Before a handler runs, the layers of [`router`] name the request ([`request_id`]), check its
//! key ([`auth`]), its content type ([`browser`]) and the room for it ([`admission`]).

pub mod access_log;
pub mod admin;
pub mod admission;
pub mod anthropic;
pub mod auth;
pub mod body;
pub mod browser;
pub mod chat;
pub mod chat_output;
pub mod completions;
pub mod constraints;
pub mod drain;
pub mod error;
pub mod held_body;
pub mod logprobs;
pub mod marker;
pub mod named_stream;
pub mod openai;
pub mod options;
pub mod prompt_logprobs;
pub mod reasoning;
pub mod request_id;
pub mod responses;
pub mod routes;
pub mod server;
pub mod stream;
pub mod submit;
pub mod tokenize;
pub mod tool_calls;
pub mod tools;
pub mod translated;
pub mod validation;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware::{from_fn, from_fn_with_state, map_response};
use axum::routing::{get, post};
use tower_http::catch_panic::CatchPanicLayer;

use crate::engine::EngineHandle;

pub use auth::ApiKeys;
pub use browser::AllowedOrigins;
pub use error::{ApiError, ErrorBody, ErrorResponse};
pub use request_id::RequestId;
pub use server::{ConnectionLimits, serve_app};

/// Settings of the HTTP layer.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// How often an idle stream sends an SSE comment, so proxies keep it open.
    pub keep_alive: Duration,
    /// Keys every route but the probes' needs; empty: the API is open.
    pub api_keys: ApiKeys,
    /// Origins that get CORS headers; `None`: no CORS at all.
    pub allowed_origins: Option<AllowedOrigins>,
    /// Sequences (prompts times `n`) in the server at once; more get 429.
    pub max_waiting_requests: usize,
    /// Keys of the `/admin/*` routes; empty: they answer 403.
    pub admin_keys: ApiKeys,
    /// Set when shutdown begins; `/ready` answers 503 from then on.
    pub drain: drain::Drain,
    /// Whether chat responses split reasoning from the answer.
    pub reasoning_parser: options::ReasoningParserChoice,
    /// The TTL and byte cap of the Responses API's store.
    pub response_store: responses::store::ResponseStoreLimits,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            max_body_bytes: 16 << 20,
            keep_alive: Duration::from_secs(15),
            api_keys: ApiKeys::default(),
            allowed_origins: None,
            max_waiting_requests: 1024,
            admin_keys: ApiKeys::default(),
            drain: drain::Drain::default(),
            reasoning_parser: options::ReasoningParserChoice::Auto,
            response_store: Default::default(),
        }
    }
}

/// What every handler shares.
pub struct AppState {
    pub engine: Arc<EngineHandle>,
    pub config: ApiConfig,
    /// Unix seconds when the router was built, the `created` of the model card.
    pub started: u64,
    /// Responses made with `store: true`, for `GET /v1/responses/{id}` and follow-ups.
    pub responses: Arc<responses::store::ResponseStore>,
}

/// The API's routes over an engine, for `serve` and for tests that embed it.
///
/// Layers from the outside in: the request id and its log span; JSON bodies for every error
/// and for panics; CORS (so preflights need no key, and pages can read a 401); the API key;
/// then, on matched routes, JSON content and, on the generation routes, admission.
pub fn router(engine: Arc<EngineHandle>, config: ApiConfig) -> Router {
    // `ApiJson` enforces the limit itself; this covers any of axum's own body extractors.
    let body_limit = DefaultBodyLimit::max(config.max_body_bytes);
    let admission = admission::Admission::new(config.max_waiting_requests);
    let keys = Arc::new(config.api_keys.clone());
    let admin = admin::routes(config.admin_keys.clone());
    let cors = config.allowed_origins.as_ref().map(browser::cors_layer);
    let responses = Arc::new(responses::store::ResponseStore::new(config.response_store));
    let state = Arc::new(AppState {
        engine,
        config,
        started: unix_seconds(),
        responses,
    });
    let generation = Router::new()
        .route("/v1/completions", post(completions::create))
        .route("/v1/chat/completions", post(chat::create))
        .route("/v1/messages", post(anthropic::create))
        .route("/v1/responses", post(responses::create))
        .route_layer(from_fn_with_state(admission, admission::admit));
    let mut app = Router::new()
        .merge(generation)
        .merge(admin)
        .route("/v1/models", get(routes::models))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/version", get(routes::version))
        .route("/health", get(routes::health))
        .route("/ready", get(routes::ready))
        .route("/metrics", get(routes::metrics))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .route_layer(from_fn(browser::require_json_body))
        .layer(from_fn_with_state(keys, auth::require_api_key));
    if let Some(cors) = cors {
        app = app.layer(cors);
    }
    app.layer(body_limit)
        .layer(map_response(error::ensure_json_body))
        .layer(CatchPanicLayer::custom(error::panic_response))
        .layer(from_fn(anthropic::error_shape))
        .layer(from_fn(request_id::assign))
        .with_state(state)
}

/// Serves the API on `listener` with the default [`ConnectionLimits`] until `shutdown`
/// completes; see [`server::serve_app`] for the shutdown. The caller shuts the engine down after.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: Arc<EngineHandle>,
    config: ApiConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    server::serve_app(
        listener,
        router(engine, config),
        ConnectionLimits::default(),
        shutdown,
    )
    .await
}

/// `id`, `created` and `model` of one response and all its chunks.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
}

impl ResponseMeta {
    /// `prefix-<request id>`, e.g. `chatcmpl-<X-Request-Id>`.
    pub fn new(
        prefix: &str,
        request_id: &RequestId,
        model: &str,
        system_fingerprint: String,
    ) -> ResponseMeta {
        ResponseMeta {
            id: format!("{prefix}-{request_id}"),
            created: unix_seconds(),
            model: model.to_string(),
            system_fingerprint,
        }
    }
}

pub(crate) fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Runs validation (tokenizing, template rendering: CPU work on possibly large inputs) on the
/// blocking pool so it does not stall other connections, at most one per core at a time.
async fn validate_off_thread<T: Send + 'static>(
    validate: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let slot = validation_slots()
        .acquire()
        .await
        .map_err(|e| ApiError::Internal {
            message: format!("validation slots closed: {e}"),
        })?;
    // The request's span goes along, so the validation's log lines name the request.
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        span.in_scope(validate)
    })
    .await
    .map_err(|e| ApiError::Internal {
        message: format!("validation task failed: {e}"),
    })?
}

/// Validations that may run at once. More than the cores only adds memory: rendering a
/// conversation of megabytes holds several copies of it until its prompt is refused, and eight
/// at once measured over 600 MiB.
fn validation_slots() -> &'static tokio::sync::Semaphore {
    static SLOTS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    SLOTS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        tokio::sync::Semaphore::new(cores)
    })
}
