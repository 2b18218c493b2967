//! The systems under test behind one interface: their processes, how a run is started, how
//! progress is read, and the committed timestamps the latency figures come from.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use super::env::{BenchEnv, Proc};
use super::{Error, Result, baseline, peer};
use trailmark::broker::Outgoing;
use trailmark::domain::{RunId, RunStartEvent};
use trailmark::inspect;
use trailmark_testkit::chain::Ledger;

/// Which system a figure belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum System {
    /// `chain` runs on `trailmark serve` processes, every guarantee on, each link's ledger row
    /// written with its step's commit (`ctx.local_write`: the ledger is a table of trailmark's
    /// own database, as B3's is of its own).
    Trailmark,
    /// The same `chain` with each ledger row an outside write (`ctx.effect`: intent recorded
    /// before the call, the ledger's own insert, result recorded after), what a write to
    /// another system's store costs.
    TrailmarkEffect,
    /// The bare loop of [`baseline`], its model answers over HTTP like trailmark's.
    B3,
    /// The same bare loop with its answers made in-process (same size, no HTTP): what B3 costs
    /// without the model call's own overhead.
    B3Local,
    /// B3 with every answer journaled the moment it arrives ([`baseline::Promises::Journal`]):
    /// the price list's first line.
    B3Journal,
    /// B3 with the journal, attempts and fencing ([`baseline::Promises::Fenced`]): the records
    /// trailmark's promises rest on, so trailmark against it is the engine's own overhead.
    B3Fenced,
    /// The opt-in DBOS-Rust peer of [`peer`] (`trailmark-peer-dbos` processes).
    Dbos,
    /// `pychain`, the same chain written with the Python SDK and served by its endpoint
    /// ([`super::python`]), on the same `trailmark serve` processes, each ledger row an
    /// outside write: what a step in another language costs (`--remote`).
    PyChain,
}

/// How far the runs with one id prefix are.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// Runs finished.
    pub runs_done: i64,
    /// Steps committed.
    pub steps_done: i64,
    /// A run that stopped without finishing, with its status and error.
    pub stopped: Option<String>,
}

impl From<inspect::Progress> for Progress {
    fn from(p: inspect::Progress) -> Self {
        Self {
            runs_done: p.succeeded,
            steps_done: p.steps_committed,
            stopped: p.stopped.map(|r| {
                format!(
                    "{} is {}: {}",
                    r.run_id,
                    r.status,
                    r.error.unwrap_or_default()
                )
            }),
        }
    }
}

/// NOTIFY channel of the baseline's and the peer's finished runs, used by the unloaded phase
/// only (trailmark's is the engine's [`inspect::RUN_FINISHED_CHANNEL`]).
pub const DONE_CHANNEL: &str = "bench_done";

impl System {
    /// Name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::Trailmark => "trailmark",
            Self::TrailmarkEffect => "trailmark effect",
            Self::B3 => "B3",
            Self::B3Local => "B3 in-process",
            Self::B3Journal => "B3 +journal",
            Self::B3Fenced => "B3 +journal +fencing",
            Self::Dbos => "DBOS",
            Self::PyChain => "pychain (Python)",
        }
    }

    /// Empties the system's tables, so every repetition starts alike.
    pub async fn reset(self, env: &BenchEnv) -> Result<()> {
        let sql = match self {
            Self::Trailmark | Self::TrailmarkEffect | Self::PyChain => {
                inspect::erase_runs(&env.pool).await?;
                trailmark_testkit::ledger::erase_ledger(&env.pool).await?;
                return Ok(());
            }
            Self::B3 | Self::B3Local | Self::B3Journal | Self::B3Fenced => {
                "TRUNCATE b3.inbox, b3.checkpoints, b3.ledger, b3.outbox, b3.journal, b3.runs, b3.steps"
            }
            Self::Dbos => peer::RESET,
        };
        sqlx::raw_sql(sql).execute(&env.pool).await?;
        Ok(())
    }

    /// Starts `workers` processes: `trailmark serve` (worker + relay + supervisor) or B3
    /// processes (consumer + relay), both from the current executable, or DBOS peer processes
    /// from the `trailmark-peer-dbos` binary next to it.
    pub fn spawn(
        self,
        env: &BenchEnv,
        workers: usize,
        tag: &str,
        answer_bytes: usize,
    ) -> Result<Vec<Proc>> {
        let bytes = answer_bytes.to_string();
        let poll = peer::POLL_MS.to_string();
        (0..workers)
            .map(|i| match self {
                Self::Trailmark | Self::TrailmarkEffect | Self::PyChain => {
                    env.spawn(&format!("{tag}-serve-{i}"), &["serve"])
                }
                Self::B3 => env.spawn(
                    &format!("{tag}-b3-{i}"),
                    &["bench", "--b3-worker", "--answer-bytes", &bytes],
                ),
                Self::B3Local => env.spawn(
                    &format!("{tag}-b3local-{i}"),
                    &[
                        "bench",
                        "--b3-worker",
                        "--answer-bytes",
                        &bytes,
                        "--b3-local-answers",
                    ],
                ),
                Self::B3Journal | Self::B3Fenced => {
                    let promises = if self == Self::B3Journal {
                        baseline::Promises::Journal
                    } else {
                        baseline::Promises::Fenced
                    };
                    env.spawn(
                        &format!("{tag}-b3{}-{i}", promises.arg()),
                        &[
                            "bench",
                            "--b3-worker",
                            "--answer-bytes",
                            &bytes,
                            "--b3-promises",
                            promises.arg(),
                        ],
                    )
                }
                Self::Dbos => env.spawn_program(
                    &format!("{tag}-dbos-{i}"),
                    &peer::dbos_binary(&env.exe)?,
                    &["--answer-bytes", &bytes, "--poll-ms", &poll],
                    &[],
                ),
            })
            .collect()
    }

    /// Waits until the `workers` processes just started are ready to take runs: consumers on
    /// the queue (trailmark, B3), or DBOS launched with its queue registered (the peer).
    pub async fn wait_ready(
        self,
        env: &BenchEnv,
        procs: &mut [Proc],
        within: Duration,
    ) -> Result<()> {
        let workers = procs.len();
        let queue = match self {
            Self::Trailmark | Self::TrailmarkEffect | Self::PyChain => env.topology().steps_queue(),
            Self::B3 | Self::B3Local | Self::B3Journal | Self::B3Fenced => {
                baseline::queue(&env.prefix)
            }
            Self::Dbos => return peer_ready(env, procs, within).await,
        };
        env.wait_consumers(&queue, workers as u32, within).await
    }

    /// Starts runs the way an upstream service would: one confirmed message each.
    /// DBOS runs are enqueued onto the peer's DBOS queue in one statement instead.
    pub async fn start_runs(self, env: &BenchEnv, ids: &[String], steps: i32) -> Result<()> {
        if self == Self::Dbos {
            sqlx::query(peer::ENQUEUE)
                .bind(ids)
                .bind(steps)
                .execute(&env.pool)
                .await?;
            return Ok(());
        }
        let msgs = ids
            .iter()
            .map(|id| match self {
                Self::Trailmark => trailmark_start(env, id, (CHAIN, steps), Ledger::Local),
                Self::TrailmarkEffect => trailmark_start(env, id, (CHAIN, steps), Ledger::Effect),
                Self::PyChain => trailmark_start(env, id, (PYCHAIN, steps), Ledger::Effect),
                Self::B3 | Self::B3Local | Self::B3Journal | Self::B3Fenced => {
                    Ok(baseline::Message::start(&env.prefix, id, steps))
                }
                Self::Dbos => unreachable!("DBOS runs are enqueued above"),
            })
            .collect::<Result<Vec<_>>>()?;
        env.publish(&msgs).await
    }

    /// Progress of the runs whose id starts with `prefix`: for the recovery bench (trailmark)
    /// and DBOS, whose tables have no index to read runs by id; B3 is read by id only
    /// ([`System::progress_of`]).
    pub async fn progress(self, env: &BenchEnv, prefix: &str) -> Result<Progress> {
        let sql = match self {
            Self::Trailmark | Self::TrailmarkEffect | Self::PyChain => {
                return Ok(Progress::from(inspect::progress(&env.pool, prefix).await?));
            }
            Self::B3 | Self::B3Local | Self::B3Journal | Self::B3Fenced => {
                unreachable!("B3's progress is read by run id: progress_of")
            }
            Self::Dbos => peer::PROGRESS,
        };
        let (runs_done, steps_done, stopped) = sqlx::query_as(sql)
            .bind(format!("{prefix}%"))
            .fetch_one(&env.pool)
            .await?;
        Ok(Progress {
            runs_done,
            steps_done,
            stopped,
        })
    }

    /// Progress of the runs `ids` names, read through the primary key where the system has one
    /// on its run ids, so that polling it costs the same beside any number of other runs.
    pub async fn progress_of(self, env: &BenchEnv, ids: &[String]) -> Result<Progress> {
        let sql = match self {
            Self::Trailmark | Self::TrailmarkEffect | Self::PyChain => {
                return Ok(Progress::from(inspect::progress_of(&env.pool, ids).await?));
            }
            Self::B3 | Self::B3Local | Self::B3Journal | Self::B3Fenced => {
                "SELECT count(*) FILTER (WHERE done), count(*) FILTER (WHERE seq >= 0), NULL::text
                   FROM b3.checkpoints WHERE run_id = ANY($1)"
            }
            Self::Dbos => {
                let prefix = ids
                    .first()
                    .and_then(|id| id.rsplit_once('-'))
                    .map_or(String::new(), |(p, _)| format!("{p}-"));
                return self.progress(env, &prefix).await;
            }
        };
        let (runs_done, steps_done, stopped) =
            sqlx::query_as(sql).bind(ids).fetch_one(&env.pool).await?;
        Ok(Progress {
            runs_done,
            steps_done,
            stopped,
        })
    }

    /// Commit-to-commit gaps between consecutive steps of one run (runs starting with
    /// `prefix`): p50 and p99 in milliseconds. trailmark and B3 stamp a step with the start time
    /// of the transaction that commits it, the DBOS peer with the time of its ledger insert (the
    /// second of its two DBOS steps); either way the gap is one full step cycle.
    pub async fn step_gaps(self, env: &BenchEnv, prefix: &str) -> Result<(f64, f64)> {
        let sql = match self {
            Self::Trailmark | Self::TrailmarkEffect | Self::PyChain => {
                let g = inspect::step_gap_percentiles(&env.pool, prefix).await?;
                return Ok((g.p50_ms.unwrap_or(0.0), g.p99_ms.unwrap_or(0.0)));
            }
            Self::Dbos => peer::STEP_GAPS,
            Self::B3 | Self::B3Local | Self::B3Journal | Self::B3Fenced => {
                "WITH g AS (SELECT committed_at - lag(committed_at) OVER (PARTITION BY run_id ORDER BY seq) AS gap
                              FROM b3.checkpoints WHERE run_id LIKE $1 AND seq >= 0)
                 SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM gap))::float8 * 1000,
                        percentile_cont(0.99) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM gap))::float8 * 1000
                   FROM g WHERE gap IS NOT NULL"
            }
        };
        let (p50, p99): (Option<f64>, Option<f64>) = sqlx::query_as(sql)
            .bind(format!("{prefix}%"))
            .fetch_one(&env.pool)
            .await?;
        Ok((p50.unwrap_or(0.0), p99.unwrap_or(0.0)))
    }

    /// The NOTIFY channel [`System::watch_done`] makes finished runs announce themselves on.
    pub fn done_channel(self) -> &'static str {
        match self {
            Self::Trailmark | Self::TrailmarkEffect | Self::PyChain => {
                inspect::RUN_FINISHED_CHANNEL
            }
            Self::B3 | Self::B3Local | Self::B3Journal | Self::B3Fenced | Self::Dbos => {
                DONE_CHANNEL
            }
        }
    }

    /// Makes (or stops making) every run that finishes NOTIFY [`System::done_channel`] with its
    /// id at its final commit, so the unloaded phase sees that commit without polling: the
    /// engine's own [`inspect::notify_run_finishes`] for trailmark, a trigger on the baseline's
    /// or the peer's own tables for the others.
    pub async fn watch_done(self, env: &BenchEnv, on: bool) -> Result<()> {
        if matches!(
            self,
            Self::Trailmark | Self::TrailmarkEffect | Self::PyChain
        ) {
            if on {
                inspect::notify_run_finishes(&env.pool).await?;
            } else {
                inspect::stop_notifying_run_finishes(&env.pool).await?;
            }
            return Ok(());
        }
        if self == Self::Dbos {
            sqlx::query(peer::UNWATCH).execute(&env.pool).await?;
            if on {
                sqlx::query(peer::WATCH_FUNCTION).execute(&env.pool).await?;
                sqlx::query(peer::WATCH_TRIGGER).execute(&env.pool).await?;
            }
            return Ok(());
        }
        sqlx::query("DROP TRIGGER IF EXISTS bench_done ON b3.checkpoints")
            .execute(&env.pool)
            .await?;
        if !on {
            return Ok(());
        }
        let function = format!(
            "CREATE OR REPLACE FUNCTION public.bench_done() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_notify('{DONE_CHANNEL}', NEW.run_id); RETURN NULL; END $$"
        );
        sqlx::query(sqlx::AssertSqlSafe(function))
            .execute(&env.pool)
            .await?;
        sqlx::query(
            "CREATE TRIGGER bench_done AFTER INSERT ON b3.checkpoints FOR EACH ROW
             WHEN (NEW.done) EXECUTE FUNCTION public.bench_done()",
        )
        .execute(&env.pool)
        .await?;
        Ok(())
    }

    /// Ledger rows and distinct references of the runs whose id starts with `prefix`: exactly
    /// one per step when every step's write happened once.
    pub async fn ledger(self, env: &BenchEnv, prefix: &str) -> Result<(i64, i64)> {
        let sql = match self {
            Self::Trailmark | Self::TrailmarkEffect | Self::PyChain => {
                let c = trailmark_testkit::ledger::ledger_counts(&env.pool, prefix).await?;
                return Ok((c.rows, c.distinct));
            }
            Self::B3 | Self::B3Local | Self::B3Journal | Self::B3Fenced => {
                "SELECT count(*), count(DISTINCT reference) FROM b3.ledger WHERE run_id LIKE $1"
            }
            Self::Dbos => {
                "SELECT count(*), count(DISTINCT reference) FROM dbos_peer.ledger WHERE run_id LIKE $1"
            }
        };
        Ok(sqlx::query_as(sql)
            .bind(format!("{prefix}%"))
            .fetch_one(&env.pool)
            .await?)
    }
}

/// Waits until every peer process has launched DBOS (its migrations ran) and registered the
/// queue; fails early if one exits.
async fn peer_ready(env: &BenchEnv, procs: &mut [Proc], within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass('dbos_peer.ready') IS NOT NULL")
            .fetch_one(&env.pool)
            .await?;
        let ready: i64 = if exists {
            sqlx::query_scalar(peer::READY).fetch_one(&env.pool).await?
        } else {
            0
        };
        if ready >= procs.len() as i64 {
            return Ok(());
        }
        for p in procs.iter_mut() {
            p.check_alive()?;
        }
        if Instant::now() > deadline {
            return Err(Error::Failed(format!(
                "{ready} of {} DBOS peer processes were ready after {within:?}; see their logs in {}",
                procs.len(),
                env.log_dir.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The built-in chain's name, and its Python twin's: the same input, ledger and keys.
const CHAIN: &str = trailmark_testkit::chain::NAME;
const PYCHAIN: &str = trailmark_testkit::pychain::NAME;

/// The start of run `id` of `workflow` (`chain` or `pychain`) with `steps` links.
fn trailmark_start(
    env: &BenchEnv,
    id: &str,
    (workflow, steps): (&str, i32),
    ledger: Ledger,
) -> Result<Outgoing> {
    let run_id =
        RunId::parse(id).map_err(|e| Error::Failed(format!("bench run id {id:?}: {e}")))?;
    let ledger = match ledger {
        Ledger::Local => "local",
        Ledger::Effect => "effect",
    };
    let event = RunStartEvent::new(
        run_id,
        workflow,
        json!({ "steps": steps, "ledger": ledger }),
    );
    Ok(env.topology().run_start(&event))
}
