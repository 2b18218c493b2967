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
use crate::operator::Decider;
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
    let rows = ops::list(&state.engine).await?;
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
    me.require(Role::Operator, "changing a schedule")?;
    if !["pause", "resume", "trigger"].contains(&action.as_str()) {
        return Err(Shown::not_found(format!(
            "there is no schedule action {action:?}; pause, resume and trigger are"
        )));
    }
    schedule::check_name(&name)?;
    if f.reason.trim().is_empty() {
        return Err(Shown::bad_request("say why: it is recorded in the audit trail"));
    }
    let once = Once::take(&state, &f.form_key, &format!("schedule.{action} {name}")).await?;
    if let Some(replay) = once.replay() {
        return Ok(replay);
    }
    let who = me.decider(&f.reason);
    let response = match carry_out(&state, &who, &name, &action).await {
        Ok(said) => {
            let q = url::form_urlencoded::Serializer::new(String::new())
                .append_pair("done", &said)
                .finish();
            Redirect::to(&format!("/schedules?{q}")).into_response()
        }
        Err(shown) => shown.into_response(),
    };
    // A failure lets the form key go, so the same form can be sent again.
    once.keep(&state, &response).await?;
    Ok(response)
}

/// Does `action` and says what was done.
async fn carry_out(
    state: &ConsoleState,
    who: &Decider,
    name: &str,
    action: &str,
) -> Result<String, Shown> {
    let engine = &state.engine;
    Ok(match action {
        "pause" => {
            ops::set_paused(engine, name, true, who).await?;
            format!("paused {name}")
        }
        "resume" => {
            let row = ops::set_paused(engine, name, false, who).await?;
            format!("resumed {name}; next tick {}", row.next_tick)
        }
        _ => {
            let done = ops::trigger(engine, name, who).await?;
            let run = done.started.first().or(done.existed.first());
            format!("triggered {name}: {}", run.cloned().unwrap_or_default())
        }
    })
}
