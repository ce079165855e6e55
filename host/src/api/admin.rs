//! The admin routes (`/admin/*`): the deployment listing and reloads, behind their own key.
//!
//! The admin key is separate from the API keys: an API key never opens `/admin`, and without a
//! configured admin key the routes answer 403 saying how to enable them.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::http::header::WWW_AUTHENTICATE;
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use super::AppState;
use super::auth::{ApiKeys, bearer_token};
use super::error::{ErrorBody, ErrorResponse};
use crate::engine::EngineError;
use crate::engine::reload::{DeploymentStatus, ReloadError, ReloadReport};

/// Every way an admin request fails; [`AdminError::status`] is the one table of statuses.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(
        "the admin routes are disabled: start the server with --admin-key KEY (or set \
         PLUGHOST_ADMIN_KEY) and send `Authorization: Bearer KEY`"
    )]
    Disabled,
    #[error(
        "the admin routes need the admin key: send it as `Authorization: Bearer KEY` (API keys \
         do not open them)"
    )]
    MissingKey,
    #[error("incorrect admin key provided")]
    WrongKey,
    #[error(transparent)]
    Reload(#[from] ReloadError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the reload task failed: {0}")]
    Internal(String),
}

impl AdminError {
    #[rustfmt::skip]
    fn status(&self) -> (StatusCode, &'static str, &'static str) {
        use StatusCode as S;
        match self {
            AdminError::Disabled =>                          (S::FORBIDDEN, "permission_error", "admin_disabled"),
            AdminError::MissingKey | AdminError::WrongKey => (S::UNAUTHORIZED, "authentication_error", "invalid_admin_key"),
            AdminError::Reload(ReloadError::NotConfigured) => (S::CONFLICT, "invalid_request_error", "reload_not_configured"),
            AdminError::Reload(ReloadError::Engine(_)) |
            AdminError::Reload(ReloadError::NotInstalled) |
            AdminError::Reload(ReloadError::PluginRuntime(_)) |
            AdminError::Engine(_) =>                         (S::SERVICE_UNAVAILABLE, "service_unavailable_error", "engine_unavailable"),
            AdminError::Reload(ReloadError::File(_)) =>      (S::UNPROCESSABLE_ENTITY, "invalid_request_error", "invalid_deployment_file"),
            AdminError::Reload(ReloadError::Component(_)) => (S::UNPROCESSABLE_ENTITY, "invalid_request_error", "component_failed"),
            AdminError::Reload(ReloadError::GlueChanged { .. }) => (S::UNPROCESSABLE_ENTITY, "invalid_request_error", "glue_changed"),
            AdminError::Internal(_) =>                       (S::INTERNAL_SERVER_ERROR, "server_error", "internal_error"),
        }
    }
}

impl IntoResponse for AdminError {
    fn into_response(self) -> Response {
        let (status, kind, code) = self.status();
        let param = match &self {
            AdminError::Reload(e) => e.slot().map(str::to_string),
            _ => None,
        };
        let body = ErrorResponse {
            error: ErrorBody {
                message: self.to_string(),
                kind,
                param,
                code: Some(code),
            },
        };
        let mut response = (status, Json(body)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(WWW_AUTHENTICATE, "Bearer".parse().expect("a valid header"));
        }
        response
    }
}

/// The admin routes, each behind the admin key.
pub fn routes(keys: ApiKeys) -> Router<Arc<AppState>> {
    Router::new()
        .route("/admin/deployment", get(deployment))
        .route("/admin/reload", post(reload))
        .route_layer(from_fn_with_state(Arc::new(keys), require_admin_key))
}

/// 403 without a configured admin key, 401 without the right one.
async fn require_admin_key(
    State(keys): State<Arc<ApiKeys>>,
    request: Request,
    next: Next,
) -> Response {
    if keys.is_empty() {
        return AdminError::Disabled.into_response();
    }
    match bearer_token(request.headers()) {
        Some(token) if keys.accepts(token) => next.run(request).await,
        Some(_) => AdminError::WrongKey.into_response(),
        None => AdminError::MissingKey.into_response(),
    }
}

/// The active deployment: each component with its hash, version, generation and counters.
async fn deployment(
    State(app): State<Arc<AppState>>,
) -> Result<Json<DeploymentStatus>, AdminError> {
    app.engine.summary()?;
    app.engine
        .deployment()
        .map(Json)
        .ok_or(AdminError::Engine(EngineError::NotReady))
}

/// Re-reads the `--config` file and swaps the new deployment in: 200 with the new generation,
/// 422 naming the component and the cause when it cannot be built.
async fn reload(State(app): State<Arc<AppState>>) -> Result<Json<ReloadReport>, AdminError> {
    let engine = app.engine.clone();
    // The build compiles and runs plugins: blocking work, kept off the async workers.
    let report = tokio::task::spawn_blocking(move || engine.reload())
        .await
        .map_err(|e| AdminError::Internal(e.to_string()))??;
    Ok(Json(report))
}
