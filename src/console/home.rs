//! The home page (what needs a person, first) and the list of runs.

use std::collections::BTreeMap;

use axum::extract::{Query, State};
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{error_box, maybe_time, one_line, page, status, time};
use super::session::Me;
use super::{ConsoleState, Shown};
use crate::dlq::Dlq;
use crate::domain::RunStatus;
use crate::store::runs::{self, Filter, Summary};

/// Runs listed per section and per page.
const LISTED: i64 = 50;
/// The busiest concurrency keys the home page lists.
const BUSIEST_KEYS: i64 = 10;
/// Up to this many dead letters the home page groups them by reason (a listing reads every one).
const HOME_GROUPS_UP_TO: u32 = 2_000;

/// `GET /`: runs needing review (with why), retrying or stuck runs, counts, dead letters.
pub async fn home(State(state): State<ConsoleState>, me: Me) -> Result<Markup, Shown> {
    let pool = &state.engine.pool;
    let review = Filter {
        status: Some(RunStatus::NeedsReview),
        ..Filter::default()
    };
    let stuck = Filter {
        stuck: true,
        ..Filter::default()
    };
    let review = runs::page(pool, &review, LISTED).await?;
    let stuck = runs::page(pool, &stuck, LISTED).await?;
    let counts = runs::counts(pool).await?;
    let keys = crate::store::flow::busiest(pool, BUSIEST_KEYS).await?;
    let letters = letters_by_reason(&state).await;
    Ok(page(
        "What needs a person",
        Some(&me),
        html! {
            h2 #review { "Needs review (" (review.len()) ")" }
            @if review.is_empty() { p.muted { "No run waits for a decision." } }
            @else {
                table {
                    thead { tr { th { "run" } th { "workflow" } th { "stopped at" } th { "why" } th { "since" } } }
                    tbody {
                        @for r in &review {
                            tr {
                                td { a.run href={ "/runs/" (r.run_id) } { (r.run_id) } }
                                td { (r.workflow) }
                                td { (step_of(r)) }
                                td { (one_line(r.error.as_deref().unwrap_or(""), 160)) }
                                td { (time(r.updated_at)) }
                            }
                        }
                    }
                }
            }
            h2 #stuck { "Retrying or stuck (" (stuck.len()) ")" }
            @if stuck.is_empty() { p.muted { "No run is retrying or stuck." } }
            @else { (stuck_table(&stuck)) }
            h2 { "Runs by status" }
            (counts_view(&counts))
            @if !keys.is_empty() {
                h2 #keys { "Busiest concurrency keys" }
                (keys_table(&keys))
            }
            h2 { "Dead letters" }
            (letters)
        },
    ))
}

fn step_of(r: &Summary) -> String {
    match &r.step {
        Some(step) => format!("{step} (position {})", r.step_seq),
        None => "–".into(),
    }
}

fn stuck_table(stuck: &[Summary]) -> Markup {
    html! {
        table {
            thead { tr { th { "run" } th { "status" } th { "step" } th.num { "attempt" } th { "next retry" } th { "last error" } th { "lease until" } } }
            tbody {
                @for r in stuck {
                    tr {
                        td { a href={ "/runs/" (r.run_id) } { (r.run_id) } }
                        td { (status(r.status)) }
                        td { (step_of(r)) }
                        td.num { (r.attempts) }
                        td { (maybe_time(r.retry_at)) }
                        td { (one_line(r.last_error.as_deref().unwrap_or("–"), 120)) }
                        td { (maybe_time(r.lease_expires_at)) }
                    }
                }
            }
        }
    }
}

/// The keys with the most runs waiting or running (`trailmark limit list` shows the same).
fn keys_table(keys: &[crate::store::flow::KeyLoad]) -> Markup {
    html! {
        table {
            thead { tr { th { "workflow" } th { "key" } th.num { "running" } th.num { "waiting" } th.num { "throttled" } } }
            tbody {
                @for k in keys {
                    tr {
                        td { (k.workflow) } td { (k.key) } td.num { (k.running) }
                        td.num { (k.waiting) } td.num { (k.throttled) }
                    }
                }
            }
        }
    }
}

fn counts_view(counts: &[runs::Count]) -> Markup {
    let mut by_status: BTreeMap<&str, i64> = BTreeMap::new();
    for c in counts {
        *by_status.entry(c.status.as_str()).or_default() += c.runs;
    }
    html! {
        div.counts {
            @for (s, n) in &by_status {
                div { a href={ "/runs?status=" (s) } { (s) } ": " strong { (n) } }
            }
        }
        @if !counts.is_empty() {
            table {
                thead { tr { th { "workflow" } th { "status" } th.num { "runs" } } }
                tbody {
                    @for c in counts {
                        tr { td { (c.workflow) } td { (status(c.status)) } td.num { (c.runs) } }
                    }
                }
            }
        }
    }
}

/// The DLQ's letters by reason, or why they cannot be read now (the page still shows).
async fn letters_by_reason(state: &ConsoleState) -> Markup {
    let listing = match Dlq::connect(&state.engine.settings.broker).await {
        Ok(dlq) => {
            let listing = dlq.grouped(HOME_GROUPS_UP_TO).await;
            dlq.close().await;
            listing.map_err(super::Shown::from)
        }
        Err(e) => Err(super::Shown::from(e)),
    };
    let listing = match listing {
        Ok(l) => l,
        Err(e) => return error_box(&e.message),
    };
    html! {
        @if listing.depth == 0 { p.muted { (listing.queue) " is empty." } }
        @else {
            p { a href="/dead-letters" { (listing.depth) " in " (listing.queue) } }
            ul { @for (reason, n) in &listing.by_reason { li { code { (reason) } ": " (n) } } }
        }
    }
}

/// `GET /runs` filters.
#[derive(Debug, Deserialize)]
pub struct RunsQuery {
    status: Option<String>,
    workflow: Option<String>,
    #[serde(default)]
    stuck: bool,
    cursor: Option<String>,
}

/// `GET /runs`: every run, newest first, a page at a time.
pub async fn runs(
    State(state): State<ConsoleState>,
    me: Me,
    Query(q): Query<RunsQuery>,
) -> Result<Markup, Shown> {
    let wanted = match q.status.as_deref().filter(|s| !s.is_empty()) {
        Some(s) => Some(
            s.parse::<RunStatus>()
                .map_err(|e| Shown::bad_request(e.to_string()))?,
        ),
        None => None,
    };
    let after = match q.cursor.as_deref() {
        Some(c) => Some(
            runs::parse_cursor(c)
                .ok_or_else(|| Shown::bad_request("that page link is not one the console made"))?,
        ),
        None => None,
    };
    let filter = Filter {
        status: wanted,
        workflow: q.workflow.clone().filter(|w| !w.is_empty()),
        stuck: q.stuck,
        after,
        ..Filter::default()
    };
    let listed = runs::page(&state.engine.pool, &filter, LISTED).await?;
    let next = (listed.len() as i64 == LISTED)
        .then(|| listed.last().map(Summary::cursor))
        .flatten();
    let keep = |cursor: &str| {
        let mut q2 = url::form_urlencoded::Serializer::new(String::new());
        if let Some(s) = wanted {
            q2.append_pair("status", s.as_str());
        }
        if let Some(w) = &filter.workflow {
            q2.append_pair("workflow", w);
        }
        if filter.stuck {
            q2.append_pair("stuck", "true");
        }
        q2.append_pair("cursor", cursor);
        q2.finish()
    };
    Ok(page(
        "Runs",
        Some(&me),
        html! {
            form method="get" action="/runs" {
                label { "status " input type="text" name="status" value=[wanted.map(|s| s.as_str())]; }
                label { "workflow " input type="text" name="workflow" value=[filter.workflow.as_deref()]; }
                label { input type="checkbox" name="stuck" value="true" checked[filter.stuck]; " retrying or stuck only" }
                button type="submit" { "Filter" }
            }
            @if listed.is_empty() { p.muted { "No run matches." } }
            @else {
                table {
                    thead { tr { th { "run" } th { "workflow" } th { "status" } th { "step" } th.num { "attempt" } th { "created" } th { "changed" } } }
                    tbody {
                        @for r in &listed {
                            tr {
                                td { a href={ "/runs/" (r.run_id) } { (r.run_id) } }
                                td { (r.workflow) " v" (r.workflow_version) }
                                td { (status(r.status)) }
                                td { (step_of(r)) }
                                td.num { (r.attempts) }
                                td { (time(r.created_at)) }
                                td { (time(r.updated_at)) }
                            }
                        }
                    }
                }
            }
            @if let Some(c) = next { p.pager { a href={ "/runs?" (keep(&c)) } { "Older runs →" } } }
        },
    ))
}
