//! Concurrency and rate limits over HTTP: what `trailmark limit` does, with the same checks and
//! words ([`crate::flow::limits`]); changes need the operator role and a reason, and are audited.

use axum::extract::State;
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::auth::Caller;
use super::decisions::decider;
use super::error::{ApiError, ErrorBody};
use super::extract::{Body, Path};
use super::input::{self, Kind};
use crate::flow::limits::{self, Ask, LimitError, Listed};
use crate::store::flow::{self, KeyLoad, LimitRow};

/// How many of the busiest keys a listing shows.
const BUSIEST: i64 = 20;

/// `POST /api/v1/limits/{workflow}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitBody {
    /// Only this key (absent: every key of the workflow).
    #[schema(example = "tenant-7")]
    key: Option<String>,
    /// Runs of a key holding a step at once (1 or more).
    #[schema(example = 5)]
    concurrency: Option<i64>,
    /// Runs of the whole workflow holding a step at once (without `key`).
    total: Option<i64>,
    /// Step starts per second per key.
    rate: Option<f64>,
    /// Why, in the operator's words (required; audited).
    reason: String,
}

/// The limits in force and the busiest keys.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct LimitList {
    /// Declared limits of each keyed workflow, then those set at run time.
    limits: Vec<Listed>,
    /// The keys with the most runs waiting or running.
    busiest_keys: Vec<KeyLoad>,
}

impl From<LimitError> for ApiError {
    fn from(e: LimitError) -> Self {
        match e {
            LimitError::Workflow(_) => Self::bad_request(e.to_string()).with_field("workflow"),
            LimitError::Field { field, .. } => Self::bad_request(e.to_string()).with_field(field),
            LimitError::Store(s) => s.into(),
        }
    }
}

/// The limits in force (declared and set) and the busiest keys with their runs.
#[utoipa::path(
    get,
    path = "/api/v1/limits",
    operation_id = "list_limits",
    tag = "limits",
    responses(
        (status = 200, description = "limits and the busiest keys", body = LimitList),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<LimitList>, ApiError> {
    let engine = &state.engine;
    let limits = limits::list(&engine.pool, &engine.registry).await?;
    let busiest_keys = flow::busiest(&engine.pool, BUSIEST).await?;
    Ok(Json(LimitList { limits, busiest_keys }))
}

/// Sets a keyed workflow's limits for one key or every key; in force within `flow.poll_ms`.
#[utoipa::path(
    post,
    path = "/api/v1/limits/{workflow}",
    operation_id = "set_limit",
    tag = "limits",
    params(("workflow" = String, Path, description = "a workflow that declares a concurrency key")),
    request_body = LimitBody,
    responses(
        (status = 200, description = "the limits now set for the key", body = LimitRow),
        (status = 400, description = "a value out of range, or a workflow without a key; `field` names it", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; nothing was changed", body = ErrorBody),
    ),
)]
pub async fn set(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(workflow): Path<String>,
    Body(b): Body<LimitBody>,
) -> Result<Json<LimitRow>, ApiError> {
    let who = decider(&caller, &b.reason, "the audit trail")?;
    input::check("workflow", &workflow, Kind::Id)?;
    if let Some(key) = &b.key {
        input::check("key", key, Kind::Id)?;
    }
    let ask = Ask {
        workflow: &workflow,
        key: b.key.as_deref(),
        concurrency: b.concurrency,
        total: b.total,
        rate: b.rate,
    };
    let engine = &state.engine;
    Ok(Json(limits::set(&engine.pool, &engine.registry, &ask, &who).await?))
}
