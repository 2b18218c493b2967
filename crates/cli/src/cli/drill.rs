//! `trailmark drill WORKFLOW`: the chaos drill (see the `trailmark_drill` crate) for any workflow
//! of this binary, with the receivers of the two it ships (`chain`'s ledger, `reconcile`'s
//! ledger and stock records) so their writes are counted at the receiver too; and for
//! `pychain`, `chain` written with the Python SDK, which the drill serves from a Python process
//! it starts, kills and restarts (its ledger is `chain`'s).

use std::sync::Arc;

use anyhow::Context;
use serde_json::Value;
use sqlx::PgPool;

use trailmark::config::Settings;
use trailmark::workflow::Registry;
use trailmark_drill::{
    self as drill, BoxFuture, BrokerFault, Faults, Hook, PostgresFault, Prepared, Receiver,
};
use trailmark_reference::{extract, ledger, mail, outside, stock};
use trailmark_standin::model_server::{ModelServer, ModelServerOptions};

/// Which fault amounts to start from (each flag below overrides one).
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Profile {
    /// Every fault, a few of each, none disturbing other users of the servers (CI runs this).
    Ci,
    /// The release check: 200 kills, 100 pauses, 50 broker restarts, 50 Postgres stops, 500
    /// poison messages, 30% duplicated deliveries (use with --runs 1000).
    Long,
    /// No fault: a baseline to compare a report with.
    None,
}

/// What to drill and how hard.
#[derive(Debug, Clone, clap::Args)]
pub struct DrillArgs {
    /// The workflow to drill (any workflow this binary runs, or `pychain`: the drill starts
    /// the Python SDK's chain example and points every process at it).
    pub workflow: String,
    /// The input every run gets (JSON).
    #[arg(long, default_value = "{}")]
    pub input: String,
    /// Runs to start.
    #[arg(long, default_value_t = 200)]
    pub runs: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Relay processes.
    #[arg(long, default_value_t = 1)]
    pub relays: usize,
    /// Supervisor processes.
    #[arg(long, default_value_t = 1)]
    pub supervisors: usize,
    /// Seed of the fault schedule and the engine seams [default: from the clock, printed].
    #[arg(long)]
    pub seed: Option<u64>,
    /// The fault amounts to start from.
    #[arg(long, value_enum, default_value = "ci")]
    pub profile: Profile,
    /// kill -9 of a process (its replacement kills itself at a named seam).
    #[arg(long)]
    pub kill: Option<u32>,
    /// Kills go through every process in turn (workers, relays, supervisors).
    #[arg(long)]
    pub kill_in_turn: bool,
    /// SIGSTOP of a worker past its lease, then SIGCONT.
    #[arg(long)]
    pub pause: Option<u32>,
    /// Broker faults.
    #[arg(long)]
    pub broker: Option<u32>,
    /// `close`: the broker closes the drill's connections (its own vhost); `restart`: stop_app
    /// and start_app (disturbs every user of the broker).
    #[arg(long)]
    pub broker_mode: Option<String>,
    /// Postgres faults.
    #[arg(long)]
    pub postgres: Option<u32>,
    /// `terminate`: end the drill database's backends; `restart`: stop -m immediate and start
    /// (disturbs every user of the server).
    #[arg(long)]
    pub postgres_mode: Option<String>,
    /// Malformed messages mixed in.
    #[arg(long)]
    pub poison: Option<u32>,
    /// Latency episodes on a proxy to Postgres and RabbitMQ (delay, then every connection cut).
    #[arg(long)]
    pub latency: Option<u32>,
    /// `pychain` only: SIGKILL of its Python step endpoint from outside, started again at once
    /// and armed to kill itself once at its kill spot.
    #[arg(long)]
    pub python_kill: Option<u32>,
    /// Share of step messages published again with the same id (0..1).
    #[arg(long)]
    pub dup: Option<f64>,
    /// Share of positions where the model answers 500 on attempt 1.
    #[arg(long)]
    pub model_500: Option<f64>,
    /// Share of positions where the tool answers after the client timeout on attempt 1.
    #[arg(long)]
    pub late_tool: Option<f64>,
    /// Share of runs started twice with the same run id.
    #[arg(long)]
    pub started_twice: Option<f64>,
    /// Share of positions forced into review on attempt 1 (the drill approves and resumes).
    #[arg(long)]
    pub review: Option<f64>,
    /// When the input makes runs wait for an event: share of runs sent their event before
    /// they reach their wait.
    #[arg(long)]
    pub event_early: Option<f64>,
    /// Share of runs sent their event twice (the same id and payload).
    #[arg(long)]
    pub event_twice: Option<f64>,
    /// Share of runs sent their event again with the same id and another payload (refused).
    #[arg(long)]
    pub event_conflict: Option<f64>,
    /// A command of yours run once this share of the work is done, as `AT:NAME=COMMAND`
    /// (`0.3:leader-killed=...`), measured like the drill's own faults; repeatable. It gets
    /// DRILL_STEPS_QUEUE, DRILL_PREFIX and DRILL_DATABASE in its environment.
    #[arg(long = "hook", value_parser = Hook::parse)]
    pub hooks: Vec<Hook>,
    /// The workers' lease, seconds (pauses last this plus 2 s, unless --pause-secs).
    #[arg(long, default_value_t = 4)]
    pub lease_secs: u64,
    /// How long each pause keeps its worker stopped, seconds [default: the lease plus 2 s].
    #[arg(long)]
    pub pause_secs: Option<u64>,
    /// Deliveries each worker takes at once [default: worker.concurrency] (lower it, with a
    /// step delay in the input, to keep runs in flight through a long fault schedule).
    #[arg(long)]
    pub concurrency: Option<u32>,
    /// Spread the runs over this many values of the workflow's concurrency key (`t0`, `t1`,
    /// ...) and check, sampled every 100 ms through the faults, that no key ever has more runs
    /// holding a step than --tenant-limit, and that no run is left in a key's line.
    #[arg(long, requires = "tenant_limit")]
    pub tenants: Option<usize>,
    /// The limit set for every key before the runs start (keep it well below the runs per
    /// tenant, so runs wait in the line).
    #[arg(long, requires = "tenants")]
    pub tenant_limit: Option<u32>,
    /// A rolling deploy for the whole drill (`chain` only): odd-numbered workers carry chain v1
    /// only, the others v1 and v2; every link must run on its run's version.
    #[arg(long)]
    pub mixed_versions: bool,
    /// Give up waiting after this long without a committed step, seconds.
    #[arg(long, default_value_t = 90)]
    pub quiet_secs: u64,
    /// Keep the drill's database, prefix and logs afterwards.
    #[arg(long)]
    pub keep: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs the drill; exits 1 (through the error) when an invariant failed.
pub async fn run(settings: &Settings, registry: Registry, args: DrillArgs) -> anyhow::Result<()> {
    let input: Value = serde_json::from_str(&args.input)
        .with_context(|| format!("--input {:?} is not JSON", args.input))?;
    anyhow::ensure!(
        args.python_kill.is_none() || drill::python::serves(&args.workflow),
        "--python-kill kills the Python endpoint of a drill of pychain; {} has none",
        args.workflow
    );
    let seed = args.seed.unwrap_or_else(clock_seed);
    let mut cfg = drill::Config::new(seed);
    cfg.runs = args.runs;
    cfg.workers = args.workers;
    cfg.relays = args.relays;
    cfg.supervisors = args.supervisors;
    cfg.lease_secs = args.lease_secs;
    cfg.pause_secs = args.pause_secs;
    cfg.quiet_secs = args.quiet_secs;
    cfg.keep = args.keep;
    cfg.worker_concurrency = args.concurrency;
    cfg.mixed_versions = args.mixed_versions;
    cfg.faults = faults(&args)?;
    cfg.tenants = args
        .tenants
        .zip(args.tenant_limit)
        .map(|(count, limit)| drill::Tenants { count, limit });
    let target = drill::Target {
        receiver: receiver(&args.workflow),
        workflow: args.workflow.clone(),
        input,
    };
    eprintln!("drill: seed {seed}");
    let report = drill::drill(settings, registry, target, &cfg).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    anyhow::ensure!(
        report.ok(),
        "the drill of {} found a broken promise (see FAIL above); replay it with: {}",
        args.workflow,
        report.replay
    );
    Ok(())
}

/// The profile's amounts with each flag given laid over them.
fn faults(a: &DrillArgs) -> anyhow::Result<Faults> {
    let mut f = match a.profile {
        Profile::Ci => Faults::ci(),
        Profile::Long => Faults::long(),
        Profile::None => Faults::none(),
    };
    let counts = [
        (a.kill, &mut f.kill),
        (a.pause, &mut f.pause),
        (a.broker, &mut f.broker),
        (a.postgres, &mut f.postgres),
        (a.poison, &mut f.poison),
        (a.latency, &mut f.latency),
        (a.python_kill, &mut f.python_kill),
    ];
    for (given, slot) in counts {
        if let Some(v) = given {
            *slot = v;
        }
    }
    let shares = [
        ("--dup", a.dup, &mut f.dup),
        ("--model-500", a.model_500, &mut f.model_500),
        ("--late-tool", a.late_tool, &mut f.late_tool),
        ("--started-twice", a.started_twice, &mut f.started_twice),
        ("--review", a.review, &mut f.review),
        ("--event-early", a.event_early, &mut f.events_early),
        ("--event-twice", a.event_twice, &mut f.events_twice),
        ("--event-conflict", a.event_conflict, &mut f.events_conflict),
    ];
    for (flag, given, slot) in shares {
        if let Some(v) = given {
            anyhow::ensure!(
                (0.0..=1.0).contains(&v),
                "{flag} is a share from 0 to 1, got {v}"
            );
            *slot = v;
        }
    }
    f.kill_in_turn |= a.kill_in_turn;
    f.hooks = a.hooks.clone();
    if let Some(m) = &a.broker_mode {
        f.broker_mode = match m.as_str() {
            "close" => BrokerFault::Close,
            "restart" => BrokerFault::Restart,
            other => anyhow::bail!("--broker-mode is close or restart, got {other:?}"),
        };
    }
    if let Some(m) = &a.postgres_mode {
        f.postgres_mode = match m.as_str() {
            "terminate" => PostgresFault::Terminate,
            "restart" => PostgresFault::Restart,
            other => anyhow::bail!("--postgres-mode is terminate or restart, got {other:?}"),
        };
    }
    Ok(f)
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

/// The receiver of a workflow this binary ships; none for others (keys are still counted).
fn receiver(workflow: &str) -> Option<Arc<dyn Receiver>> {
    match workflow {
        // pychain writes chain's ledger, with the same references.
        trailmark_testkit::chain::NAME | trailmark_testkit::pychain::NAME => {
            Some(Arc::new(drill::ChainLedger))
        }
        trailmark_reference::workflow::NAME => Some(Arc::new(Reconcile::default())),
        _ => None,
    }
}

/// `reconcile`'s receivers: the ledger and the stock records in the outside database, the
/// mail exchange its notes go to (declared under the drill's prefix), and the stand-in model
/// that extracts line items, served from the drill's process.
#[derive(Default)]
struct Reconcile {
    model: tokio::sync::Mutex<Option<ModelServer>>,
}

fn failed(what: &str, e: impl std::fmt::Display) -> drill::Error {
    drill::Error::Failed(format!("reconcile receiver: {what}: {e}"))
}

impl Receiver for Reconcile {
    fn prepare<'a>(
        &'a self,
        settings: &'a Settings,
        mut input: Value,
    ) -> BoxFuture<'a, drill::Result<Prepared>> {
        Box::pin(async move {
            let prefix = &settings.broker.prefix;
            let conn = trailmark::broker::connect(&settings.broker, "drill-mail").await?;
            let ch = conn
                .create_channel()
                .await
                .map_err(|e| failed("channel", e))?;
            mail::declare(&ch, prefix)
                .await
                .map_err(|e| failed("declaring the mail exchange", e))?;
            let _ = conn.close(200, "declared".into()).await;
            if let Some(obj) = input.as_object_mut() {
                obj.insert(
                    "mail_exchange".into(),
                    Value::String(mail::exchange(prefix)),
                );
            }
            let opts = ModelServerOptions {
                responder: Some(extract::responder()),
                ..Default::default()
            };
            let model = ModelServer::start(opts)
                .await
                .map_err(|e| failed("starting the stand-in model", e))?;
            let child_env = vec![
                ("TRAILMARK__MODEL__BASE_URL".to_owned(), model.base_url()),
                ("TRAILMARK__MODEL__API_KEY".to_owned(), String::new()),
            ];
            *self.model.lock().await = Some(model);
            Ok(Prepared { input, child_env })
        })
    }

    fn count<'a>(
        &'a self,
        pool: &'a PgPool,
        runs: &'a [String],
    ) -> BoxFuture<'a, drill::Result<(i64, i64)>> {
        Box::pin(async move {
            let outside = outside::pool_for(pool)
                .await
                .map_err(|e| failed("outside database", e))?;
            let (mut rows, mut distinct) = (0, 0);
            for run in runs {
                let (r1, d1) = ledger::counts(&outside, run)
                    .await
                    .map_err(|e| failed("ledger", e))?;
                let (r2, d2) = stock::counts(&outside, run)
                    .await
                    .map_err(|e| failed("stock", e))?;
                rows += r1 + r2;
                distinct += d1 + d2;
            }
            Ok((rows, distinct))
        })
    }

    fn teardown<'a>(&'a self, settings: &'a Settings) -> BoxFuture<'a, drill::Result<()>> {
        Box::pin(async move {
            if let Some(model) = self.model.lock().await.take() {
                model.shutdown().await;
            }
            let conn = trailmark::broker::connect(&settings.broker, "drill-mail").await?;
            if let Ok(ch) = conn.create_channel().await {
                let _ = mail::delete(&ch, &settings.broker.prefix).await;
            }
            let _ = conn.close(200, "removed".into()).await;
            let options: sqlx::postgres::PgConnectOptions = settings
                .database
                .url
                .parse()
                .map_err(|e| failed("database URL", e))?;
            let outside =
                outside::options_for(&options).map_err(|e| failed("outside database", e))?;
            outside::drop_database(&outside)
                .await
                .map_err(|e| failed("dropping the outside database", e))
        })
    }
}
