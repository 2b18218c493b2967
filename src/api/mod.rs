//! The HTTP surface every long-running process serves on `api.listen`: `/livez`, `/readyz` and
//! `/metrics` for orchestrators and Prometheus, and the ops API under `/api/v1` (JSON, bearer
//! tokens with roles, an OpenAPI document) for people and tools deciding about runs and dead
//! letters. The API shares its views and decisions with the CLI: the run timeline, the store's
//! listings, `operator` and `dlq`.
//!
//! | file | part |
//! |---|---|
//! | `auth.rs` | tokens, roles, the caller |
//! | `input.rs` | the one check of text from outside (ids, reasons, parameters, headers) |
//! | `edge.rs` | that check at the door, errors in the documented shape, security headers |
//! | `extract.rs` | path, query and JSON body, refusals in the documented shape |
//! | `idempotency.rs` | the `Idempotency-Key` header |
//! | `runs.rs` | listings, one run, its steps, calls and effects |
//! | `start.rs` | starting a run (`POST /api/v1/runs`), checked as a run-start event is |
//! | `decisions.rs` | resume, undo (with a preview), cancel, approve, reject; the export |
//! | `dlq.rs` | dead letters |
//! | `admin.rs` | workflows, contracts, the audit trail |
//! | `versions.rs` | workflow versions with their runs in flight, and moving runs between them |
//! | `health.rs` | `/livez`, `/readyz`, `/metrics` |
//! | `openapi.rs` | the endpoint table and the OpenAPI document generated from the handlers |

mod admin;
mod auth;
mod decisions;
mod dlq;
mod edge;
mod error;
mod events;
mod extract;
mod health;
mod idempotency;
mod limits;
pub mod input;
mod openapi;
mod runs;
mod schedules;
mod start;
mod versions;

use std::sync::Arc;
use std::time::Duration;

use axum::http::{Request, StatusCode};
use axum::routing::{get, post};
use axum::{Router, middleware};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

pub use auth::{Role, Token, hash_token, identify, new_token, parse_tokens};
pub use error::{ApiError, ErrorBody};
pub use openapi::{ENDPOINTS, Endpoint, document};

use crate::config::ApiSettings;
use crate::engine::Engine;

/// What every handler reaches.
#[derive(Clone)]
pub(crate) struct AppState {
    engine: Arc<Engine>,
    tokens: Arc<Vec<Token>>,
}

/// Why the API cannot be served: its settings (`api.tokens`, `api.listen`) cannot be used.
pub type Error = crate::config::Error;

/// The whole HTTP surface, for `engine`.
pub fn router(engine: Arc<Engine>) -> Result<Router, Error> {
    let tokens = parse_tokens(&engine.settings.api.tokens).map_err(Error::new)?;
    let settings = engine.settings.api.clone();
    let state = AppState {
        engine,
        tokens: Arc::new(tokens),
    };
    let api = Router::new()
        .route("/runs", get(runs::list).post(start::start))
        .route("/runs/counts", get(runs::counts))
        .route("/runs/{run_id}", get(runs::show))
        .route("/runs/{run_id}/steps", get(runs::steps))
        .route("/runs/{run_id}/journal", get(runs::journal))
        .route("/runs/{run_id}/effects", get(runs::effects))
        .route("/runs/{run_id}/undo-preview", get(decisions::undo_preview))
        .route("/runs/{run_id}/fork", post(decisions::fork))
        .route("/runs/{run_id}/diff/{other}", get(decisions::diff))
        .route("/runs/{run_id}/resume", post(decisions::resume))
        .route("/runs/{run_id}/undo", post(decisions::undo))
        .route("/runs/{run_id}/cancel", post(decisions::cancel))
        .route("/runs/{run_id}/approve", post(decisions::approve))
        .route("/runs/{run_id}/reject", post(decisions::reject))
        .route("/decisions/export", get(decisions::export))
        .route("/events", get(events::list).post(events::send))
        .route("/dead-letters", get(dlq::list))
        .route("/dead-letters/requeue", post(dlq::requeue))
        .route("/dead-letters/purge", post(dlq::purge))
        .route("/dead-letters/{id}", get(dlq::show))
        .route("/dead-letters/{id}/reveal", post(dlq::reveal))
        .route("/schedules", get(schedules::list).post(schedules::create))
        .route("/schedules/{name}", get(schedules::show))
        .route("/schedules/{name}/pause", post(schedules::pause))
        .route("/schedules/{name}/resume", post(schedules::resume))
        .route("/schedules/{name}/trigger", post(schedules::trigger))
        .route("/schedules/{name}/backfill", post(schedules::backfill))
        .route("/schedules/{name}/delete", post(schedules::delete))
        .route("/limits", get(limits::list))
        .route("/limits/{workflow}", post(limits::set))
        .route("/workflows", get(admin::workflows))
        .route("/workflows/versions", get(versions::list))
        .route("/workflows/{workflow}/move", post(versions::move_runs))
        .route("/workflows/{name}/contract", get(admin::contract))
        .route("/audit", get(admin::audit))
        .route("/openapi.json", get(openapi::openapi_json))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            idempotency::keyed,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::authenticate,
        ));
    let trace = TraceLayer::new_for_http().make_span_with(|req: &Request<_>| {
        let id = req
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        tracing::debug_span!("http", method = %req.method(), path = %req.uri().path(), request.id = %id)
    });
    let console = crate::console::router(state.engine.clone(), state.tokens.clone());
    Ok(Router::new()
        .nest("/api/v1", api)
        .route("/livez", get(health::livez))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .with_state(state)
        .merge(console)
        .layer(CatchPanicLayer::new())
        .layer(TimeoutLayer::with_status_code(
            StatusCode::GATEWAY_TIMEOUT,
            Duration::from_secs(settings.request_timeout_secs),
        ))
        .layer(middleware::from_fn_with_state(
            settings.body_limit_bytes,
            edge::guard,
        ))
        .layer(RequestBodyLimitLayer::new(settings.body_limit_bytes))
        .layer(middleware::from_fn(edge::documented))
        .layer(middleware::from_fn(edge::secure))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(trace)
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .layer(middleware::from_fn(edge::strip_unreadable_id)))
}

/// Binds `api.listen`; `None` when it is empty (nothing is served).
pub async fn bind(settings: &ApiSettings) -> Result<Option<TcpListener>, Error> {
    if settings.listen.trim().is_empty() {
        return Ok(None);
    }
    TcpListener::bind(settings.listen.trim())
        .await
        .map(Some)
        .map_err(|e| {
            Error::new(format!(
                "cannot listen on {} (api.listen): {e}; choose another address or port",
                settings.listen
            ))
        })
}

/// Serves `router` on `listener` until `stop` fires (in-flight requests are finished).
pub async fn serve(
    router: Router,
    listener: TcpListener,
    stop: CancellationToken,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "api listening");
    }
    axum::serve(listener, router)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await
}
