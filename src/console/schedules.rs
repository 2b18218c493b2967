//! Schedules: every schedule with its cadence, next tick and counts, and (for operators) pause,
//! resume and trigger, each with a reason, once per form, audited like the CLI's and the API's.

use axum::Form;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{csrf_field, done_box, page, time};
use super::once::Once;
use super::session::Me;
use super::{ConsoleState, Shown};
use crate::config::tokens::Role;
use crate::schedule::{self, ops};

/// `GET /schedules` options.
#[derive(Debug, Deserialize)]
pub struct ListQuery {
    done: Option<String>,
}

/// `GET /schedules`.
pub async fn list(
    State(state): State<ConsoleState>,
    me: Me,
    Query(q): Query<ListQuery>,
) -> Result<Markup, Shown> {
    let rows = ops::list(&state.engine).await.map_err(shown)?;
    Ok(page(
        "Schedules",
        Some(&me),
        html! {
            @if let Some(done) = &q.done { (done_box(done)) }
            @if rows.is_empty() { p.muted { "No schedules; create one with " code { "trailmark schedule create" } "." } }
            @else {
                table #schedules {
                    thead { tr { th { "name" } th { "workflow" } th { "cadence" } th { "overlap" } th { "next tick" }
                        th { "state" } th.num { "started" } th.num { "skipped" } th {} } }
                    tbody { @for r in &rows { tr data-schedule=(r.name) {
                        td.key { (r.name) }
                        td { (r.workflow) }
                        td { @if let Some(cron) = &r.cron { code { (cron) } " " (r.tz.as_deref().unwrap_or("UTC")) }
                             @else { "every " (r.every_secs.unwrap_or_default()) " s" } }
                        td { (r.overlap) }
                        td { @if r.paused { "–" } @else { (time(r.next_tick)) } }
                        td.state { @if r.paused { "paused" } @else { "active" } }
                        td.num { (r.started) }
                        td.num { (r.skipped) }
                        td { @if me.may(Role::Operator) {
                            @for action in actions(r.paused) {
                                form.inline method="post" action={ "/schedules/" (r.name) "/" (action) } data-action=(action) {
                                    (csrf_field(&me))
                                    input type="hidden" name="form_key" value=(uuid::Uuid::new_v4().to_string());
                                    input type="text" name="reason" placeholder="why" required;
                                    button type="submit" { (action) }
                                }
                            }
                        } }
                    } } }
                }
            }
        },
    ))
}

fn actions(paused: bool) -> [&'static str; 2] {
    match paused {
        true => ["resume", "trigger"],
        false => ["pause", "trigger"],
    }
}

/// A schedule action's form.
#[derive(Debug, Deserialize)]
pub struct ActForm {
    #[serde(default)]
    reason: String,
    #[serde(default)]
    form_key: String,
}

/// `POST /schedules/{name}/{action}`: pause, resume or trigger (once per form).
pub async fn act(
    State(state): State<ConsoleState>,
    me: Me,
    Path((name, action)): Path<(String, String)>,
    Form(f): Form<ActForm>,
) -> Result<Response, Shown> {
    if !me.may(Role::Operator) {
        return Err(Shown::new(
            axum::http::StatusCode::FORBIDDEN,
            "Not allowed",
            "changing a schedule needs the operator role",
        ));
    }
    schedule::check_name(&name).map_err(shown)?;
    if f.reason.trim().is_empty() {
        return Err(Shown::bad_request("say why: it is recorded in the audit trail"));
    }
    let once = Once::take(&state, &f.form_key, &format!("schedule.{action} {name}")).await?;
    if let Some(replay) = once.replay() {
        return Ok(replay);
    }
    let who = me.decider(&f.reason);
    let engine = &state.engine;
    let said = match action.as_str() {
        "pause" => ops::set_paused(engine, &name, true, &who).await.map(|_| format!("paused {name}")),
        "resume" => ops::set_paused(engine, &name, false, &who).await.map(|r| format!("resumed {name}; next tick {}", r.next_tick)),
        "trigger" => ops::trigger(engine, &name, &who).await.map(|d| {
            format!("triggered {name}: {}", d.started.first().or(d.existed.first()).cloned().unwrap_or_default())
        }),
        other => return Err(Shown::not_found(format!("there is no schedule action {other:?}; pause, resume and trigger are"))),
    }
    .map_err(shown)?;
    let q = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("done", &said)
        .finish();
    let response = Redirect::to(&format!("/schedules?{q}")).into_response();
    once.keep(&state, &response).await?;
    Ok(response)
}

/// A schedule error as the console shows it.
fn shown(e: schedule::Error) -> Shown {
    match e {
        schedule::Error::NotFound(_) => Shown::not_found(e.to_string()),
        schedule::Error::Invalid { .. } => Shown::bad_request(e.to_string()),
        schedule::Error::Conflict(_) => Shown::new(axum::http::StatusCode::CONFLICT, "Conflict", e.to_string()),
        schedule::Error::Store(s) => Shown::from(s),
    }
}
