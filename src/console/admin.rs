//! Each workflow's recovery contract as a table, and the audit trail (admin).

use axum::extract::{Query, State};
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{page, time};
use super::session::Me;
use super::{ConsoleState, Shown};
use crate::config::tokens::Role;
use crate::store::audit;
use crate::workflow::contract;

/// `GET /workflows`: what each workflow promises when it crashes, step by step.
pub async fn workflows(State(state): State<ConsoleState>, me: Me) -> Markup {
    let registry = &state.engine.registry;
    let contracts: Vec<contract::Contract> = registry
        .names()
        .iter()
        .filter_map(|n| registry.get(n))
        .map(|w| contract::derive(&w))
        .collect();
    page(
        "Workflows",
        Some(&me),
        html! {
            @for c in &contracts {
                h2 id=(c.workflow) { (c.workflow) }
                p { "Unit of progress: " (c.unit_of_progress) }
                p.muted { (c.while_recovering) }
                @for w in &c.warnings { p.error { (w) } }
                table {
                    thead { tr { th { "step" } th { "kind" } th { "on a crash" } th { "key" } th { "undo" } th { "needs a person" } } }
                    tbody { @for s in &c.steps { tr {
                        td { (s.step) } td { (format!("{:?}", s.kind).to_lowercase()) } td { (s.on_crash) }
                        td.key { (s.key_recipe.as_deref().unwrap_or("–")) } td { (s.compensation) }
                        td { (s.needs_person.as_deref().unwrap_or("–")) }
                    } } }
                }
            }
        },
    )
}

/// `GET /audit` options.
#[derive(Debug, Deserialize)]
pub struct AuditQuery {
    target: Option<String>,
    before: Option<i64>,
}

/// Entries per page.
const PAGE: i64 = 100;

/// `GET /audit` (admin): who did what, when and why, newest first.
pub async fn audit(
    State(state): State<ConsoleState>,
    me: Me,
    Query(q): Query<AuditQuery>,
) -> Result<Markup, Shown> {
    me.require(Role::Admin, "the audit trail")?;
    let target = q.target.as_deref().filter(|t| !t.is_empty());
    let entries = audit::list(&state.engine.pool, target, q.before, PAGE).await?;
    let older = (entries.len() as i64 == PAGE)
        .then(|| entries.last().map(|e| e.id))
        .flatten();
    Ok(page(
        "Audit trail",
        Some(&me),
        html! {
            form method="get" action="/audit" {
                label { "target " input type="text" name="target" value=[target]; }
                button type="submit" { "Filter" }
            }
            table #audit {
                thead { tr { th { "when" } th { "who" } th { "via" } th { "what" } th { "on" } th { "status" } th { "why" } } }
                tbody { @for e in &entries { tr {
                    td { (time(e.at)) } td { (e.actor) " (" (e.role) ")" } td { (e.via) } td { (e.action) }
                    td.key { (e.target) }
                    td { @if let (Some(b), Some(a)) = (&e.status_before, &e.status_after) { (b) " → " (a) } }
                    td { (e.reason) }
                } } }
            }
            @if let Some(id) = older {
                p.pager { a href={ "/audit?before=" (id) @if let Some(t) = target { "&target=" (t) } } { "Older →" } }
            }
        },
    ))
}
