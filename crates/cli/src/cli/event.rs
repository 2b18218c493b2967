//! `trailmark event send | list`: events sent to waiting runs (a supplier's reply, a webhook,
//! a signed document), and the events trailmark keeps for waits that have not come yet.

use anyhow::Context;
use clap::Subcommand;

use trailmark::config::Settings;
use trailmark::domain::InboundEvent;
use trailmark::engine::Engine;
use trailmark::operator::Decider;
use trailmark::store::{self, waits};
use trailmark::wait::{self, EventSent};
use trailmark::workflow::Registry;

/// The `event` subcommands.
#[derive(Debug, Subcommand)]
pub enum EventCommand {
    /// Send an event to the runs that wait for its name and key; one no run waits for yet is
    /// kept for the first wait that comes. The same --id again is the same event.
    Send(SendArgs),
    /// List events, newest first: pending (kept for a wait), consumed, expired.
    List {
        /// Only `pending`, `consumed` or `expired` events.
        #[arg(long, value_parser = ["pending", "consumed", "expired"])]
        state: Option<String>,
        /// Only events of this name.
        #[arg(long)]
        name: Option<String>,
        /// Only events with this match key.
        #[arg(long)]
        key: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `event send` options.
#[derive(Debug, clap::Args)]
pub struct SendArgs {
    /// The event's name (e.g. supplier.reply): waits name the events they take.
    pub name: String,
    /// Its match key: a run's id, unless the run's wait names another key.
    #[arg(long)]
    pub key: String,
    /// Its id: the same id sent again is the same event (nothing more happens), with another
    /// payload it is refused. Without one, a fresh id is made and printed.
    #[arg(long)]
    pub id: Option<String>,
    /// The payload the resumed step reads: JSON, `@FILE`, or `-` for standard input ({} when
    /// absent).
    #[arg(long)]
    pub payload: Option<String>,
    /// Why, for the audit trail (optional).
    #[arg(long)]
    pub reason: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs an `event` subcommand.
pub async fn dispatch(
    settings: Settings,
    registry: Registry,
    command: EventCommand,
) -> anyhow::Result<()> {
    match command {
        EventCommand::Send(args) => send(settings, registry, args).await,
        EventCommand::List {
            state,
            name,
            key,
            limit,
            json,
        } => {
            let filter = waits::SignalFilter { state, name, key };
            list(&settings, &filter, limit, json).await
        }
    }
}

/// Checks the event where it enters (each field, its size), then records it and moves on the
/// runs that wait for it, in one transaction.
async fn send(settings: Settings, registry: Registry, args: SendArgs) -> anyhow::Result<()> {
    if let Some(reason) = &args.reason {
        trailmark::api::input::check("--reason", reason, trailmark::api::input::Kind::Reason)?;
    }
    let payload = super::run::read_json("--payload", args.payload.as_deref())?;
    let limit = settings.worker.max_message_bytes;
    let event = InboundEvent::new(&args.name, &args.key, args.id.as_deref(), payload, limit)
        .map_err(|e| anyhow::anyhow!("{e}; nothing was sent"))?;
    let engine = Engine::new(settings, registry).await?;
    let who = Decider::cli(
        super::decide::default_actor(),
        args.reason.unwrap_or_default(),
    );
    let sent = wait::send(&engine, event, wait::Sender::Audited(&who))
        .await
        .with_context(|| format!("event {} (key {})", args.name, args.key))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&sent)?);
    } else {
        println!("{}", said(&sent));
    }
    Ok(())
}

/// What became of an event, in one line.
fn said(s: &EventSent) -> String {
    let what = format!("event {} ({}, key {})", s.id, s.name, s.key);
    match s.outcome.as_str() {
        "resumed" => format!(
            "{what} resumed {} run(s): {}",
            s.resumed.len(),
            s.resumed.join(", ")
        ),
        "kept" => format!(
            "{what}: no run waits for it yet; kept until {} for the first wait for {} with key {}",
            s.kept_until.map(|t| t.to_string()).unwrap_or_default(),
            s.name,
            s.key
        ),
        _ => format!(
            "{what} was received before (now {}); nothing more happened",
            s.first.as_deref().unwrap_or("-")
        ),
    }
}

/// `event list`.
async fn list(
    settings: &Settings,
    filter: &waits::SignalFilter,
    limit: i64,
    as_json: bool,
) -> anyhow::Result<()> {
    let pool = store::connect(&settings.database).await?;
    let rows = waits::signals(&pool, filter, limit).await?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("no events");
        return Ok(());
    }
    let mut table = super::table::new(
        &["id", "name", "key", "state", "runs", "received", "until"],
        &["runs"],
    );
    for r in &rows {
        table.add_row(vec![
            r.signal_id.clone(),
            r.name.clone(),
            r.key.clone(),
            r.state().to_owned(),
            r.resumed.to_string(),
            r.received_at.format("%Y-%m-%d %H:%M:%S").to_string(),
            r.expires_at.format("%Y-%m-%d %H:%M:%S").to_string(),
        ]);
    }
    super::table::print(&table);
    Ok(())
}
