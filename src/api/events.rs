//! `POST /api/v1/events`: an event sent to waiting runs over HTTP (a supplier's reply relayed by
//! a webhook handler, a signed document), and `GET /api/v1/events`: the events trailmark holds.
//! The event is checked as the CLI and the AMQP consumer check it (`InboundEvent::new`: each
//! field, then its size as a message) and recorded by the same function (`wait::send`), so every
//! face refuses the same events with the same words: a bad field is 400 naming it, the same id
//! with another payload is 409 `event_conflict`, nothing recorded. The event's id makes it
//! idempotent (the same body again answers `duplicate`), and an `Idempotency-Key` works as on
//! every POST. A new event writes its audit row in its transaction.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Extension;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::AppState;
use super::auth::{Caller, Role};
use super::error::{ApiError, ErrorBody};
use super::extract::{Body, Query};
use super::input::{self, Kind};
use crate::domain::{BadEvent, InboundEvent};
use crate::store::waits::{self, SignalFilter, SignalRow};
use crate::wait::{self, EventSent, SendError};

/// An event for the runs that wait for it.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EventBody {
    /// The event's name (1-200 characters from `A-Z a-z 0-9 . _ : -`): a wait names the events
    /// it takes.
    #[schema(example = "supplier.reply")]
    name: String,
    /// Its match key (1-200 characters, no control character): a run's id, unless the run's
    /// wait names another key.
    #[schema(example = "order-42")]
    key: String,
    /// Its id (as `name`'s characters): the same id again is the same event; with another
    /// payload it is refused. Absent: a fresh id is made and answered.
    #[schema(example = "evt-2026-10-13-0042")]
    id: Option<String>,
    /// What the resumed step reads (any JSON; default `{}`).
    #[serde(default = "super::extract::empty_object")]
    #[schema(value_type = Object, example = json!({"price": 41.5}))]
    payload: Value,
    /// Why, in the sender's words; kept in the audit trail (optional).
    reason: Option<String>,
}

/// A field the event check refused: 400 naming it.
fn bad(e: &BadEvent) -> ApiError {
    ApiError::bad_request(format!("{e}; nothing was recorded")).with_field(e.field())
}

/// Sends an event: `resumed` (it moved waiting runs on), `kept` (no run waits for it yet; the
/// first wait for its name and key takes it) or `duplicate` (this id was received before).
#[utoipa::path(
    post,
    path = "/api/v1/events",
    operation_id = "send_event",
    tag = "events",
    request_body = EventBody,
    responses(
        (status = 200, description = "what became of the event: resumed (with the runs it moved on), kept (until when), or duplicate", body = EventSent),
        (status = 400, description = "a field is wrong (empty, too long, bad characters, a NUL in the payload) or the event is over worker.max_message_bytes; `field` names it; nothing was recorded", body = ErrorBody),
        (status = 409, description = "event_conflict: the id was received before with another name, key or payload; nothing was recorded", body = ErrorBody),
        (status = 503, description = "Postgres is unreachable; try again (the same body is safe to send again)", body = ErrorBody),
    ),
)]
pub async fn send(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Body(b): Body<EventBody>,
) -> Result<Json<EventSent>, ApiError> {
    caller.require(Role::Operator)?;
    if let Some(reason) = &b.reason {
        input::check("reason", reason, Kind::Reason)?;
    }
    let who = caller.decider(b.reason.as_deref().unwrap_or_default());
    let limit = state.engine.settings.worker.max_message_bytes;
    let event = InboundEvent::new(&b.name, &b.key, b.id.as_deref(), b.payload, limit)
        .map_err(|e| bad(&e))?;
    match wait::send(&state.engine, event, wait::Sender::Audited(&who)).await {
        Ok(sent) => Ok(Json(sent)),
        Err(SendError::Bad(e)) => Err(bad(&e)),
        Err(SendError::Store(e)) => Err(e.into()),
        Err(conflict) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "event_conflict",
            conflict.to_string(),
        )
        .with_field("id")),
    }
}

/// `GET /api/v1/events` filters.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventQuery {
    /// Only `pending` (kept for a wait), `consumed` or `expired` events.
    state: Option<String>,
    /// Only events of this name.
    name: Option<String>,
    /// Only events with this match key.
    key: Option<String>,
    /// Events in the answer (default 100, at most 500).
    limit: Option<i64>,
}

/// Events, newest first.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct EventList {
    events: Vec<SignalRow>,
}

/// Lists events, newest first: pending (kept for a wait that has not come), consumed, expired.
#[utoipa::path(
    get,
    path = "/api/v1/events",
    operation_id = "list_events",
    tag = "events",
    params(EventQuery),
    responses(
        (status = 200, description = "events, newest first", body = EventList),
        (status = 503, description = "Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn list(
    State(state): State<AppState>,
    Query(q): Query<EventQuery>,
) -> Result<Json<EventList>, ApiError> {
    if let Some(s) = q.state.as_deref()
        && !["pending", "consumed", "expired"].contains(&s)
    {
        return Err(ApiError::bad_request(format!(
            "state {s:?} is not one: pending, consumed or expired"
        ))
        .with_field("state"));
    }
    let filter = SignalFilter {
        state: q.state,
        name: q.name,
        key: q.key,
    };
    let limit = q.limit.unwrap_or(100).clamp(1, 500);
    let events = waits::signals(&state.engine.pool, &filter, limit).await?;
    Ok(Json(EventList { events }))
}
