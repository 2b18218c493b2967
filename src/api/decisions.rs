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
use super::error::{ApiError, ErrorBody};
use super::idempotency;
use crate::operator::{self, Decider, UndoOptions};
use crate::store::decisions;

/// `POST /api/v1/runs/{run_id}/cancel` (and the reason of a dead letter's reveal and of a
/// schedule's pause, resume, trigger or delete).
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReasonBody {
    /// Why, in the decider's words (required; at most 2,000 characters, lines and tabs allowed).
    pub(super) reason: String,
}

/// `POST /api/v1/runs/{run_id}/resume`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResumeBody {
    /// Why, in the decider's words (required).
    reason: String,
    /// Reset the failed step's attempts and continue on the deployed version.
    #[serde(default)]
    after_fix: bool,
    /// With `after_fix`: set the stopped step's journaled answers aside and ask the model again
    /// (the fix was to the prompt or the model).
    #[serde(default)]
    ask_again: bool,
}

/// `POST /api/v1/runs/{run_id}/undo`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UndoBody {
    /// Why, in the decider's words (required).
    reason: String,
    /// The items to reverse, e.g. `{"supplier": "S-07"}` (`{}` or absent: everything).
    #[schema(value_type = Option<Object>)]
    scope: Option<Value>,
    /// Go ahead although a stopped step's writes stay.
    #[serde(default)]
    leave_partial: bool,
}

/// `POST /api/v1/runs/{run_id}/approve` and `.../reject`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StepBody {
    /// Why, in the decider's words (required).
    reason: String,
    /// The step the run waits at.
    #[schema(required = true, value_type = String)]
    step: Option<String>,
}

/// A reason: present, and within [`input::MAX_REASON`] characters of printable text.
pub(super) fn reason(text: &str, recorded_with: &str) -> Result<(), ApiError> {
    if text.trim().is_empty() {
        return Err(ApiError::bad_request(format!(
            "reason must say why (it is recorded with {recorded_with})"
        ))
        .with_field("reason"));
    }
    input::check("reason", text, Kind::Reason)?;
    Ok(())
}

/// An operator who said why: the decider of a decision (or of a schedule's change, whose reason
/// is `recorded_with` the audit trail).
pub(super) fn decider(caller: &Caller, why: &str, recorded_with: &str) -> Result<Decider, ApiError> {
    caller.require(Role::Operator)?;
    reason(why, recorded_with)?;
    Ok(caller.decider(why))
}

fn step_of(step: Option<&str>) -> Result<&str, ApiError> {
    let step = step.ok_or_else(|| {
        ApiError::bad_request("step is required: the step the run waits at").with_field("step")
    })?;
    input::check("step", step, Kind::Id)?;
    Ok(step)
}

fn undo_options(scope: Option<Value>, leave_partial: bool) -> Result<UndoOptions, ApiError> {
    let scope = scope.unwrap_or_else(|| json!({}));
    if !scope.is_object() {
        return Err(ApiError::bad_request(
            "scope must be a JSON object, e.g. {\"supplier\": \"S-07\"}",
        )
        .with_field("scope"));
    }
    Ok(UndoOptions {
        scope,
        leave_partial,
    })
}

/// Resumes a run in `needs_review`: replays the stopped step, or with `after_fix` resets its
/// attempts and continues on the deployed version.
#[utoipa::path(
    post,
    path = "/api/v1/runs/{run_id}/resume",
    operation_id = "resume_run",
    tag = "decisions",
    params(("run_id" = String, Path, description = "the run")),
    request_body = ResumeBody,
    responses(
        (status = 200, description = OUTCOME, body = Object),
        (status = 404, description = "no such run", body = ErrorBody),
        (status = 409, description = DOES_NOT_FIT, body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; nothing was decided", body = ErrorBody),
    ),
)]
pub async fn resume(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(run_id): Path<String>,
    Body(b): Body<ResumeBody>,
) -> Result<Json<operator::Outcome>, ApiError> {
    let who = decider(&caller, &b.reason, "the decision")?;
    let how = operator::Resume::from_flags(b.after_fix, b.ask_again).ok_or_else(|| {
        ApiError::bad_request(
            "ask_again needs after_fix: a plain resume replays the answers the step already has",
        )
        .with_field("ask_again")
    })?;
    Ok(Json(
        operator::resume(&state.engine, &run_id, &who, how).await?,
    ))
}

/// Undoes a run: its steps' compensations, newest first, for everything or a scope.
#[utoipa::path(
    post,
    path = "/api/v1/runs/{run_id}/undo",
    operation_id = "undo_run",
    tag = "decisions",
    params(("run_id" = String, Path, description = "the run")),
    request_body = UndoBody,
    responses(
        (status = 200, description = OUTCOME, body = Object),
        (status = 404, description = "no such run", body = ErrorBody),
        (status = 409, description = DOES_NOT_FIT, body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; nothing was decided", body = ErrorBody),
    ),
)]
pub async fn undo(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(run_id): Path<String>,
    headers: HeaderMap,
    Body(b): Body<UndoBody>,
) -> Result<Json<operator::Outcome>, ApiError> {
    let who = decider(&caller, &b.reason, "the decision")?;
    idempotency::required(&headers)?;
    let opts = undo_options(b.scope, b.leave_partial)?;
    Ok(Json(
        operator::undo(&state.engine, &run_id, &who, opts).await?,
    ))
}

/// Cancels a run.
#[utoipa::path(
    post,
    path = "/api/v1/runs/{run_id}/cancel",
    operation_id = "cancel_run",
    tag = "decisions",
    params(("run_id" = String, Path, description = "the run")),
    request_body = ReasonBody,
    responses(
        (status = 200, description = OUTCOME, body = Object),
        (status = 404, description = "no such run", body = ErrorBody),
        (status = 409, description = DOES_NOT_FIT, body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; nothing was decided", body = ErrorBody),
    ),
)]
pub async fn cancel(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(run_id): Path<String>,
    Body(b): Body<ReasonBody>,
) -> Result<Json<operator::Outcome>, ApiError> {
    let who = decider(&caller, &b.reason, "the decision")?;
    Ok(Json(operator::cancel(&state.engine, &run_id, &who).await?))
}

/// Approves the step a waiting run stopped at: the human step completes and the run goes on.
#[utoipa::path(
    post,
    path = "/api/v1/runs/{run_id}/approve",
    operation_id = "approve_step",
    tag = "decisions",
    params(("run_id" = String, Path, description = "the run")),
    request_body = StepBody,
    responses(
        (status = 200, description = OUTCOME, body = Object),
        (status = 404, description = "no such run", body = ErrorBody),
        (status = 409, description = DOES_NOT_FIT, body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; nothing was decided", body = ErrorBody),
    ),
)]
pub async fn approve(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(run_id): Path<String>,
    Body(b): Body<StepBody>,
) -> Result<Json<operator::Outcome>, ApiError> {
    let who = decider(&caller, &b.reason, "the decision")?;
    let step = step_of(b.step.as_deref())?;
    Ok(Json(
        operator::approve(&state.engine, &run_id, step, &who).await?,
    ))
}

/// Rejects the step a waiting run stopped at.
#[utoipa::path(
    post,
    path = "/api/v1/runs/{run_id}/reject",
    operation_id = "reject_step",
    tag = "decisions",
    params(("run_id" = String, Path, description = "the run")),
    request_body = StepBody,
    responses(
        (status = 200, description = OUTCOME, body = Object),
        (status = 404, description = "no such run", body = ErrorBody),
        (status = 409, description = DOES_NOT_FIT, body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; nothing was decided", body = ErrorBody),
    ),
)]
pub async fn reject(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(run_id): Path<String>,
    Body(b): Body<StepBody>,
) -> Result<Json<operator::Outcome>, ApiError> {
    let who = decider(&caller, &b.reason, "the decision")?;
    let step = step_of(b.step.as_deref())?;
    Ok(Json(
        operator::reject(&state.engine, &run_id, step, &who).await?,
    ))
}

/// What a decision answers (`operator::Outcome`).
const OUTCOME: &str = "the decision: run_id, action, status_before, status_after, and next (one line on what happens next)";

/// When a decision does not fit.
const DOES_NOT_FIT: &str = "the decision does not fit the run's status (the body's status says which), or a request with the same Idempotency-Key is still running";

/// Where a fork starts.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum ForkFrom {
    /// A position.
    Position(i64),
    /// A step name (its first visit).
    Step(String),
}

/// `POST /api/v1/runs/{run_id}/fork`: a shadow fork unless `live` is true.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkBody {
    /// Why (required; recorded with the fork).
    #[schema(max_length = 2000)]
    reason: String,
    /// A position (number) or a step name (its first visit).
    from: ForkFrom,
    /// The fork's id (default `<run>-fork-<8 hex>`).
    run_id: Option<String>,
    /// A new input (default: the parent's).
    #[schema(value_type = Option<Object>)]
    input: Option<Value>,
    /// true: the fork makes its outside writes for real. Absent or false: a shadow fork, whose
    /// outside writes are recorded, not made.
    #[serde(default)]
    #[schema(default = false)]
    live: bool,
    /// The default; true together with live is refused.
    #[serde(default)]
    #[schema(default = true, deprecated)]
    shadow: bool,
    /// A run whose journaled answers from the fork point on are replayed.
    answers_from: Option<String>,
}

/// Forks a run: a new run from its checkpoint at `from`, in shadow unless the body says
/// `"live": true` (a live fork writes outside under its own keys, which nobody should get by
/// leaving a field out; the CLI asks for `--yes` the same way). Either needs an
/// `Idempotency-Key` like other bulk actions.
#[utoipa::path(
    post,
    path = "/api/v1/runs/{run_id}/fork",
    operation_id = "fork_run",
    tag = "decisions",
    params(("run_id" = String, Path, description = "the parent run")),
    request_body = ForkBody,
    responses(
        (status = 200, description = "the fork's plan: parent, run_id, workflow, version, from_seq, from_step, shadow, inherited_positions, inherited_answers, writing_steps", body = Object),
        (status = 404, description = "no such parent run", body = ErrorBody),
        (status = 409, description = "the fork does not fit the parent (no such step, a position it never reached, the fork's id is taken), or a request with the same Idempotency-Key is still running", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; nothing was made", body = ErrorBody),
    ),
)]
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
        .with_field("live"));
    }
    for (field, id) in [("run_id", &b.run_id), ("answers_from", &b.answers_from)] {
        if let Some(id) = id {
            input::check(field, id, Kind::Id)?;
        }
    }
    let from = match &b.from {
        ForkFrom::Position(n) => i32::try_from(*n).ok().map(operator::ForkPoint::Position),
        ForkFrom::Step(s) => s.parse().ok(),
    }
    .ok_or_else(|| {
        ApiError::bad_request("from must be a position (a number) or a step name")
            .with_field("from")
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
#[utoipa::path(
    get,
    path = "/api/v1/runs/{run_id}/diff/{other}",
    operation_id = "diff_runs",
    tag = "runs",
    params(
        ("run_id" = String, Path, description = "run A"),
        ("other" = String, Path, description = "run B"),
    ),
    responses(
        (status = 200, description = "the two runs compared position by position", body = crate::diff::RunDiff),
        (status = 404, description = "one of the runs does not exist", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn diff(
    State(state): State<AppState>,
    Path((run_id, other)): Path<(String, String)>,
) -> Result<Json<crate::diff::RunDiff>, ApiError> {
    Ok(Json(
        crate::diff::compare(&state.engine.pool, &run_id, &other).await?,
    ))
}

/// `GET /api/v1/runs/{id}/undo-preview` options.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PreviewQuery {
    /// The scope as a JSON object, e.g. `{"supplier":"S-07"}` (absent: everything).
    scope: Option<String>,
    /// Go ahead although a stopped step's writes stay.
    #[serde(default)]
    leave_partial: bool,
}

/// What an undo would reverse, without doing anything.
#[utoipa::path(
    get,
    path = "/api/v1/runs/{run_id}/undo-preview",
    operation_id = "undo_preview",
    tag = "decisions",
    params(("run_id" = String, Path, description = "the run"), PreviewQuery),
    responses(
        (status = 200, description = "what an undo would do: run_id, status, scope, compensations (newest first: step, seq, compensation, writes, reversals or cannot_list), left_standing", body = Object),
        (status = 404, description = "no such run", body = ErrorBody),
        (status = 409, description = "the run cannot be undone as asked (its status, a stopped step's writes without leave_partial)", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
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
        .map_err(|e| ApiError::bad_request(format!("scope is not JSON: {e}")).with_field("scope"))?;
    let opts = undo_options(scope, q.leave_partial)?;
    Ok(Json(
        operator::undo_preview(&state.engine, &run_id, opts).await?,
    ))
}

/// `GET /api/v1/decisions/export` options.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExportQuery {
    /// Decisions after this id (default 0: from the first).
    #[serde(default)]
    after: i64,
    /// Decisions in the answer (default 10,000, at most 100,000).
    limit: Option<i64>,
}

/// Every decision as a JSON line: the checkpoint and evidence a person saw, the run's proposed
/// next action, what they decided, who and why.
#[utoipa::path(
    get,
    path = "/api/v1/decisions/export",
    operation_id = "export_decisions",
    tag = "decisions",
    params(ExportQuery),
    responses(
        (status = 200, description = "one JSON object a line: id, decided_at, run_id, workflow, step, seq, checkpoint, evidence, proposed_next_action, decision, actor, reason, status_before, status_after", body = String, content_type = "application/x-ndjson"),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
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
