//! `trailmark limit`: a keyed workflow's concurrency and rate limits, changed at run time, and
//! the busiest keys.

use trailmark::config::Settings;
use trailmark::flow::limits::{self, Ask};
use trailmark::operator::Decider;
use trailmark::store::{self, flow};
use trailmark::workflow::Registry;

/// `limit` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum LimitCommand {
    /// Set a workflow's limits for one key (`--key`) or every key; they apply within seconds.
    Set {
        /// The workflow (it must declare a concurrency key).
        workflow: String,
        /// Only this key (default: every key of the workflow).
        #[arg(long)]
        key: Option<String>,
        /// Runs of a key holding a step at once.
        #[arg(long)]
        concurrency: Option<i64>,
        /// Runs of the whole workflow holding a step at once (without --key).
        #[arg(long)]
        total: Option<i64>,
        /// Step starts per second per key.
        #[arg(long)]
        rate: Option<f64>,
        /// Why, kept in the audit trail.
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Remove the limits set for a key (or every key): the declared ones apply again.
    Clear {
        /// The workflow.
        workflow: String,
        /// Only this key (default: the every-key row).
        #[arg(long)]
        key: Option<String>,
        /// Why, kept in the audit trail.
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// The limits in force (declared and set), and the busiest keys with their runs.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs a `limit` subcommand.
pub async fn run(
    settings: Settings,
    registry: Registry,
    command: LimitCommand,
) -> anyhow::Result<()> {
    let pool = store::connect(&settings.database).await?;
    match command {
        LimitCommand::Set {
            workflow,
            key,
            concurrency,
            total,
            rate,
            reason,
        } => {
            trailmark::api::input::check("--reason", &reason, trailmark::api::input::Kind::Reason)?;
            let ask = Ask {
                workflow: &workflow,
                key: key.as_deref(),
                concurrency,
                total,
                rate,
            };
            let who = Decider::cli(super::decide::default_actor(), reason);
            let row = limits::set(&pool, &registry, &ask, &who).await?;
            println!(
                "{} key {}: concurrency {}, total {}, rate {} (in force within {} ms)",
                row.workflow,
                if row.key.is_empty() { "*" } else { &row.key },
                shown(row.concurrency),
                shown(row.total),
                row.rate.map_or("as declared".into(), |r| format!("{r}/s")),
                settings.flow.poll_ms
            );
        }
        LimitCommand::Clear {
            workflow,
            key,
            reason,
        } => {
            let who = Decider::cli(super::decide::default_actor(), reason);
            let cleared = limits::clear(&pool, &workflow, key.as_deref(), &who).await?;
            let which = key.as_deref().unwrap_or("*");
            match cleared {
                true => println!(
                    "{workflow} key {which}: limits set at run time removed; the declared ones apply"
                ),
                false => println!("{workflow} key {which}: no limit was set; nothing changed"),
            }
        }
        LimitCommand::List { json } => list(&pool, &registry, json).await?,
    }
    Ok(())
}

fn shown(n: Option<i32>) -> String {
    n.map_or("as declared".into(), |n| n.to_string())
}

async fn list(pool: &sqlx::PgPool, registry: &Registry, json: bool) -> anyhow::Result<()> {
    let limits = limits::list(pool, registry).await?;
    let busiest = flow::busiest(pool, 20).await?;
    if json {
        let all = serde_json::json!({ "limits": limits, "busiest_keys": busiest });
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    let mut t = super::table::new(
        &[
            "workflow",
            "key",
            "concurrency",
            "total",
            "rate/s",
            "source",
        ],
        &["concurrency", "total", "rate/s"],
    );
    for l in &limits {
        let n = |v: Option<i64>| v.map_or("-".into(), |v| v.to_string());
        t.add_row(vec![
            l.workflow.clone(),
            l.key.clone(),
            n(l.concurrency),
            n(l.total),
            l.rate.map_or("-".into(), |r| r.to_string()),
            l.source.clone(),
        ]);
    }
    super::table::print(&t);
    println!();
    if busiest.is_empty() {
        println!("no run holds or waits for a slot");
        return Ok(());
    }
    let mut t = super::table::new(
        &["workflow", "key", "running", "waiting", "throttled"],
        &["running", "waiting", "throttled"],
    );
    for k in &busiest {
        t.add_row(vec![
            k.workflow.clone(),
            k.key.clone(),
            k.running.to_string(),
            k.waiting.to_string(),
            k.throttled.to_string(),
        ]);
    }
    super::table::print(&t);
    Ok(())
}
