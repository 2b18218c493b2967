//! `/livez`, `/readyz` and `/metrics`: for orchestrators and Prometheus, without a token.

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::AppState;

/// 200 when every loop of the process comes round; 503 with the reasons otherwise.
pub async fn livez(State(state): State<AppState>) -> Response {
    let verdict = state.engine.health.live();
    let status = if verdict.ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(verdict)).into_response()
}

/// 200 when the process can work (Postgres with this build's schema, the worker consuming, not
/// draining); 503 with the reasons otherwise.
pub async fn readyz(State(state): State<AppState>) -> Response {
    let engine = &state.engine;
    let verdict = engine.health.ready(&engine.settings.database).await;
    let status = if verdict.ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(verdict)).into_response()
}

/// The process's metrics, in the Prometheus text format.
pub async fn metrics() -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::metrics::render(),
    )
        .into_response()
}
