//! The opt-in peer (`--peer dbos`): DBOS-Rust (crate `dbos`), Postgres-only durable execution
//! with a checkpoint per step, doing the work trailmark and B3 do. It runs in its own binary,
//! `trailmark-peer-dbos` (crate `crates/peer-dbos`), which the bench starts like a B3 worker, so
//! that neither the engine nor the `trailmark` binary links DBOS.
//!
//! This module is the contract between the bench and that binary: where the binary is, the names
//! of its schemas, queue and workflow, the ledger it writes, the arguments a run is enqueued with,
//! and the SQL the bench starts runs and reads progress with. Both sides use these, so they
//! cannot drift apart.
//!
//! How a run goes: the bench enqueues it onto the DBOS queue [`QUEUE`] with DBOS's own SQL
//! enqueue function (the way a service in any language starts DBOS work, like trailmark's run
//! start message); the peer's DBOS executor dequeues up to `worker.concurrency` at once (the
//! queue's per-process concurrency, like the prefetch of trailmark and B3) and runs workflow
//! [`WORKFLOW`]: per step one DBOS step that calls the model (the answer is DBOS's recorded step
//! output) and one that inserts the step's ledger row keyed `run:seq`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Error, Result};
use trailmark::model::{ChatMessage, ChatRequest};

/// A peer the bench can measure beside trailmark and B3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Peer {
    /// DBOS-Rust, in the `trailmark-peer-dbos` binary.
    Dbos,
}

/// File name of the peer's binary, looked for next to the `trailmark` executable.
pub const DBOS_BINARY: &str = "trailmark-peer-dbos";

/// Schema of DBOS's own system tables (DBOS's default), in the bench database.
pub const DBOS_SCHEMA: &str = "dbos";

/// Schema of the peer's ledger and readiness rows, in the bench database.
pub const PEER_SCHEMA: &str = "dbos_peer";

/// The DBOS queue runs are enqueued onto.
pub const QUEUE: &str = "bench";

/// The DBOS workflow a run is (registered under this name by the peer).
pub const WORKFLOW: &str = "chain";

/// DBOS application name of the peer processes (also what their Postgres rows are owned by).
pub const APP_NAME: &str = "trailmark_bench_peer";

/// How often the peer's DBOS executor polls the queue, in ms. DBOS queues are polled (1 s by
/// default); a queue-bound benchmark at the default would measure mostly the poll, so it is set
/// low enough that a freed slot waits little, and printed with the report.
pub const POLL_MS: u64 = 10;

/// The peer's own tables: the ledger (one row per step, keyed `run:seq`, stamped with the time
/// of the insert, which the step gaps are read from) and one row per process once it is ready.
/// Created by the peer under an advisory lock, so several processes may start at once.
pub const PEER_DDL: &str = "
CREATE SCHEMA IF NOT EXISTS dbos_peer;
CREATE TABLE IF NOT EXISTS dbos_peer.ledger (reference TEXT PRIMARY KEY, run_id TEXT NOT NULL,
    step INTEGER NOT NULL, payload TEXT NOT NULL, committed_at TIMESTAMPTZ NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS dbos_peer.ready (executor_id TEXT PRIMARY KEY, pid INTEGER NOT NULL,
    ready_at TIMESTAMPTZ NOT NULL DEFAULT now());
";

/// The ledger insert of one step; a repeated insert (a step re-run after a crash) changes nothing.
pub const LEDGER_INSERT: &str = "INSERT INTO dbos_peer.ledger (reference, run_id, step, payload)
    VALUES ($1, $2, $3, $4) ON CONFLICT (reference) DO NOTHING";

/// What one run is told: its id and length.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunArgs {
    /// Run id, also the DBOS workflow id.
    pub run: String,
    /// Steps in the run.
    pub steps: i32,
}

/// The workflow's input as DBOS's SQL enqueue function stores it (`portable_json`: positional
/// and named arguments); the peer's workflow takes this and reads the one positional argument.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Enqueued {
    /// Positional arguments: exactly one [`RunArgs`].
    #[serde(rename = "positionalArgs")]
    pub positional_args: Vec<RunArgs>,
    /// Named arguments (none).
    #[serde(rename = "namedArgs", default)]
    pub named_args: serde_json::Value,
}

impl Enqueued {
    /// The run's arguments, or why the row cannot be a run of this bench.
    pub fn run(self) -> std::result::Result<RunArgs, String> {
        match <[RunArgs; 1]>::try_from(self.positional_args) {
            Ok([args]) => Ok(args),
            Err(other) => Err(format!(
                "a bench run takes one positional argument ({{run, steps}}), got {}",
                other.len()
            )),
        }
    }
}

/// The same request `chain` and B3 make for link `seq` of `steps` in `run`.
pub fn request(run: &str, seq: i32, steps: i32) -> ChatRequest {
    ChatRequest {
        messages: vec![
            ChatMessage::system("You are one link of a chain. Answer briefly."),
            ChatMessage::user(format!("Link {seq} of {steps} in run {run}.")),
        ],
        max_tokens: Some(64),
        temperature: Some(0.0),
    }
}

/// The peer's binary next to `exe` (the running `trailmark`), or an error that says how to build it.
pub fn dbos_binary(exe: &Path) -> Result<PathBuf> {
    let dir = exe.parent().unwrap_or(Path::new("."));
    let path = dir.join(DBOS_BINARY);
    if path.is_file() {
        return Ok(path);
    }
    // A debug `trailmark` looks in target/debug, a release one in target/release.
    let profile = if dir.ends_with("debug") {
        ""
    } else {
        " --release"
    };
    Err(Error::Failed(format!(
        "--peer dbos runs the DBOS peer from {}, which is missing; build it with \
         `cargo build{profile} -p trailmark-peer-dbos` (it is a separate binary so that trailmark \
         does not link DBOS)",
        path.display()
    )))
}

/// Enqueues runs (ids `$1`, `$2` steps each) onto [`QUEUE`] in one statement, through DBOS's SQL
/// enqueue function; the workflow id is the run id.
pub const ENQUEUE: &str = "SELECT dbos.enqueue_workflow(
        workflow_name => 'chain', queue_name => 'bench',
        positional_args => ARRAY[json_build_object('run', id, 'steps', $2::int)],
        workflow_id => id)
    FROM unnest($1::text[]) AS id";

/// Runs finished, steps committed (ledger rows) and the first run that stopped unfinished, for
/// run ids `LIKE $1`.
pub const PROGRESS: &str = "SELECT
    (SELECT count(*) FROM dbos.workflow_status WHERE workflow_uuid LIKE $1 AND status = 'SUCCESS'),
    (SELECT count(*) FROM dbos_peer.ledger WHERE run_id LIKE $1),
    (SELECT min(workflow_uuid || ' is ' || status || ': ' || COALESCE(error, ''))
       FROM dbos.workflow_status
      WHERE workflow_uuid LIKE $1 AND status IN ('ERROR', 'CANCELLED', 'MAX_RECOVERY_ATTEMPTS_EXCEEDED'))";

/// p50 and p99 of the gaps between consecutive ledger inserts of one run, in ms (runs `LIKE $1`).
pub const STEP_GAPS: &str = "WITH g AS (SELECT committed_at - lag(committed_at) OVER (PARTITION BY run_id ORDER BY step) AS gap
                  FROM dbos_peer.ledger WHERE run_id LIKE $1)
     SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM gap))::float8 * 1000,
            percentile_cont(0.99) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM gap))::float8 * 1000
       FROM g WHERE gap IS NOT NULL";

/// Empties the peer's world: DBOS's schema and the peer's. The peer recreates both (DBOS runs its
/// migrations at launch), so every repetition starts from a fresh DBOS system database.
pub const RESET: &str =
    "DROP SCHEMA IF EXISTS dbos CASCADE; DROP SCHEMA IF EXISTS dbos_peer CASCADE";

/// Processes that have launched DBOS and registered the queue.
pub const READY: &str = "SELECT count(*) FROM dbos_peer.ready";

/// NOTIFYs the bench's channel with the run id when DBOS marks a workflow finished.
pub const WATCH_FUNCTION: &str = "CREATE OR REPLACE FUNCTION public.bench_done_dbos() RETURNS trigger
    LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_notify('bench_done', NEW.workflow_uuid); RETURN NULL; END $$";

/// The trigger that calls [`WATCH_FUNCTION`].
pub const WATCH_TRIGGER: &str = "CREATE TRIGGER bench_done AFTER UPDATE ON dbos.workflow_status
    FOR EACH ROW WHEN (NEW.status = 'SUCCESS' AND OLD.status IS DISTINCT FROM 'SUCCESS')
    EXECUTE FUNCTION public.bench_done_dbos()";

/// Removes [`WATCH_TRIGGER`].
pub const UNWATCH: &str = "DROP TRIGGER IF EXISTS bench_done ON dbos.workflow_status";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_enqueued_input_is_what_the_sql_function_writes() {
        // What `enqueue_workflow` stores: json_build_object('positionalArgs', ..., 'namedArgs', ...).
        let stored = r#"{"positionalArgs" : [{"run" : "l1-0", "steps" : 10}], "namedArgs" : {}}"#;
        let parsed: Enqueued = serde_json::from_str(stored).unwrap();
        assert_eq!(
            parsed.run().unwrap(),
            RunArgs {
                run: "l1-0".into(),
                steps: 10
            }
        );
        let none: Enqueued = serde_json::from_str(r#"{"positionalArgs": []}"#).unwrap();
        assert!(none.run().unwrap_err().contains("got 0"));
    }

    #[test]
    fn a_missing_binary_says_how_to_build_it() {
        let dir = std::env::temp_dir().join("trailmark-peer-test-none/release");
        let err = dbos_binary(&dir.join("trailmark")).unwrap_err().to_string();
        assert!(
            err.contains("cargo build --release -p trailmark-peer-dbos"),
            "{err}"
        );
        let err = dbos_binary(Path::new("/nonexistent/target/debug/trailmark"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`cargo build -p trailmark-peer-dbos`"),
            "{err}"
        );
    }

    #[test]
    fn the_sql_names_what_the_constants_name() {
        for sql in [ENQUEUE, PROGRESS, WATCH_TRIGGER, UNWATCH] {
            assert!(sql.contains(&format!("{DBOS_SCHEMA}.")), "{sql}");
        }
        for sql in [PEER_DDL, LEDGER_INSERT, PROGRESS, STEP_GAPS, READY] {
            assert!(sql.contains(&format!("{PEER_SCHEMA}.")), "{sql}");
        }
        for schema in [DBOS_SCHEMA, PEER_SCHEMA] {
            let dropped = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
            assert!(RESET.contains(&dropped), "{RESET}");
        }
        assert!(ENQUEUE.contains(&format!("'{WORKFLOW}'")), "{ENQUEUE}");
        assert!(ENQUEUE.contains(&format!("'{QUEUE}'")), "{ENQUEUE}");
        assert!(WATCH_FUNCTION.contains(super::super::systems::DONE_CHANNEL));
    }
}
