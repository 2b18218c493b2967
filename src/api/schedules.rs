//! Schedules over HTTP: what `trailmark schedule` does, with the same checks and words
//! ([`crate::schedule::ops`]); changes need the operator role and a reason, and are audited.

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::AppState;
use super::auth::Caller;
use super::decisions::{ReasonBody, decider};
use super::error::{ApiError, ErrorBody};
use super::extract::{Body, Path};
use super::input::{self, Kind};
use crate::schedule::{self, ops};
use crate::store::schedules::ScheduleRow;

/// What a schedule change's reason is recorded with.
const AUDITED: &str = "the audit trail";

/// `POST /api/v1/schedules`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    /// Its name: 1 to 64 letters, digits, `.`, `_` or `-`; every run is `<name>:<tick>`.
    #[schema(example = "nightly")]
    name: String,
    /// The workflow each tick starts.
    #[schema(example = "chain")]
    workflow: String,
    /// The runs' input (default `{}`).
    #[serde(default = "super::extract::empty_object")]
    #[schema(value_type = Object)]
    input: Value,
    /// A cron expression (five fields, or six with seconds); give it or `every`.
    #[schema(example = "0 2 * * *")]
    cron: Option<String>,
    /// The cron expression's IANA time zone (default UTC).
    tz: Option<String>,
    /// A fixed interval (`30s`, `15m`, `2h`, `1d`); give it or `cron`.
    every: Option<String>,
    /// `skip` (default), `buffer-one` or `allow`.
    overlap: Option<String>,
    /// How far back missed ticks are still started (default `1m`).
    catch_up: Option<String>,
    /// Why, in the creator's words (required; audited).
    reason: String,
}

/// `POST /api/v1/schedules/{name}/backfill`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BackfillBody {
    /// The first tick time (RFC 3339).
    from: DateTime<Utc>,
    /// The last tick time, not in the future.
    to: DateTime<Utc>,
    /// Why (required; audited).
    reason: String,
}

/// Every schedule.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ScheduleList {
    /// By name.
    schedules: Vec<ScheduleRow>,
}

fn name_of(name: &str) -> Result<(), ApiError> {
    input::check("name", name, Kind::Id)?;
    schedule::check_name(name)?;
    Ok(())
}

/// Every schedule: cadence, next tick, paused, runs started and ticks skipped.
#[utoipa::path(
    get,
    path = "/api/v1/schedules",
    operation_id = "list_schedules",
    tag = "schedules",
    responses(
        (status = 200, description = "every schedule, by name", body = ScheduleList),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<ScheduleList>, ApiError> {
    let schedules = ops::list(&state.engine).await?;
    Ok(Json(ScheduleList { schedules }))
}

/// Creates a schedule; the same schedule again answers it (200), another one under the name is
/// refused (409).
#[utoipa::path(
    post,
    path = "/api/v1/schedules",
    operation_id = "create_schedule",
    tag = "schedules",
    request_body = CreateBody,
    responses(
        (status = 201, description = "the schedule, created", body = ScheduleRow),
        (status = 200, description = "the same schedule existed; nothing changed", body = ScheduleRow),
        (status = 409, description = "another schedule has the name", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; nothing was created", body = ErrorBody),
    ),
)]
pub async fn create(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Body(b): Body<CreateBody>,
) -> Result<(StatusCode, Json<ScheduleRow>), ApiError> {
    let who = decider(&caller, &b.reason, AUDITED)?;
    // The name's own rule is checked by ops::create; here only as text from outside.
    input::check("name", &b.name, Kind::Id)?;
    input::check("workflow", &b.workflow, Kind::Id)?;
    let mut create = ops::Create::new(b.name, b.workflow, b.input, b.cron, b.tz, b.every)?;
    if let Some(overlap) = &b.overlap {
        create = create.overlap(overlap)?;
    }
    if let Some(catch_up) = &b.catch_up {
        create = create.catch_up(catch_up)?;
    }
    let (row, created) = ops::create(&state.engine, &create, &who).await?;
    let status = match created {
        true => StatusCode::CREATED,
        false => StatusCode::OK,
    };
    Ok((status, Json(row)))
}

/// One schedule, its next five ticks and its newest runs.
#[utoipa::path(
    get,
    path = "/api/v1/schedules/{name}",
    operation_id = "show_schedule",
    tag = "schedules",
    params(("name" = String, Path, description = "the schedule")),
    responses(
        (status = 200, description = "the schedule, its next ticks and newest runs", body = ops::Shown),
        (status = 404, description = "no such schedule", body = ErrorBody),
    ),
)]
pub async fn show(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<ops::Shown>, ApiError> {
    name_of(&name)?;
    Ok(Json(ops::show(&state.engine, &name).await?))
}

/// Pauses a schedule: nothing starts until it is resumed.
#[utoipa::path(
    post,
    path = "/api/v1/schedules/{name}/pause",
    operation_id = "pause_schedule",
    tag = "schedules",
    params(("name" = String, Path, description = "the schedule")),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "the schedule, paused", body = ScheduleRow),
        (status = 404, description = "no such schedule", body = ErrorBody),
    ),
)]
pub async fn pause(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    Body(b): Body<ReasonBody>,
) -> Result<Json<ScheduleRow>, ApiError> {
    paused(state, caller, name, b, true).await
}

/// Resumes a schedule from the next tick after now.
#[utoipa::path(
    post,
    path = "/api/v1/schedules/{name}/resume",
    operation_id = "resume_schedule",
    tag = "schedules",
    params(("name" = String, Path, description = "the schedule")),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "the schedule, resumed", body = ScheduleRow),
        (status = 404, description = "no such schedule", body = ErrorBody),
    ),
)]
pub async fn resume(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    Body(b): Body<ReasonBody>,
) -> Result<Json<ScheduleRow>, ApiError> {
    paused(state, caller, name, b, false).await
}

async fn paused(
    state: AppState,
    caller: Caller,
    name: String,
    b: ReasonBody,
    pause: bool,
) -> Result<Json<ScheduleRow>, ApiError> {
    let who = decider(&caller, &b.reason, AUDITED)?;
    name_of(&name)?;
    Ok(Json(ops::set_paused(&state.engine, &name, pause, &who).await?))
}

/// Starts one run of the schedule now, whatever its overlap policy.
#[utoipa::path(
    post,
    path = "/api/v1/schedules/{name}/trigger",
    operation_id = "trigger_schedule",
    tag = "schedules",
    params(("name" = String, Path, description = "the schedule")),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "the run started (or found)", body = ops::Started),
        (status = 404, description = "no such schedule", body = ErrorBody),
    ),
)]
pub async fn trigger(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    Body(b): Body<ReasonBody>,
) -> Result<Json<ops::Started>, ApiError> {
    let who = decider(&caller, &b.reason, AUDITED)?;
    name_of(&name)?;
    Ok(Json(ops::trigger(&state.engine, &name, &who).await?))
}

/// Starts the run of every past tick in `[from, to]` that has none.
#[utoipa::path(
    post,
    path = "/api/v1/schedules/{name}/backfill",
    operation_id = "backfill_schedule",
    tag = "schedules",
    params(("name" = String, Path, description = "the schedule")),
    request_body = BackfillBody,
    responses(
        (status = 200, description = "runs started, and ticks whose run existed", body = ops::Started),
        (status = 404, description = "no such schedule", body = ErrorBody),
    ),
)]
pub async fn backfill(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    Body(b): Body<BackfillBody>,
) -> Result<Json<ops::Started>, ApiError> {
    let who = decider(&caller, &b.reason, AUDITED)?;
    name_of(&name)?;
    Ok(Json(
        ops::backfill(&state.engine, &name, b.from, b.to, &who).await?,
    ))
}

/// Deletes a schedule; its runs stay.
#[utoipa::path(
    post,
    path = "/api/v1/schedules/{name}/delete",
    operation_id = "delete_schedule",
    tag = "schedules",
    params(("name" = String, Path, description = "the schedule")),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "deleted", body = Object),
        (status = 404, description = "no such schedule", body = ErrorBody),
    ),
)]
pub async fn delete(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    Body(b): Body<ReasonBody>,
) -> Result<Json<Value>, ApiError> {
    let who = decider(&caller, &b.reason, AUDITED)?;
    name_of(&name)?;
    ops::delete(&state.engine, &name, &who).await?;
    Ok(Json(json!({ "deleted": name })))
}
