//! `trailmark run fork` and `trailmark run diff`: rerun a run from a position under a new id,
//! live or in shadow, and compare two runs.

use anyhow::{Context, bail};
use serde_json::Value;

use trailmark::config::Settings;
use trailmark::diff::{self, RunDiff};
use trailmark::domain::ShadowWrite;
use trailmark::engine::Engine;
use trailmark::operator::{self, Decider, ForkPlan, ForkPoint, ForkRequest};
use trailmark::store::{self, forks::Lineage};
use trailmark::workflow::Registry;

/// `run fork` as typed.
#[derive(Debug, clap::Args)]
pub struct ForkArgs {
    /// The run to fork.
    pub run_id: String,
    /// Where the fork starts: a position (as `run show` prints it) or a step name (its first
    /// visit). Positions before it are taken over, not run again.
    #[arg(long)]
    pub from: String,
    /// The fork's id (default: `<run>-fork-<8 hex>`).
    #[arg(long = "run-id", value_name = "NEW")]
    pub new_run_id: Option<String>,
    /// A new input (JSON); default: the run's own.
    #[arg(long)]
    pub input: Option<String>,
    /// Record outside writes and messages instead of making them; the fork ends `shadowed`.
    #[arg(long)]
    pub shadow: bool,
    /// Replay the model answers this run journaled from the fork point on instead of asking the
    /// model again (for example the parent itself, when only code changed); a step whose
    /// request differs stops for review, as any replay does.
    #[arg(long, value_name = "RUN")]
    pub answers_from: Option<String>,
    /// Do not ask before a live fork writes outside.
    #[arg(long)]
    pub yes: bool,
    /// Who decides and why.
    #[command(flatten)]
    pub who: super::runs::Who,
}

/// `trailmark run fork ...`.
pub async fn fork(settings: Settings, registry: Registry, args: ForkArgs) -> anyhow::Result<()> {
    if args.who.reason.trim().is_empty() {
        bail!("--reason must say why (it is recorded with the fork)");
    }
    trailmark::api::input::check(
        "--reason",
        &args.who.reason,
        trailmark::api::input::Kind::Reason,
    )?;
    let input = match args.input.as_deref() {
        Some(raw) => Some(
            serde_json::from_str::<Value>(raw)
                .with_context(|| format!("--input is not valid JSON: {raw}"))?,
        ),
        None => None,
    };
    let req = ForkRequest {
        from: args.from.parse::<ForkPoint>().expect("infallible"),
        run_id: args.new_run_id.clone(),
        input,
        shadow: args.shadow,
        answers_from: args.answers_from.clone(),
    };
    let engine = Engine::new(settings, registry).await?;
    let plan = operator::fork_plan(&engine, &args.run_id, &req).await?;
    describe(&plan);
    if !plan.shadow && !plan.writing_steps.is_empty() {
        super::confirm(
            &format!(
                "fork run {} live as {}: steps {} write outside again, under the fork's keys (new writes)",
                plan.parent,
                plan.run_id,
                plan.writing_steps.join(", ")
            ),
            "Use --shadow to see what it would do without writing, or ",
            args.yes,
        )
        .await?;
    }
    let who = Decider::cli(
        args.who.actor.unwrap_or_else(super::decide::default_actor),
        args.who.reason,
    );
    let req = ForkRequest {
        run_id: Some(plan.run_id.clone()),
        ..req
    };
    let made = operator::fork(&engine, &args.run_id, &req, &who).await?;
    if args.who.json {
        println!("{}", serde_json::to_string_pretty(&made)?);
    } else {
        let mode = if made.shadow { "shadow" } else { "live" };
        println!(
            "fork {} of {}: {mode}, from {} (position {}); follow it with `trailmark run watch {}`",
            made.run_id, made.parent, made.from_step, made.from_seq, made.run_id
        );
    }
    Ok(())
}

/// Says on stderr what the fork takes over and what it will run.
fn describe(p: &ForkPlan) {
    let taken = match p.inherited_positions {
        0 => "nothing taken over".to_owned(),
        n => format!(
            "{} taken over with {} journaled answers",
            positions_before(n),
            p.inherited_answers
        ),
    };
    eprintln!(
        "fork {} of {} ({} v{}): {taken}; runs from {} (position {})",
        p.run_id, p.parent, p.workflow, p.version, p.from_step, p.from_seq
    );
    if p.shadow {
        eprintln!("shadow: outside writes and messages are recorded, never made or sent");
    } else if !p.writing_steps.is_empty() {
        eprintln!(
            "live: these steps write outside for real, under the fork's own keys: {}",
            p.writing_steps.join(", ")
        );
    }
}

/// `trailmark run diff A B [--json]`.
pub async fn diff(settings: &Settings, a: &str, b: &str, as_json: bool) -> anyhow::Result<()> {
    let pool = store::connect(&settings.database).await?;
    let d = diff::compare(&pool, a, b).await?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        print_diff(&d);
    }
    Ok(())
}

fn print_diff(d: &RunDiff) {
    println!(
        "A {} ({} v{}, {})  B {} ({} v{}, {})",
        d.a.run_id,
        d.a.workflow,
        d.a.version,
        d.a.status,
        d.b.run_id,
        d.b.workflow,
        d.b.version,
        d.b.status
    );
    if d.inherited_before > 0 {
        println!(
            "{} shared (taken over by the fork); compared {} positions from {}",
            positions_before(d.inherited_before),
            d.compared,
            d.inherited_before
        );
    }
    for p in &d.differences {
        let step = p.b_step.as_deref().or(p.a_step.as_deref()).unwrap_or("-");
        let output = if p.output_changed {
            "output differs"
        } else {
            "same output"
        };
        println!("position {} {step}: {output}", p.seq);
        for a in &p.answers {
            let why = if a.request_changed {
                "request and answer differ"
            } else {
                "answer differs"
            };
            println!(
                "  model call {}: {why} (tokens {:+}, cost {:+.4})",
                a.call_no, a.tokens_delta, a.cost_delta
            );
            println!("    A: {}", one_line(a.a.as_deref()));
            println!("    B: {}", one_line(a.b.as_deref()));
        }
        for w in &p.writes {
            let request = w.b_request.as_ref().or(w.a_request.as_ref());
            let shown = request.map(|r| format!("  {r}")).unwrap_or_default();
            println!("  {} {} {}{shown}", w.kind, w.change, w.key);
        }
    }
    println!(
        "{} of {} positions differ; B spent {:+} tokens, {:+.4} cost against A",
        d.differences.len(),
        d.compared,
        d.tokens_delta,
        d.cost_delta
    );
}

/// "position 0" or "positions 0 to N-1".
fn positions_before(n: i32) -> String {
    match n {
        1 => "position 0".into(),
        n => format!("positions 0 to {}", n - 1),
    }
}

fn one_line(text: Option<&str>) -> String {
    match text {
        None => "(no call)".into(),
        Some(t) => {
            let flat = t.split_whitespace().collect::<Vec<_>>().join(" ");
            match flat.char_indices().nth(160) {
                Some((i, _)) => format!("{}…", &flat[..i]),
                None => flat,
            }
        }
    }
}

/// `run show`'s lines about where a run comes from, what was forked from it, and what a shadow
/// run would have written.
pub fn print_lineage(l: &Lineage, writes: &[ShadowWrite]) {
    if let Some(p) = &l.parent {
        let mode = if p.shadow { "shadow fork" } else { "fork" };
        println!(
            "{mode} of {} from {} (position {}) by {} at {}: {}",
            p.parent_run_id, p.from_step, p.from_seq, p.actor, p.created_at, p.reason
        );
    }
    for c in &l.children {
        let mode = if c.shadow { "shadow fork" } else { "fork" };
        println!(
            "{mode} {} from {} (position {}) by {}: {}",
            c.run_id, c.from_step, c.from_seq, c.actor, c.reason
        );
    }
    if !writes.is_empty() {
        println!("would have written ({}):", writes.len());
        for w in writes.iter().take(20) {
            println!("  position {} {} {} -> {}", w.seq, w.kind, w.key, w.target);
        }
        if writes.len() > 20 {
            println!(
                "  ... and {} more (all of them with --json)",
                writes.len() - 20
            );
        }
    }
}
