//! `trailmark run start | show | list`.

use anyhow::{Context, bail};
use serde_json::{Value, json};

use trailmark::broker;
use trailmark::config::Settings;
use trailmark::domain::{RunId, RunStartEvent, RunStatus};
use trailmark::store::{self, runs};
use trailmark::timeline;
use trailmark::workflow::Registry;

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

/// `run show ID [--json]`.
pub async fn show(settings: &Settings, run_id: &str, as_json: bool) -> anyhow::Result<()> {
    let pool = store::connect(&settings.database).await?;
    let Some(r) = timeline::load(&pool, run_id).await? else {
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
