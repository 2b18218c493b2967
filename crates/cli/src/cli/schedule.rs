//! `trailmark schedule create | list | show | pause | resume | trigger | backfill | delete`.

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::{ArgGroup, Subcommand};

use trailmark::config::Settings;
use trailmark::engine::Engine;
use trailmark::schedule::ops;
use trailmark::workflow::Registry;

use super::dlq::Audited;

/// The `schedule` subcommands.
#[derive(Debug, Subcommand)]
pub enum ScheduleCommand {
    /// Create a schedule: each tick starts one run `<NAME>:<tick>` of the workflow.
    #[command(group(ArgGroup::new("cadence").required(true).args(["cron", "every"])))]
    Create {
        /// Its name: 1 to 64 letters, digits, '.', '_' or '-'.
        name: String,
        /// The workflow each tick starts.
        #[arg(long)]
        workflow: String,
        /// A cron expression (five fields, or six with seconds), e.g. "0 2 * * *".
        #[arg(long)]
        cron: Option<String>,
        /// The cron expression's IANA time zone (default UTC).
        #[arg(long, requires = "cron")]
        tz: Option<String>,
        /// A fixed interval: 30s, 15m, 2h, 1d (ticks on its multiples since the epoch).
        #[arg(long)]
        every: Option<String>,
        /// The runs' input, a JSON object: inline, @file or - for stdin.
        #[arg(long, default_value = "{}")]
        input: String,
        /// While the previous run is unfinished: skip the tick, buffer-one (start it when the run
        /// ends), or allow (start anyway).
        #[arg(long, default_value = "skip")]
        overlap: String,
        /// Ticks missed while no scheduler ran are still started if within this window.
        #[arg(long, default_value = "1m")]
        catch_up: String,
        /// Who does it, and why: recorded in the audit trail.
        #[command(flatten)]
        who: Audited,
    },
    /// Every schedule: cadence, next tick, paused, runs started and ticks skipped.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// One schedule: its settings, its next ticks and its newest runs.
    Show {
        /// The schedule.
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Pause: no tick starts anything until it is resumed.
    Pause {
        /// The schedule.
        name: String,
        /// Who does it, and why.
        #[command(flatten)]
        who: Audited,
    },
    /// Resume from the next tick after now (ticks while paused are not made up).
    Resume {
        /// The schedule.
        name: String,
        /// Who does it, and why.
        #[command(flatten)]
        who: Audited,
    },
    /// Start one run now, whatever the overlap policy.
    Trigger {
        /// The schedule.
        name: String,
        /// Who does it, and why.
        #[command(flatten)]
        who: Audited,
    },
    /// Start the run of every past tick in a range that has none (run twice, it starts none).
    Backfill {
        /// The schedule.
        name: String,
        /// First tick time (RFC 3339, e.g. 2026-12-01T00:00:00Z).
        #[arg(long)]
        from: String,
        /// Last tick time, not in the future.
        #[arg(long)]
        to: String,
        /// Who does it, and why.
        #[command(flatten)]
        who: Audited,
    },
    /// Delete the schedule; the runs it started stay.
    Delete {
        /// The schedule.
        name: String,
        /// Who does it, and why.
        #[command(flatten)]
        who: Audited,
    },
}

/// Runs one `schedule` subcommand.
pub async fn run(
    settings: Settings,
    registry: Registry,
    command: ScheduleCommand,
) -> anyhow::Result<()> {
    let engine = Engine::new(settings, registry).await?;
    match command {
        ScheduleCommand::Create {
            name,
            workflow,
            cron,
            tz,
            every,
            input,
            overlap,
            catch_up,
            who,
        } => {
            let input = super::run::read_input(Some(&input))?;
            let create = ops::Create::new(name, workflow, input, cron, tz, every)?
                .overlap(&overlap)?
                .catch_up(&catch_up)?;
            let (row, _) = ops::create(&engine, &create, &who.checked()?).await?;
            println!(
                "schedule {} starts {} {}; next tick {}",
                row.name,
                row.workflow,
                cadence_text(&row),
                row.next_tick
            );
        }
        ScheduleCommand::List { json } => list(&engine, json).await?,
        ScheduleCommand::Show { name, json } => show(&engine, &name, json).await?,
        ScheduleCommand::Pause { name, who } => {
            let row = ops::set_paused(&engine, &name, true, &who.checked()?).await?;
            println!(
                "schedule {} is paused; nothing starts until `trailmark schedule resume {}`",
                row.name, row.name
            );
        }
        ScheduleCommand::Resume { name, who } => {
            let row = ops::set_paused(&engine, &name, false, &who.checked()?).await?;
            println!("schedule {} resumed; next tick {}", row.name, row.next_tick);
        }
        ScheduleCommand::Trigger { name, who } => {
            let done = ops::trigger(&engine, &name, &who.checked()?).await?;
            print_started(&done);
        }
        ScheduleCommand::Backfill {
            name,
            from,
            to,
            who,
        } => {
            let (from, to) = (time("--from", &from)?, time("--to", &to)?);
            let done = ops::backfill(&engine, &name, from, to, &who.checked()?).await?;
            print_started(&done);
        }
        ScheduleCommand::Delete { name, who } => {
            ops::delete(&engine, &name, &who.checked()?).await?;
            println!("schedule {name} deleted; the runs it started stay");
        }
    }
    Ok(())
}

async fn list(engine: &Engine, json: bool) -> anyhow::Result<()> {
    let rows = ops::list(engine).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("no schedules; create one with `trailmark schedule create`");
        return Ok(());
    }
    let mut table = super::table::new(
        &[
            "name",
            "workflow",
            "cadence",
            "overlap",
            "next tick",
            "state",
            "started",
            "skipped",
        ],
        &["started", "skipped"],
    );
    for r in rows {
        let state = if r.paused { "paused" } else { "active" };
        table.add_row(vec![
            r.name.clone(),
            r.workflow.clone(),
            cadence_text(&r),
            r.overlap.clone(),
            r.next_tick.to_rfc3339(),
            state.to_owned(),
            r.started.to_string(),
            r.skipped.to_string(),
        ]);
    }
    super::table::print(&table);
    Ok(())
}

async fn show(engine: &Engine, name: &str, json: bool) -> anyhow::Result<()> {
    let shown = ops::show(engine, name).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&shown)?);
        return Ok(());
    }
    let r = &shown.schedule;
    println!(
        "schedule {}  workflow {}  {}",
        r.name,
        r.workflow,
        cadence_text(r)
    );
    println!(
        "overlap {}  catch-up {} s  {}  started {}  skipped {}",
        r.overlap,
        r.catch_up_secs,
        if r.paused { "paused" } else { "active" },
        r.started,
        r.skipped
    );
    println!("input {}", r.input);
    for t in &shown.upcoming {
        println!("next  {}", t.to_rfc3339());
    }
    for run in &shown.recent_runs {
        println!("run   {}  {}", run.run_id, run.status);
    }
    Ok(())
}

fn print_started(done: &ops::Started) {
    for id in &done.started {
        println!("started {id}");
    }
    println!(
        "{} runs started, {} existed already",
        done.started.len(),
        done.existed.len()
    );
}

fn cadence_text(r: &trailmark::store::schedules::ScheduleRow) -> String {
    match (&r.cron, r.every_secs) {
        (Some(cron), _) => format!("cron \"{cron}\" {}", r.tz.as_deref().unwrap_or("UTC")),
        (None, Some(secs)) => format!("every {secs} s"),
        _ => "-".into(),
    }
}

fn time(flag: &str, text: &str) -> anyhow::Result<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.to_utc())
        .with_context(|| {
            format!("{flag} {text:?} is not an RFC 3339 time such as 2026-12-01T00:00:00Z")
        })
}
