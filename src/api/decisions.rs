//! Deciding about runs: resume, resume after a fix, undo (with a preview of what it would
//! reverse), cancel, approve, reject. A reason is required; a decision that does not fit the
//! run's status is 409 with the status. Each writes its audit row in the decision's transaction.
//! Also forks (a new run from another's checkpoint), comparisons of two runs, and the export
//! of every decision, for evaluations.

use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::Response;
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{Value, json};

use super::AppState;
use super::extract::{Body, Path, Query};
use super::input::{self, Kind};
use super::auth::{Caller, Role};
use super::error::ApiError;
use super::idempotency;
use crate::operator::{self, Decider, UndoOptions};
use crate::store::decisions;

/// What every decision carries.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    /// Why, in the decider's words (required).
    reason: String,
    /// `resume`: reset the failed step's attempts and continue on the deployed version.
    #[serde(default)]
    after_fix: bool,
    /// `resume` with `after_fix`: set the stopped step's journaled answers aside and ask the
    /// model again (the fix was to the prompt or the model).
    #[serde(default)]
    ask_again: bool,
    /// `approve`, `reject`: the step the run waits at.
    step: Option<String>,
    /// `undo`: the items to reverse (`{}` or absent: everything).
    scope: Option<Value>,
    /// `undo`: go ahead although a stopped step's writes stay.
    #[serde(default)]
    leave_partial: bool,
}

/// A reason: present, and within [`input::MAX_REASON`] characters of printable text.
pub(super) fn reason(text: &str, recorded_with: &str) -> Result<(), ApiError> {
    if text.trim().is_empty() {
        return Err(ApiError::bad_request(format!(
            "reason must say why (it is recorded with {recorded_with})"
        ))
        .with("field", "reason"));
    }
    input::check("reason", text, Kind::Reason)?;
    Ok(())
}

fn decider(caller: &Caller, d: &Decision) -> Result<Decider, ApiError> {
    reason(&d.reason, "the decision")?;
    Ok(caller.decider(&d.reason))
}

fn step_of(d: &Decision) -> Result<&str, ApiError> {
    let step = d.step.as_deref().ok_or_else(|| {
        ApiError::bad_request("step is required: the step the run waits at").with("field", "step")
    })?;
    input::check("step", step, Kind::Id)?;
    Ok(step)
}

fn resume_how(d: &Decision) -> Result<operator::Resume, ApiError> {
    operator::Resume::from_flags(d.after_fix, d.ask_again).ok_or_else(|| {
        ApiError::bad_request(
            "ask_again needs after_fix: a plain resume replays the answers the step already has",
        )
    })
}

fn undo_options(scope: Option<Value>, leave_partial: bool) -> Result<UndoOptions, ApiError> {
    let scope = scope.unwrap_or_else(|| json!({}));
    if !scope.is_object() {
        return Err(ApiError::bad_request(
            "scope must be a JSON object, e.g. {\"supplier\": \"S-07\"}",
        ));
    }
    Ok(UndoOptions {
        scope,
        leave_partial,
    })
}

/// `POST /api/v1/runs/{id}/{decision}`.
pub async fn decide(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((run_id, action)): Path<(String, String)>,
    headers: HeaderMap,
    Body(d): Body<Decision>,
) -> Result<Json<operator::Outcome>, ApiError> {
    caller.require(Role::Operator)?;
    let who = decider(&caller, &d)?;
    let engine = &state.engine;
    let outcome = match action.as_str() {
        "resume" => operator::resume(engine, &run_id, &who, resume_how(&d)?).await?,
        "undo" => {
            idempotency::required(&headers)?;
            let opts = undo_options(d.scope.clone(), d.leave_partial)?;
            operator::undo(engine, &run_id, &who, opts).await?
        }
        "cancel" => operator::cancel(engine, &run_id, &who).await?,
        "approve" => operator::approve(engine, &run_id, step_of(&d)?, &who).await?,
        "reject" => operator::reject(engine, &run_id, step_of(&d)?, &who).await?,
        other => {
            return Err(ApiError::not_found(format!(
                "no decision {other:?}: resume, undo, cancel, approve or reject"
            )));
        }
    };
    Ok(Json(outcome))
}

/// `POST /api/v1/runs/{id}/fork`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkBody {
    /// Why (required).
    reason: String,
    /// A position (number) or a step name (its first visit).
    from: Value,
    /// The fork's id (default `<run>-fork-<8 hex>`).
    run_id: Option<String>,
    /// A new input (default: the parent's).
    input: Option<Value>,
    /// Make the fork's outside writes for real. Without it a fork is a shadow: its outside
    /// writes are recorded, not made.
    #[serde(default)]
    live: bool,
    /// Record outside writes instead of making them (the default; kept for callers that say so).
    #[serde(default)]
    shadow: bool,
    /// A run whose journaled answers from the fork point on are replayed.
    answers_from: Option<String>,
}

/// Forks a run: a new run from its checkpoint at `from`, in shadow unless the body says
/// `"live": true` (a live fork writes outside under its own keys, which nobody should get by
/// leaving a field out; the CLI asks for `--yes` the same way). Either needs an
/// `Idempotency-Key` like other bulk actions.
pub async fn fork(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(run_id): Path<String>,
    headers: HeaderMap,
    Body(b): Body<ForkBody>,
) -> Result<Json<operator::ForkPlan>, ApiError> {
    caller.require(Role::Operator)?;
    idempotency::required(&headers)?;
    reason(&b.reason, "the fork")?;
    if b.live && b.shadow {
        return Err(ApiError::bad_request(
            "live and shadow contradict each other: send \"live\": true for a fork that writes outside, or leave it out for a shadow fork",
        )
        .with("field", "live"));
    }
    for (field, id) in [("run_id", &b.run_id), ("answers_from", &b.answers_from)] {
        if let Some(id) = id {
            input::check(field, id, Kind::Id)?;
        }
    }
    let from = match &b.from {
        Value::Number(n) => n
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .map(operator::ForkPoint::Position),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
    .ok_or_else(|| {
        ApiError::bad_request("from must be a position (a number) or a step name")
            .with("field", "from")
    })?;
    let req = operator::ForkRequest {
        from,
        run_id: b.run_id,
        input: b.input,
        shadow: !b.live,
        answers_from: b.answers_from,
    };
    let who = caller.decider(&b.reason);
    Ok(Json(
        operator::fork(&state.engine, &run_id, &req, &who).await?,
    ))
}

/// `GET /api/v1/runs/{id}/diff/{other}`: two runs compared position by position.
pub async fn diff(
    State(state): State<AppState>,
    Path((run_id, other)): Path<(String, String)>,
) -> Result<Json<crate::diff::RunDiff>, ApiError> {
    Ok(Json(
        crate::diff::compare(&state.engine.pool, &run_id, &other).await?,
    ))
}

/// `GET /api/v1/runs/{id}/undo-preview` options.
#[derive(Debug, Deserialize)]
pub struct PreviewQuery {
    /// The scope as JSON.
    scope: Option<String>,
    #[serde(default)]
    leave_partial: bool,
}

/// What an undo would reverse, without doing anything.
pub async fn undo_preview(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    Query(q): Query<PreviewQuery>,
) -> Result<Json<operator::Preview>, ApiError> {
    let scope = q
        .scope
        .as_deref()
        .map(serde_json::from_str::<Value>)
        .transpose()
        .map_err(|e| ApiError::bad_request(format!("scope is not JSON: {e}")))?;
    let opts = undo_options(scope, q.leave_partial)?;
    Ok(Json(
        operator::undo_preview(&state.engine, &run_id, opts).await?,
    ))
}

/// `GET /api/v1/decisions/export` options.
#[derive(Debug, Deserialize)]
pub struct ExportQuery {
    /// Decisions after this id (0: from the first).
    #[serde(default)]
    after: i64,
    limit: Option<i64>,
}

/// Every decision as a JSON line: the checkpoint and evidence a person saw, the run's proposed
/// next action, what they decided, who and why.
pub async fn export(
    State(state): State<AppState>,
    Query(q): Query<ExportQuery>,
) -> Result<Response, ApiError> {
    let limit = q.limit.unwrap_or(10_000).clamp(1, 100_000);
    let rows = decisions::export(&state.engine.pool, q.after, limit).await?;
    let mut lines = String::new();
    for row in rows {
        let next = row.evidence["handover"]["next"]
            .as_str()
            .or_else(|| row.evidence["next"].as_str())
            .map(str::to_owned);
        let mut line = serde_json::to_value(&row).expect("a decision serialises");
        line["proposed_next_action"] = json!(next);
        lines += &line.to_string();
        lines.push('\n');
    }
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(axum::body::Body::from(lines))
        .map_err(|e| ApiError::internal(&e))
}
