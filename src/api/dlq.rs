//! Dead letters: grouped by reason with counts, one letter's headers (its body hidden until an
//! admin reveals it, which is audited), requeue and purge by ids, by reason or all, each with a
//! preview of how many letters it would touch.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{Value, json};

use super::AppState;
use super::extract::{Body, Path, Query};
use super::input::{self, Kind};
use super::auth::{Caller, Role};
use super::error::ApiError;
use super::idempotency;
use crate::dlq::{Cursor, Dlq, Page, Selection, quiet};

/// Most letters a page shows.
const MAX_PAGE: usize = 10_000;

/// `GET /api/v1/dead-letters` options.
#[derive(Debug, Deserialize)]
pub struct ListQuery {
    limit: Option<usize>,
    after: Option<String>,
}

/// The DLQ: its depth, the letters by reason with counts, and one page of letters, oldest first
/// (by time of death, then id); `next` is the `after` of the following page.
pub async fn list(
    State(state): State<AppState>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let after = q
        .after
        .as_deref()
        .map(|a| {
            Cursor::parse(a).ok_or_else(|| {
                ApiError::bad_request("after is not a cursor this API handed out (the `next` of a listing)")
                    .with("field", "after")
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
    let by_reason: Vec<Value> = listing
        .by_reason
        .iter()
        .map(|(reason, count)| json!({ "reason": reason, "count": count }))
        .collect();
    Ok(Json(json!({
        "queue": listing.queue,
        "depth": listing.depth,
        "by_reason": by_reason,
        "letters": listing.letters,
        "next": listing.next,
        "unseen": listing.unseen,
    })))
}

/// One letter: every header; the body only as its size (revealing it is an audited action).
pub async fn show(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let dlq = Dlq::connect(&state.engine.settings.broker).await?;
    let shown = dlq.show(&id, &quiet).await;
    dlq.close().await;
    let shown = shown?;
    Ok(Json(json!({
        "letter": shown.letter,
        "headers": shown.headers,
        "body": { "hidden": true, "bytes": shown.letter.body_bytes },
    })))
}

/// Why someone acts on dead letters.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reason {
    reason: String,
}

/// `POST /api/v1/dead-letters/{id}/reveal`: the body, for an admin, audited.
pub async fn reveal(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Body(why): Body<Reason>,
) -> Result<Json<Value>, ApiError> {
    caller.require(Role::Admin)?;
    require_reason(&why.reason)?;
    let dlq = Dlq::connect(&state.engine.settings.broker).await?;
    let shown = dlq.show(&id, &quiet).await;
    dlq.close().await;
    let shown = shown?;
    write_audit(&state, &caller, "dlq.reveal", &id, &why.reason, json!({})).await?;
    Ok(Json(
        json!({ "letter": shown.letter, "headers": shown.headers, "body": shown.body }),
    ))
}

/// Which letters a requeue or purge touches, and whether only to count them.
#[derive(Debug, Deserialize)]
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
pub async fn requeue(
    state: State<AppState>,
    caller: Extension<Caller>,
    headers: HeaderMap,
    bulk: Body<Bulk>,
) -> Result<Json<Value>, ApiError> {
    bulk_action(state, caller, headers, bulk, "dlq.requeue", Role::Operator).await
}

/// `POST /api/v1/dead-letters/purge` (admin).
pub async fn purge(
    state: State<AppState>,
    caller: Extension<Caller>,
    headers: HeaderMap,
    bulk: Body<Bulk>,
) -> Result<Json<Value>, ApiError> {
    bulk_action(state, caller, headers, bulk, "dlq.purge", Role::Admin).await
}

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
        let listing = dlq.list(&Page::all(), &quiet).await;
        dlq.close().await;
        let selected = listing?.letters.iter().filter(|l| which.matches(l)).count();
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
