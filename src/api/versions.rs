//! Workflow versions over HTTP: what `trailmark workflow versions` lists and what `trailmark
//! workflow move` does, with the same checks and words ([`crate::operator::versions`],
//! [`crate::operator::move_runs`]); a move needs the operator role, a reason and (unless it is a
//! preview) an `Idempotency-Key`, and each moved run is audited.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::auth::Caller;
use super::decisions::decider;
use super::error::{ApiError, ErrorBody};
use super::extract::{Body, Path};
use super::idempotency;
use super::input::{self, Kind};
use crate::operator::{self, MoveAsk, MovePlan, VersionState};

/// Most runs one move may name.
const MAX_RUNS: usize = 1_000;

/// Every workflow version known to this process, a live worker or a run in flight.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Versions {
    /// By workflow, then version.
    versions: Vec<VersionState>,
}

/// `POST /api/v1/workflows/{workflow}/move`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveBody {
    /// Why, in the operator's words (required; recorded with each moved run).
    reason: String,
    /// The version the runs are on.
    #[schema(example = 1)]
    from: i32,
    /// The version they go to; this process must carry it.
    #[schema(example = 2)]
    to: i32,
    /// Only these runs (absent or empty: every run in flight at `from`).
    #[serde(default)]
    runs: Vec<String>,
    /// List each run and what a move would do to it; change nothing.
    #[serde(default)]
    preview: bool,
}

/// Every workflow version known to this process, to a live worker or to a run in flight: who
/// carries it, its runs in flight by status, and whether it can be removed from the code.
#[utoipa::path(
    get,
    path = "/api/v1/workflows/versions",
    operation_id = "workflow_versions",
    tag = "workflows",
    responses(
        (status = 200, description = "each workflow version with its runs in flight and a verdict", body = Versions),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<Versions>, ApiError> {
    let versions = operator::versions(&state.engine).await?;
    Ok(Json(Versions { versions }))
}

/// Moves the runs of a workflow at rest (stopped for review or waiting) from one version to
/// another; runs executing a step, and runs at a step the target lacks, stay and are listed.
#[utoipa::path(
    post,
    path = "/api/v1/workflows/{workflow}/move",
    operation_id = "move_workflow_runs",
    tag = "workflows",
    params(("workflow" = String, Path, description = "the workflow whose runs move")),
    request_body = MoveBody,
    responses(
        (status = 200, description = "each run with what became of it (or would, for a preview): moved, busy, lacks_step, changed, skipped, with why", body = MovePlan),
        (status = 409, description = "this process does not carry the target version; `field` is `to`", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; runs of the batches already done are moved and recorded", body = ErrorBody),
    ),
)]
pub async fn move_runs(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(workflow): Path<String>,
    headers: HeaderMap,
    Body(b): Body<MoveBody>,
) -> Result<Json<MovePlan>, ApiError> {
    let who = decider(&caller, &b.reason, "each moved run")?;
    input::check("workflow", &workflow, Kind::Id)?;
    if b.runs.len() > MAX_RUNS {
        let why = format!("at most {MAX_RUNS} runs at once; send the rest in another move");
        return Err(ApiError::bad_request(why).with_field("runs"));
    }
    for id in &b.runs {
        input::check("runs", id, Kind::Id)?;
    }
    let ask = MoveAsk {
        workflow,
        from: b.from,
        to: b.to,
        runs: b.runs,
    };
    if b.preview {
        return Ok(Json(
            operator::move_preview(&state.engine, &ask)
                .await
                .map_err(refused)?,
        ));
    }
    idempotency::required(&headers)?;
    let done = operator::move_runs(&state.engine, &ask, &who).await;
    Ok(Json(done.map_err(refused)?))
}

/// A move that cannot be made as asked is 409 naming `to`; the rest as every decision's error.
fn refused(e: operator::Error) -> ApiError {
    match e {
        operator::Error::Version { .. } => ApiError::conflict(e.to_string()).with_field("to"),
        other => other.into(),
    }
}
