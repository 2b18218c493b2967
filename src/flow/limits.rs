//! Changing a workflow's limits at run time (`trailmark limit set`, `PUT /api/v1/limits/...`):
//! checked against what the workflow declares, recorded with who and why, in force for the next
//! claim of the key (a raised limit hands its new slots within `flow.poll_ms`).

use serde_json::json;

use super::MAX_KEY_LEN;
use crate::operator::Decider;
use crate::store::flow::{self as rows, LimitChange, LimitRow};
use crate::store::{self, audit};
use crate::workflow::Registry;

/// The fastest rate a key may be given: past it, a rate limits nothing a worker can reach.
pub const MAX_RATE: f64 = 100_000.0;
/// The slowest: below one start a day, a run would wait longer than any lease or timeout means.
pub const MIN_RATE: f64 = 1.0 / 86_400.0;

/// Why a limit change was refused, naming the field.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// No such workflow here, or it declares no key.
    #[error("{0}")]
    Workflow(String),
    /// A value out of range.
    #[error("{field}: {why}")]
    Field {
        /// The field (`concurrency`, `total`, `rate`, `key`).
        field: &'static str,
        /// What is wrong and what would do.
        why: String,
    },
    /// The database failed; nothing was changed.
    #[error("the limit was not changed")]
    Store(#[from] store::Error),
}

impl From<sqlx::Error> for LimitError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e.into())
    }
}

/// A change asked for: for one key, or every key of the workflow.
#[derive(Debug, Clone)]
pub struct Ask<'a> {
    /// The workflow.
    pub workflow: &'a str,
    /// One key (`None`: every key).
    pub key: Option<&'a str>,
    /// Runs of a key holding a step at once.
    pub concurrency: Option<i64>,
    /// Runs of the workflow holding a step at once (every key only).
    pub total: Option<i64>,
    /// Step starts per second per key.
    pub rate: Option<f64>,
}

fn field(field: &'static str, why: impl Into<String>) -> LimitError {
    LimitError::Field { field, why: why.into() }
}

fn count(name: &'static str, n: Option<i64>) -> Result<Option<i32>, LimitError> {
    match n {
        None => Ok(None),
        Some(n) if (1..=i64::from(i32::MAX)).contains(&n) => Ok(Some(n as i32)),
        Some(n) => Err(field(name, format!("{n} is not a limit: give 1 or more (to stop a workflow's runs, pause their starts)"))),
    }
}

/// The change checked: the workflow declares a key, every value is in range, something changes.
pub fn check(registry: &Registry, ask: &Ask<'_>) -> Result<LimitChange, LimitError> {
    let Some(workflow) = registry.get(ask.workflow) else {
        return Err(LimitError::Workflow(format!(
            "no workflow {} is deployed here (known: {}); name one of those",
            ask.workflow,
            registry.names().join(", ")
        )));
    };
    if workflow.flow.concurrency.is_none() {
        return Err(LimitError::Workflow(format!(
            "workflow {} declares no concurrency key, so its runs cannot be limited per key; declare one with Workflow::concurrency",
            ask.workflow
        )));
    }
    if let Some(key) = ask.key
        && (key.is_empty() || key.len() > MAX_KEY_LEN || key.chars().any(char::is_control))
    {
        return Err(field("key", format!("a key is 1 to {MAX_KEY_LEN} bytes of printable text")));
    }
    if ask.key.is_some() && ask.total.is_some() {
        return Err(field("total", "a total limit is the whole workflow's: set it without a key"));
    }
    let rate = match ask.rate {
        Some(r) if !(MIN_RATE..=MAX_RATE).contains(&r) => {
            return Err(field("rate", format!("{r} step starts a second cannot be met: give one from {MIN_RATE:.6} (one a day) to {MAX_RATE}")));
        }
        r => r,
    };
    let change = LimitChange {
        concurrency: count("concurrency", ask.concurrency)?,
        total: count("total", ask.total)?,
        rate,
    };
    if change.concurrency.is_none() && change.total.is_none() && change.rate.is_none() {
        return Err(field("concurrency", "nothing to change: give --concurrency, --total or --rate"));
    }
    Ok(change)
}

/// Sets the limits asked for and records it in the audit trail, in one transaction.
pub async fn set(pool: &sqlx::PgPool, registry: &Registry, ask: &Ask<'_>, who: &Decider) -> Result<LimitRow, LimitError> {
    let change = check(registry, ask)?;
    let key = ask.key.unwrap_or("");
    let mut tx = pool.begin().await?;
    let row = rows::set_limit(&mut *tx, (ask.workflow, key), &change, &who.actor).await?;
    let target = format!("{}/{}", ask.workflow, ask.key.unwrap_or("*"));
    let details = json!({ "concurrency": row.concurrency, "total": row.total, "rate": row.rate });
    audit::insert(&mut *tx, &who.audit_entry("limit.set", &target, &details)).await?;
    tx.commit().await?;
    Ok(row)
}

/// Removes the limits set for a key (or every key), so the declared ones apply again.
pub async fn clear(pool: &sqlx::PgPool, workflow: &str, key: Option<&str>, who: &Decider) -> Result<bool, LimitError> {
    let mut tx = pool.begin().await?;
    let cleared = rows::clear_limit(&mut *tx, (workflow, key.unwrap_or(""))).await?;
    let target = format!("{workflow}/{}", key.unwrap_or("*"));
    audit::insert(&mut *tx, &who.audit_entry("limit.clear", &target, &json!({ "cleared": cleared }))).await?;
    tx.commit().await?;
    Ok(cleared)
}

/// One line of `trailmark limit list`: a workflow's limits for a key, as declared or as set.
#[derive(Debug, Clone, serde::Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Listed {
    /// The workflow.
    pub workflow: String,
    /// The key (`*`: every key).
    pub key: String,
    /// Runs of a key holding a step at once.
    pub concurrency: Option<i64>,
    /// Runs of the workflow holding a step at once.
    pub total: Option<i64>,
    /// Step starts per second per key.
    pub rate: Option<f64>,
    /// `declared` (in the workflow's code) or who set it.
    pub source: String,
}

/// Every keyed workflow's declared limits, and every limit set at run time.
pub async fn list(pool: &sqlx::PgPool, registry: &Registry) -> Result<Vec<Listed>, LimitError> {
    let mut out = Vec::new();
    for name in registry.names() {
        let Some(c) = registry.get(&name).and_then(|w| w.flow.concurrency.clone()) else {
            continue;
        };
        out.push(Listed {
            workflow: name,
            key: format!("* (declared, key field {})", c.key.name()),
            concurrency: Some(i64::from(c.per_key)),
            total: c.total.map(i64::from),
            rate: None,
            source: "declared".into(),
        });
    }
    for r in rows::limits(pool).await? {
        out.push(Listed {
            key: if r.key.is_empty() { "*".into() } else { r.key },
            workflow: r.workflow,
            concurrency: r.concurrency.map(i64::from),
            total: r.total.map(i64::from),
            rate: r.rate,
            source: format!("set by {} at {}", r.set_by, r.set_at.format("%Y-%m-%d %H:%M:%S UTC")),
        });
    }
    Ok(out)
}
