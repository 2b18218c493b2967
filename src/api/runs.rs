//! Reading runs: listings with filters and cursors, counts, one run's timeline, and its steps,
//! model calls and effects a page at a time (a run of 10,000 steps is never sent whole).

use axum::Json;
use axum::extract::State;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::AppState;
use super::extract::{Path, Query};
use super::error::ApiError;
use crate::domain::RunStatus;
use crate::store::{effects, journal, runs, steps};
use crate::timeline;

/// Most items in one page.
const MAX_PAGE: i64 = 500;

fn page_size(limit: Option<i64>) -> i64 {
    limit.unwrap_or(100).clamp(1, MAX_PAGE)
}

/// `GET /api/v1/runs` filters.
#[derive(Debug, Deserialize)]
pub struct ListQuery {
    status: Option<String>,
    workflow: Option<String>,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    /// Only runs retrying or stuck.
    #[serde(default)]
    stuck: bool,
    cursor: Option<String>,
    limit: Option<i64>,
}

/// A page of runs.
#[derive(Debug, Serialize)]
pub struct RunPage {
    runs: Vec<runs::Summary>,
    /// Pass as `cursor` for the next page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    next_cursor: Option<String>,
}

/// Lists runs, newest first.
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

/// Runs by status, and by workflow and status.
pub async fn counts(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let counts = runs::counts(&state.engine.pool).await?;
    let mut by_status = serde_json::Map::new();
    for c in &counts {
        let n = by_status
            .get(c.status.as_str())
            .and_then(Value::as_i64)
            .unwrap_or(0);
        by_status.insert(c.status.as_str().into(), json!(n + c.runs));
    }
    Ok(Json(
        json!({ "by_status": by_status, "by_workflow": counts }),
    ))
}

/// Steps shown with a run; the rest a page at a time.
const STEPS_SHOWN: i64 = 50;

/// One run: its row, handover note, decisions, parked items, progress lines, what it spent, and
/// its newest steps.
pub async fn show(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
) -> Result<Json<timeline::Overview>, ApiError> {
    timeline::overview(&state.engine.pool, &run_id, None, STEPS_SHOWN)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("run {run_id} not found")))
}

/// Paging through a run's positions.
#[derive(Debug, Deserialize)]
pub struct PageQuery {
    /// Items after this position (-1: from the start).
    #[serde(default = "from_start")]
    after: i32,
    limit: Option<i64>,
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
pub async fn steps(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    Query(q): Query<PageQuery>,
) -> Result<Json<Value>, ApiError> {
    existing(&state, &run_id).await?;
    let page = steps::page(&state.engine.pool, &run_id, q.after, page_size(q.limit)).await?;
    Ok(Json(json!({ "steps": page })))
}

/// A run's model calls, in order (what was asked and what it cost; not the answers).
pub async fn journal(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    Query(q): Query<PageQuery>,
) -> Result<Json<Value>, ApiError> {
    existing(&state, &run_id).await?;
    let page = journal::page(&state.engine.pool, &run_id, q.after, page_size(q.limit)).await?;
    Ok(Json(json!({ "calls": page })))
}

/// A run's effects with their state (`done`, `intent`, `unknown`).
pub async fn effects(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    Query(q): Query<PageQuery>,
) -> Result<Json<Value>, ApiError> {
    existing(&state, &run_id).await?;
    let page = effects::page(&state.engine.pool, &run_id, q.after, page_size(q.limit)).await?;
    Ok(Json(json!({ "effects": page })))
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
