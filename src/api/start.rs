//! `POST /api/v1/runs`: a run started over HTTP, for upstream services and tools that speak HTTP
//! rather than AMQP. The start is checked as a worker checks a run-start event
//! ([`crate::worker::start_message`]: the event's size, then the workflow and its input check),
//! refused with the same words and the same reason codes (`oversized`, `unknown_workflow`,
//! `bad_input`, `run_conflict`). The run id is the start's idempotency key, as for an event: the
//! same id with the same workflow and input again starts nothing and answers the run (200); with
//! another workflow or input it is refused (409) and the run is kept. A new run is made as the
//! run-start consumer makes one: the run and its first step message in the outbox, in one
//! transaction (with its audit row), so the answer (201) names a run that exists.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::AppState;
use super::auth::{Caller, Role};
use super::error::{ApiError, ErrorBody};
use super::extract::Body;
use super::input::{self, Kind};
use crate::domain::{RunId, RunStartEvent, RunStatus, StepAddress, request_hash};
use crate::operator::Decider;
use crate::flow::debounce::{self, Held};
use crate::store::debounce::DebouncedStart;
use crate::store::{self, audit, runs};
use crate::worker::run_start::{self, Created};
use crate::workflow::{StartRefused, Workflow};

/// What starts a run.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StartBody {
    /// The workflow to run (`GET /api/v1/workflows` lists those this process runs).
    #[schema(example = "chain")]
    workflow: String,
    /// The run's id, chosen by the caller (1-200 characters from `A-Z a-z 0-9 . _ : -`): the
    /// start's idempotency key. The same body again (a retry after a timeout) answers the same
    /// run; another workflow or input under this id is refused.
    #[schema(example = "night-2026-10-13")]
    run_id: String,
    /// The workflow's input: any JSON its input check accepts (default `{}`).
    #[serde(default = "super::extract::empty_object")]
    #[schema(example = json!({"steps": 3}))]
    input: Value,
    /// Why, in the starter's words; kept in the audit trail (optional).
    reason: Option<String>,
    /// Where the run stands among runs waiting for a slot of its concurrency key: 0 (lowest)
    /// to 4 (highest); 2 when absent.
    #[schema(example = 3)]
    priority: Option<i64>,
    /// The workflow version the run starts on and keeps until it ends (one this process
    /// carries); the newest when absent.
    #[schema(example = 2)]
    version: Option<i32>,
}

/// Where to read a run.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RunLinks {
    /// The run (`GET`).
    pub run: String,
    /// Its steps (`GET`).
    pub steps: String,
    /// Its model calls (`GET`).
    pub journal: String,
    /// Its outside writes (`GET`).
    pub effects: String,
}

/// A started run, as the start found it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct StartedRun {
    /// The run.
    pub run_id: String,
    /// Its workflow.
    pub workflow: String,
    /// The workflow version it follows.
    pub workflow_version: i32,
    /// Where it stands (`running` for a run this request made).
    pub status: RunStatus,
    /// The step it runs next (none once it ended).
    pub step: Option<StepAddress>,
    /// Whether this request made the run; false when it existed with this workflow and input.
    pub created: bool,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// Where to follow it.
    pub links: RunLinks,
}

impl StartedRun {
    fn new(run: runs::RunRow, created: bool) -> Self {
        let at = format!("/api/v1/runs/{}", run.run_id);
        Self {
            links: RunLinks {
                steps: format!("{at}/steps"),
                journal: format!("{at}/journal"),
                effects: format!("{at}/effects"),
                run: at,
            },
            run_id: run.run_id,
            workflow: run.workflow,
            workflow_version: run.workflow_version,
            status: run.status,
            step: run.step,
            created,
            created_at: run.created_at,
        }
    }
}

/// A start the worker would refuse, refused here with its words and reason code.
fn refused(run_id: &RunId, why: StartRefused) -> ApiError {
    let (status, field) = match why {
        StartRefused::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "input"),
        StartRefused::UnknownWorkflow { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "workflow"),
        StartRefused::UnknownVersion { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "version"),
        StartRefused::BadInput { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "input"),
    };
    let message = format!("run {run_id}: {why}; nothing was started");
    ApiError::new(status, why.reason(), message).with_field(field)
}

/// Another start of an existing run: the event path's `run_conflict`, in its words.
fn conflict(event: &RunStartEvent, run: &runs::RunRow) -> ApiError {
    let (stored, asked) = (request_hash(&run.input), request_hash(&event.input));
    ApiError::new(
        StatusCode::CONFLICT,
        "run_conflict",
        format!(
            "run {} exists with workflow {} and input {stored} (status {}); this start asks for workflow {} with input {asked}. Start the new work under another run id; the run was not changed",
            event.run_id, run.workflow, run.status, event.workflow
        ),
    )
    .with_field("run_id")
    .with_run_status(run.status.as_str())
}

/// The body's text checked where it enters, and the start as a worker would check it.
fn checked(state: &AppState, b: StartBody) -> Result<(RunStartEvent, Arc<Workflow>), ApiError> {
    input::check("workflow", &b.workflow, Kind::Id)?;
    input::check("run_id", &b.run_id, Kind::Id)?;
    if let Some(reason) = &b.reason {
        input::check("reason", reason, Kind::Reason)?;
    }
    let run_id = RunId::parse(&b.run_id)
        .map_err(|e| ApiError::bad_request(e.to_string()).with_field("run_id"))?;
    let priority = b
        .priority
        .map(crate::flow::Priority::new)
        .transpose()
        .map_err(|e| ApiError::bad_request(e.to_string()).with_field("priority"))?;
    let event = RunStartEvent {
        priority,
        version: b.version,
        ..RunStartEvent::new(run_id, &b.workflow, b.input)
    };
    let engine = &state.engine;
    let limit = engine.settings.worker.max_message_bytes;
    let (_, workflow) =
        crate::worker::start_message(&engine.registry, &engine.topology, limit, &event)
            .map_err(|why| refused(&event.run_id, why))?;
    Ok((event, workflow))
}

/// Starts a run: `201` with the run when this request made it, `200` with it when it existed
/// with this workflow and input.
#[utoipa::path(
    post,
    path = "/api/v1/runs",
    operation_id = "start_run",
    tag = "runs",
    request_body = StartBody,
    params(
        ("traceparent" = Option<String>, Header,
            description = "optional W3C trace context (`00-<trace id>-<span id>-<flags>`): the run's trace continues the caller's, its run span under the caller's span; without one, or when it is not a valid traceparent, the run begins a trace of its own"),
    ),
    responses(
        (status = 201, description = "the run was made (status running; its first step is queued)", body = StartedRun,
            headers(("location" = String, description = "the run's path"))),
        (status = 200, description = "the run existed, started with this workflow and input: nothing new was started", body = StartedRun),
        (status = 202, description = "the workflow debounces its starts: the start is held under its key, `pending` until `due_at` (then it becomes a run unless a later start with its key replaces it), or was recorded before (`created` false; `superseded` when a later start replaced it)", body = HeldStart),
        (status = 409, description = "run_conflict: a run with this id exists (or existed and was removed by retention) with another workflow or input; it was not changed", body = ErrorBody),
        (status = 410, description = "run_pruned: the run existed with this workflow and input, finished and was removed by retention; nothing was started", body = ErrorBody),
        (status = 413, description = "oversized: the run-start event would be over worker.max_message_bytes (pass large inputs by reference)", body = ErrorBody),
        (status = 422, description = "unknown_workflow: no such workflow here; bad_input: the workflow's input check refused the input, or the field its debounce key is read from is missing, not a string, number or boolean, or too long", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; try again (the same body is safe to send again)", body = ErrorBody),
    ),
)]
pub async fn start(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    headers: axum::http::HeaderMap,
    Body(b): Body<StartBody>,
) -> Result<Response, ApiError> {
    caller.require(Role::Operator)?;
    // The caller's W3C trace context: the run's trace continues it (see `trace`).
    let traceparent = headers
        .get(crate::trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok());
    let reason = b.reason.clone().unwrap_or_default();
    let (event, workflow) = checked(&state, b)?;
    let first = workflow.first_step().ok_or_else(|| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown_step",
            format!("workflow {} has no steps; nothing was started", workflow.name),
        )
        .with_field("workflow")
    })?;
    let mut tx = state.engine.pool.begin().await.map_err(store::Error::from)?;
    let engine = &state.engine;
    let made = match &workflow.flow.debounce {
        // Held under its key (`flow::debounce`), unless its run id stands for a run already.
        Some(debounce) => {
            let rules = (workflow.as_ref(), debounce);
            match debounce::hold(&mut tx, &engine.topology, rules, (&event, traceparent)).await? {
                Held::Run(created) => created,
                held => return held_start(tx, (&caller, &reason), &event, held).await,
            }
        }
        None => run_start::create(&mut tx, (&engine.topology, None), (&workflow.name, workflow.version, Some(&workflow.flow)), &first, (&event, traceparent), |_| {}).await?,
    };
    match made {
        Created::New { .. } => {}
        Created::Exists(existing) => {
            tx.rollback().await.map_err(store::Error::from)?;
            return again(&event, Some(*existing));
        }
        Created::Vanished => {
            tx.rollback().await.map_err(store::Error::from)?;
            return again(&event, None);
        }
        Created::Pruned(gone) => {
            tx.rollback().await.map_err(store::Error::from)?;
            return Err(pruned(&event, &gone));
        }
    }
    audited(&mut tx, &caller.decider(&reason), &event, &workflow).await?;
    let run = runs::get(&mut *tx, event.run_id.as_str())
        .await?
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the run made in this transaction could not be read back",
            )
        })?;
    tx.commit().await.map_err(store::Error::from)?;
    tracing::info!(run.id = %event.run_id, workflow = %workflow.name, "run started through the API");
    created(StartedRun::new(run, true))
}

/// A start of a debounced workflow, held rather than started: where it stands.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct HeldStart {
    /// The start as recorded: `state` `pending` until `due_at` (then it becomes a run, unless a
    /// later start with its key replaces it), or `superseded` (by `superseded_by`).
    #[serde(flatten)]
    pub start: DebouncedStart,
    /// Whether this request recorded it; false when it was recorded before with this workflow
    /// and input.
    pub created: bool,
    /// The pending start this one replaced (it will not run), if any.
    pub replaced: Option<String>,
    /// Where it stands, in words.
    pub message: String,
}

/// `202` with a held start (recorded now, or before), `409` for another input under a recorded
/// start's id, `422` for a missing key; committed only when this request recorded it.
async fn held_start(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    (caller, reason): (&Caller, &str),
    event: &RunStartEvent,
    held: Held,
) -> Result<Response, ApiError> {
    let (start, created, replaced) = match held {
        Held::Pending { entry, replaced } => (entry, true, replaced),
        Held::Known(entry) if entry.same => (entry, false, None),
        Held::Known(entry) => {
            return Err(ApiError::new(StatusCode::CONFLICT, "run_conflict", format!(
                "{}. This start asks for workflow {} with other input; start the new work under another run id",
                debounce::describe(&entry), event.workflow
            ))
            .with_field("run_id"));
        }
        Held::Refused(why) => return Err(refused(&event.run_id, why)),
        Held::Busy | Held::Run(_) => {
            return Err(ApiError::conflict(format!(
                "run {}: another start with its key or id was recorded at the same moment; send the start again",
                event.run_id
            )));
        }
    };
    if created {
        let details = json!({
            "workflow": event.workflow,
            "input_hash": request_hash(&event.input),
            "debounced": {"key": start.key_value, "due_at": start.due_at, "replaced": replaced},
        });
        let who = caller.decider(reason);
        audit::insert(&mut *tx, &who.audit_entry("run.start", event.run_id.as_str(), &details)).await?;
        tx.commit().await.map_err(store::Error::from)?;
        tracing::info!(run.id = %event.run_id, due_at = %start.due_at, "run start held through the API (debounced)");
    } else {
        tx.rollback().await.map_err(store::Error::from)?;
    }
    let message = debounce::describe(&start);
    let body = HeldStart { start, created, replaced, message };
    Ok((StatusCode::ACCEPTED, Json(body)).into_response())
}

/// A second start of an existing run: the run when it was started the same way, else refused.
fn again(event: &RunStartEvent, existing: Option<runs::RunRow>) -> Result<Response, ApiError> {
    match existing {
        Some(run) if run.started_with(&event.workflow, &event.input) => {
            Ok(Json(StartedRun::new(run, false)).into_response())
        }
        Some(run) => Err(conflict(event, &run)),
        // Removed between the insert and the read: a retry makes it.
        None => Err(ApiError::conflict(format!(
            "run {} was removed while it was being started; send the start again",
            event.run_id
        ))),
    }
}

/// A start of a run that finished and was removed by retention: nothing starts, whether it
/// repeats the start (`run_pruned`) or asks for something else (`run_conflict`).
fn pruned(event: &RunStartEvent, gone: &crate::store::retention::Tombstone) -> ApiError {
    let what = format!(
        "run {} ran workflow {} (it ended {} and was removed by retention at {})",
        event.run_id, gone.workflow, gone.status, gone.pruned_at
    );
    if gone.same {
        return ApiError::new(
            StatusCode::GONE,
            "run_pruned",
            format!("{what}; this start repeats it, so nothing was started. Its archive, if any, is named by `trailmark prune` and the log"),
        );
    }
    ApiError::new(StatusCode::CONFLICT, "run_conflict", format!(
        "{what}; this start asks for workflow {} with other input, so nothing was started. Start the new work under another run id",
        event.workflow
    ))
}

/// The start's audit row, in the start's transaction.
async fn audited(
    tx: &mut sqlx::PgConnection,
    who: &Decider,
    event: &RunStartEvent,
    workflow: &Workflow,
) -> Result<(), ApiError> {
    let details = json!({
        "workflow": workflow.name,
        "version": workflow.version,
        "input_hash": request_hash(&event.input),
    });
    let entry = audit::NewEntry {
        status_after: Some(RunStatus::Running.as_str()),
        ..who.audit_entry("run.start", event.run_id.as_str(), &details)
    };
    audit::insert(tx, &entry).await?;
    Ok(())
}

/// `201` with the run and its `location`.
fn created(started: StartedRun) -> Result<Response, ApiError> {
    let location = HeaderValue::from_str(&started.links.run).map_err(|e| ApiError::internal(&e))?;
    let mut response = (StatusCode::CREATED, Json(started)).into_response();
    response.headers_mut().insert(header::LOCATION, location);
    Ok(response)
}
