//! The two systems under test behind one interface: their processes, how a run is started,
//! how progress is read, and the committed timestamps the latency figures come from.

use serde::Serialize;
use serde_json::json;

use super::env::{BenchEnv, Proc};
use super::{Error, Result, baseline};
use trailmark::broker::Outgoing;
use trailmark::domain::{RunId, RunStartEvent};

/// Which system a figure belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum System {
    /// `chain` runs on `trailmark serve` processes, every guarantee on.
    Trailmark,
    /// The bare loop of [`baseline`].
    B3,
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

/// NOTIFY channel of finished runs, used by the unloaded phase only.
pub const DONE_CHANNEL: &str = "bench_done";

impl System {
    /// Name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::Trailmark => "trailmark",
            Self::B3 => "B3",
        }
    }

    /// Empties the system's tables, so every repetition starts alike.
    pub async fn reset(self, env: &BenchEnv) -> Result<()> {
        let sql = match self {
            // Every per-run table is named: they have no foreign key to runs for CASCADE to follow.
            Self::Trailmark => {
                "TRUNCATE trailmark.runs, trailmark.steps, trailmark.journal, trailmark.effects,
                          trailmark.parked, trailmark.decisions, trailmark.inbox, trailmark.outbox,
                          trailmark.chain_ledger"
            }
            Self::B3 => "TRUNCATE b3.inbox, b3.checkpoints, b3.ledger, b3.outbox",
        };
        sqlx::query(sql).execute(&env.pool).await?;
        Ok(())
    }

    /// Starts `workers` processes: `trailmark serve` (worker + relay + supervisor), or B3
    /// processes (consumer + relay), both from the current executable.
    pub fn spawn(
        self,
        env: &BenchEnv,
        workers: usize,
        tag: &str,
        answer_bytes: usize,
    ) -> Result<Vec<Proc>> {
        let bytes = answer_bytes.to_string();
        (0..workers)
            .map(|i| match self {
                Self::Trailmark => env.spawn(&format!("{tag}-serve-{i}"), &["serve"]),
                Self::B3 => env.spawn(
                    &format!("{tag}-b3-{i}"),
                    &["bench", "--b3-worker", "--answer-bytes", &bytes],
                ),
            })
            .collect()
    }

    /// The queue whose consumer count shows that the processes are up.
    pub fn queue(self, env: &BenchEnv) -> String {
        match self {
            Self::Trailmark => env.topology().steps_queue(),
            Self::B3 => baseline::queue(&env.prefix),
        }
    }

    /// Starts runs the way an upstream service would: one confirmed message each.
    pub async fn start_runs(self, env: &BenchEnv, ids: &[String], steps: i32) -> Result<()> {
        let msgs = ids
            .iter()
            .map(|id| match self {
                Self::Trailmark => trailmark_start(env, id, steps),
                Self::B3 => Ok(baseline::Message::start(&env.prefix, id, steps)),
            })
            .collect::<Result<Vec<_>>>()?;
        env.publish(&msgs).await
    }

    /// Progress of the runs whose id starts with `prefix`.
    pub async fn progress(self, env: &BenchEnv, prefix: &str) -> Result<Progress> {
        let sql = match self {
            Self::Trailmark => {
                "SELECT count(*) FILTER (WHERE status = 'succeeded'), COALESCE(sum(step_seq), 0)::bigint,
                        min(run_id || ' is ' || status || ': ' || COALESCE(error, '')) FILTER (WHERE status NOT IN ('running', 'succeeded'))
                   FROM trailmark.runs WHERE run_id LIKE $1"
            }
            Self::B3 => {
                "SELECT count(*) FILTER (WHERE done), count(*) FILTER (WHERE seq >= 0), NULL::text
                   FROM b3.checkpoints WHERE run_id LIKE $1"
            }
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

    /// Commit-to-commit gaps between consecutive steps of one run (runs starting with
    /// `prefix`): p50 and p99 in milliseconds. Both systems stamp a step with the start time of
    /// the transaction that commits it, so the gap is one full step cycle.
    pub async fn step_gaps(self, env: &BenchEnv, prefix: &str) -> Result<(f64, f64)> {
        let sql = match self {
            Self::Trailmark => {
                "WITH g AS (SELECT finished_at - lag(finished_at) OVER (PARTITION BY run_id ORDER BY seq) AS gap
                              FROM trailmark.steps WHERE run_id LIKE $1)
                 SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM gap))::float8 * 1000,
                        percentile_cont(0.99) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM gap))::float8 * 1000
                   FROM g WHERE gap IS NOT NULL"
            }
            Self::B3 => {
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

    /// Installs (or removes) a trigger that NOTIFYs [`DONE_CHANNEL`] with the run id when a run
    /// finishes, so the unloaded phase sees the final commit without polling.
    pub async fn watch_done(self, env: &BenchEnv, on: bool) -> Result<()> {
        let table = match self {
            Self::Trailmark => "trailmark.runs",
            Self::B3 => "b3.checkpoints",
        };
        let drop = format!("DROP TRIGGER IF EXISTS bench_done ON {table}");
        sqlx::query(sqlx::AssertSqlSafe(drop))
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
        let trigger = match self {
            Self::Trailmark => "CREATE TRIGGER bench_done AFTER UPDATE ON trailmark.runs FOR EACH ROW
                 WHEN (NEW.finished_at IS NOT NULL AND OLD.finished_at IS NULL) EXECUTE FUNCTION public.bench_done()",
            Self::B3 => "CREATE TRIGGER bench_done AFTER INSERT ON b3.checkpoints FOR EACH ROW
                 WHEN (NEW.done) EXECUTE FUNCTION public.bench_done()",
        };
        sqlx::query(trigger).execute(&env.pool).await?;
        Ok(())
    }
}

fn trailmark_start(env: &BenchEnv, id: &str, steps: i32) -> Result<Outgoing> {
    let run_id =
        RunId::parse(id).map_err(|e| Error::Failed(format!("bench run id {id:?}: {e}")))?;
    let event = RunStartEvent::new(
        run_id,
        trailmark::builtin::chain::NAME,
        json!({ "steps": steps }),
    );
    Ok(env.topology().run_start(&event))
}
