//! `trailmark run start | show | list`.

use anyhow::{Context, bail};
use serde_json::{Value, json};

use trailmark::broker;
use trailmark::config::Settings;
use trailmark::domain::{RunId, RunStartEvent, RunStatus};
use trailmark::flow::debounce;
use trailmark::store::debounce as debounce_store;
use trailmark::store::{self, runs};
use trailmark::timeline;
use trailmark::workflow::Registry;

/// `run start` options.
#[derive(Debug, clap::Args)]
pub struct StartArgs {
    /// Workflow name (e.g. chain).
    pub workflow: String,
    /// Caller-chosen run id; starting the same id again with the same input starts one run,
    /// with another input it is refused.
    #[arg(long)]
    pub run_id: String,
    /// Workflow input: JSON, `@FILE` to read it from a file, or `-` for standard input.
    #[arg(long)]
    pub input: Option<String>,
    /// Return only once a worker has created the run (or fail after --wait-secs).
    #[arg(long)]
    pub wait: bool,
    /// How long --wait waits.
    #[arg(long, default_value_t = 60)]
    pub wait_secs: u64,
    /// Then follow the run like `trailmark run watch` until it ends.
    #[arg(long)]
    pub follow: bool,
    /// A W3C trace context (`00-<trace id>-<span id>-<flags>`) the run's trace continues; sent
    /// as the run-start message's `traceparent` header.
    #[arg(long, env = "TRACEPARENT")]
    pub traceparent: Option<String>,
    /// Where the run stands among runs waiting for a slot of its concurrency key: 0 (lowest)
    /// to 4 (highest); 2 when not given.
    #[arg(long, value_parser = priority)]
    pub priority: Option<trailmark::Priority>,
    /// The workflow version the run starts on and keeps until it ends (`trailmark workflow
    /// versions` lists them); the newest this binary carries when not given.
    #[arg(long)]
    pub version: Option<i32>,
}

fn priority(text: &str) -> Result<trailmark::Priority, String> {
    let level: i64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number; give 0 (lowest) to 4 (highest)"))?;
    trailmark::Priority::new(level).map_err(|e| e.to_string())
}

/// Publishes a run-start event exactly as an upstream service would, after the checks a worker
/// would make: the workflow exists, the input is one it accepts, the event fits the message
/// limit, and no run with this id exists with another input.
pub async fn start(
    settings: &Settings,
    registry: &Registry,
    args: StartArgs,
) -> anyhow::Result<()> {
    let run_id = RunId::parse(&args.run_id)?;
    let input = read_input(args.input.as_deref())?;
    let event = RunStartEvent {
        priority: args.priority,
        version: args.version,
        ..RunStartEvent::new(run_id.clone(), &args.workflow, input)
    };
    let topology = broker::Topology::new(&settings.broker.prefix, settings.broker.delivery_limit);
    let limit = settings.worker.max_message_bytes;
    let (mut message, workflow) =
        trailmark::worker::start_message(registry, &topology, limit, &event)
            .map_err(|refused| anyhow::anyhow!("{refused}; nothing was published"))?;
    if let Some(tp) = &args.traceparent {
        let traced = [(trailmark::trace::TRACEPARENT.to_owned(), tp.clone())];
        message.headers = broker::map_to_headers(&traced.into_iter().collect());
    }
    let pool = match store::connect(&settings.database).await {
        Ok(pool) => Some(pool),
        // The event is what starts the run; the checks that need the database are a courtesy.
        Err(e) if !args.wait && !args.follow => {
            tracing::warn!(error = %trailmark::error::Report(&e), "cannot check for an existing run; publishing anyway");
            None
        }
        Err(e) => return Err(e).context("--wait needs the database to see the run appear"),
    };
    if let Some(pool) = &pool
        && let Some(run) = runs::get(pool, run_id.as_str()).await?
    {
        if !run.started_with(&event.workflow, &event.input) {
            bail!(
                "run {run_id} exists with workflow {} and another input (status {}); a second start would be refused as run_conflict. Use another run id",
                run.workflow,
                run.status
            );
        }
        println!(
            "run {run_id} already exists with this workflow and input (status {}); nothing to start. Follow it with `trailmark run show {run_id}`",
            run.status
        );
        return Ok(());
    }
    if let Some(pool) = &pool
        && workflow.flow.debounce.is_some()
        && let Some(held) =
            debounce_store::find(pool, run_id.as_str(), Some((&event.workflow, &event.input)))
                .await?
    {
        if !held.same {
            bail!(
                "{}; a second start with another input would be refused as run_conflict. Use another run id",
                debounce::describe(&held)
            );
        }
        println!("{}; nothing to start", debounce::describe(&held));
        return Ok(());
    }
    broker::publish_once(&settings.broker, "cli", &message)
        .await
        .map_err(|e| match e {
            broker::Error::Refused { .. } => anyhow::Error::new(e)
                .context("the broker refused the run-start event (has `trailmark migrate` declared the topology?)"),
            e => anyhow::Error::new(e).context("publishing the run-start event"),
        })?;
    println!(
        "run-start event for {run_id} (workflow {}) published to {}; follow it with `trailmark run show {run_id}`",
        event.workflow,
        topology.runs_exchange()
    );
    if let Some(rules) = &workflow.flow.debounce {
        return debounced(pool.as_ref(), &event, rules, &args).await;
    }
    match pool {
        Some(pool) if args.follow => {
            super::watch::watch(&pool, run_id.as_str(), args.wait_secs).await
        }
        Some(pool) if args.wait => wait_for_run(settings, &pool, &run_id, args.wait_secs).await,
        None if args.follow => bail!("--follow needs the database to see the run"),
        _ => Ok(()),
    }
}

/// After a start of a debounced workflow was published: what becomes of it, and with `--wait`
/// or `--follow` where it stands once a worker recorded it (pending until when, or the run when
/// its id had one); `--follow` then follows the run once it starts.
async fn debounced(
    pool: Option<&sqlx::PgPool>,
    event: &RunStartEvent,
    rules: &trailmark::flow::Debounce,
    args: &StartArgs,
) -> anyhow::Result<()> {
    let key = rules.key.value_in(&event.input).unwrap_or_default();
    println!(
        "workflow {} debounces its starts by {} (window {} s): this start is held under key {key} and becomes a run {} s after the last start with this key (at most {} s after the burst's first), unless a later start replaces it; `trailmark run show {}` says where it stands",
        event.workflow,
        rules.key.name(),
        rules.window.as_secs_f64(),
        rules.window.as_secs_f64(),
        rules.max_hold().as_secs_f64(),
        event.run_id
    );
    let Some(pool) = pool.filter(|_| args.wait || args.follow) else {
        if args.follow {
            bail!("--follow needs the database to see the run");
        }
        return Ok(());
    };
    let id = event.run_id.as_str();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(args.wait_secs);
    let held = loop {
        if runs::get(pool, id).await?.is_some() {
            break None;
        }
        if let Some(held) = debounce_store::find(pool, id, None).await? {
            break Some(held);
        }
        if std::time::Instant::now() >= deadline {
            bail!(
                "start {id} was not recorded within {} s: check `trailmark dlq list` (a refused start is dead-lettered with its reason) and that a worker runs",
                args.wait_secs
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    let appear_secs = match &held {
        Some(held) => {
            println!("{}", debounce::describe(held));
            let until_due = (held.due_at - chrono::Utc::now()).num_seconds().max(0) as u64;
            if held.state != "pending" || !args.follow {
                return Ok(());
            }
            until_due + args.wait_secs
        }
        None => args.wait_secs,
    };
    if args.follow {
        return super::watch::watch(pool, id, appear_secs).await;
    }
    println!("run {id} exists");
    Ok(())
}

/// The input as given: inline JSON, `@FILE`, or `-` for standard input; `{}` when absent.
pub(crate) fn read_input(raw: Option<&str>) -> anyhow::Result<Value> {
    read_json("--input", raw)
}

/// A JSON option (`flag`) as given: inline JSON, `@FILE`, or `-` for standard input; `{}` when
/// absent.
pub(crate) fn read_json(flag: &str, raw: Option<&str>) -> anyhow::Result<Value> {
    let text = match raw {
        None => return Ok(json!({})),
        Some("-") => std::io::read_to_string(std::io::stdin())
            .with_context(|| format!("reading {flag} from standard input"))?,
        Some(arg) => match arg.strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path)
                .with_context(|| format!("reading {flag} from {path}"))?,
            None => arg.to_owned(),
        },
    };
    serde_json::from_str(&text).with_context(|| {
        let shown: String = text.chars().take(200).collect();
        format!("{flag} is not valid JSON: {shown}")
    })
}

/// Waits until a worker has created the run, saying so when no worker consumes the start queue.
async fn wait_for_run(
    settings: &Settings,
    pool: &sqlx::PgPool,
    run_id: &RunId,
    wait_secs: u64,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_secs);
    let mut next_look = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        if let Some(run) = runs::get(pool, run_id.as_str()).await? {
            println!("run {run_id} exists (status {})", run.status);
            return Ok(());
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            let why = match waiting_start(settings).await {
                Some(note) => note,
                None => {
                    "check `trailmark dlq list` (a refused start is dead-lettered with its reason)"
                        .into()
                }
            };
            bail!("run {run_id} did not appear within {wait_secs} s: {why}");
        }
        if now >= next_look {
            if let Some(note) = waiting_start(settings).await {
                eprintln!("still waiting for run {run_id}: {note}");
            }
            next_look = now + std::time::Duration::from_secs(10);
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// What `run show` and `run watch` say of a run id no run has: where to look, and what the start
/// queue holds.
pub async fn not_found(settings: &Settings, run_id: &str) -> String {
    if let Some(gone) = removed(settings, run_id).await {
        return gone;
    }
    if let Some(held) = held(settings, run_id).await {
        return held;
    }
    let note = waiting_start(settings)
        .await
        .map(|n| format!("; {n}"))
        .unwrap_or_default();
    format!("run {run_id} not found: list runs with `trailmark run list`{note}")
}

/// A start a debounce holds or superseded, in words (`None`: no such start).
async fn held(settings: &Settings, run_id: &str) -> Option<String> {
    let pool = store::connect(&settings.database).await.ok()?;
    let held = debounce_store::find(&pool, run_id, None).await.ok()??;
    Some(debounce::describe(&held))
}

/// What retention left of a removed run (its tombstone), in words.
async fn removed(settings: &Settings, run_id: &str) -> Option<String> {
    let pool = store::connect(&settings.database).await.ok()?;
    let g = store::retention::gone(&pool, run_id).await.ok()??;
    let archive = match g.archived_to {
        Some(path) => format!("its archive is {path}"),
        None => "no archive was written (retention.archive_dir was empty)".into(),
    };
    Some(format!(
        "run {run_id} {} and was removed by retention at {}; {archive}",
        g.status, g.pruned_at
    ))
}

/// What the start queue says about a run that does not exist yet: events waiting, and whether
/// any worker consumes them; `None` when a worker consumes and nothing waits (the event may have
/// been refused).
async fn waiting_start(settings: &Settings) -> Option<String> {
    let topology = broker::Topology::new(&settings.broker.prefix, settings.broker.delivery_limit);
    let queue = topology.run_start_queue();
    match broker::queue_state(&settings.broker, &queue).await {
        Ok(Some(q)) if q.consumers == 0 => Some(format!(
            "{} start event(s) wait in {queue} and no worker is consuming {queue}: start one with `trailmark serve`",
            q.messages
        )),
        Ok(Some(q)) if q.messages > 0 => Some(format!(
            "{} start event(s) wait in {queue}, consumed by {} worker(s)",
            q.messages, q.consumers
        )),
        Ok(Some(_)) => None,
        Ok(None) => Some(format!(
            "queue {queue} does not exist: run `trailmark migrate`, or check TRAILMARK__BROKER__PREFIX"
        )),
        Err(e) => Some(format!(
            "the broker cannot be asked: {}",
            trailmark::error::Report(&e)
        )),
    }
}

/// `run show ID [--json]`.
pub async fn show(settings: &Settings, run_id: &str, as_json: bool) -> anyhow::Result<()> {
    let pool = store::connect(&settings.database).await?;
    let Some(r) = timeline::load(&pool, run_id).await? else {
        bail!("{}", not_found(settings, run_id).await);
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
        r.around.effects.recorded,
        r.around.effects.completed
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
    if let Some(key) = &run.flow_key {
        println!("concurrency key {key}  priority {}", run.priority);
    }
    if let Some(w) = &r.around.flow_wait {
        let what = match w.reason.as_str() {
            "rate" => format!(
                "a token of key {}'s rate limit, not before {}",
                w.key, w.not_before
            ),
            "total" => format!(
                "a slot of its workflow's total limit ({} of key {} ahead)",
                w.ahead, w.key
            ),
            _ => format!("a slot of key {} ({} ahead in line)", w.key, w.ahead),
        };
        println!("waits for {what} since {}, holding no lease", w.since);
    }
    super::fork::print_lineage(&r.around.lineage, &r.shadow_writes);
    print_family(&run.run_id, &r.around.family);
    if let Some(error) = &run.error {
        println!("error: {error}");
    }
    if let Some(note) = &run.handover {
        print_handover(note);
    }
    print_waits(&r.around.waits);
    for d in &r.around.decisions {
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
    if !r.around.parked.is_empty() {
        println!("parked items ({}):", r.around.parked.len());
        for p in &r.around.parked {
            println!(
                "  {}  (step {}, position {}): {}",
                p.item, p.step, p.seq, p.reason
            );
        }
    }
    if !r.around.progress.is_empty() {
        println!("progress:");
        for p in &r.around.progress {
            println!("  {}  {}", p.at.format("%H:%M:%S"), p.line);
        }
    }
    const SHOWN: usize = 20;
    let skip = r.steps.len().saturating_sub(SHOWN);
    if skip > 0 {
        println!("... {skip} earlier steps (all of them with --json)");
    }
    let mut steps = super::table::new(
        &["seq", "step", "attempts", "ms"],
        &["seq", "attempts", "ms"],
    );
    for s in &r.steps[skip..] {
        let ms = match s.finished_at {
            Some(f) => (f - s.started_at).num_milliseconds().to_string(),
            None => unfinished(run, s.seq).to_owned(),
        };
        steps.add_row(vec![
            s.seq.to_string(),
            s.step.to_string(),
            s.attempts.to_string(),
            ms,
        ]);
    }
    super::table::print(&steps);
    Ok(())
}

/// The run that started this one, and the child runs its steps started, counted by state.
fn print_family(run_id: &str, family: &trailmark::store::children::Family) {
    if let Some(parent) = &family.parent {
        println!("child of run {parent} (`trailmark run show {parent}`)");
    }
    for f in &family.fan_outs {
        let c = &f.children;
        let ended = match (f.joined_at, f.stopped_at) {
            (Some(at), _) => format!("joined {}", at.format("%Y-%m-%d %H:%M:%S")),
            (None, Some(at)) => format!("stopped for review {}", at.format("%Y-%m-%d %H:%M:%S")),
            (None, None) => "waiting".to_owned(),
        };
        println!(
            "children of position {} ({ended}; join {}, {} failure(s) allowed, {} at once): {} in all, {} succeeded, {} failed, {} running, {} not started, {} skipped",
            f.seq,
            f.join,
            f.max_failures,
            f.max_in_flight,
            c.total,
            c.succeeded,
            c.failed,
            c.running,
            c.pending,
            c.skipped
        );
    }
    if !family.fan_outs.is_empty() {
        println!("  list them: `trailmark run list --parent {run_id}`");
    }
}

/// What the run waited for and waits for: each event or sleep with its times, how it ended, and
/// the event it received.
fn print_waits(waits: &[trailmark::store::waits::WaitRow]) {
    if waits.is_empty() {
        return;
    }
    let time = |t: chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%d %H:%M:%S").to_string();
    println!("waits:");
    for w in waits {
        let what = match (&w.event_name, &w.match_key) {
            (Some(name), Some(key)) => format!("event {name} (key {key})"),
            _ => "a time (sleep)".to_owned(),
        };
        let ended = match (&w.resolved_at, w.resolution.as_deref()) {
            (None, _) => "WAITING NOW".to_owned(),
            (Some(at), Some("event")) => format!("event received, moved on {}", time(*at)),
            (Some(at), Some(how)) => format!("{how} at {}", time(*at)),
            (Some(at), None) => format!("ended {}", time(*at)),
        };
        println!(
            "  after step {} (position {}): {what}, since {} until {}: {ended}; next {}",
            w.step,
            w.seq,
            time(w.since),
            time(w.until),
            w.next_step
        );
        if let (Some(id), Some(payload)) = (&w.event_id, &w.payload) {
            let shown: String = payload.to_string().chars().take(200).collect();
            let at = w.received_at.map(time).unwrap_or_default();
            println!("    event {id} received {at}: {shown}");
        }
    }
}

/// What a step without a commit is doing, from its run's status: only a run that is moving has a
/// running step; one stopped for review or waiting holds it where it stopped.
fn unfinished(run: &runs::RunRow, seq: i32) -> &'static str {
    match run.status {
        _ if seq != run.step_seq => "unfinished",
        RunStatus::Running | RunStatus::Compensating => "running",
        RunStatus::NeedsReview => "in review",
        RunStatus::Waiting => "waiting",
        _ => "unfinished",
    }
}

/// `run list [--status S] [--parent ID] [--json]`.
pub async fn list(
    settings: &Settings,
    (status, parent): (Option<&str>, Option<&str>),
    as_json: bool,
    limit: i64,
) -> anyhow::Result<()> {
    let status: Option<RunStatus> = status.map(str::parse).transpose()?;
    let pool = store::connect(&settings.database).await?;
    let rows = runs::list(&pool, (status, parent), limit).await?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!(
            "no runs{}{}",
            status
                .map(|s| format!(" with status {s}"))
                .unwrap_or_default(),
            parent
                .map(|p| format!(" started by run {p}"))
                .unwrap_or_default()
        );
        return Ok(());
    }
    // `at` is the position the run is at; an ended run is at none.
    let mut table = super::table::new(&["run", "workflow", "status", "at", "updated"], &["at"]);
    for r in rows {
        let at = match r.status.is_terminal() {
            true => "-".to_owned(),
            false => r.step_seq.to_string(),
        };
        table.add_row(vec![
            r.run_id.to_string(),
            r.workflow.clone(),
            r.status.to_string(),
            at,
            r.updated_at.to_string(),
        ]);
    }
    super::table::print(&table);
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
    if note["error_class"] == "children_failed" {
        println!("handover note: {}", text("error"));
        for c in note["failed"].as_array().into_iter().flatten() {
            println!(
                "  child {} {} ({}): {}",
                c["index"],
                c["run_id"].as_str().unwrap_or("-"),
                c["state"].as_str().unwrap_or("-"),
                c["reason"].as_str().unwrap_or("-")
            );
        }
        println!("  next          {}", text("on_resume"));
        return;
    }
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
