//! Reading runs: listings with filters and cursors, counts, one run's timeline, and its steps,
//! model calls and effects a page at a time (a run of 10,000 steps is never sent whole).

use std::collections::BTreeMap;

use axum::Json;
use axum::http::StatusCode;
use axum::extract::State;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::error::{ApiError, ErrorBody};
use super::extract::{Path, Query};
use crate::domain::RunStatus;
use crate::store::{effects, journal, runs, steps};
use crate::timeline;

/// Most items in one page.
const MAX_PAGE: i64 = 500;

fn page_size(limit: Option<i64>) -> i64 {
    limit.unwrap_or(100).clamp(1, MAX_PAGE)
}

/// `GET /api/v1/runs` filters.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only runs with this status.
    #[param(value_type = Option<RunStatus>)]
    status: Option<String>,
    /// Only runs of this workflow.
    workflow: Option<String>,
    /// Only runs made at or after this time (RFC 3339).
    since: Option<DateTime<Utc>>,
    /// Only runs made before this time (RFC 3339).
    until: Option<DateTime<Utc>>,
    /// Only runs retrying or stuck (attempt > 1, lease expired, or waiting in a delay queue).
    #[serde(default)]
    stuck: bool,
    /// Only the child runs of this run.
    parent: Option<String>,
    /// Where the page starts: a `next_cursor` this API handed out.
    cursor: Option<String>,
    /// Runs in the page (default 100, at most 500).
    limit: Option<i64>,
}

/// A page of runs.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RunPage {
    runs: Vec<runs::Summary>,
    /// Pass as `cursor` for the next page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    next_cursor: Option<String>,
}

/// Lists runs, newest first.
#[utoipa::path(
    get,
    path = "/api/v1/runs",
    operation_id = "list_runs",
    tag = "runs",
    params(ListQuery),
    responses(
        (status = 200, description = "a page of runs, newest first", body = RunPage),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn list(
    State(state): State<AppState>,
    Query(q): Query<ListQuery>,
) -> Result<Json<RunPage>, ApiError> {
    let status = q
        .status
        .as_deref()
        .map(str::parse::<RunStatus>)
        .transpose()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let after = q.cursor.as_deref().map(decode_cursor).transpose()?;
    let filter = runs::Filter {
        status,
        workflow: q.workflow,
        since: q.since,
        until: q.until,
        stuck: q.stuck,
        after,
        parent: q.parent,
    };
    let limit = page_size(q.limit);
    let page = runs::page(&state.engine.pool, &filter, limit).await?;
    let next_cursor = (page.len() as i64 == limit)
        .then(|| page.last().map(runs::Summary::cursor))
        .flatten();
    Ok(Json(RunPage {
        runs: page,
        next_cursor,
    }))
}

fn decode_cursor(cursor: &str) -> Result<(DateTime<Utc>, String), ApiError> {
    runs::parse_cursor(cursor)
        .ok_or_else(|| ApiError::bad_request("cursor is not one this API handed out"))
}

/// How many runs there are by status, and by workflow and status.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Counts {
    /// Runs by status (statuses with no run are left out).
    by_status: BTreeMap<String, i64>,
    /// Runs by workflow and status.
    by_workflow: Vec<runs::Count>,
}

/// Runs by status, and by workflow and status.
#[utoipa::path(
    get,
    path = "/api/v1/runs/counts",
    operation_id = "count_runs",
    tag = "runs",
    responses(
        (status = 200, description = "runs by status, and by workflow and status", body = Counts),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn counts(State(state): State<AppState>) -> Result<Json<Counts>, ApiError> {
    let by_workflow = runs::counts(&state.engine.pool).await?;
    let mut by_status = BTreeMap::new();
    for c in &by_workflow {
        *by_status.entry(c.status.as_str().to_owned()).or_default() += c.runs;
    }
    Ok(Json(Counts {
        by_status,
        by_workflow,
    }))
}

/// Steps shown with a run; the rest a page at a time.
const STEPS_SHOWN: i64 = 50;

/// One run: its row, handover note, decisions, parked items, progress lines, what it spent, and
/// its newest steps.
#[utoipa::path(
    get,
    path = "/api/v1/runs/{run_id}",
    operation_id = "show_run",
    tag = "runs",
    params(("run_id" = String, Path, description = "the run")),
    responses(
        (status = 200, description = "the run with its newest steps", body = timeline::Overview),
        (status = 404, description = "no such run (`not_found`), or a debounced start that is no run (`debounced`: pending until its due time, or superseded by a later start, which the message names)", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn show(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
) -> Result<Json<timeline::Overview>, ApiError> {
    let pool = &state.engine.pool;
    if let Some(overview) = timeline::overview(pool, &run_id, None, STEPS_SHOWN).await? {
        return Ok(Json(overview));
    }
    // A start a debounce held or superseded has no run (yet): say so, not "not found".
    Err(match crate::flow::debounce::find(pool, &run_id).await? {
        Some(held) => ApiError::new(StatusCode::NOT_FOUND, "debounced", crate::flow::debounce::describe(&held)),
        None => ApiError::not_found(format!("run {run_id} not found")),
    })
}

/// Paging through a run's positions.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// Items after this position (default -1: from the start).
    #[serde(default = "from_start")]
    after: i32,
    /// Items in the page (default 100, at most 500).
    limit: Option<i64>,
}

/// A page of a run's steps.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct StepPage {
    /// Steps in order of position.
    steps: Vec<steps::StepRow>,
}

/// A page of a run's model calls.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct CallPage {
    /// Calls in order of position and call number.
    calls: Vec<journal::Call>,
}

/// A page of a run's outside writes.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct EffectPage {
    /// Effects in order of position.
    effects: Vec<effects::EffectView>,
}

fn from_start() -> i32 {
    -1
}

/// 404 for a run that does not exist: an empty page would say "no steps yet".
async fn existing(state: &AppState, run_id: &str) -> Result<(), ApiError> {
    match runs::get(&state.engine.pool, run_id).await? {
        Some(_) => Ok(()),
        None => Err(ApiError::not_found(format!(
            "run {run_id} not found; GET /api/v1/runs lists the runs there are"
        ))),
    }
}

/// A run's steps, in order.
#[utoipa::path(
    get,
    path = "/api/v1/runs/{run_id}/steps",
    operation_id = "run_steps",
    tag = "runs",
    params(("run_id" = String, Path, description = "the run"), PageQuery),
    responses(
        (status = 200, description = "the run's steps after `after`, in order", body = StepPage),
        (status = 404, description = "no such run", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn steps(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    Query(q): Query<PageQuery>,
) -> Result<Json<StepPage>, ApiError> {
    existing(&state, &run_id).await?;
    let steps = steps::page(&state.engine.pool, &run_id, q.after, page_size(q.limit)).await?;
    Ok(Json(StepPage { steps }))
}

/// A run's model calls, in order (what was asked and what it cost; not the answers).
#[utoipa::path(
    get,
    path = "/api/v1/runs/{run_id}/journal",
    operation_id = "run_journal",
    tag = "runs",
    params(("run_id" = String, Path, description = "the run"), PageQuery),
    responses(
        (status = 200, description = "the run's model calls after `after`, in order", body = CallPage),
        (status = 404, description = "no such run", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn journal(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    Query(q): Query<PageQuery>,
) -> Result<Json<CallPage>, ApiError> {
    existing(&state, &run_id).await?;
    let calls = journal::page(&state.engine.pool, &run_id, q.after, page_size(q.limit)).await?;
    Ok(Json(CallPage { calls }))
}

/// A run's effects with their state (`done`, `intent`, `unknown`).
#[utoipa::path(
    get,
    path = "/api/v1/runs/{run_id}/effects",
    operation_id = "run_effects",
    tag = "runs",
    params(("run_id" = String, Path, description = "the run"), PageQuery),
    responses(
        (status = 200, description = "the run's outside writes after `after`, in order", body = EffectPage),
        (status = 404, description = "no such run", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn effects(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    Query(q): Query<PageQuery>,
) -> Result<Json<EffectPage>, ApiError> {
    existing(&state, &run_id).await?;
    let effects = effects::page(&state.engine.pool, &run_id, q.after, page_size(q.limit)).await?;
    Ok(Json(EffectPage { effects }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forged_cursor_is_refused() {
        assert!(decode_cursor("nonsense").is_err());
        assert!(decode_cursor("12x.run-1").is_err());
        let at = DateTime::from_timestamp_micros(1_790_000_000_123_456).unwrap();
        assert_eq!(
            decode_cursor("1790000000123456.run-1.a:b").unwrap(),
            (at, "run-1.a:b".to_owned())
        );
    }
}
