//! Dead letters: grouped by reason with counts, one letter's headers and reason (its body hidden
//! until an admin reveals it, which is audited), and requeue or purge by id, by reason or all,
//! each after a page that counts what it will touch.

use axum::Form;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;
use serde_json::json;

use super::layout::{csrf_field, done_box, error_box, page, text_time};
use super::once::Once;
use super::session::{Me, Person};
use super::{ConsoleState, Shown};
use crate::config::tokens::Role;
use crate::dlq::{BodyView, Cursor, Dlq, Page, Selection, quiet};
use crate::operator;

/// Letters listed on the page.
const LISTED: usize = 200;

/// `GET /dead-letters` options.
#[derive(Debug, Deserialize)]
pub struct ListQuery {
    done: Option<String>,
    /// The page after this cursor (the listing's `next`).
    after: Option<String>,
}

/// `GET /dead-letters`.
pub async fn list(
    State(state): State<ConsoleState>,
    me: Me,
    Query(q): Query<ListQuery>,
) -> Result<Markup, Shown> {
    let after = q
        .after
        .as_deref()
        .map(|a| {
            a.parse::<Cursor>().map_err(|_| {
                Shown::bad_request("this page link is broken (its `after` is not one the console made); start from the first page of dead letters")
            })
        })
        .transpose()?;
    let dlq = Dlq::connect(&state.engine.settings.broker).await?;
    let listing = dlq.list(&Page { after, limit: LISTED }, &quiet).await;
    dlq.close().await;
    let listing = listing?;
    let by_reason = &listing.by_reason;
    Ok(page(
        "Dead letters",
        Some(&me),
        html! {
            @if let Some(done) = &q.done { (done_box(done)) }
            @if listing.depth == 0 { p.muted { (listing.queue) " is empty." } }
            @else {
                p { (listing.depth) " in " code { (listing.queue) } ", oldest first"
                    @if listing.unseen > 0 { " (" (listing.unseen) " held by another client just now, not counted)" } }
                table #by-reason {
                    thead { tr { th { "reason" } th.num { "letters" } th {} } }
                    tbody { @for (reason, n) in by_reason { tr data-reason=(reason) {
                        td { code { (reason) } } td.num { (n) }
                        td { @if me.may(Role::Operator) {
                            a href={ "/dead-letters/act/requeue?reason_code=" (reason) } { "requeue…" } " "
                        } @if me.may(Role::Admin) {
                            a href={ "/dead-letters/act/purge?reason_code=" (reason) } { "purge…" }
                        } }
                    } } }
                }
                @if me.may(Role::Operator) { p { a href="/dead-letters/act/requeue?all=true" { "Requeue all…" } " "
                    @if me.may(Role::Admin) { a href="/dead-letters/act/purge?all=true" { "Purge all…" } } } }
                table #letters {
                    thead { tr { th { "id" } th { "reason" } th { "from queue" } th.num { "tries" } th.num { "bytes" } th { "failed at" } th { "detail" } } }
                    tbody { @for d in &listing.letters { tr {
                        td.key { a href={ "/dead-letters/" (d.id) } { (d.id) } }
                        td { code { (d.reason) } }
                        td { (d.queue.as_deref().unwrap_or("–")) }
                        td.num { (d.deliveries.map(|n| n.to_string()).unwrap_or("–".into())) }
                        td.num { (d.body_bytes) }
                        td { (text_time(d.failed_at.as_deref())) }
                        td { (super::layout::one_line(d.detail.as_deref().unwrap_or(""), 120)) }
                    } } }
                }
                @if let Some(next) = &listing.next {
                    p { a #next-page href={ "/dead-letters?after=" (url::form_urlencoded::byte_serialize(next.as_bytes()).collect::<String>()) } { "Later letters…" } }
                }
            }
        },
    ))
}

/// `GET /dead-letters/{id}`: headers and reason; the body stays hidden.
pub async fn show(
    State(state): State<ConsoleState>,
    me: Me,
    Path(id): Path<String>,
) -> Result<Markup, Shown> {
    letter_page(&state, &me, &id, None).await
}

async fn letter_page(
    state: &ConsoleState,
    me: &Person,
    id: &str,
    revealed: Option<BodyView>,
) -> Result<Markup, Shown> {
    let dlq = Dlq::connect(&state.engine.settings.broker).await?;
    let shown = dlq.show(id, &quiet).await;
    dlq.close().await;
    let shown = shown?;
    let d = &shown.letter;
    Ok(page(
        &format!("Dead letter {id}"),
        Some(me),
        html! {
            p { "reason " code #reason { (d.reason) } " · " (d.detail.as_deref().unwrap_or("")) }
            table {
                tbody { @for (k, v) in &shown.headers { tr { th { (k) } td.key { (v) } } } }
            }
            h2 { "Body (" (d.body_bytes) " bytes)" }
            @match &revealed {
                Some(BodyView::Json { text }) => pre.json #body { (text) },
                Some(BodyView::Binary { bytes, head_hex, .. }) => p #body { (bytes) " bytes, not UTF-8 JSON; first bytes in hex: " code { (head_hex) } },
                None => {
                    p.muted { "Hidden: it may hold personal data. Revealing it is recorded in the audit trail." }
                    @if me.may(Role::Admin) {
                        form.box method="post" action={ "/dead-letters/" (id) "/reveal" } {
                            (csrf_field(me))
                            label { "Why " input type="text" name="reason" required; }
                            button type="submit" { "Reveal the body" }
                        }
                    }
                }
            }
            @if me.may(Role::Operator) {
                p { a href={ "/dead-letters/act/requeue?ids=" (id) } { "Requeue this letter…" }
                    @if me.may(Role::Admin) { " " a href={ "/dead-letters/act/purge?ids=" (id) } { "Purge it…" } } }
            }
        },
    ))
}

/// A reason, for actions that need one.
#[derive(Debug, Deserialize)]
pub struct Why {
    #[serde(default)]
    reason: String,
}

/// `POST /dead-letters/{id}/reveal` (admin, audited).
pub async fn reveal(
    State(state): State<ConsoleState>,
    me: Me,
    Path(id): Path<String>,
    Form(why): Form<Why>,
) -> Result<Markup, Shown> {
    me.require(Role::Admin, "revealing a dead letter's body")?;
    if why.reason.trim().is_empty() {
        return Err(Shown::bad_request("say why you reveal it: it is recorded"));
    }
    let dlq = Dlq::connect(&state.engine.settings.broker).await?;
    let shown = dlq.show(&id, &quiet).await;
    dlq.close().await;
    let body = shown?.body;
    record(&state, &me, "dlq.reveal", &id, &why.reason, json!({})).await?;
    letter_page(&state, &me, &id, Some(body)).await
}

/// Which letters an action touches, from a link or a form.
#[derive(Debug, Deserialize)]
pub struct Which {
    ids: Option<String>,
    reason_code: Option<String>,
    all: Option<String>,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    form_key: String,
}

impl Which {
    fn selection(&self) -> Result<Selection, Shown> {
        let ids: Vec<String> = self
            .ids
            .as_deref()
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        match (
            ids.is_empty(),
            self.reason_code.as_deref().filter(|c| !c.is_empty()),
            self.all.is_some(),
        ) {
            (false, None, false) => Ok(Selection::Ids(ids)),
            (true, Some(code), false) => Ok(Selection::Reason(code.to_owned())),
            (true, None, true) => Ok(Selection::All),
            _ => Err(Shown::bad_request(
                "say which letters: ids, a reason code, or all",
            )),
        }
    }
}

fn action_of(action: &str, me: &Person) -> Result<(&'static str, Role), Shown> {
    let (name, role) = match action {
        "requeue" => ("dlq.requeue", Role::Operator),
        "purge" => ("dlq.purge", Role::Admin),
        other => {
            return Err(Shown::not_found(format!(
                "no dead-letter action {other:?}: requeue or purge"
            )));
        }
    };
    me.require(role, &format!("{action} of dead letters"))?;
    Ok((name, role))
}

/// `GET /dead-letters/act/{action}`: how many letters it will touch, and a form to confirm.
pub async fn confirm(
    State(state): State<ConsoleState>,
    me: Me,
    Path(action): Path<String>,
    Query(which): Query<Which>,
) -> Result<Markup, Shown> {
    action_of(&action, &me)?;
    let selection = which.selection()?;
    let dlq = Dlq::connect(&state.engine.settings.broker).await?;
    let count = dlq.count(&selection).await;
    dlq.close().await;
    let count = count?;
    let touched = count.selected;
    Ok(page(
        &format!("{} dead letters?", capitalised(&action)),
        Some(&me),
        html! {
            p #will-touch { "This will " (action) " " strong #count { (touched) } " of the " (count.depth)
                " dead letters (" code { (selection.target()) } ")." }
            @if action == "purge" { (error_box("Purged letters are deleted for good.")) }
            @if touched > 0 {
                form.box method="post" action={ "/dead-letters/act/" (action) } {
                    (csrf_field(&me))
                    @if let Some(ids) = &which.ids { input type="hidden" name="ids" value=(ids); }
                    @if let Some(code) = &which.reason_code { input type="hidden" name="reason_code" value=(code); }
                    @if which.all.is_some() { input type="hidden" name="all" value="true"; }
                    input type="hidden" name="form_key" value=(uuid::Uuid::new_v4().to_string());
                    label { "Why " input type="text" name="reason" required; }
                    button type="submit" class=(if action == "purge" { "danger" } else { "" }) { (capitalised(&action)) " " (touched) }
                }
            }
            p { a href="/dead-letters" { "Back to the dead letters" } }
        },
    ))
}

fn capitalised(s: &str) -> String {
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().collect::<String>() + c.as_str())
        .unwrap_or_default()
}

/// `POST /dead-letters/act/{action}`: the confirmed requeue or purge (once per form).
pub async fn act(
    State(state): State<ConsoleState>,
    me: Me,
    Path(action): Path<String>,
    Form(which): Form<Which>,
) -> Result<Response, Shown> {
    let (name, _) = action_of(&action, &me)?;
    let selection = which.selection()?;
    if which.reason.trim().is_empty() {
        return Err(Shown::bad_request(
            "say why: it is recorded in the audit trail",
        ));
    }
    let once = Once::take(
        &state,
        &which.form_key,
        &format!("{name} {}", selection.target()),
    )
    .await?;
    if let Some(replay) = once.replay() {
        return Ok(replay);
    }
    let dlq = Dlq::connect(&state.engine.settings.broker).await?;
    let done = match name {
        "dlq.requeue" => dlq.requeue(&selection, &quiet).await.map(|r| {
            let said = format!("requeued {} of {} dead letters", r.requeued, r.depth);
            (said, json!(r))
        }),
        _ => dlq
            .purge(&selection, &quiet)
            .await
            .map(|p| (format!("purged {} dead letters", p.purged), json!(p))),
    };
    dlq.close().await;
    let response = match done {
        Ok((said, details)) => {
            record(
                &state,
                &me,
                name,
                &selection.target(),
                &which.reason,
                details,
            )
            .await?;
            let q = url::form_urlencoded::Serializer::new(String::new())
                .append_pair("done", &said)
                .finish();
            Redirect::to(&format!("/dead-letters?{q}")).into_response()
        }
        Err(e) => {
            let shown = Shown::from(e);
            (
                StatusCode::from_u16(shown.status.as_u16())
                    .unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                page("Not done", Some(&me), error_box(&shown.message)),
            )
                .into_response()
        }
    };
    once.keep(&state, &response).await?;
    Ok(response)
}

async fn record(
    state: &ConsoleState,
    me: &Person,
    action: &str,
    target: &str,
    reason: &str,
    details: serde_json::Value,
) -> Result<(), Shown> {
    operator::record_action(
        &state.engine.pool,
        &me.decider(reason),
        action,
        target,
        &details,
    )
    .await
    .map_err(|e| match e {
        operator::Error::Store(s) => Shown::from(s),
        other => Shown::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Not recorded",
            other.to_string(),
        ),
    })
}
