//! [`Trailmark`]: the one call that starts an engine inside a program, and the handle to its
//! runs. It does what `trailmark migrate` and `trailmark serve` do (create the database and the
//! broker topology when asked, wait for the servers, run worker, relay, supervisor and the HTTP
//! surface) until its shutdown token fires or, when asked, until SIGTERM or Ctrl-C; then it
//! drains: in-flight steps finish or are abandoned uncommitted, and nothing is lost either way.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::domain::{RunId, RunStartEvent, RunStatus};
use crate::engine::Engine;
use crate::error::{Cause, Reaction, Report};
use crate::failpoint::Failpoints;
use crate::operator::{self, Decider};
use crate::process::{self, Components};
use crate::store::{self, runs};
use crate::wait::EventSent;
use crate::workflow::Registry;

/// What went wrong, in words that say what to do next.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Postgres or RabbitMQ is down, unreachable or overloaded: try again later.
    #[error("{what}: {}; try again once the server is back", Report(source.as_ref()))]
    Unavailable {
        /// What trailmark was doing.
        what: String,
        /// The server's own error.
        #[source]
        source: Cause,
    },
    /// The settings or the servers' state keep the engine from working (a wrong URL or
    /// password, a missing database, vhost or schema): no retry helps until they are fixed.
    #[error("{what}: {}; fix the settings (or start with migrate) and try again", Report(source.as_ref()))]
    Setup {
        /// What trailmark was doing.
        what: String,
        /// Why it could not.
        #[source]
        source: Cause,
    },
    /// The request was refused and the refusal is the answer (an unknown workflow, an input the
    /// workflow does not accept, a run id taken by another input, a decision the run does not
    /// wait for).
    #[error("{0}")]
    Refused(String),
    /// The run did not come to rest within the time given.
    #[error(
        "run {run_id} is still {status} after {waited_ms} ms; wait longer, or look at it with `trailmark run show {run_id}`"
    )]
    StillMoving {
        /// The run.
        run_id: RunId,
        /// Where it stood when the wait ended.
        status: RunStatus,
        /// How long was waited.
        waited_ms: u64,
    },
    /// The shutdown token fired before the engine had started; nothing was in flight.
    #[error("asked to stop before the engine had started; nothing ran")]
    Cancelled,
    /// A component of the engine stopped with an error (see the cause); the engine is stopped.
    #[error("the engine stopped: {}", Report(.0.as_ref()))]
    Stopped(#[source] Cause),
}

impl Error {
    /// Sorts a library error by what the caller does about it.
    fn from_cause(
        what: impl Into<String>,
        e: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        let what = what.into();
        match crate::reaction::reaction(&e) {
            Reaction::Retry => Self::Unavailable {
                what,
                source: Box::new(e),
            },
            Reaction::Fix => Self::Setup {
                what,
                source: Box::new(e),
            },
            _ => Self::Refused(format!("{what}: {}", Report(&e))),
        }
    }
}

/// A run as its starter sees it: where it stands and what it produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct RunView {
    /// The run.
    pub run_id: RunId,
    /// Its workflow.
    pub workflow: String,
    /// Where it stands.
    pub status: RunStatus,
    /// The step it runs or waits at (none once it ended).
    pub step: Option<String>,
    /// Its final output, once it succeeded.
    pub output: Option<Value>,
    /// The last error or the reason it stopped for review.
    pub error: Option<String>,
    /// What a person must decide (while it waits at a human step) or the handover note (while
    /// it needs review).
    pub question: Option<Value>,
}

impl RunView {
    fn from_row(row: runs::RunRow) -> Result<Self, Error> {
        let run_id = RunId::parse(&row.run_id).map_err(|e| Error::Refused(e.to_string()))?;
        Ok(Self {
            run_id,
            workflow: row.workflow,
            status: row.status,
            step: row.step.map(|s| s.as_str().to_owned()),
            output: row.output,
            error: row.error,
            question: row.handover,
        })
    }

    /// Whether nothing more happens without a person or an outside event: the run ended, needs
    /// review, waits for a decision, or waits for an event (a sleeping run wakes by itself, so
    /// it is not at rest).
    pub fn at_rest(&self) -> bool {
        let asleep = self
            .question
            .as_ref()
            .is_some_and(|q| q.get("waiting_for").and_then(Value::as_str) == Some("time"));
        self.status.is_terminal()
            || self.status == RunStatus::NeedsReview
            || (self.status == RunStatus::Waiting && self.question.is_some() && !asleep)
    }
}

/// How an engine starts: see [`Trailmark::builder`].
#[must_use = "a builder does nothing until `start` is called"]
pub struct Builder {
    settings: Settings,
    registry: Registry,
    migrate: bool,
    shutdown: CancellationToken,
    signals: bool,
    components: Components,
    failpoints: Failpoints,
}

impl Builder {
    /// Creates the database when missing, applies the migrations and declares the broker
    /// topology before starting (what `trailmark migrate` does; idempotent). Off by default:
    /// in a fleet, one deploy step migrates, not every process.
    pub fn migrate(mut self, yes: bool) -> Self {
        self.migrate = yes;
        self
    }

    /// Stops the engine (and drains it) when `token` is cancelled.
    pub fn shutdown_on(mut self, token: CancellationToken) -> Self {
        self.shutdown = token;
        self
    }

    /// Stops the engine (and drains it) on SIGTERM or Ctrl-C too.
    pub fn until_signal(mut self) -> Self {
        self.signals = true;
        self
    }

    /// Which components this process runs (the CLI's `worker`, `relay`, `supervisor`).
    #[cfg(feature = "testkit")]
    pub fn components(mut self, components: Components) -> Self {
        self.components = components;
        self
    }

    /// Failpoints and drill seams (crash tests and drills).
    #[cfg(feature = "testkit")]
    pub fn failpoints(mut self, failpoints: Failpoints) -> Self {
        self.failpoints = failpoints;
        self
    }

    /// Starts the engine: migrates when asked, waits for Postgres and RabbitMQ (up to
    /// `process.startup_timeout_secs`), then serves in the background. A shutdown asked for
    /// before it started ends the wait with [`Error::Cancelled`].
    pub async fn start(self) -> Result<Trailmark, Error> {
        if self.signals {
            watch_signals(self.shutdown.clone())?;
        }
        let shutdown = self.shutdown.clone();
        let engine = tokio::select! {
            engine = self.prepare() => engine?,
            () = shutdown.cancelled() => return Err(Error::Cancelled),
        };
        let serving = tokio::spawn(process::run(
            engine.clone(),
            self.components,
            shutdown.clone(),
        ));
        Ok(Trailmark {
            engine,
            shutdown,
            serving: Mutex::new(Some(serving)),
        })
    }

    async fn prepare(&self) -> Result<Arc<Engine>, Error> {
        let settings = &self.settings;
        if self.migrate {
            migrate(settings).await?;
        }
        loop {
            crate::startup::check(settings)
                .await
                .map_err(|e| Error::from_cause("the servers trailmark needs are not ready", e))?;
            let made = Engine::with_failpoints(
                settings.clone(),
                self.registry.clone(),
                self.failpoints.clone(),
            )
            .await;
            match made {
                Ok(engine) => return Ok(engine),
                // The server went away between the check and the pool (a restart at that very
                // moment, found by the drills): check again, which waits for it.
                Err(e) if crate::reaction::reaction(&e) == Reaction::Retry => {
                    tracing::warn!(error = %Report(&e), "a server went away while the engine started; waiting for it again");
                }
                Err(e) => return Err(Error::from_cause("the engine cannot start", e)),
            }
        }
    }
}

/// Creates the database, applies the migrations, declares the topology.
async fn migrate(settings: &Settings) -> Result<(), Error> {
    let what = "preparing trailmark's database";
    store::ensure_database(&settings.database)
        .await
        .map_err(|e| Error::from_cause(what, e))?;
    let pool = store::connect(&settings.database)
        .await
        .map_err(|e| Error::from_cause(what, e))?;
    let applied = store::migrate(&pool).await;
    pool.close().await;
    applied.map_err(|e| Error::from_cause(what, e))?;
    crate::broker::declare_topology(&settings.broker)
        .await
        .map_err(|e| Error::from_cause("declaring the broker topology", e))?;
    Ok(())
}

/// Cancels `shutdown` on SIGTERM or Ctrl-C. Installed before anything waits: as PID 1 of a
/// container a process gets no default action for SIGTERM, and until a handler exists the
/// signal is dropped (a `podman stop` during start-up would wait for the runtime's SIGKILL).
fn watch_signals(shutdown: CancellationToken) -> Result<(), Error> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(|e| Error::Setup {
        what: "installing the SIGTERM handler".into(),
        source: Box::new(e),
    })?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("Ctrl-C: shutting down"),
            () = shutdown.cancelled() => return,
        }
        shutdown.cancel();
    });
    Ok(())
}

/// A running engine inside this program: it serves its workflows' runs in the background, and
/// starts, reads and decides runs for the program.
pub struct Trailmark {
    engine: Arc<Engine>,
    shutdown: CancellationToken,
    serving: Mutex<Option<JoinHandle<Result<(), process::Error>>>>,
}

impl Trailmark {
    /// Starts an engine with `settings` and the workflows of `registry`, stopped by
    /// [`Trailmark::shutdown`]; the servers must be prepared (`trailmark migrate`). For
    /// migration, signals or a shutdown token of your own, use [`Trailmark::builder`].
    pub async fn start(settings: Settings, registry: Registry) -> Result<Self, Error> {
        Self::builder(settings, registry).start().await
    }

    /// How an engine starts, step by step: `Trailmark::builder(settings, registry)
    /// .migrate(true).until_signal().start()`.
    pub fn builder(settings: Settings, registry: Registry) -> Builder {
        Builder {
            settings,
            registry,
            migrate: false,
            shutdown: CancellationToken::new(),
            signals: false,
            components: Components::ALL,
            failpoints: Failpoints::default(),
        }
    }

    /// The engine's inside, for the project's own tools.
    #[cfg(feature = "testkit")]
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The settings the engine runs with.
    pub fn settings(&self) -> &Settings {
        &self.engine.settings
    }

    /// Starts run `run_id` of `workflow` with `input`, as a run-start event from another service
    /// would (published with confirms; the worker creates the run). Starting the same id again
    /// with the same workflow and input starts nothing and is not an error; with another input
    /// it is refused. An input the workflow does not accept is refused before anything is sent.
    /// A workflow that debounces its starts ([`crate::Workflow::debounce`]) holds the start under
    /// its key: [`Trailmark::run`] finds no run until the burst ends, and none if a later start
    /// with the key replaced this one.
    pub async fn start_run(
        &self,
        run_id: &str,
        workflow: &str,
        input: &impl Serialize,
    ) -> Result<RunId, Error> {
        self.start_run_at(run_id, workflow, input, crate::flow::Priority::NORMAL)
            .await
    }

    /// [`Trailmark::start_run`] with a priority among the runs waiting for a slot of the run's
    /// concurrency key (see [`crate::Concurrency`]).
    pub async fn start_run_at(
        &self,
        run_id: &str,
        workflow: &str,
        input: &impl Serialize,
        priority: crate::flow::Priority,
    ) -> Result<RunId, Error> {
        let run_id = RunId::parse(run_id).map_err(|e| Error::Refused(e.to_string()))?;
        let input = serde_json::to_value(input).map_err(|e| {
            Error::Refused(format!("run {run_id}: the input cannot be made JSON: {e}"))
        })?;
        let event = RunStartEvent {
            priority: Some(priority),
            ..RunStartEvent::new(run_id.clone(), workflow, input)
        };
        let engine = &self.engine;
        let limit = engine.settings.worker.max_message_bytes;
        let (message, _) =
            crate::worker::start_message(&engine.registry, &engine.topology, limit, &event)
                .map_err(|refused| {
                    Error::Refused(format!("run {run_id}: {refused}; nothing was started"))
                })?;
        if let Some(run) = self.row(run_id.as_str()).await? {
            if !run.started_with(&event.workflow, &event.input) {
                return Err(Error::Refused(format!(
                    "run {run_id} exists with workflow {} and another input (status {}); use another run id",
                    run.workflow, run.status
                )));
            }
            return Ok(run_id);
        }
        crate::broker::publish_once(&self.engine.settings.broker, "embedded", &message)
            .await
            .map_err(|e| Error::from_cause(format!("publishing the start of run {run_id}"), e))?;
        Ok(run_id)
    }

    /// Sends the event `name` with match key `key` to the runs that wait for it (a wait's key
    /// is its run's id unless the step set another), with `payload` for the step that goes on.
    /// `id` makes it idempotent: the same id again is the same event and changes nothing, the
    /// same id with another payload is refused; `None` gives it a fresh id. An event no run
    /// waits for yet is kept (`waits.event_keep_secs`) for the first wait that comes. Recorded
    /// in the audit trail as sent by this program.
    pub async fn send_event(
        &self,
        name: &str,
        key: &str,
        id: Option<&str>,
        payload: &impl Serialize,
    ) -> Result<EventSent, Error> {
        let who = Decider::embedded("program", "");
        let payload = serde_json::to_value(payload).map_err(|e| {
            Error::Refused(format!(
                "event {name}: the payload cannot be made JSON: {e}"
            ))
        })?;
        let limit = self.engine.settings.worker.max_message_bytes;
        let event = crate::domain::InboundEvent::new(name, key, id, payload, limit)
            .map_err(|e| Error::Refused(format!("{e}; nothing was sent")))?;
        crate::wait::send(&self.engine, event, crate::wait::Sender::Audited(&who))
            .await
            .map_err(|e| Error::from_cause(format!("sending event {name} (key {key})"), e))
    }

    /// Where run `run_id` stands; `None` when no such run exists (yet: a started run appears
    /// once a worker took its start event).
    pub async fn run(&self, run_id: &str) -> Result<Option<RunView>, Error> {
        self.row(run_id).await?.map(RunView::from_row).transpose()
    }

    async fn row(&self, run_id: &str) -> Result<Option<runs::RunRow>, Error> {
        runs::get(&self.engine.pool, run_id)
            .await
            .map_err(|e| Error::from_cause(format!("reading run {run_id}"), e))
    }

    /// Waits until run `run_id` comes to rest (see [`RunView::at_rest`]): it ended, needs
    /// review, or waits for a person's decision. Fails with [`Error::StillMoving`] after
    /// `timeout`, and with [`Error::Refused`] if the run never appeared.
    pub async fn wait_for(&self, run_id: &str, timeout: Duration) -> Result<RunView, Error> {
        let started = Instant::now();
        // Polled: a run's rest is a row in Postgres, and a read every 50 ms costs little next
        // to a step; a caller waiting on many runs should read them in one query instead.
        let mut seen = None;
        loop {
            if let Some(run) = self.run(run_id).await? {
                if run.at_rest() {
                    return Ok(run);
                }
                seen = Some(run.status);
            }
            if started.elapsed() >= timeout {
                let waited_ms = started.elapsed().as_millis() as u64;
                return match seen {
                    Some(status) => Err(Error::StillMoving {
                        run_id: RunId::parse(run_id).map_err(|e| Error::Refused(e.to_string()))?,
                        status,
                        waited_ms,
                    }),
                    None => Err(Error::Refused(format!(
                        "run {run_id} did not appear within {waited_ms} ms: was it started, and does a worker serve its workflow?"
                    ))),
                };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Approves the decision run `run_id` waits for at `step`, as `who` with `reason` (both
    /// recorded in the audit trail): a human step completes and the run goes on.
    pub async fn approve(
        &self,
        run_id: &str,
        step: &str,
        who: &str,
        reason: &str,
    ) -> Result<(), Error> {
        self.decide(true, run_id, step, Decider::embedded(who, reason))
            .await
    }

    /// Rejects the decision run `run_id` waits for at `step`: the run goes where the step's
    /// `on_reject` says, or is cancelled.
    pub async fn reject(
        &self,
        run_id: &str,
        step: &str,
        who: &str,
        reason: &str,
    ) -> Result<(), Error> {
        self.decide(false, run_id, step, Decider::embedded(who, reason))
            .await
    }

    async fn decide(
        &self,
        approve: bool,
        run_id: &str,
        step: &str,
        who: Decider,
    ) -> Result<(), Error> {
        let (doing, decided) = match approve {
            true => (
                "approving",
                operator::approve(&self.engine, run_id, step, &who).await,
            ),
            false => (
                "rejecting",
                operator::reject(&self.engine, run_id, step, &who).await,
            ),
        };
        let what = || format!("{doing} run {run_id} at step {step}");
        decided.map(drop).map_err(|e| Error::from_cause(what(), e))
    }

    /// The token that stops this engine; cancel it from anywhere to begin the drain.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Serves until the shutdown token fires (or a signal, with
    /// [`Builder::until_signal`]), then drains and returns.
    pub async fn serve(&self) -> Result<(), Error> {
        let serving = self.serving.lock().await.take();
        match serving {
            Some(task) => match task.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(Error::Stopped(Box::new(e))),
                Err(e) => Err(Error::Stopped(Box::new(e))),
            },
            // Already awaited by an earlier call.
            None => Ok(()),
        }
    }

    /// Stops the engine: no new steps start, in-flight steps finish (or are abandoned
    /// uncommitted after one lease), then the pool closes.
    pub async fn shutdown(self) -> Result<(), Error> {
        self.shutdown.cancel();
        let served = self.serve().await;
        self.engine.pool.close().await;
        served
    }
}
