//! `trailmark drill WORKFLOW`: starts runs of any registered workflow on worker processes the
//! drill owns, injects faults on a seeded schedule, waits for every run to settle, and reports
//! what the promises kept, in the spirit of Jepsen's reports. Also a library call, so a team
//! drills its own workflows from its own binary ([`drill`]).
//!
//! | file | part |
//! |---|---|
//! | `schedule.rs` | the seeded generator and the fault plan |
//! | `fleet.rs` | the owned processes: restarts, kills, seams armed, pauses |
//! | `faults.rs` | broker, Postgres and poison faults; recovery time |
//! | `proxy.rs` | the latency fault: a delaying, cutting TCP proxy |
//! | `tap.rs` | the dup fault: step messages published again with the same id |
//! | `events.rs` | events for runs that wait: sent early, twice, or with a conflicting payload |
//! | `settle.rs` | the drive loop: progress, faults at their moment, forced reviews resumed |
//! | `keys.rs` | runs spread over concurrency keys; each key's limit sampled, lines left |
//! | `python.rs` | `pychain`'s Python step endpoint: started, killed from outside, restarted |
//! | `check.rs` | counts, call logs, the DLQ, and each invariant's verdict |
//! | `report.rs` | the report, as text and JSON |

pub mod check;
pub mod events;
pub mod faults;
pub mod fleet;
pub mod keys;
pub mod proxy;
pub mod python;
pub mod report;
pub mod schedule;
pub mod settle;
pub mod tap;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::PgPool;

pub use faults::{BrokerFault, PostgresFault};
pub use keys::Tenants;
pub use report::Report;
use schedule::Fault;
pub use schedule::Hook;
use trailmark::config::Settings;
use trailmark::workflow::Registry;

/// Every run a drill starts has an id starting with this (its database is its own).
pub const RUN_PREFIX: &str = "drill-";

/// Why a drill could not run (a drill that ran and found a broken promise is a [`Report`]
/// whose [`Report::ok`] is false, not an error).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The drill's own environment failed (database, broker, child processes).
    #[error(transparent)]
    Env(#[from] trailmark_bench::Error),
    /// Postgres failed or is unreachable.
    #[error("the drill lost the database")]
    Store(#[from] trailmark::store::Error),
    /// RabbitMQ failed or is unreachable.
    #[error("the drill lost the broker")]
    Broker(#[from] trailmark::broker::Error),
    /// The workflow, its input or a setting cannot be drilled, or a fault could not be made.
    #[error("{0}")]
    Failed(String),
}

impl From<trailmark::dlq::Error> for Error {
    fn from(e: trailmark::dlq::Error) -> Self {
        Self::Failed(format!("reading the drill's DLQ: {e}"))
    }
}

/// Shorthand for drill results.
pub type Result<T> = std::result::Result<T, Error>;

/// A boxed future, for [`Receiver`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The system a workflow writes to, as a drill sees it: set up in the drill's place, its rows
/// counted, removed afterwards. A drill of a workflow without one counts keys only.
pub trait Receiver: Send + Sync {
    /// Prepares what the workflow writes to (and the model it asks) for a drill whose
    /// processes use `settings`; returns the input the runs get (for example with the drill's
    /// own exchange in it) and settings for the processes.
    fn prepare<'a>(
        &'a self,
        settings: &'a Settings,
        input: Value,
    ) -> BoxFuture<'a, Result<Prepared>> {
        let _ = settings;
        Box::pin(async move {
            Ok(Prepared {
                input,
                child_env: Vec::new(),
            })
        })
    }

    /// `(rows, distinct references)` the receiver holds for `runs`: more rows than references
    /// is a write done twice.
    fn count<'a>(
        &'a self,
        pool: &'a PgPool,
        runs: &'a [String],
    ) -> BoxFuture<'a, Result<(i64, i64)>>;

    /// Removes what [`Receiver::prepare`] made.
    fn teardown<'a>(&'a self, settings: &'a Settings) -> BoxFuture<'a, Result<()>> {
        let _ = settings;
        Box::pin(async { Ok(()) })
    }
}

/// What [`Receiver::prepare`] gives the drill.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The input every run gets.
    pub input: Value,
    /// Environment for the drill's processes (e.g. `TRAILMARK__MODEL__BASE_URL`).
    pub child_env: Vec<(String, String)>,
}

/// `chain`'s receiver: the `chain_ledger` table, one row per reference.
pub struct ChainLedger;

impl Receiver for ChainLedger {
    fn count<'a>(
        &'a self,
        pool: &'a PgPool,
        runs: &'a [String],
    ) -> BoxFuture<'a, Result<(i64, i64)>> {
        Box::pin(async move {
            let c = trailmark_testkit::ledger::forward_ledger_counts(pool, runs).await?;
            Ok((c.rows, c.distinct))
        })
    }
}

/// What to drill: a workflow, the input every run gets, and optionally how to count its writes.
#[derive(Clone)]
pub struct Target {
    /// A workflow of the registry.
    pub workflow: String,
    /// The input of every run (the same work per run, so the control run gives the expected).
    pub input: Value,
    /// The system it writes to, when the drill knows how to count it.
    pub receiver: Option<Arc<dyn Receiver>>,
}

/// The faults and their amounts. Counts are spread over 5%..85% of the expected steps; shares
/// (0..1) apply to each message or position.
#[derive(Debug, Clone)]
pub struct Faults {
    /// `kill -9` of a process (each replacement is armed to kill itself at a named seam).
    pub kill: u32,
    /// Kills go through every process in turn (workers, relays, supervisors) instead of
    /// hitting a worker four times in five.
    pub kill_in_turn: bool,
    /// SIGSTOP of a worker past its lease, then SIGCONT.
    pub pause: u32,
    /// Broker faults, made as `broker_mode` says.
    pub broker: u32,
    /// Close the drill's connections, or restart the broker.
    pub broker_mode: BrokerFault,
    /// Postgres faults, made as `postgres_mode` says.
    pub postgres: u32,
    /// End the drill's backends, or stop the server at once and start it.
    pub postgres_mode: PostgresFault,
    /// Malformed messages, sent in bursts of up to ten.
    pub poison: u32,
    /// Latency episodes: delay on every byte to Postgres and RabbitMQ, then every connection cut.
    pub latency: u32,
    /// SIGKILL of the Python step endpoint from outside, started again at once (drills of
    /// `pychain` only: other drills have no endpoint, and leave it out of their plan).
    pub python_kill: u32,
    /// Share of step messages published again with the same id.
    pub dup: f64,
    /// Share of positions where the model answers 500 on attempt 1.
    pub model_500: f64,
    /// Share of positions where the tool answers after the client timeout on attempt 1.
    pub late_tool: f64,
    /// Share of runs whose start event is published twice.
    pub started_twice: f64,
    /// Share of positions forced into review on attempt 1 (resumed by the drill).
    pub review: f64,
    /// When the runs wait for an event: share of runs sent theirs before they wait.
    pub events_early: f64,
    /// Share of runs sent their event twice (the same id and payload).
    pub events_twice: f64,
    /// Share of runs sent their event again with the same id and another payload.
    pub events_conflict: f64,
    /// Commands run at chosen shares of the work (see [`Hook`]).
    pub hooks: Vec<Hook>,
}

impl Faults {
    /// No fault at all.
    pub fn none() -> Self {
        Self {
            kill: 0,
            kill_in_turn: false,
            pause: 0,
            broker: 0,
            broker_mode: BrokerFault::Close,
            postgres: 0,
            postgres_mode: PostgresFault::Terminate,
            poison: 0,
            latency: 0,
            python_kill: 0,
            dup: 0.0,
            model_500: 0.0,
            late_tool: 0.0,
            started_twice: 0.0,
            review: 0.0,
            events_early: 0.0,
            events_twice: 0.0,
            events_conflict: 0.0,
            hooks: Vec::new(),
        }
    }

    /// The CI profile: every fault, in amounts that fit a few minutes on 2 cores, none of them
    /// disturbing anyone else on the servers.
    pub fn ci() -> Self {
        Self {
            kill: 6,
            pause: 2,
            broker: 2,
            postgres: 2,
            poison: 20,
            latency: 2,
            python_kill: 2,
            dup: 0.1,
            model_500: 0.02,
            late_tool: 0.02,
            started_twice: 0.05,
            review: 0.01,
            events_early: 0.3,
            events_twice: 0.2,
            events_conflict: 0.1,
            ..Self::none()
        }
    }

    /// The release profile: 200 kills, 50 broker restarts, 50 Postgres stops, 100 pauses, 500
    /// poison messages, 30% duplicated deliveries (run it over 1,000 runs).
    pub fn long() -> Self {
        Self {
            kill: 200,
            pause: 100,
            broker: 50,
            broker_mode: BrokerFault::Restart,
            postgres: 50,
            postgres_mode: PostgresFault::Restart,
            poison: 500,
            latency: 20,
            python_kill: 50,
            dup: 0.3,
            ..Self::ci()
        }
    }

    /// Each planned fault and its count; `python`: the drill owns a Python step endpoint to kill.
    fn counts(&self, python: bool) -> Vec<(Fault, u32)> {
        vec![
            (Fault::Kill, self.kill),
            (Fault::Pause, self.pause),
            (Fault::Broker, self.broker),
            (Fault::Postgres, self.postgres),
            (Fault::Poison, self.poison.div_ceil(10)),
            (Fault::Latency, self.latency),
            (Fault::PythonKill, if python { self.python_kill } else { 0 }),
        ]
    }

    /// The engine seams' setting (`TRAILMARK_DRILL`) for the processes.
    fn seams_spec(&self, seed: u64, dir: &std::path::Path) -> String {
        format!(
            "seed={seed};dir={};model_500={};late_tool={};review={}",
            dir.display(),
            self.model_500,
            self.late_tool,
            self.review
        )
    }
}

/// How a drill runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Runs started (default 200).
    pub runs: usize,
    /// Worker processes.
    pub workers: usize,
    /// Relay processes.
    pub relays: usize,
    /// Supervisor processes.
    pub supervisors: usize,
    /// The seed of the schedule and of the engine seams.
    pub seed: u64,
    /// What to inject.
    pub faults: Faults,
    /// The workers' lease (short, so pauses past it stay short).
    pub lease_secs: u64,
    /// How long a pause keeps its worker stopped (default: the lease plus 2 s).
    pub pause_secs: Option<u64>,
    /// The drill gives up waiting after this long without a step committed.
    pub quiet_secs: u64,
    /// Keep the database, prefix and logs for a look afterwards.
    pub keep: bool,
    /// Print a progress line every few seconds (to stderr).
    pub progress: bool,
    /// Deliveries each worker takes at once (`worker.concurrency`; default: the setting's).
    pub worker_concurrency: Option<u32>,
    /// The program the processes are started from, with `worker`, `relay` and `supervisor`
    /// as their argument (default: the current executable).
    pub program: Option<std::path::PathBuf>,
    /// Spread the runs over keys of the workflow's concurrency key, each limited (default: the
    /// input as given, the declared limits).
    pub tenants: Option<Tenants>,
    /// A rolling deploy for the whole drill: half the workers carry `chain` v1 only, the
    /// others v1 and v2, and every link must run on its run's version.
    pub mixed_versions: bool,
}

impl Config {
    /// 200 runs, 2 workers, a relay and a supervisor, the CI faults.
    pub fn new(seed: u64) -> Self {
        Self {
            runs: 200,
            workers: 2,
            relays: 1,
            supervisors: 1,
            seed,
            faults: Faults::ci(),
            lease_secs: 4,
            pause_secs: None,
            quiet_secs: 90,
            keep: false,
            progress: true,
            worker_concurrency: None,
            program: None,
            tenants: None,
            mixed_versions: false,
        }
    }
}

/// Drills `target` as `cfg` says against the servers in `base`, in a database, broker prefix
/// (and for broker faults a vhost) of its own, all removed at the end unless `cfg.keep`.
/// Worker processes are started from `cfg.program` (default: the current executable) with
/// `worker`, `relay` or `supervisor`; it must serve the registry's workflows. A drill of
/// `pychain` also starts its Python step endpoint and points every process at it ([`python`]).
pub async fn drill(
    base: &Settings,
    registry: Registry,
    target: Target,
    cfg: &Config,
) -> Result<Report> {
    let started = Instant::now();
    let keyed = checked(&registry, &target, cfg)?;
    if cfg.mixed_versions && target.workflow != trailmark_testkit::chain::NAME {
        return Err(Error::Failed(format!(
            "--mixed-versions drills `chain`, the one workflow built at two versions here, not {:?}",
            target.workflow
        )));
    }
    if cfg.runs == 0 || cfg.workers == 0 {
        return Err(Error::Failed(
            "a drill needs at least one run and one worker".into(),
        ));
    }
    let mut base = base.clone();
    let vhost = if cfg.faults.broker > 0 && cfg.faults.broker_mode == BrokerFault::Close {
        Some(own_vhost(&mut base)?)
    } else {
        None
    };
    let result = settle::run(&base, registry, &target, cfg, vhost.as_deref(), keyed).await;
    if let Some(vh) = &vhost
        && !cfg.keep
        && let Err(e) = faults::delete_vhost(vh)
    {
        tracing::warn!(vhost = %vh, error = %e, "the drill's vhost could not be removed");
    }
    let mut report = result?;
    report.wall_secs = started.elapsed().as_secs_f64();
    report.replay = replay(&target, cfg);
    Ok(report)
}

/// Checks that `target` can be drilled; the spread over concurrency keys when `cfg` asks for one.
/// `pychain` need not be in `registry`: the drill serves it from the Python endpoint it starts,
/// whose manifest every process it starts reads (and which checks the input, as the control
/// run shows before any fault).
fn checked(registry: &Registry, target: &Target, cfg: &Config) -> Result<Option<keys::Keyed>> {
    let wf = match registry.get(&target.workflow) {
        Some(wf) => wf,
        None if python::serves(&target.workflow) => {
            if cfg.tenants.is_some() {
                return Err(Error::Failed(format!(
                    "--tenants spreads runs over a concurrency key, and {:?} declares none",
                    target.workflow
                )));
            }
            return Ok(None);
        }
        None => {
            return Err(Error::Failed(format!(
                "workflow {:?} is not registered in this binary; registered: {}",
                target.workflow,
                registry.names().join(", ")
            )));
        }
    };
    wf.check_input(&target.input).map_err(|e| {
        Error::Failed(format!(
            "the input for {:?} is refused: {e}",
            target.workflow
        ))
    })?;
    let Some(t) = cfg.tenants else {
        return Ok(None);
    };
    let keyed = keys::Keyed::new(&wf, t, &target.input)?;
    wf.check_input(&keyed.input(&target.input, 0))
        .map_err(|e| Error::Failed(format!("the input with a tenant is refused: {e}")))?;
    Ok(Some(keyed))
}

/// Creates a vhost for the drill and points `base` at it.
fn own_vhost(base: &mut Settings) -> Result<String> {
    let mut url = url::Url::parse(&base.broker.url).map_err(|e| {
        Error::Failed(format!(
            "AMQP_URL {} is not a URL: {e}",
            trailmark::redact::url(&base.broker.url)
        ))
    })?;
    let vhost = format!(
        "tmdrill-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let user = if url.username().is_empty() {
        "guest"
    } else {
        url.username()
    }
    .to_owned();
    faults::create_vhost(&vhost, &user)?;
    url.set_path(&format!("/{vhost}"));
    base.broker.url = url.to_string();
    Ok(vhost)
}

/// The command that runs this drill again.
fn replay(target: &Target, cfg: &Config) -> String {
    let f = &cfg.faults;
    format!(
        "trailmark drill {} --input '{}' --runs {} --workers {} --relays {} --supervisors {} --seed {} --kill {}{} --pause {} --broker {} --broker-mode {} --postgres {} --postgres-mode {} --poison {} --latency {} --dup {} --model-500 {} --late-tool {} --started-twice {} --review {} --event-early {} --event-twice {} --event-conflict {}",
        target.workflow,
        target.input,
        cfg.runs,
        cfg.workers,
        cfg.relays,
        cfg.supervisors,
        cfg.seed,
        f.kill,
        if f.kill_in_turn {
            " --kill-in-turn"
        } else {
            ""
        },
        f.pause,
        f.broker,
        match f.broker_mode {
            BrokerFault::Close => "close",
            BrokerFault::Restart => "restart",
        },
        f.postgres,
        match f.postgres_mode {
            PostgresFault::Terminate => "terminate",
            PostgresFault::Restart => "restart",
        },
        f.poison,
        f.latency,
        f.dup,
        f.model_500,
        f.late_tool,
        f.started_twice,
        f.review,
        f.events_early,
        f.events_twice,
        f.events_conflict
    ) + &cfg
        .worker_concurrency
        .map_or(String::new(), |n| format!(" --concurrency {n}"))
        + &format!(" --lease-secs {}", cfg.lease_secs)
        + &cfg.tenants.map_or(String::new(), |t| {
            format!(" --tenants {} --tenant-limit {}", t.count, t.limit)
        })
        + if cfg.mixed_versions {
            " --mixed-versions"
        } else {
            ""
        }
        + &cfg
            .pause_secs
            .map_or(String::new(), |n| format!(" --pause-secs {n}"))
        + &if python::serves(&target.workflow) {
            format!(" --python-kill {}", f.python_kill)
        } else {
            String::new()
        }
        + &f.hooks
            .iter()
            .map(|h| {
                format!(
                    " --hook '{}:{}={}'",
                    h.at,
                    h.name,
                    h.command.replace('\'', "'\\''")
                )
            })
            .collect::<String>()
}

/// Prints a progress line to stderr when asked to.
fn say(cfg: &Config, line: &str) {
    if cfg.progress {
        eprintln!("drill: {line}");
    }
}

impl Config {
    /// How long a pause keeps its worker stopped: `pause_secs`, or long enough to outlast the
    /// lease by two seconds.
    pub fn pause_length(&self) -> Duration {
        Duration::from_secs(self.pause_secs.unwrap_or(self.lease_secs + 2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(workflow: &str) -> Target {
        Target {
            workflow: workflow.into(),
            input: serde_json::json!({}),
            receiver: None,
        }
    }

    #[test]
    fn only_a_drill_with_a_python_endpoint_plans_its_kills_and_replays_them() {
        let f = Faults::ci();
        let python = |counts: Vec<(Fault, u32)>| {
            counts
                .into_iter()
                .find(|(fault, _)| *fault == Fault::PythonKill)
                .map(|(_, n)| n)
        };
        assert_eq!(python(f.counts(false)), Some(0));
        assert_eq!(python(f.counts(true)), Some(f.python_kill));
        let cfg = Config::new(3);
        assert!(replay(&target("pychain"), &cfg).ends_with(" --python-kill 2"));
        assert!(!replay(&target("chain"), &cfg).contains("--python-kill"));
    }

    #[test]
    fn pychain_is_drilled_without_being_registered_and_nothing_else_is() {
        let registry = trailmark_testkit::registry();
        let cfg = Config::new(3);
        assert!(matches!(
            checked(&registry, &target("pychain"), &cfg),
            Ok(None)
        ));
        let unknown = checked(&registry, &target("nope"), &cfg).err();
        assert!(
            unknown.is_some_and(|e| e.to_string().contains("not registered")),
            "an unknown workflow is refused"
        );
        let tenants = Config {
            tenants: Some(Tenants { count: 2, limit: 1 }),
            ..Config::new(3)
        };
        assert!(checked(&registry, &target("pychain"), &tenants).is_err());
    }
}
