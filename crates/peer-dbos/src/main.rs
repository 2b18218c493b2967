//! `trailmark-peer-dbos`: one process of the bench's DBOS-Rust peer (`trailmark bench --peer
//! dbos` starts it; it is not meant to be run by hand).
//!
//! It launches a DBOS executor on the bench database (DBOS's system tables in schema `dbos`),
//! registers the queue the bench enqueues runs onto with a per-process concurrency of
//! `worker.concurrency` (the deliveries trailmark and B3 keep in flight), and runs workflow
//! `chain`: per step, one DBOS step that asks the model (the same request as trailmark's `chain`
//! and B3, over HTTP to the bench's stand-in model server, or the in-process stand-in answer when
//! no model is configured; DBOS records the answer as the step's output) and one DBOS step that
//! inserts the step's ledger row keyed `run:seq` (ON CONFLICT DO NOTHING). The contract with the
//! bench (names, SQL, the enqueued arguments) is `trailmark_bench::peer`.
//!
//! Settings come from the environment the bench gives every child (`DATABASE_URL`,
//! `TRAILMARK__DATABASE__MAX_CONNECTIONS`, `TRAILMARK__MODEL__BASE_URL`, `TRAILMARK_CONFIG`, ...),
//! read with trailmark's own loader. SIGTERM or Ctrl-C shuts DBOS down and exits 0.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use dbos::{
    Config, DBOS, Enqueue, QueueConflict, QueueOptions, StartOptions, StepOptions, WorkflowRef,
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use trailmark::config::Settings;
use trailmark::model::ModelClient;
use trailmark_bench::baseline::Answers;
use trailmark_bench::peer::{self, Enqueued, RunArgs};

/// What the bench tells the peer; everything else comes from the children's environment.
#[derive(Debug, Parser)]
#[command(
    name = "trailmark-peer-dbos",
    version,
    about = "One process of the DBOS peer that `trailmark bench --peer dbos` starts"
)]
struct Args {
    /// Bytes of the in-process stand-in answer, used when no model server is configured.
    #[arg(long, default_value_t = trailmark_bench::BUILTIN_ANSWER_BYTES)]
    answer_bytes: usize,
    /// How often DBOS polls the bench queue for runs, in milliseconds.
    #[arg(long, default_value_t = peer::POLL_MS, value_parser = clap::value_parser!(u64).range(1..))]
    poll_ms: u64,
}

/// What the workflow's steps use: the ledger's pool and the model.
struct Work {
    ledger: PgPool,
    answers: Answers,
}

/// A step that failed (the model call or the ledger insert), as DBOS records it.
#[derive(Debug, thiserror::Error, Serialize, Deserialize)]
#[error("{0}")]
struct StepFailed(String);

fn failed(what: String) -> dbos::Error<StepFailed> {
    dbos::Error::Application(StepFailed(what))
}

impl Work {
    /// The model's answer to link `seq` of `run`.
    async fn answer(&self, run: &str, seq: i32, steps: i32) -> dbos::Result<String, StepFailed> {
        self.answers.answer(run, seq, steps).await.map_err(failed)
    }

    /// Inserts the ledger row of link `seq` of `run`; false if it was already there.
    async fn post(&self, run: &str, seq: i32, payload: &str) -> dbos::Result<bool, StepFailed> {
        let reference = format!("{run}:{seq}");
        let done = sqlx::query(peer::LEDGER_INSERT)
            .bind(&reference)
            .bind(run)
            .bind(seq)
            .bind(payload)
            .execute(&self.ledger)
            .await
            .map_err(|e| failed(format!("ledger insert {reference}: {e}")))?;
        Ok(done.rows_affected() == 1)
    }
}

/// A few quick retries, as a DBOS application would give a model call or an insert; a step
/// that still fails fails its run, which the bench reports.
fn retries() -> StepOptions<StepFailed> {
    StepOptions {
        max_attempts: 3,
        interval: Duration::from_millis(100),
        ..Default::default()
    }
}

/// The workflow: `steps` links, each a recorded model answer and a keyed ledger insert.
async fn chain(work: Arc<Work>, input: Enqueued) -> dbos::Result<i32, StepFailed> {
    let RunArgs { run, steps } = input.run().map_err(failed)?;
    for seq in 0..steps {
        let answer: String =
            dbos::step_with("answer", retries(), || work.answer(&run, seq, steps)).await?;
        let payload = trailmark::domain::request_hash(&json!(answer));
        let _created: bool =
            dbos::step_with("ledger", retries(), || work.post(&run, seq, &payload)).await?;
    }
    Ok(steps)
}

/// The peer's own tables, created once whichever process gets there first.
async fn create_tables(pool: &PgPool) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('trailmark-peer-dbos'))")
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql(peer::PEER_DDL).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// Waits until DBOS's poller of the bench queue has come down to its floor.
///
/// A DBOS queue worker starts polling at DBOS's default of 1 s and walks towards the queue's own
/// interval by 10% per quiet poll, about 10 s from launch to a 10 ms floor. Runs started before
/// then wait up to a second for the poll, which would measure the start-up rather than DBOS (as
/// a run on a cold trailmark would). So the peer enqueues no-op probe workflows, one at a time,
/// until one is dequeued within a few poll intervals of being enqueued, and only then reports
/// ready.
async fn settle_poller(
    probe: &WorkflowRef<(), ()>,
    pool: &PgPool,
    executor_id: &str,
    poll: Duration,
) -> anyhow::Result<()> {
    let settled_ms = 3 * poll.as_millis() as i64 + 5;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut last_ms = None;
    for n in 0_u64.. {
        if tokio::time::Instant::now() > deadline {
            let last = last_ms.map_or("none was dequeued".to_owned(), |ms: i64| {
                format!("the last waited {ms} ms for its dequeue")
            });
            anyhow::bail!(
                "DBOS's queue poller did not come down to {} ms within 60 s ({last}); is Postgres \
                 overloaded? The peer's log has DBOS's own warnings",
                poll.as_millis()
            );
        }
        let id = format!("probe-{executor_id}-{n}");
        let options = StartOptions {
            workflow_id: Some(&id),
            queue: Some(Enqueue::new(peer::QUEUE)),
            ..Default::default()
        };
        probe
            .start_with((), options)
            .await
            .with_context(|| format!("enqueueing probe workflow {id}"))?;
        // The probe's own dequeue is what is waited for, a few ms at a time.
        let waited = loop {
            let row: Option<(Option<i64>,)> = sqlx::query_as(
                "SELECT started_at_epoch_ms - created_at FROM dbos.workflow_status
                  WHERE workflow_uuid = $1 AND status = 'SUCCESS'",
            )
            .bind(&id)
            .fetch_optional(pool)
            .await
            .with_context(|| format!("reading probe workflow {id}"))?;
            if let Some((waited,)) = row {
                break waited.unwrap_or(i64::MAX);
            }
            if tokio::time::Instant::now() > deadline {
                break i64::MAX;
            }
            tokio::time::sleep(poll / 2).await;
        };
        last_ms = Some(waited);
        if waited <= settled_ms {
            break;
        }
    }
    Ok(())
}

/// Waits for SIGTERM (the bench stopping its children) or Ctrl-C.
async fn stopped() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    tokio::select! {
        _ = term.recv() => {}
        r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
    }
    Ok(())
}

async fn run(args: Args) -> anyhow::Result<()> {
    let settings = Settings::load().context("loading the settings (DATABASE_URL, TRAILMARK__*)")?;
    let url = settings.database.url.clone();
    let shown = trailmark::redact::url(&url);
    // trailmark's split: `pool` connections for the engine (here DBOS's system database), half
    // as many more for the step's own writes (here the ledger).
    let pool = settings.database.max_connections.max(1);
    let ledger = PgPoolOptions::new()
        .max_connections((pool / 2).max(1))
        .connect(&url)
        .await
        .with_context(|| format!("connecting to {shown} for the ledger; is Postgres up?"))?;
    create_tables(&ledger)
        .await
        .with_context(|| format!("creating the peer's tables in {shown}"))?;
    let answers = if settings.model.is_configured() {
        Answers::Http(ModelClient::new(&settings.model).context("the model client")?)
    } else {
        Answers::Local(args.answer_bytes)
    };
    let work = Arc::new(Work {
        ledger: ledger.clone(),
        answers,
    });

    // One executor id per process: at launch DBOS recovers the workflows its executor id left
    // PENDING, and two processes sharing one would take each other's runs.
    let executor_id = format!("peer-{}", std::process::id());
    let dbos = DBOS::new(Config {
        app_version: Some("bench".into()),
        executor_id: Some(executor_id.clone()),
        max_connections: pool,
        schema: peer::DBOS_SCHEMA.into(),
        ..Config::new(peer::APP_NAME, url)
    });
    dbos.register_workflow(peer::WORKFLOW, move |input: Enqueued| {
        chain(Arc::clone(&work), input)
    })
    .context("registering the workflow")?;
    let probe: WorkflowRef<(), ()> = dbos
        .register_workflow("probe", |(): ()| async { Ok(()) })
        .context("registering the probe workflow")?;
    dbos.launch()
        .await
        .with_context(|| format!("launching DBOS on {shown}"))?;
    let concurrency = i32::from(settings.worker.concurrency.max(1));
    let queue = QueueOptions {
        worker_concurrency: Some(concurrency),
        polling_interval: Duration::from_millis(args.poll_ms),
        ..Default::default()
    };
    let registered = match dbos
        .register_queue(peer::QUEUE, queue, QueueConflict::AlwaysUpdate)
        .await
    {
        Ok(_) => {
            let poll = Duration::from_millis(args.poll_ms);
            settle_poller(&probe, &ledger, &executor_id, poll).await
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("registering queue {}", peer::QUEUE))),
    };
    let ready = match registered {
        Ok(()) => sqlx::query(
            "INSERT INTO dbos_peer.ready (executor_id, pid) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(&executor_id)
        .bind(std::process::id() as i32)
        .execute(&ledger)
        .await
        .map(drop)
        .context("reporting ready"),
        Err(e) => Err(e),
    };
    let outcome = match ready {
        Ok(()) => {
            tracing::info!(executor_id, concurrency, "DBOS peer ready");
            stopped().await
        }
        Err(e) => Err(e),
    };
    // Running workflows stay PENDING, as DBOS leaves them on any shutdown.
    dbos.shutdown().await;
    ledger.close().await;
    outcome
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("trailmark-peer-dbos: {e:#}");
            ExitCode::FAILURE
        }
    }
}
