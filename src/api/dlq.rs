//! Dead letters: grouped by reason with counts, one letter's headers (its body hidden until an
//! admin reveals it, which is audited), requeue and purge by ids, by reason or all, each with a
//! preview of how many letters it would touch.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::AppState;
use super::auth::{Caller, Role};
use super::decisions::ReasonBody;
use super::error::{ApiError, ErrorBody};
use super::extract::{Body, Path, Query};
use super::idempotency;
use super::input::{self, Kind};
use crate::dlq::{BodyView, Cursor, DeadLetter, Dlq, Page, Selection, quiet};

/// Most letters a page shows.
const MAX_PAGE: usize = 10_000;

/// `GET /api/v1/dead-letters` options.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Letters shown (default 100, at most 10,000; the counts cover every letter).
    limit: Option<usize>,
    /// The page after this cursor: the `next` of the previous page.
    after: Option<String>,
}

/// How many letters have one reason.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ReasonCount {
    /// The reason code (`undecodable`, `run_conflict`, ...).
    reason: String,
    /// Letters with it.
    count: u32,
}

/// The dead-letter queue.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Listing {
    /// The DLQ's name.
    queue: String,
    /// Letters in it.
    depth: u32,
    /// Letters by reason, with counts.
    by_reason: Vec<ReasonCount>,
    /// One page of letters, oldest first by time of death, then id (see `limit`, `after`).
    #[schema(value_type = Vec<Object>)]
    letters: Vec<DeadLetter>,
    /// The `after` of the next page; absent on the last.
    next: Option<String>,
    /// Letters another client held during the listing (not listed, still in the DLQ).
    unseen: u32,
}

/// One letter's body as shown: hidden until an admin reveals it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct HiddenBody {
    /// Always true here.
    hidden: bool,
    /// The body's size.
    bytes: usize,
}

/// One dead letter, its body hidden.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Letter {
    /// The letter.
    #[schema(value_type = Object)]
    letter: DeadLetter,
    /// Every header it carries.
    headers: BTreeMap<String, Value>,
    /// Its body: hidden.
    body: HiddenBody,
}

/// One dead letter with its body (revealed by an admin, audited).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Revealed {
    /// The letter.
    #[schema(value_type = Object)]
    letter: DeadLetter,
    /// Every header it carries.
    headers: BTreeMap<String, Value>,
    /// Its body: the text where it is UTF-8, else its head in hex.
    #[schema(value_type = Object)]
    body: BodyView,
}

/// The DLQ: its depth, the letters by reason with counts, and one page of letters, oldest first
/// (by time of death, then id); `next` is the `after` of the following page.
#[utoipa::path(
    get,
    path = "/api/v1/dead-letters",
    operation_id = "list_dead_letters",
    tag = "dead letters",
    params(ListQuery),
    responses(
        (status = 200, description = "the DLQ's depth, letters by reason with counts, and one page of letters, oldest first", body = Listing),
        (status = 400, description = "`after` is not a cursor a listing handed out", body = ErrorBody),
        (status = 503, description = "RabbitMQ is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn list(
    State(state): State<AppState>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Listing>, ApiError> {
    let after = q
        .after
        .as_deref()
        .map(|a| {
            a.parse::<Cursor>().map_err(|_| {
                ApiError::bad_request(
                    "after is not a cursor this API handed out (the `next` of a listing)",
                )
                .with_field("after")
            })
        })
        .transpose()?;
    let page = Page {
        after,
        limit: q.limit.unwrap_or(100).min(MAX_PAGE),
    };
    let dlq = Dlq::connect(&state.engine.settings.broker).await?;
    let listing = dlq.list(&page, &quiet).await;
    dlq.close().await;
    let listing = listing?;
    let by_reason = listing
        .by_reason
        .into_iter()
        .map(|(reason, count)| ReasonCount { reason, count })
        .collect();
    Ok(Json(Listing {
        by_reason,
        letters: listing.letters,
        queue: listing.queue,
        depth: listing.depth,
        next: listing.next,
        unseen: listing.unseen,
    }))
}

/// One letter: every header; the body only as its size (revealing it is an audited action).
#[utoipa::path(
    get,
    path = "/api/v1/dead-letters/{id}",
    operation_id = "show_dead_letter",
    tag = "dead letters",
    params(("id" = String, Path, description = "the letter's id")),
    responses(
        (status = 200, description = "the letter and its headers; its body hidden", body = Letter),
        (status = 404, description = "no such letter in the DLQ", body = ErrorBody),
        (status = 503, description = "RabbitMQ is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn show(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Letter>, ApiError> {
    let dlq = Dlq::connect(&state.engine.settings.broker).await?;
    let shown = dlq.show(&id, &quiet).await;
    dlq.close().await;
    let shown = shown?;
    Ok(Json(Letter {
        body: HiddenBody {
            hidden: true,
            bytes: shown.letter.body_bytes,
        },
        letter: shown.letter,
        headers: shown.headers,
    }))
}

/// `POST /api/v1/dead-letters/{id}/reveal`: the body, for an admin, audited.
#[utoipa::path(
    post,
    path = "/api/v1/dead-letters/{id}/reveal",
    operation_id = "reveal_dead_letter",
    tag = "dead letters",
    params(("id" = String, Path, description = "the letter's id")),
    request_body = ReasonBody,
    responses(
        (status = 200, description = "the letter, its headers and its body; the reveal is audited", body = Revealed),
        (status = 404, description = "no such letter in the DLQ", body = ErrorBody),
        (status = 503, description = "RabbitMQ or Postgres is unreachable; try again", body = ErrorBody),
    ),
)]
pub async fn reveal(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Body(why): Body<ReasonBody>,
) -> Result<Json<Revealed>, ApiError> {
    caller.require(Role::Admin)?;
    require_reason(&why.reason)?;
    let dlq = Dlq::connect(&state.engine.settings.broker).await?;
    let shown = dlq.show(&id, &quiet).await;
    dlq.close().await;
    let shown = shown?;
    write_audit(&state, &caller, "dlq.reveal", &id, &why.reason, json!({})).await?;
    Ok(Json(Revealed {
        letter: shown.letter,
        headers: shown.headers,
        body: shown.body,
    }))
}

/// Which letters a requeue or purge touches, and whether only to count them.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Bulk {
    /// Why (required).
    reason: String,
    /// These letters.
    ids: Option<Vec<String>>,
    /// Every letter with this reason code.
    reason_code: Option<String>,
    /// Every letter.
    #[serde(default)]
    all: bool,
    /// Only count what it would touch.
    #[serde(default)]
    preview: bool,
}

impl Bulk {
    fn selection(&self) -> Result<Selection, ApiError> {
        for (i, id) in self.ids.iter().flatten().enumerate() {
            input::check(&format!("ids[{i}]"), id, Kind::Id)?;
        }
        if let Some(code) = &self.reason_code {
            input::check("reason_code", code, Kind::Id)?;
        }
        match (&self.ids, &self.reason_code, self.all) {
            (Some(ids), None, false) if !ids.is_empty() => Ok(Selection::Ids(ids.clone())),
            (None, Some(code), false) => Ok(Selection::Reason(code.clone())),
            (None, None, true) => Ok(Selection::All),
            _ => Err(ApiError::bad_request(
                "say which letters: exactly one of ids (a non-empty list), reason_code, or all: true",
            )),
        }
    }
}

/// `POST /api/v1/dead-letters/requeue` (operator).
#[utoipa::path(
    post,
    path = "/api/v1/dead-letters/requeue",
    operation_id = "requeue_dead_letters",
    tag = "dead letters",
    request_body = Bulk,
    responses(
        (status = 200, description = BULK_DONE, body = Object),
        (status = 404, description = "a letter asked for by id is not in the DLQ", body = ErrorBody),
        (status = 503, description = "RabbitMQ or Postgres is unreachable; try again under the same Idempotency-Key", body = ErrorBody),
    ),
)]
pub async fn requeue(
    state: State<AppState>,
    caller: Extension<Caller>,
    headers: HeaderMap,
    bulk: Body<Bulk>,
) -> Result<Json<Value>, ApiError> {
    bulk_action(state, caller, headers, bulk, "dlq.requeue", Role::Operator).await
}

/// `POST /api/v1/dead-letters/purge` (admin).
#[utoipa::path(
    post,
    path = "/api/v1/dead-letters/purge",
    operation_id = "purge_dead_letters",
    tag = "dead letters",
    request_body = Bulk,
    responses(
        (status = 200, description = BULK_DONE, body = Object),
        (status = 404, description = "a letter asked for by id is not in the DLQ", body = ErrorBody),
        (status = 503, description = "RabbitMQ or Postgres is unreachable; try again under the same Idempotency-Key", body = ErrorBody),
    ),
)]
pub async fn purge(
    state: State<AppState>,
    caller: Extension<Caller>,
    headers: HeaderMap,
    bulk: Body<Bulk>,
) -> Result<Json<Value>, ApiError> {
    bulk_action(state, caller, headers, bulk, "dlq.purge", Role::Admin).await
}

/// What a requeue or purge answers.
const BULK_DONE: &str = "with preview: {preview: true, would_touch}; otherwise what was done: the letters requeued or purged, and those that failed with why";

async fn bulk_action(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Body(bulk): Body<Bulk>,
    action: &'static str,
    role: Role,
) -> Result<Json<Value>, ApiError> {
    caller.require(role)?;
    require_reason(&bulk.reason)?;
    let which = bulk.selection()?;
    let dlq = Dlq::connect(&state.engine.settings.broker).await?;
    if bulk.preview {
        let count = dlq.count(&which).await;
        dlq.close().await;
        let selected = count?.selected;
        return Ok(Json(json!({ "preview": true, "would_touch": selected })));
    }
    idempotency::required(&headers)?;
    let done = match action {
        "dlq.requeue" => dlq.requeue(&which, &quiet).await.map(|r| json!(r)),
        _ => dlq.purge(&which, &quiet).await.map(|r| json!(r)),
    };
    dlq.close().await;
    let done = done?;
    write_audit(
        &state,
        &caller,
        action,
        &which.target(),
        &bulk.reason,
        done.clone(),
    )
    .await?;
    Ok(Json(done))
}

fn require_reason(reason: &str) -> Result<(), ApiError> {
    super::decisions::reason(reason, "the audit trail")
}

async fn write_audit(
    state: &AppState,
    caller: &Caller,
    action: &str,
    target: &str,
    reason: &str,
    details: Value,
) -> Result<(), ApiError> {
    let who = caller.decider(reason);
    crate::operator::record_action(&state.engine.pool, &who, action, target, &details).await?;
    Ok(())
}
