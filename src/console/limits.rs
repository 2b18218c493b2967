//! Limits: the concurrency and rate limits of keyed workflows and the busiest keys, and (for
//! operators) a form that sets a limit, with a reason, once per form, audited like the CLI's and
//! the API's (`flow::limits::set`).

use axum::Form;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{csrf_field, done_box, page};
use super::once::Once;
use super::session::Me;
use super::{ConsoleState, Shown};
use crate::config::tokens::Role;
use crate::flow::limits::{self, Ask, LimitError};
use crate::store::flow;

/// The busiest keys the page lists.
const BUSIEST: i64 = 50;

/// `GET /limits` options.
#[derive(Debug, Deserialize)]
pub struct ListQuery {
    done: Option<String>,
}

/// `GET /limits`.
pub async fn list(State(state): State<ConsoleState>, me: Me, Query(q): Query<ListQuery>) -> Result<Markup, Shown> {
    let engine = &state.engine;
    let set = limits::list(&engine.pool, &engine.registry).await.map_err(shown)?;
    let keys = flow::busiest(&engine.pool, BUSIEST).await?;
    let keyed: Vec<String> = engine
        .registry
        .names()
        .into_iter()
        .filter(|n| engine.registry.get(n).is_some_and(|w| w.flow.concurrency.is_some()))
        .collect();
    let n = |v: Option<i64>| v.map_or("–".into(), |v| v.to_string());
    Ok(page(
        "Limits",
        Some(&me),
        html! {
            @if let Some(done) = &q.done { (done_box(done)) }
            @if set.is_empty() { p.muted { "No workflow here declares a concurrency key." } }
            @else {
                table #limits {
                    thead { tr { th { "workflow" } th { "key" } th.num { "concurrency" } th.num { "total" } th.num { "rate/s" } th { "source" } } }
                    tbody { @for l in &set { tr {
                        td { (l.workflow) } td.key { (l.key) } td.num { (n(l.concurrency)) } td.num { (n(l.total)) }
                        td.num { (l.rate.map_or("–".into(), |r| r.to_string())) } td { (l.source) }
                    } } }
                }
            }
            @if me.may(Role::Operator) && !keyed.is_empty() {
                h2 { "Set a limit" }
                form #set-limit method="post" action="/limits" {
                    (csrf_field(&me))
                    input type="hidden" name="form_key" value=(uuid::Uuid::new_v4().to_string());
                    select name="workflow" { @for w in &keyed { option value=(w) { (w) } } }
                    input type="text" name="key" placeholder="key (empty: every key)";
                    input type="number" name="concurrency" min="1" placeholder="concurrency";
                    input type="number" name="total" min="1" placeholder="total";
                    input type="number" name="rate" min="0" step="any" placeholder="rate/s";
                    input type="text" name="reason" placeholder="why" required;
                    button type="submit" { "set" }
                }
            }
            h2 { "Busiest keys" }
            @if keys.is_empty() { p.muted { "No run holds or waits for a slot." } }
            @else {
                table #keys {
                    thead { tr { th { "workflow" } th { "key" } th.num { "running" } th.num { "waiting" } th.num { "throttled" } } }
                    tbody { @for k in &keys { tr {
                        td { (k.workflow) } td.key { (k.key) } td.num { (k.running) } td.num { (k.waiting) } td.num { (k.throttled) }
                    } } }
                }
            }
        },
    ))
}

/// The set-limit form; empty fields leave a limit as it is.
#[derive(Debug, Deserialize)]
pub struct SetForm {
    workflow: String,
    #[serde(default)]
    key: String,
    #[serde(default)]
    concurrency: String,
    #[serde(default)]
    total: String,
    #[serde(default)]
    rate: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    form_key: String,
}

fn number<T: std::str::FromStr>(field: &str, text: &str) -> Result<Option<T>, Shown> {
    match text.trim() {
        "" => Ok(None),
        t => t.parse().map(Some).map_err(|_| Shown::bad_request(format!("{field}: {t:?} is not a number"))),
    }
}

/// `POST /limits`: sets a limit (once per form).
pub async fn set(State(state): State<ConsoleState>, me: Me, Form(f): Form<SetForm>) -> Result<Response, Shown> {
    me.require(Role::Operator, "changing a limit")?;
    if f.reason.trim().is_empty() {
        return Err(Shown::bad_request("say why: it is recorded in the audit trail"));
    }
    let key = Some(f.key.trim()).filter(|k| !k.is_empty());
    let ask = Ask {
        workflow: &f.workflow,
        key,
        concurrency: number("concurrency", &f.concurrency)?,
        total: number("total", &f.total)?,
        rate: number("rate", &f.rate)?,
    };
    let once = Once::take(&state, &f.form_key, &format!("limit.set {}/{}", f.workflow, key.unwrap_or("*"))).await?;
    if let Some(replay) = once.replay() {
        return Ok(replay);
    }
    let who = me.decider(&f.reason);
    let engine = &state.engine;
    let response = match limits::set(&engine.pool, &engine.registry, &ask, &who).await {
        Ok(row) => {
            let said = format!(
                "set {} key {}: concurrency {}, total {}, rate {}",
                row.workflow,
                if row.key.is_empty() { "*" } else { &row.key },
                row.concurrency.map_or("as declared".into(), |v| v.to_string()),
                row.total.map_or("as declared".into(), |v| v.to_string()),
                row.rate.map_or("as declared".into(), |v| format!("{v}/s")),
            );
            let q = url::form_urlencoded::Serializer::new(String::new()).append_pair("done", &said).finish();
            Redirect::to(&format!("/limits?{q}")).into_response()
        }
        Err(e) => shown(e).into_response(),
    };
    // A failure lets the form key go, so the same form can be sent again.
    once.keep(&state, &response).await?;
    Ok(response)
}

fn shown(e: LimitError) -> Shown {
    match e {
        LimitError::Store(s) => Shown::from(s),
        other => Shown::bad_request(other.to_string()),
    }
}
