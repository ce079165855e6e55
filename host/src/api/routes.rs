//! The small routes: `/v1/models`, `/health` (liveness), `/ready` (readiness), `/metrics`, and the OpenAI-shaped 404 and 405 fallbacks.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::{Method, StatusCode, Uri};
use axum::response::IntoResponse;

use super::AppState;
use super::error::ApiError;
use super::openai::{ModelCard, ModelList};
use crate::engine::HealthReport;

/// The Prometheus text exposition format.
const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

pub async fn models(State(app): State<Arc<AppState>>) -> Result<Json<ModelList>, ApiError> {
    let summary = app.engine.summary()?;
    let card = ModelCard {
        id: summary.name,
        object: "model",
        created: app.started,
        owned_by: "plughost",
        root: summary.root,
        parent: None,
        system_fingerprint: app.engine.pin()?.fingerprint().to_string(),
        max_model_len: summary.max_model_len,
    };
    Ok(Json(ModelList {
        object: "list",
        data: vec![card],
    }))
}

/// The server's version, as vLLM's `/version` answers.
pub async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}

/// 200 once the model is ready; 503 while it loads, when it failed to load, and when the
/// engine died, stalled or hung on the device (then the process is on its way out). The 200
/// body lists each plugin component's failure-policy state, which never changes the status.
pub async fn health(State(app): State<Arc<AppState>>) -> Result<Json<HealthReport>, ApiError> {
    app.engine.summary()?;
    Ok(Json(app.engine.health_report()))
}

/// Readiness: 200 while the server takes new work; 503 while the model loads, after an engine
/// fault, from the first shutdown signal on (while requests in flight drain), and while a new
/// device worker prepares the model.
pub async fn ready(State(app): State<Arc<AppState>>) -> Result<StatusCode, ApiError> {
    if app.config.drain.is_draining() {
        return Err(ApiError::Draining);
    }
    if app.engine.is_repreparing() {
        return Err(ApiError::DeviceRestarting);
    }
    app.engine.summary()?;
    Ok(StatusCode::OK)
}

pub async fn metrics(State(app): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        app.engine.render_metrics(),
    )
}

pub async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::RouteNotFound {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
}

pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
}
