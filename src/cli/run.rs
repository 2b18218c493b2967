//! `trailmark run start | show | list`.

use anyhow::{Context, bail};
use serde::Serialize;
use serde_json::{Value, json};

use crate::broker;
use crate::config::Settings;
use crate::domain::{RunId, RunStartEvent, RunStatus};
use crate::store::{self, decisions, effects, journal, parked, runs, steps};
use crate::workflow::Registry;

/// Publishes a run-start event exactly as an upstream service would.
pub async fn start(
    settings: &Settings,
    registry: &Registry,
    workflow: &str,
    run_id: &str,
    input: Option<&str>,
) -> anyhow::Result<()> {
    let run_id = RunId::parse(run_id)?;
    if registry.get(workflow).is_none() {
        bail!(
            "unknown workflow {workflow:?}: this build runs {}",
            registry.names().join(", ")
        );
    }
    let input: Value = match input {
        Some(raw) => serde_json::from_str(raw)
            .with_context(|| format!("--input is not valid JSON: {raw}"))?,
        None => json!({}),
    };
    let event = RunStartEvent::new(run_id.clone(), workflow, input);
    let topology = broker::Topology::new(&settings.broker.prefix, settings.broker.delivery_limit);
    broker::publish_once(&settings.broker, "cli", &topology.run_start(&event))
        .await
        .context(
            "publishing the run-start event (has `trailmark migrate` declared the topology?)",
        )?;
    println!(
        "run-start event for {run_id} (workflow {workflow}) published to {}; follow it with `trailmark run show {run_id}`",
        topology.runs_exchange()
    );
    Ok(())
}

/// Everything `run show` reports.
#[derive(Debug, Serialize)]
pub struct RunReport {
    /// The run row.
    #[serde(flatten)]
    pub run: runs::RunRow,
    /// Committed steps.
    pub steps_done: usize,
    /// Claims across all positions (more than `steps_done` means retries or crashes).
    pub attempts: i64,
    /// Journal entries, tokens, cost.
    pub journal: JournalTotals,
    /// Effects recorded and completed.
    pub effects: EffectTotals,
    /// Items set aside with their reasons.
    pub parked: Vec<parked::ParkedRow>,
    /// Operator decisions, oldest first (the timeline's human part).
    pub decisions: Vec<decisions::DecisionRow>,
    /// Every checkpoint.
    pub steps: Vec<steps::StepRow>,
}

/// Journal totals of a run.
#[derive(Debug, Serialize)]
pub struct JournalTotals {
    /// Entries.
    pub entries: i64,
    /// Tokens.
    pub tokens: i64,
    /// Cost.
    pub cost: f64,
}

/// Effect totals of a run.
#[derive(Debug, Serialize)]
pub struct EffectTotals {
    /// Intents recorded.
    pub recorded: i64,
    /// With a known result.
    pub completed: i64,
}

/// Loads the report of one run.
pub async fn report(pool: &sqlx::PgPool, run_id: &str) -> anyhow::Result<Option<RunReport>> {
    let Some(run) = runs::get(pool, run_id).await? else {
        return Ok(None);
    };
    let steps = steps::list(pool, run_id).await?;
    let spent = journal::totals(pool, run_id).await?;
    let (recorded, completed) = effects::totals(pool, run_id).await?;
    Ok(Some(RunReport {
        steps_done: steps.iter().filter(|s| s.finished_at.is_some()).count(),
        attempts: steps.iter().map(|s| s.attempts as i64).sum(),
        journal: JournalTotals {
            entries: spent.entries,
            tokens: spent.tokens,
            cost: spent.cost,
        },
        effects: EffectTotals {
            recorded,
            completed,
        },
        parked: parked::list(pool, run_id).await?,
        decisions: decisions::list(pool, run_id).await?,
        run,
        steps,
    }))
}

/// `run show ID [--json]`.
pub async fn show(settings: &Settings, run_id: &str, as_json: bool) -> anyhow::Result<()> {
    let pool = store::connect(&settings.database).await?;
    let Some(r) = report(&pool, run_id).await? else {
        bail!("run {run_id} not found: list runs with `trailmark run list`");
    };
    if as_json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let run = &r.run;
    println!(
        "run {}  workflow {} v{}  status {}",
        run.run_id, run.workflow, run.workflow_version, run.status
    );
    println!(
        "created {}  updated {}  finished {}",
        run.created_at,
        run.updated_at,
        run.finished_at.map(|t| t.to_string()).unwrap_or("-".into())
    );
    println!(
        "steps done {}  attempts {}  next {}",
        r.steps_done,
        r.attempts,
        run.step.as_ref().map_or("-", |s| s.as_str())
    );
    println!(
        "journal entries {} (tokens {}, cost {:.4})  effects {} recorded, {} completed",
        r.journal.entries,
        r.journal.tokens,
        r.journal.cost,
        r.effects.recorded,
        r.effects.completed
    );
    if let Some(owner) = &run.lease_owner {
        println!(
            "lease held by {owner} until {}  fence {}",
            run.lease_expires_at
                .map(|t| t.to_string())
                .unwrap_or_default(),
            run.fence
        );
    }
    if let Some(error) = &run.error {
        println!("error: {error}");
    }
    if let Some(note) = &run.handover {
        print_handover(note);
    }
    for d in &r.decisions {
        let version = if d.version_before != d.version_after {
            format!(" (v{} -> v{})", d.version_before, d.version_after)
        } else {
            String::new()
        };
        let step = d
            .step
            .as_deref()
            .map(|s| format!(" step {s}"))
            .unwrap_or_default();
        println!(
            "decision {} {}{step} by {}: {} -> {}{version}: {}",
            d.created_at, d.action, d.actor, d.status_before, d.status_after, d.reason
        );
    }
    if !r.parked.is_empty() {
        println!("parked items ({}):", r.parked.len());
        for p in &r.parked {
            println!(
                "  {}  (step {}, position {}): {}",
                p.item, p.step, p.seq, p.reason
            );
        }
    }
    const SHOWN: usize = 20;
    let skip = r.steps.len().saturating_sub(SHOWN);
    if skip > 0 {
        println!("... {skip} earlier steps (all of them with --json)");
    }
    println!(
        "{:>6}  {:<24} {:>8}  {:>10}",
        "seq", "step", "attempts", "ms"
    );
    for s in &r.steps[skip..] {
        let ms = s
            .finished_at
            .map(|f| (f - s.started_at).num_milliseconds().to_string())
            .unwrap_or("running".into());
        println!("{:>6}  {:<24} {:>8}  {:>10}", s.seq, s.step, s.attempts, ms);
    }
    Ok(())
}

/// `run list [--status S] [--json]`.
pub async fn list(
    settings: &Settings,
    status: Option<&str>,
    as_json: bool,
    limit: i64,
) -> anyhow::Result<()> {
    let status: Option<RunStatus> = status.map(str::parse).transpose()?;
    let pool = store::connect(&settings.database).await?;
    let rows = runs::list(&pool, status, limit).await?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!(
            "no runs{}",
            status
                .map(|s| format!(" with status {s}"))
                .unwrap_or_default()
        );
        return Ok(());
    }
    println!(
        "{:<32} {:<16} {:<14} {:>6}  updated",
        "run", "workflow", "status", "next"
    );
    for r in rows {
        println!(
            "{:<32} {:<16} {:<14} {:>6}  {}",
            r.run_id, r.workflow, r.status, r.step_seq, r.updated_at
        );
    }
    Ok(())
}

fn print_handover(note: &Value) {
    let text = |k: &str| {
        note[k]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| note[k].to_string())
    };
    let keys = |k: &str| {
        let list: Vec<String> = note[k]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["key"].as_str().map(str::to_owned))
            .collect();
        if list.is_empty() {
            "none".to_owned()
        } else {
            format!("{} ({})", list.len(), list.join(", "))
        }
    };
    println!("handover note (written {}):", text("written_at"));
    println!(
        "  failed step   {} (position {}, attempt {})",
        text("failed_step"),
        note["seq"],
        note["attempt"]
    );
    println!("  error [{}]  {}", text("error_class"), text("error"));
    println!("  effects done  {}", keys("effects_committed"));
    println!("  outcome unknown  {}", keys("effects_unknown"));
    println!("  next          {}", text("next"));
}
