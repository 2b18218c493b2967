//! Workflows and their recovery contracts, and the audit trail (admin).

use axum::extract::State;
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{Value, json};

use super::AppState;
use super::extract::{Path, Query};
use super::auth::{Caller, Role};
use super::error::ApiError;
use crate::store::audit;
use crate::workflow::contract;

/// The workflows this process runs, with their versions.
pub async fn workflows(State(state): State<AppState>) -> Json<Value> {
    let registry = &state.engine.registry;
    let list: Vec<Value> = registry
        .names()
        .iter()
        .filter_map(|n| registry.get(n))
        .map(|w| json!({ "name": w.name, "version": w.version, "steps": w.steps.len() }))
        .collect();
    Json(json!({ "workflows": list }))
}

/// A workflow's recovery contract, derived from its step declarations.
pub async fn contract(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<contract::Contract>, ApiError> {
    let wf = state.engine.registry.get(&name).ok_or_else(|| {
        ApiError::not_found(format!(
            "workflow {name:?} is not deployed here (this process runs {})",
            state.engine.registry.names().join(", ")
        ))
    })?;
    Ok(Json(contract::derive(&wf)))
}

/// `GET /api/v1/audit` options.
#[derive(Debug, Deserialize)]
pub struct AuditQuery {
    /// Entries about this target only (a run id, a dead letter's id).
    target: Option<String>,
    /// Entries before this id (a cursor; absent: from the newest).
    before: Option<i64>,
    limit: Option<i64>,
}

/// Who did what, when and why, newest first (admin).
pub async fn audit(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<AuditQuery>,
) -> Result<Json<Value>, ApiError> {
    caller.require(Role::Admin)?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let entries = audit::list(&state.engine.pool, q.target.as_deref(), q.before, limit).await?;
    let next_before = (entries.len() as i64 == limit)
        .then(|| entries.last().map(|e| e.id))
        .flatten();
    Ok(Json(
        json!({ "entries": entries, "next_before": next_before }),
    ))
}
