//! `trailmark prune` and `trailmark run export`: what retention removes, by hand, and one run's
//! whole record in the archive's format.

use std::time::Duration;

use anyhow::Context;

use trailmark::config::Settings;
use trailmark::engine::Engine;
use trailmark::retention::{self, Policy, Pruned};
use trailmark::store::{self, retention as sql};
use trailmark::workflow::Registry;

/// `prune` options.
#[derive(Debug, clap::Args)]
pub struct PruneArgs {
    /// Print what would be removed (at most a batch of runs per workflow listed), remove
    /// nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Remove every workflow's finished runs older than this (e.g. `30d`, `12h`) instead of
    /// the configured keep times.
    #[arg(long, value_parser = older_than)]
    pub older_than: Option<Duration>,
    /// Spend this share of the time removing (percent, 1-100; after a batch that took t, rest
    /// t x (100 - duty) / duty) instead of `retention.duty_percent`; 100 removes as fast as
    /// Postgres allows, for a maintenance window.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub duty: Option<u32>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

fn older_than(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text.trim())
        .map_err(|e| format!("{e}; give a duration such as 30d, 12h or 90m"))?;
    if d < Duration::from_secs(1) {
        return Err("it must be at least 1s".into());
    }
    Ok(d)
}

/// Runs one prune pass, printing progress on stderr and what was removed.
pub async fn prune(settings: Settings, registry: Registry, args: PruneArgs) -> anyhow::Result<()> {
    let mut policy = Policy::from_settings(&settings.retention);
    if let Some(d) = args.older_than {
        policy = policy.older_than(d);
    } else if !policy.removes_runs() {
        eprintln!(
            "retention.keep_secs and retention.workflows keep every finished run; only tombstones, inbox ids and audit rows age out (give --older-than to remove runs by hand)"
        );
    }
    if let Some(duty) = args.duty {
        policy = policy.duty(duty);
    }
    let engine = Engine::new(settings, registry).await?;
    // Called after each batch and every second of the rests between them: say only what moved.
    let mut shown: i64 = 0;
    let done = retention::prune(&engine, &policy, args.dry_run, |so_far| {
        if !so_far.dry_run && so_far.removed.runs > shown {
            shown = so_far.removed.runs;
            eprintln!("… {shown} runs removed so far");
        }
    })
    .await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&done)?);
    } else {
        print!("{}", said(&done));
    }
    Ok(())
}

/// What a pass did, for a person.
fn said(p: &Pruned) -> String {
    let verb = if p.dry_run { "would remove" } else { "removed" };
    let mut out = String::new();
    for id in &p.run_ids {
        out.push_str(&format!("{verb} run {id}\n"));
    }
    if p.dry_run {
        out.push_str(&format!(
            "{} finished runs due (at most a batch per workflow listed)\n",
            p.run_ids.len()
        ));
    } else {
        let r = &p.removed;
        out.push_str(&format!(
            "{} runs removed ({} archived), with {} step rows, {} journal entries, {} outside-write records, {} other rows\n",
            r.runs, p.archived, r.steps, r.journal, r.effects, r.other
        ));
    }
    for (what, n) in &p.aged {
        out.push_str(&format!(
            "{what}: {n} aged out{}\n",
            if p.dry_run { " (would be)" } else { "" }
        ));
    }
    out
}

/// `run export ID`: the run's whole record as JSON, on stdout or in `output`.
pub async fn export(
    settings: &Settings,
    run_id: &str,
    output: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let pool = store::connect(&settings.database).await?;
    let docs = sql::export(&pool, &[run_id.to_owned()])
        .await
        .with_context(|| format!("run {run_id} could not be exported"))?;
    if let Some((_, doc)) = docs.into_iter().next() {
        return super::replay::write_json(&doc, output);
    }
    anyhow::bail!("{}", super::run::not_found(settings, run_id).await)
}
