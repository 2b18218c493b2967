//! One run: the handover note on top, the decisions the person's role and the run's status
//! allow, what the run says while it works (refreshed while it moves), its steps, model calls and
//! effects a page at a time (a run of 10,000 steps opens as fast as one of ten), parked items and
//! the decisions taken. Undo goes through a preview of the exact reversals, then a confirmation.

use axum::Form;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;
use serde_json::Value;

use super::layout::{
    csrf_field, done_box, error_box, json_block, maybe_time, one_line, page, status, time,
};
use super::session::{Me, Person};
use super::{ConsoleState, Shown, refusal};
use crate::config::tokens::Role;
use crate::domain::RunStatus;
use crate::operator::{self, Outcome, Resume, UndoOptions};
use crate::store::runs::RunRow;
use crate::store::{effects, forks, journal, progress, runs, steps};
use crate::timeline::{self, Overview};

/// Steps, model calls and effects shown per page.
const PAGE: i64 = 100;
/// Compensations an undo page lists one by one, and reversals per compensation: the count above
/// them covers all; a run of 10,000 positions would otherwise make a page of megabytes.
const COMPENSATIONS_SHOWN: usize = 100;
/// See [`COMPENSATIONS_SHOWN`].
const REVERSALS_SHOWN: usize = 500;
/// Where the whole list is.
const UNDO_PREVIEW_API: &str = "GET /api/v1/runs/{run_id}/undo-preview";
/// Items of a handover note's lists shown before "and N more".
const NOTE_ITEMS: usize = 20;
/// Progress lines shown in the live part.
const PROGRESS_SHOWN: usize = 12;

/// `GET /runs/{id}` options.
#[derive(Debug, Deserialize)]
pub struct RunQuery {
    /// Show the steps after this position (absent: the newest page).
    after: Option<i32>,
    /// What was just done (after a decision's redirect).
    done: Option<String>,
}

/// What a page says besides the run: what was just done, or what went wrong in a form.
enum Notice {
    None,
    Done(String),
    Failed(String),
}

/// `GET /runs/{id}`.
pub async fn show(
    State(state): State<ConsoleState>,
    me: Me,
    Path(run_id): Path<String>,
    Query(q): Query<RunQuery>,
) -> Result<Response, Shown> {
    let notice = match q.done {
        Some(done) => Notice::Done(done),
        None => Notice::None,
    };
    render(&state, &me, &run_id, q.after, notice, StatusCode::OK).await
}

async fn render(
    state: &ConsoleState,
    me: &Person,
    run_id: &str,
    after: Option<i32>,
    notice: Notice,
    code: StatusCode,
) -> Result<Response, Shown> {
    let pool = &state.engine.pool;
    let Some(o) = timeline::overview(pool, run_id, after, PAGE).await? else {
        return Err(Shown::not_found(format!(
            "run {run_id} not found; list runs on the Runs page"
        )));
    };
    let from = o.steps.first().map_or(-1, |s| s.seq - 1);
    let calls = journal::page(pool, run_id, from, PAGE).await?;
    let writes = effects::page(pool, run_id, from, PAGE).await?;
    let mut children = Vec::with_capacity(o.around.family.fan_outs.len());
    for f in &o.around.family.fan_outs {
        children.push(crate::store::children::page(pool, (run_id, f.seq), 0, CHILDREN_LISTED).await?);
    }
    let body = html! {
        @match &notice {
            Notice::Done(done) => (done_box(done)),
            _ => {},
        }
        (summary(&o))
        @if matches!(o.run.status, RunStatus::NeedsReview | RunStatus::Waiting) {
            @if let Some(note) = &o.run.handover { (handover(note)) }
        }
        @if me.may(Role::Operator) {
            h2 #decide { "Decide" }
            @if let Notice::Failed(why) = &notice { (error_box(why)) }
            (decisions(me, &o))
        }
        (live_part(&Live::read(pool, &o.run, &o.around.progress).await?))
        (steps_part(&o))
        h2 { "Model calls" }
        @if calls.is_empty() { p.muted { "None at these positions." } }
        @else {
            table {
                thead { tr { th.num { "position" } th.num { "call" } th { "model" } th { "prompt hash" } th.num { "tokens" } th.num { "cost" } th.num { "ms" } } }
                tbody { @for c in &calls { tr {
                    td.num { (c.seq) } td.num { (c.call_no) } td { (c.model.as_deref().unwrap_or(&c.kind)) }
                    td.key { (&c.request_hash[..16.min(c.request_hash.len())]) "…" }
                    td.num { (c.tokens) } td.num { (format!("{:.4}", c.cost)) } td.num { (c.latency_ms) }
                } } }
            }
        }
        h2 { "Effects" }
        @if writes.is_empty() { p.muted { "None at these positions." } }
        @else {
            table {
                thead { tr { th { "key" } th { "tool" } th.num { "position" } th { "state" } th { "request hash" } } }
                tbody { @for e in &writes {
                    tr class=(if e.state == "unknown" { "unknown" } else { "" }) {
                        td.key { (e.idempotency_key) } td { (e.tool) } td.num { (e.seq) }
                        td { @if e.state == "unknown" { strong { "unknown outcome" } } @else { (e.state) } }
                        td.key { (&e.request_hash[..16.min(e.request_hash.len())]) "…" }
                    }
                } }
            }
        }
        (waits_part(&o.around.waits))
        (children_part(run_id, &o.around.family, &children))
        @if !o.around.parked.is_empty() {
            h2 { "Parked items" }
            table {
                thead { tr { th { "item" } th { "step" } th.num { "position" } th { "why" } } }
                tbody { @for p in &o.around.parked { tr { td { (p.item) } td { (p.step) } td.num { (p.seq) } td { (p.reason) } } } }
            }
        }
        h2 { "Decisions" }
        @if o.around.decisions.is_empty() { p.muted { "No one has decided anything about this run." } }
        @else {
            table {
                thead { tr { th { "when" } th { "who" } th { "what" } th { "status" } th { "why" } } }
                tbody { @for d in &o.around.decisions { tr {
                    td { (time(d.created_at)) } td { (d.actor) } td { (d.action) }
                    td { (d.status_before) " → " (d.status_after) } td { (d.reason) }
                } } }
            }
        }
    };
    let title = format!("Run {}", o.run.run_id);
    Ok((code, page(&title, Some(me), body)).into_response())
}

fn summary(o: &Overview) -> Markup {
    let r = &o.run;
    html! {
        p #status-line {
            (status(r.status)) " "
            (r.workflow) " v" (r.workflow_version)
            @if let Some(step) = &r.step { " · step " strong { (step) } " (position " (r.step_seq) ")" }
            " · " (o.steps_total) " positions · " (o.spent.model_calls) " model calls, "
            (o.spent.tokens) " tokens, cost " (format!("{:.4}", o.spent.cost))
            " · effects " (o.around.effects.completed) "/" (o.around.effects.recorded) " completed"
        }
        p.muted {
            "created " (time(r.created_at)) " · changed " (time(r.updated_at))
            @if let Some(f) = r.finished_at { " · finished " (time(f)) }
            @if let Some(owner) = &r.lease_owner { " · lease " (owner) " until " (maybe_time(r.lease_expires_at)) }
            @if let Some(key) = &r.flow_key { " · concurrency key " (key) ", priority " (r.priority) }
        }
        @if let Some(w) = &o.around.flow_wait {
            p.flow-wait {
                "Waits, holding no lease, for "
                @if w.reason == "rate" { "a token of key " (w.key) "'s rate limit (not before " (time(w.not_before)) ")" }
                @else if w.reason == "total" { "a slot of its workflow's total limit" }
                @else { "a slot of key " (w.key) }
                ", since " (time(w.since)) "; " (w.ahead) " of its key ahead in line."
            }
        }
        @if let (Some(error), false) = (&r.error, matches!(r.status, RunStatus::NeedsReview | RunStatus::Waiting)) {
            p.muted { "last error: " (error) }
        }
        (lineage(&o.around.lineage))
        @if let Some(parent) = &o.around.family.parent {
            p #parent { "child run of " a href={ "/runs/" (parent) } { (parent) } }
        }
    }
}

/// The children a run page lists per fan-out (the CLI and the API page through all of them).
const CHILDREN_LISTED: i64 = 50;

/// The child runs the run's steps started: per fan-out, the counts by state and the first
/// children with links.
fn children_part(
    run_id: &str,
    family: &crate::store::children::Family,
    pages: &[Vec<crate::domain::ChildResult>],
) -> Markup {
    html! {
        @for (f, listed) in family.fan_outs.iter().zip(pages) {
            h2 #children { "Children of position " (f.seq) }
            p {
                (f.children.total) " in all: " (f.children.succeeded) " succeeded, "
                (f.children.failed) " failed, " (f.children.running) " running, "
                (f.children.pending) " not started, " (f.children.skipped) " skipped · join "
                (f.join) ", " (f.max_failures) " failure(s) allowed, " (f.max_in_flight) " at once"
            }
            table {
                thead { tr { th.num { "index" } th { "run" } th { "state" } th { "why" } } }
                tbody { @for c in listed { tr {
                    td.num { (c.index) }
                    td { a href={ "/runs/" (c.run_id) } { (c.run_id) } }
                    td { (c.state) } td { (c.reason.as_deref().unwrap_or("")) }
                } } }
            }
            @if i64::from(f.children.total) > CHILDREN_LISTED {
                p.muted { "The first " (CHILDREN_LISTED) " are listed; all of them: "
                    code { "trailmark run list --parent " (run_id) } }
            }
        }
    }
}

/// Where a fork comes from and what was forked from this run, with links both ways.
fn lineage(l: &forks::Lineage) -> Markup {
    let mode = |shadow: bool| if shadow { "shadow fork" } else { "fork" };
    html! {
        @if let Some(p) = &l.parent {
            p #lineage {
                (mode(p.shadow)) " of " a href={ "/runs/" (p.parent_run_id) } { (p.parent_run_id) }
                " from " (p.from_step) " (position " (p.from_seq) ") by " (p.actor) ": " (p.reason)
            }
        }
        @if !l.children.is_empty() {
            p #forks {
                "forks: "
                @for (i, c) in l.children.iter().enumerate() {
                    @if i > 0 { ", " }
                    a href={ "/runs/" (c.run_id) } { (c.run_id) } " (" (mode(c.shadow)) " from position " (c.from_seq) ")"
                }
            }
        }
    }
}

/// Keys of a note's effect list, at most [`NOTE_ITEMS`], with how many were left out.
fn keys(list: Option<&Value>) -> (Vec<String>, usize) {
    let all = list.and_then(Value::as_array).cloned().unwrap_or_default();
    let shown = all
        .iter()
        .take(NOTE_ITEMS)
        .map(|e| {
            let key = e["key"].as_str().unwrap_or_default();
            let tool = e["tool"].as_str().unwrap_or_default();
            format!("{key} ({tool}, position {})", e["seq"])
        })
        .collect();
    (shown, all.len().saturating_sub(NOTE_ITEMS))
}

fn handover(note: &Value) -> Markup {
    let text = |k: &str| note[k].as_str().map(str::to_owned);
    let (done, done_more) = keys(note.get("effects_committed"));
    let (unknown, unknown_more) = keys(note.get("effects_unknown"));
    let parked = note["parked"].as_array().cloned().unwrap_or_default();
    html! {
        section.note #handover {
            h2 { "Handover note" }
            dl {
                @if let Some(step) = text("failed_step") {
                    dt { "Stopped at" } dd { (step) " (position " (note["seq"]) ", attempt " (note["attempt"]) ")" }
                }
                @if let Some(class) = text("error_class") { dt { "Error class" } dd { (class) } }
                @if let Some(error) = text("error").or_else(|| text("question")) { dt { "What happened" } dd #handover-error { (error) } }
                dt { "Effects done" }
                dd { @if done.is_empty() { "none" } @else { ul { @for k in &done { li.key { (k) } } } } @if done_more > 0 { "and " (done_more) " more" } }
                dt { "Effects of unknown outcome" }
                dd { @if unknown.is_empty() { "none" } @else { ul { @for k in &unknown { li.key { strong { (k) } } } } } @if unknown_more > 0 { "and " (unknown_more) " more" } }
                @if !parked.is_empty() {
                    dt { "Parked items" }
                    dd { ul { @for p in &parked { li { (p["item"].as_str().unwrap_or_default()) ": " (p["reason"].as_str().unwrap_or_default()) } } } }
                }
                @if let Some(next) = text("next") { dt { "Proposed next action" } dd { (next) } }
            }
            details { summary { "The whole note" } (json_block(note)) }
        }
    }
}

/// The decisions that fit the run's status (the operator functions refuse the others anyway).
fn decisions(me: &Person, o: &Overview) -> Markup {
    let r = &o.run;
    let id = &r.run_id;
    let reason = html! { label { "Why " input type="text" name="reason" required placeholder="recorded with the decision"; } };
    let step = r
        .step
        .as_ref()
        .map(|s| s.as_str().to_owned())
        .unwrap_or_default();
    let form = |action: &str, label: &str, extra: Markup, danger: bool| {
        html! {
            form method="post" action={ "/runs/" (id) "/decide" } data-action=(action) {
                (csrf_field(me))
                input type="hidden" name="action" value=(action);
                input type="hidden" name="step" value=(step);
                (reason) (extra)
                button type="submit" class=(if danger { "danger" } else { "" }) { (label) }
            }
        }
    };
    let s = r.status;
    html! {
        div.decisions {
            @if s == RunStatus::NeedsReview {
                (form("resume", "Resume", html! { p.muted { "Runs the stopped step again from its checkpoint; journaled answers are replayed." } }, false))
                (form("resume_after_fix", "Resume after fix", html! {
                    label { input type="checkbox" name="ask_again" value="true"; " ask the model again (set the step's journaled answers aside)" }
                    p.muted { "Resets the step's attempts; continues on the run's version if this build carries it, else on the newest." }
                }, false))
            }
            // A run waiting for an event or a time is not waiting for a person: approve and
            // reject would be refused, so the page says what moves it on instead.
            @if let Some(w) = o.around.waits.last().filter(|w| s == RunStatus::Waiting && w.resolved_at.is_none()) {
                p.muted #moves-on { @match (&w.event_name, &w.match_key) {
                    (Some(name), Some(key)) => { "It goes on when event " (name) " with key " (key) " arrives (trailmark event send " (name) " --key " (key) "); it times out at " (time(w.until)) "." },
                    _ => { "It wakes by itself at " (time(w.until)) "." },
                } }
            } @else if s == RunStatus::Waiting {
                (form("approve", "Approve", html! {}, false))
                (form("reject", "Reject", html! {}, true))
            }
            @if s.accepts_steps() || matches!(s, RunStatus::NeedsReview | RunStatus::Waiting) {
                (form("cancel", "Cancel the run", html! {}, true))
            }
            @if !s.accepts_steps() && !r.shadow {
                form method="get" action={ "/runs/" (id) "/undo" } data-action="undo-preview" {
                    label { "Undo scope (JSON, empty: everything) " input type="text" name="scope" placeholder=r#"{"supplier": "SUP03"}"#; }
                    label { input type="checkbox" name="leave_partial" value="true"; " leave a stopped step's writes standing" }
                    button type="submit" { "Preview the undo" }
                }
            }
        }
    }
}

/// What the run waited for and waits for: each event or sleep with since and until, how it
/// ended, and the event it received.
fn waits_part(waits: &[crate::store::waits::WaitRow]) -> Markup {
    html! {
        @if !waits.is_empty() {
            h2 #waits { "Waits" }
            table {
                thead { tr {
                    th.num { "position" } th { "step" } th { "for" } th { "since" } th { "until" }
                    th { "ended" } th { "event received" }
                } }
                tbody { @for w in waits { tr {
                    td.num { (w.seq) } td { (w.step) }
                    td { @match (&w.event_name, &w.match_key) {
                        (Some(name), Some(key)) => { "event " (name) " (key " (key) ")" },
                        _ => { "a time (sleep)" },
                    } }
                    td { (time(w.since)) } td { (time(w.until)) }
                    td { @match (&w.resolved_at, &w.resolution) {
                        (None, _) => { strong { "waiting now" } },
                        (Some(at), how) => { (how.as_deref().unwrap_or("ended")) " · " (time(*at)) },
                    } }
                    td.key { @if let Some(id) = &w.event_id {
                        (id) ": " (w.payload.as_ref().map(|p| p.to_string().chars().take(200).collect::<String>()).unwrap_or_default())
                    } }
                } } }
            }
        }
    }
}

/// The part that moves: status, step, attempts and progress lines; polled while the run runs.
/// What the live part shows: the run's row, the attempt at its current position (read apart
/// from the page of steps shown, which may be an older page) and its progress lines.
struct Live<'a> {
    run: &'a RunRow,
    attempts: i32,
    progress: &'a [progress::Line],
}

impl<'a> Live<'a> {
    async fn read(
        pool: &sqlx::PgPool,
        run: &'a RunRow,
        progress: &'a [progress::Line],
    ) -> Result<Live<'a>, Shown> {
        let attempts = steps::attempts_at(pool, &run.run_id, run.step_seq).await?;
        Ok(Live {
            run,
            attempts,
            progress,
        })
    }
}

fn live_part(l: &Live) -> Markup {
    let (r, attempts) = (l.run, l.attempts);
    // A waiting run moves by itself too (an event, its timer, another person's decision).
    let moving = r.status.accepts_steps() || r.status == RunStatus::Waiting;
    let shown = l.progress.len().saturating_sub(PROGRESS_SHOWN);
    let lines = &l.progress[shown..];
    html! {
        section #live
            hx-get=[moving.then(|| format!("/runs/{}/live?was={}", r.run_id, r.status.as_str()))]
            hx-trigger=[moving.then_some("every 2s")]
            hx-swap=[moving.then_some("outerHTML")] {
            h2 { "Now" }
            p #live-status {
                (status(r.status))
                @if let Some(step) = &r.step { " step " (step) " (position " (r.step_seq) "), attempt " (attempts) }
                @if moving { span.muted { " · refreshes every 2 s" } }
            }
            @if lines.is_empty() { p.muted { "The run has said nothing about its progress." } }
            @else {
                ul #progress { @for l in lines { li { (time(l.at)) " · position " (l.seq) " · " (l.line) } } }
            }
        }
    }
}

fn steps_part(o: &Overview) -> Markup {
    let first = o.steps.first().map_or(0, |s| s.seq);
    let last = o.steps.last().map_or(-1, |s| s.seq);
    let id = &o.run.run_id;
    html! {
        h2 #steps { "Steps " (first) "–" (last) " of " (o.steps_total) }
        p.pager {
            @if first > 0 { a href={ "/runs/" (id) "?after=" ((first - PAGE as i32 - 1).max(-1)) "#steps" } { "← earlier" } }
            @if (last as i64) < o.steps_total - 1 { a href={ "/runs/" (id) "?after=" (last) "#steps" } { "later →" } }
            @if first > 0 || (last as i64) < o.steps_total - 1 { a href={ "/runs/" (id) "?after=-1#steps" } { "first" } a href={ "/runs/" (id) "#steps" } { "newest" } }
        }
        table {
            thead { tr { th.num { "position" } th { "step" } th.num { "attempts" } th { "started" } th { "finished" } th.num { "ms" } th { "next retry" } th { "last error" } } }
            tbody { @for s in &o.steps { tr {
                td.num { (s.seq) } td { (s.step) } td.num { (s.attempts) }
                td { (time(s.started_at)) } td { (maybe_time(s.finished_at)) }
                td.num { @if let Some(f) = s.finished_at { ((f - s.started_at).num_milliseconds()) } @else { "–" } }
                td { (maybe_time(s.retry_at)) }
                td { (one_line(s.last_error.as_deref().unwrap_or("–"), 100)) }
            } } }
        }
    }
}

/// `GET /runs/{id}/live` options.
#[derive(Debug, Deserialize)]
pub struct LiveQuery {
    /// The status the page was showing.
    was: Option<String>,
}

/// `GET /runs/{id}/live`: the moving part again; when the status changed, the whole page
/// reloads (its note and its decisions changed too).
pub async fn live(
    State(state): State<ConsoleState>,
    _me: Me,
    Path(run_id): Path<String>,
    Query(q): Query<LiveQuery>,
) -> Result<Response, Shown> {
    // Polled every 2 s by every open page of a moving or waiting run: three indexed reads, not the page's.
    let pool = &state.engine.pool;
    let Some(run) = runs::get(pool, &run_id).await? else {
        return Err(Shown::not_found(format!("run {run_id} not found")));
    };
    let progress = progress::list(pool, &run_id, 0).await?;
    let part = live_part(&Live::read(pool, &run, &progress).await?);
    if q.was.as_deref() != Some(run.status.as_str()) {
        return Ok(([("HX-Refresh", "true")], part).into_response());
    }
    Ok(part.into_response())
}

/// A decision's form.
#[derive(Debug, Deserialize)]
pub struct DecideForm {
    action: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    step: String,
    ask_again: Option<String>,
}

/// `POST /runs/{id}/decide`: resume, resume after a fix, cancel, approve, reject.
pub async fn decide(
    State(state): State<ConsoleState>,
    me: Me,
    Path(run_id): Path<String>,
    Form(f): Form<DecideForm>,
) -> Result<Response, Shown> {
    me.require(Role::Operator, "deciding about a run")?;
    if f.reason.trim().is_empty() {
        let why = "say why in the reason field: it is recorded with the decision".to_owned();
        return render(
            &state,
            &me,
            &run_id,
            None,
            Notice::Failed(why),
            StatusCode::BAD_REQUEST,
        )
        .await;
    }
    let engine = &state.engine;
    let who = me.decider(&f.reason);
    let ask_again = f.ask_again.is_some();
    let decided = match f.action.as_str() {
        "resume" => operator::resume(engine, &run_id, &who, Resume::Again).await,
        "resume_after_fix" => {
            let how = Resume::from_flags(true, ask_again).expect("after_fix is set");
            operator::resume(engine, &run_id, &who, how).await
        }
        "cancel" => operator::cancel(engine, &run_id, &who).await,
        "approve" => operator::approve(engine, &run_id, &f.step, &who).await,
        "reject" => operator::reject(engine, &run_id, &f.step, &who).await,
        other => {
            return Err(Shown::bad_request(format!(
                "no decision {other:?}: resume, resume_after_fix, cancel, approve or reject"
            )));
        }
    };
    finish(&state, &me, &run_id, decided).await
}

/// After a decision: back to the run with what was done, or the run with why not, in place.
async fn finish(
    state: &ConsoleState,
    me: &Person,
    run_id: &str,
    decided: operator::Result<Outcome>,
) -> Result<Response, Shown> {
    match decided {
        Ok(o) => {
            let done = format!(
                "{}: {} → {}; {}",
                o.action, o.status_before, o.status_after, o.next
            );
            let q = url::form_urlencoded::Serializer::new(String::new())
                .append_pair("done", &done)
                .finish();
            Ok(Redirect::to(&format!("/runs/{run_id}?{q}")).into_response())
        }
        Err(e) => {
            let code = refusal(&e);
            if code == StatusCode::NOT_FOUND {
                return Err(Shown::not_found(e.to_string()));
            }
            let why = crate::error::Report(&e).to_string();
            render(state, me, run_id, None, Notice::Failed(why), code).await
        }
    }
}

/// `GET /runs/{id}/undo` options.
#[derive(Debug, Deserialize)]
pub struct UndoQuery {
    #[serde(default)]
    scope: String,
    leave_partial: Option<String>,
}

fn undo_options(scope: &str, leave_partial: bool) -> Result<UndoOptions, String> {
    let scope: Value = match scope.trim() {
        "" => serde_json::json!({}),
        raw => serde_json::from_str(raw).map_err(|e| {
            format!("the scope is not JSON ({e}); write it like {{\"supplier\": \"SUP03\"}}")
        })?,
    };
    if !scope.is_object() {
        return Err("the scope must be a JSON object, like {\"supplier\": \"SUP03\"}".into());
    }
    Ok(UndoOptions {
        scope,
        leave_partial,
    })
}

/// `GET /runs/{id}/undo`: what an undo would write, exactly, and a form to confirm it.
pub async fn undo_preview(
    State(state): State<ConsoleState>,
    me: Me,
    Path(run_id): Path<String>,
    Query(q): Query<UndoQuery>,
) -> Result<Response, Shown> {
    me.require(Role::Operator, "undoing a run")?;
    let leave = q.leave_partial.is_some();
    let opts = match undo_options(&q.scope, leave) {
        Ok(o) => o,
        Err(why) => {
            return render(
                &state,
                &me,
                &run_id,
                None,
                Notice::Failed(why),
                StatusCode::BAD_REQUEST,
            )
            .await;
        }
    };
    let preview = match operator::undo_preview(&state.engine, &run_id, opts).await {
        Ok(p) => p,
        Err(e) => {
            let code = refusal(&e);
            let why = crate::error::Report(&e).to_string();
            return render(&state, &me, &run_id, None, Notice::Failed(why), code).await;
        }
    };
    let listed: usize = preview
        .compensations
        .iter()
        .map(|c| c.reversals.as_ref().map_or(0, Vec::len))
        .sum();
    let body = html! {
        p { "Run " a href={ "/runs/" (run_id) } { (run_id) } " is " (status(preview.status)) ". Scope: " code { (preview.scope) } }
        p { "The undo runs " (preview.compensations.len()) " compensations, newest first, writing these " (listed) " reversals:" }
        @for c in preview.compensations.iter().take(COMPENSATIONS_SHOWN) {
            @if c.children_first > 0 {
                p.children-first { "Then the " (c.children_first) " child runs started at position " (c.seq) " are undone, side by side; the run waits until every one is compensated before this compensation." }
            }
            h2 { (c.step) " (position " (c.seq) ")" }
            p.muted { (c.compensation) }
            @match (&c.reversals, &c.cannot_list) {
                (Some(list), _) => {
                    @if list.is_empty() { p { "Nothing in this scope." } }
                    @else {
                        table.reversals data-step=(c.step) {
                            thead { tr { th { "key" } th { "what" } } }
                            tbody { @for r in list.iter().take(REVERSALS_SHOWN) { tr { td.key.reversal { (r.key) } td { (r.what) } } } }
                        }
                        @if list.len() > REVERSALS_SHOWN { p.muted { "and " (list.len() - REVERSALS_SHOWN) " more (" (UNDO_PREVIEW_API) " lists every one)." } }
                    }
                }
                (None, Some(why)) => (error_box(&format!("its reversals cannot be listed, and the compensation would fail the same way: {why}"))),
                (None, None) => p { "It reverses the step's " (c.writes.len()) " recorded writes as its code decides (the workflow lists no reversals)." },
            }
        }
        @if preview.compensations.len() > COMPENSATIONS_SHOWN {
            p.muted { "and " (preview.compensations.len() - COMPENSATIONS_SHOWN) " older compensations (" (UNDO_PREVIEW_API) " lists every one)." }
        }
        @if !preview.left_standing.is_empty() {
            h2 { "Left standing" }
            p { "These writes of the step that stopped are not reversed; reverse them by hand:" }
            ul { @for k in &preview.left_standing { li.key { (k) } } }
        }
        form.box method="post" action={ "/runs/" (run_id) "/undo" } {
            (csrf_field(&me))
            input type="hidden" name="scope" value=(q.scope);
            @if leave { input type="hidden" name="leave_partial" value="true"; }
            input type="hidden" name="form_key" value=(uuid::Uuid::new_v4().to_string());
            label { "Why " input type="text" name="reason" required; }
            button.danger type="submit" { "Undo: write these reversals" }
        }
    };
    Ok(page(&format!("Undo run {run_id}?"), Some(&me), body).into_response())
}

/// The undo confirmation.
#[derive(Debug, Deserialize)]
pub struct UndoForm {
    #[serde(default)]
    scope: String,
    leave_partial: Option<String>,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    form_key: String,
}

/// `POST /runs/{id}/undo`: the confirmed undo (once, however often the form is sent).
pub async fn undo(
    State(state): State<ConsoleState>,
    me: Me,
    Path(run_id): Path<String>,
    Form(f): Form<UndoForm>,
) -> Result<Response, Shown> {
    me.require(Role::Operator, "undoing a run")?;
    let opts = undo_options(&f.scope, f.leave_partial.is_some()).map_err(Shown::bad_request)?;
    if f.reason.trim().is_empty() {
        return Err(Shown::bad_request(
            "say why in the reason field: it is recorded with the decision",
        ));
    }
    let fingerprint = format!("undo {run_id} {} {}", f.scope, f.leave_partial.is_some());
    let once = super::once::Once::take(&state, &f.form_key, &fingerprint).await?;
    if let Some(replay) = once.replay() {
        return Ok(replay);
    }
    let decided = operator::undo(&state.engine, &run_id, &me.decider(&f.reason), opts).await;
    let response = finish(&state, &me, &run_id, decided).await?;
    once.keep(&state, &response).await?;
    Ok(response)
}
