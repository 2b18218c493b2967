//! `trailmark workflow versions | move`: which workflow versions runs in flight still need, and
//! the explicit, audited move of runs from one version to another.

use std::io::IsTerminal;

use anyhow::bail;
use clap::Subcommand;

use trailmark::config::Settings;
use trailmark::engine::Engine;
use trailmark::operator::{self, Decider, MoveAsk, MovePlan, Verdict, VersionState};
use trailmark::workflow::Registry;

/// The `workflow` subcommands.
#[derive(Debug, Subcommand)]
pub enum WorkflowCommand {
    /// Every workflow version known to this binary, to the live workers or to a run in flight:
    /// its runs in flight by status, the oldest one's age, and whether it can be removed.
    Versions {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Move runs in flight from one version to another (this binary must carry the target):
    /// only runs stopped for review or waiting move; running ones are listed as busy. Asks
    /// first, unless --yes; --preview lists each run and what would become of it.
    Move(MoveArgs),
}

/// `workflow move` options.
#[derive(Debug, clap::Args)]
pub struct MoveArgs {
    /// The workflow.
    pub workflow: String,
    /// The version the runs are on.
    #[arg(long)]
    pub from: i32,
    /// The version they go to.
    #[arg(long)]
    pub to: i32,
    /// Only this run (repeat for more); every run in flight at --from when not given.
    #[arg(long = "run")]
    pub runs: Vec<String>,
    /// List each run with its step and whether it would move; change nothing.
    #[arg(long)]
    pub preview: bool,
    /// Do not ask for confirmation.
    #[arg(long)]
    pub yes: bool,
    /// Who moves them and why (recorded with each moved run).
    #[command(flatten)]
    pub who: super::runs::Who,
}

/// Runs a `workflow` subcommand.
pub async fn run(
    settings: Settings,
    registry: Registry,
    command: WorkflowCommand,
) -> anyhow::Result<()> {
    let engine = Engine::new(settings, registry).await?;
    match command {
        WorkflowCommand::Versions { json } => versions(&engine, json).await,
        WorkflowCommand::Move(args) => move_runs(&engine, args).await,
    }
}

async fn versions(engine: &Engine, json: bool) -> anyhow::Result<()> {
    let all = operator::versions(engine).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    if all.is_empty() {
        println!(
            "no workflow versions: this binary carries none, no live worker does, no run is in flight"
        );
        return Ok(());
    }
    let numbers = ["live", "running", "waiting", "review", "undoing", "oldest"];
    let mut t = super::table::new(
        &[
            "workflow", "version", "here", "live", "running", "waiting", "review", "undoing",
            "oldest", "verdict",
        ],
        &numbers,
    );
    for v in &all {
        t.add_row(row(v));
    }
    super::table::print(&t);
    Ok(())
}

/// A version's line: here = carried by this binary; live = live workers carrying it; the
/// runs in flight by status; the oldest one's age.
fn row(v: &VersionState) -> Vec<String> {
    let n = |status: &str| v.in_flight.get(status).copied().unwrap_or(0).to_string();
    vec![
        v.workflow.clone(),
        format!("v{}", v.version),
        if v.carried_here { "yes" } else { "-" }.into(),
        v.live_workers.to_string(),
        n("running"),
        n("waiting"),
        n("needs_review"),
        n("compensating"),
        v.oldest_age_secs.map_or("-".into(), age),
        v.verdict.clone(),
    ]
}

/// An age in its two largest units: `3d 4h`, `2h 5m`, `40s`.
fn age(secs: i64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3_600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

async fn move_runs(engine: &Engine, args: MoveArgs) -> anyhow::Result<()> {
    super::decide::check_reason(&args.who.reason)?;
    let ask = MoveAsk {
        workflow: args.workflow.clone(),
        from: args.from,
        to: args.to,
        runs: args.runs.clone(),
    };
    let plan = operator::move_preview(engine, &ask).await?;
    if args.preview {
        report(&plan, args.who.json)?;
        if !args.who.json {
            println!("preview: nothing was changed");
        }
        return Ok(());
    }
    let movable = plan.count(Verdict::Moves);
    if movable == 0 {
        report(&plan, args.who.json)?;
        return nothing_moved(&plan);
    }
    ask_first(&plan, movable, &args).await?;
    let actor = args.who.actor.unwrap_or_else(super::decide::default_actor);
    let who = Decider::cli(actor, args.who.reason);
    // Only the runs the operator was shown as moving.
    let confirmed = MoveAsk {
        runs: plan.ids(Verdict::Moves),
        ..ask
    };
    let mut done = operator::move_runs(engine, &confirmed, &who).await?;
    // The report also lists the runs the preview showed as not moving, as they stood then.
    let shown = plan
        .runs
        .into_iter()
        .filter(|r| r.verdict != Verdict::Moves);
    done.runs.extend(shown);
    done.runs.sort_by(|a, b| a.run_id.cmp(&b.run_id));
    report(&done, args.who.json)
}

/// Asks on the terminal before moving, showing the runs there (stdout stays the report);
/// `--yes` skips the question, and without a terminal the move is refused.
async fn ask_first(plan: &MovePlan, movable: usize, args: &MoveArgs) -> anyhow::Result<()> {
    if !args.yes && !args.who.json && std::io::stdin().is_terminal() {
        for line in runs_lines(plan) {
            eprintln!("{line}");
        }
    }
    let what = format!(
        "move {movable} run(s) of {} from v{} to v{}",
        plan.workflow, plan.from, plan.to
    );
    super::confirm(&what, "Check them with `--preview`, ", args.yes).await
}

/// Refuses (exit 1) when runs were listed and none could move, saying why in a line.
fn nothing_moved(plan: &MovePlan) -> anyhow::Result<()> {
    if plan.runs.is_empty() {
        return Ok(());
    }
    bail!(
        "no run of {} moved from v{} to v{}: {} busy, {} lacking a step in v{}, {} not in flight at v{}; see the list above",
        plan.workflow,
        plan.from,
        plan.to,
        plan.count(Verdict::Busy),
        plan.count(Verdict::LacksStep),
        plan.to,
        plan.count(Verdict::Skipped),
        plan.from
    )
}

/// Prints the runs and the summary, or the plan as JSON.
fn report(plan: &MovePlan, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(plan)?);
        return Ok(());
    }
    for line in runs_lines(plan) {
        println!("{line}");
    }
    print_summary(plan);
    Ok(())
}

/// Most runs listed as text; the runs that do not move first, so none of them is cut off
/// before a run that does (every run with --json).
const SHOWN: usize = 200;

/// Each run: its status, step and position, what it waits for, and what becomes of it.
fn runs_lines(plan: &MovePlan) -> Vec<String> {
    if plan.runs.is_empty() {
        return vec![format!(
            "no run of {} v{} is in flight: nothing to move (`trailmark workflow versions` says whether v{} can go)",
            plan.workflow, plan.from, plan.from
        )];
    }
    let mut shown: Vec<_> = plan.runs.iter().collect();
    shown.sort_by_key(|r| matches!(r.verdict, Verdict::Moves | Verdict::Moved));
    let mut t = super::table::new(&["run", "status", "step", "at", "verdict", "why"], &["at"]);
    for r in shown.iter().take(SHOWN) {
        let status = match (&r.status, &r.waiting_for) {
            (Some(s), Some(w)) => format!("{s} ({w})"),
            (Some(s), None) => s.to_string(),
            (None, _) => "-".into(),
        };
        t.add_row(vec![
            r.run_id.clone(),
            status,
            r.step.clone().unwrap_or_else(|| "-".into()),
            r.seq.map_or("-".into(), |s| s.to_string()),
            verdict(r.verdict).into(),
            r.why.clone(),
        ]);
    }
    let mut lines: Vec<String> = t.lines().map(|l| l.trim_end().to_owned()).collect();
    if shown.len() > SHOWN {
        lines.push(format!(
            "... and {} more runs (all of them with --json)",
            shown.len() - SHOWN
        ));
    }
    lines
}

fn verdict(v: Verdict) -> &'static str {
    match v {
        Verdict::Moves => "would move",
        Verdict::Moved => "moved",
        Verdict::Busy => "busy",
        Verdict::LacksStep => "stays",
        Verdict::Changed => "changed",
        Verdict::Skipped => "skipped",
    }
}

fn print_summary(plan: &MovePlan) {
    if plan.runs.is_empty() {
        return;
    }
    let moved = if plan.applied {
        format!("{} moved", plan.count(Verdict::Moved))
    } else {
        format!("{} would move", plan.count(Verdict::Moves))
    };
    let lacks = format!("stay (v{} lacks a step they need)", plan.to);
    let others = [
        (Verdict::Busy, "busy (move again once they wait or stop)"),
        (Verdict::LacksStep, lacks.as_str()),
        (Verdict::Changed, "changed meanwhile"),
        (Verdict::Skipped, "skipped"),
    ];
    let mut parts = vec![moved];
    for (v, what) in others {
        match plan.count(v) {
            0 => {}
            n => parts.push(format!("{n} {what}")),
        }
    }
    println!(
        "{} v{} -> v{}: {}",
        plan.workflow,
        plan.from,
        plan.to,
        parts.join(", ")
    );
    if plan.to_live_workers == 0 {
        println!(
            "no live worker carries {} v{} yet: a moved run's next step waits for one (deploy it before resuming them)",
            plan.workflow, plan.to
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ages_read_in_their_two_largest_units() {
        assert_eq!(super::age(40), "40s");
        assert_eq!(super::age(125), "2m 5s");
        assert_eq!(super::age(7_500), "2h 5m");
        assert_eq!(super::age(3 * 86_400 + 4 * 3_600 + 59), "3d 4h");
    }
}
