//! Workflows and their recovery contracts, and the audit trail (admin).

use axum::extract::State;
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::auth::{Caller, Role};
use super::error::{ApiError, ErrorBody};
use super::extract::{Path, Query};
use crate::store::audit;
use crate::workflow::contract;

/// A workflow this process runs.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct WorkflowInfo {
    /// Its name (what a run start names).
    name: String,
    /// The version new runs follow.
    version: i32,
    /// Declared steps.
    steps: usize,
}

/// The workflows this process runs.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Workflows {
    /// By name.
    workflows: Vec<WorkflowInfo>,
}

/// The workflows this process runs, with their versions.
#[utoipa::path(
    get,
    path = "/api/v1/workflows",
    operation_id = "list_workflows",
    tag = "workflows",
    responses((status = 200, description = "the workflows this process runs, by name", body = Workflows)),
)]
pub async fn workflows(State(state): State<AppState>) -> Json<Workflows> {
    let registry = &state.engine.registry;
    let workflows = registry
        .names()
        .iter()
        .filter_map(|n| registry.get(n))
        .map(|w| WorkflowInfo {
            name: w.name.clone(),
            version: w.version,
            steps: w.steps.len(),
        })
        .collect();
    Json(Workflows { workflows })
}

/// A workflow's recovery contract, derived from its step declarations.
#[utoipa::path(
    get,
    path = "/api/v1/workflows/{name}/contract",
    operation_id = "workflow_contract",
    tag = "workflows",
    params(("name" = String, Path, description = "the workflow")),
    responses(
        (status = 200, description = "the workflow's recovery contract", body = contract::Contract),
        (status = 404, description = "no such workflow here", body = ErrorBody),
    ),
)]
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
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// Entries about this target only (a run id, a dead letter's id).
    target: Option<String>,
    /// Entries before this id (a cursor: `next_before`; absent: from the newest).
    before: Option<i64>,
    /// Entries in the page (default 100, at most 1,000).
    limit: Option<i64>,
}

/// A page of the audit trail.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct AuditPage {
    /// Newest first.
    entries: Vec<audit::Entry>,
    /// Pass as `before` for the next page; null on the last.
    next_before: Option<i64>,
}

/// Who did what, when and why, newest first (admin).
#[utoipa::path(
    get,
    path = "/api/v1/audit",
    operation_id = "audit_trail",
    tag = "audit",
    params(AuditQuery),
    responses(
        (status = 200, description = "who did what, when and why, newest first", body = AuditPage),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn audit(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<AuditQuery>,
) -> Result<Json<AuditPage>, ApiError> {
    caller.require(Role::Admin)?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let entries = audit::list(&state.engine.pool, q.target.as_deref(), q.before, limit).await?;
    let next_before = (entries.len() as i64 == limit)
        .then(|| entries.last().map(|e| e.id))
        .flatten();
    Ok(Json(AuditPage {
        entries,
        next_before,
    }))
}
