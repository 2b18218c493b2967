//! Crashes of Postgres itself right after a relaxed commit (`store::relaxed_pool`, README
//! "Trade-offs made for speed"): a commit that returns before its WAL is flushed, made durable
//! only by a later synchronous commit. Relaxed are: journal entries (made durable by the step's
//! effect intent), effect results and a step commit that only moves a running run on to its next
//! step (both by the next step's claim; a step that ends its run commits synchronously), and the
//! removal of eagerly published outbox rows (by whichever synchronous commit comes next).
//! Synchronous are the run's start, every claim, effect intents, outside writes, advances that
//! carry local writes or sent messages, and the commits that end a run or hand it to a person:
//! a crash loses nothing committed before one of them. The promise: losing a relaxed commit to a
//! Postgres crash costs a repeat (a model answer paid twice, a write sent again under its key, a
//! message published again, a step run again), never a wrong result and never a run that stops
//! moving: a lost step commit leaves the run at that step's position under the lease of its
//! claim, and the step runs again when its message comes back or, with no message, once the
//! lease expires.
//!
//! The tests run without pre-claims (`worker.preclaim`), so that every step is claimed by a
//! claim statement and its advance commit is relaxed, except the last two, which are about
//! pre-claims: a step started on one commits synchronously, and one lost with its relaxed commit
//! must not let the step started on it write.
//!
//! Each test but the last seven runs a real `trailmark serve` on a Postgres server of its own (a
//! temporary cluster on a free port, so it runs beside the other tests and never touches the
//! shared server), makes the worker SIGKILL itself right after one relaxed commit, stops that
//! Postgres at once with `pg_ctl stop -m immediate` and starts it again (crash recovery). What was
//! committed after the last synchronous commit must be gone, and nothing before it: the server is
//! set up so that nothing but a synchronous commit writes WAL out of its buffers (see
//! [`Postgres`]). A fresh `trailmark serve` must then finish the run with what users rely on:
//! every ledger write once, every effect with its result, every position committed once, the
//! journal holding each answer once, no message left unpublished in the outbox. The last seven
//! tests have no kill: the worker (an engine in the test's process) lives on through the crash,
//! which comes after a step without an outside write was committed and acknowledged.
//!
//! Progress lines (`ctx.progress`, retry and resume notes) are relaxed too, and cosmetic: a lost
//! line is not repeated and nothing depends on it, so they have no test here.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::servers::{TempDir, append, as_postgres, is_root, pg_bin, run_ok};
use common::{ChildGuard, Running, TestEnv, closed_port, eventually, wait_exit};
use serde_json::{Value, json};
use sqlx::Connection;
use tokio::sync::Notify;
use trailmark::config::Settings;
use trailmark::domain::RunStatus;
use trailmark::store;
use trailmark::workflow::{StepKind, StepOutcome, Workflow};
use trailmark_standin::model_server::{ModelServer, ModelServerOptions};

/// Bound on every wait.
const WAIT: Duration = Duration::from_secs(90);
/// Links of each test's `chain` run.
const STEPS: i64 = 5;
/// The one `chain` run of each test.
const RUN: &str = "r-relaxed";
/// How soon a run hit by a crash must move again: ten lease periods (`worker.lease_secs` is 3 s
/// in the tests), time for the supervisor to re-queue a step whose lease expired.
const MOVES_WITHIN: Duration = Duration::from_secs(30);

/// A Postgres server of the test's own, configured so that an asynchronous commit stays in the
/// WAL buffers (in shared memory, which an immediate stop discards) until a synchronous commit
/// flushes it: the WAL writer wakes only every 10 s and writes without flushing
/// (`wal_writer_flush_after` far above what a test writes); no checkpoint, background writer,
/// autovacuum or standby snapshot runs. The WAL writer would still write the buffers out (to the
/// kernel, which keeps them across the immediate stop) on its next round, up to 10 s later; so
/// the test freezes it ([`Postgres::freeze_wal_writer`]) and the crash kills it frozen: the loss
/// is then certain instead of likely. fsync and synchronous_commit stay on, as in production.
struct Postgres {
    bin: PathBuf,
    data: PathBuf,
    log: PathBuf,
    port: u16,
    /// The WAL writer's pid while it is frozen.
    frozen: Option<i32>,
}

impl Postgres {
    /// Creates the cluster in `dir` and starts it.
    fn start(dir: &Path) -> Self {
        let pg = Self {
            bin: pg_bin(),
            data: dir.join("data"),
            log: dir.join("postgres.log"),
            port: closed_port(),
            frozen: None,
        };
        std::fs::create_dir_all(&pg.data).unwrap();
        if is_root() {
            run_ok(
                Command::new("chown")
                    .arg("postgres:")
                    .arg(dir)
                    .arg(&pg.data),
                "chown",
            );
        }
        run_ok(
            as_postgres(&pg.bin.join("initdb"))
                .args(["-U", "postgres", "-A", "trust", "--no-sync", "-D"])
                .arg(&pg.data),
            "initdb",
        );
        append(
            &pg.data.join("postgresql.conf"),
            &format!(
                "listen_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
                 max_connections = 60\nshared_buffers = 32MB\nfsync = on\nsynchronous_commit = on\n\
                 wal_level = minimal\nmax_wal_senders = 0\nwal_writer_delay = 10000ms\n\
                 wal_writer_flush_after = 1GB\nbgwriter_lru_maxpages = 0\n\
                 checkpoint_timeout = 1d\nmax_wal_size = 10GB\nautovacuum = off\n",
                pg.port,
                pg.data.display()
            ),
        );
        pg.run();
        pg
    }

    /// `pg_ctl` on this cluster, waiting at most 60 s.
    fn ctl(&self, args: &[&str]) -> Command {
        let mut cmd = as_postgres(&self.bin.join("pg_ctl"));
        cmd.args(["-t", "60", "-D"])
            .arg(&self.data)
            .args(args)
            .stdout(Stdio::null());
        cmd
    }

    /// Starts the server and waits until it takes connections (after crash recovery, if any).
    fn run(&self) {
        let started = self
            .ctl(&["-w", "-l", self.log.to_str().unwrap(), "start"])
            .status()
            .expect("run pg_ctl");
        assert!(
            started.success(),
            "pg_ctl start: {}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }

    /// The URL of database `trailmark` on this server.
    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/trailmark", self.port)
    }

    /// Freezes the WAL writer (SIGSTOP), so that only synchronous commits write WAL out.
    async fn freeze_wal_writer(&mut self, pool: &sqlx::PgPool) {
        let pid: i32 =
            sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'")
                .fetch_one(pool)
                .await
                .expect("the WAL writer's pid");
        // SAFETY: signalling a process of this test's own cluster.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        self.frozen = Some(pid);
    }

    /// The crash: `pg_ctl stop -m immediate` (every server process quits at once, nothing is
    /// written or flushed), the frozen WAL writer killed where it stands, and a wait until the
    /// server is gone.
    async fn crash(&mut self) {
        run_ok(
            &mut self.ctl(&["-W", "-m", "immediate", "stop"]),
            "pg_ctl stop -m immediate",
        );
        if let Some(pid) = self.frozen.take() {
            // SAFETY: as above; SIGKILL ends a stopped process without running any of its code.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let pid_file = self.data.join("postmaster.pid");
        let gone = eventually("the crashed Postgres to exit", WAIT, || async {
            (!pid_file.exists()).then_some(())
        })
        .await;
        assert!(gone.is_some(), "Postgres did not stop within {WAIT:?}");
    }
}

impl Drop for Postgres {
    /// Stops the server (immediately), thawing a frozen WAL writer first so that it can quit.
    fn drop(&mut self) {
        if let Some(pid) = self.frozen.take() {
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGCONT) };
        }
        let _ = self
            .ctl(&["-w", "-m", "immediate", "stop"])
            .stderr(Stdio::null())
            .status();
    }
}

/// One test's world: trailmark on its own Postgres (and its own broker prefix on the shared
/// RabbitMQ) and a model server that counts the answers it gives. Fields drop in this order:
/// the broker topology, the model, the server, then its directory.
struct World {
    env: TestEnv,
    model: ModelServer,
    pg: Postgres,
    _dir: TempDir,
}

impl World {
    /// A fresh world whose Postgres keeps asynchronous commits unwritten.
    async fn new(name: &str) -> Self {
        Self::with(name, |_| {}).await
    }

    /// [`World::new`] with settings changed before the environment is made. Pre-claims are
    /// off unless `customize` turns them on: every step is then claimed by a claim statement,
    /// the path whose advance commits are relaxed.
    async fn with(name: &str, customize: impl FnOnce(&mut Settings)) -> Self {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
        let dir = TempDir::new(&format!("relaxed-{name}-{tag}"));
        let mut pg = Postgres::start(&dir.0);
        let url = pg.url();
        let env = TestEnv::with(|s| {
            s.database.url = url;
            s.database.max_connections = 6;
            s.worker.preclaim = false;
            customize(s);
        })
        .await;
        pg.freeze_wal_writer(&env.pool).await;
        let model = ModelServer::start(ModelServerOptions::default())
            .await
            .expect("start the model server");
        Self {
            env,
            model,
            pg,
            _dir: dir,
        }
    }

    /// `trailmark serve` as a child process asking this world's model, armed with `failpoints`.
    fn serve(&self, failpoints: Option<&str>) -> ChildGuard {
        let model = [("TRAILMARK__MODEL__BASE_URL", self.model.base_url())];
        self.env.spawn_process_with(failpoints, &model)
    }

    /// Starts the run, waits for `worker` to SIGKILL itself at its failpoint, then crashes
    /// Postgres; returns the answers the model gave before.
    async fn worker_then_postgres_crash(
        &mut self,
        mut worker: ChildGuard,
        step_delay_ms: u64,
    ) -> u64 {
        let input = json!({"steps": STEPS, "step_delay_ms": step_delay_ms});
        self.env.start_run("chain", RUN, input).await;
        let status = wait_exit(&mut worker, WAIT)
            .await
            .unwrap_or_else(|| panic!("the worker did not reach its failpoint within {WAIT:?}"));
        assert_eq!(
            status.signal(),
            Some(9),
            "the worker should have SIGKILLed itself: {status:?}"
        );
        let answered = self.model.answered();
        self.postgres_crash().await;
        answered
    }

    /// Stops Postgres with `-m immediate` at once and starts it again (crash recovery); the
    /// test's pool is made anew.
    async fn postgres_crash(&mut self) {
        self.env.pool.close().await;
        self.pg.crash().await;
        self.pg.run();
        let log = std::fs::read_to_string(&self.pg.log).unwrap_or_default();
        assert!(
            log.contains("automatic recovery in progress"),
            "Postgres did not recover from a crash: {log}"
        );
        self.env.pool = store::connect(&self.env.settings.database)
            .await
            .expect("connect after the crash");
    }

    /// Run `id` as it stands (it must exist: a synchronous commit made it).
    async fn run(&self, id: &str) -> store::runs::RunRow {
        store::runs::get(&self.env.pool, id)
            .await
            .expect("read the run")
            .unwrap_or_else(|| panic!("run {id} is gone"))
    }

    /// Asserts where the crash left the run: running at `seq` under the lease of that position's
    /// claim (a synchronous commit, so it outlives the crash; the killed worker holds it), the
    /// positions before it committed; returns how often `seq` was claimed.
    async fn stopped_at(&self, seq: i32) -> i64 {
        let run = self.run(RUN).await;
        assert_eq!(
            (run.status, run.step_seq),
            (RunStatus::Running, seq),
            "where the crash left the run"
        );
        assert!(
            run.lease_owner.is_some() && run.lease_expires_at.is_some(),
            "position {seq}'s claim, a synchronous commit, lost its lease in the crash"
        );
        assert_eq!(self.env.steps_done(RUN).await, i64::from(seq));
        self.env.attempts(RUN, seq).await
    }

    /// Asserts what a crash right after position 2's step commit (relaxed: it only moved the
    /// run on) lost: that commit and the effect result before it (relaxed too), and nothing
    /// before the step's last synchronous commit, its write (whose intent had made the claim and
    /// the journal entry durable), nor position 1's effect result (made durable by the claim).
    async fn lost_position_2_commit(&self) {
        assert_eq!(
            self.stopped_at(2).await,
            1,
            "position 2's claim, a synchronous commit, was lost"
        );
        assert_eq!(
            self.effect_result(2).await,
            None,
            "the effect result before the lost commit survived"
        );
        assert!(
            self.effect_result(1).await.is_some(),
            "position 1's effect result, made durable by position 2's claim, was lost"
        );
        let journaled = self
            .env
            .scalar(
                "SELECT count(*) FROM trailmark.journal WHERE run_id = $1",
                RUN,
            )
            .await;
        assert_eq!(
            journaled, 3,
            "position 2's answer, made durable by the effect intent, was lost"
        );
        assert_eq!(self.env.chain_ledger(RUN).await, (3, 3));
    }

    /// A synchronous commit of the test's own (a row in a table of its own): it writes out and
    /// flushes all WAL before it, so every relaxed commit made so far outlives a crash.
    async fn sync_commit(&self) {
        for sql in [
            "CREATE TABLE IF NOT EXISTS public.flushes (at timestamptz NOT NULL DEFAULT now())",
            "INSERT INTO public.flushes DEFAULT VALUES",
        ] {
            sqlx::query(sql).execute(&self.env.pool).await.expect(sql);
        }
    }

    /// Starts a fresh `trailmark serve`, waits for the run to succeed and asserts what users
    /// rely on, `again` being how many positions must have been claimed twice; the process is
    /// returned so that it lives until the test's end.
    async fn finish_and_check(&self, again: i64) -> ChildGuard {
        let second = self.serve(None);
        self.env.wait_status(RUN, RunStatus::Succeeded, WAIT).await;
        assert_eq!(
            self.env.chain_ledger(RUN).await,
            (STEPS, STEPS),
            "one ledger row per key, one key per step"
        );
        let (effects, unfinished): (i64, i64) = sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE result IS NULL OR completed_at IS NULL)
               FROM trailmark.effects WHERE run_id = $1",
        )
        .bind(RUN)
        .fetch_one(&self.env.pool)
        .await
        .unwrap();
        assert_eq!(
            (effects, unfinished),
            (STEPS, 0),
            "(effects, effects without result)"
        );
        let journal: (i64, i64) = sqlx::query_as(
            "SELECT count(*), count(DISTINCT seq) FROM trailmark.journal WHERE run_id = $1",
        )
        .bind(RUN)
        .fetch_one(&self.env.pool)
        .await
        .unwrap();
        assert_eq!(
            journal,
            (STEPS, STEPS),
            "one answer per position in the journal"
        );
        // The database is this test's own: every processed step message is this run's.
        let inbox: i64 =
            sqlx::query_scalar("SELECT count(*) FROM trailmark.inbox WHERE consumer = 'steps'")
                .fetch_one(&self.env.pool)
                .await
                .unwrap();
        assert_eq!(inbox, STEPS, "step messages processed: one per position");
        assert_eq!(self.env.steps_done(RUN).await, STEPS, "positions committed");
        assert_eq!(
            self.attempts().await,
            (STEPS + again, again),
            "(claims, positions claimed twice)"
        );
        let empty = eventually("no unpublished row left in the outbox", WAIT, || async {
            let pending: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM trailmark.outbox WHERE published_at IS NULL",
            )
            .fetch_one(&self.env.pool)
            .await
            .ok()?;
            (pending == 0).then_some(())
        })
        .await;
        assert!(empty.is_some(), "rows stayed unpublished in the outbox");
        second
    }

    /// Outbox rows of `run` not yet published (`None` while Postgres does not answer).
    async fn unpublished_rows(&self, run: &str) -> Option<i64> {
        sqlx::query_scalar(
            "SELECT count(*) FROM trailmark.outbox WHERE published_at IS NULL
                AND convert_from(body, 'UTF8')::jsonb ->> 'run_id' = $1",
        )
        .bind(run)
        .fetch_one(&self.env.pool)
        .await
        .ok()
    }

    /// Messages waiting in the steps queue (a passive declare answers the count).
    async fn ready_step_messages(&self) -> u32 {
        let conn = trailmark::broker::connect(&self.env.settings.broker, "test-queue-depth")
            .await
            .expect("connect RabbitMQ");
        let channel = conn.create_channel().await.expect("open a channel");
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let queue = self.env.topology().steps_queue();
        let declared = channel
            .queue_declare(queue.as_str().into(), passive, Default::default())
            .await
            .expect("the steps queue");
        let _ = conn.close(200, "counted".into()).await;
        declared.message_count()
    }

    /// (sum of attempts, positions attempted more than once) of the run.
    async fn attempts(&self) -> (i64, i64) {
        sqlx::query_as(
            "SELECT COALESCE(sum(attempts), 0)::bigint, count(*) FILTER (WHERE attempts > 1)
               FROM trailmark.steps WHERE run_id = $1",
        )
        .bind(RUN)
        .fetch_one(&self.env.pool)
        .await
        .unwrap()
    }

    /// The recorded result of link `seq`'s ledger write.
    async fn effect_result(&self, seq: i32) -> Option<Value> {
        sqlx::query_scalar("SELECT result FROM trailmark.effects WHERE idempotency_key = $1")
            .bind(format!("{RUN}:link:{seq}"))
            .fetch_one(&self.env.pool)
            .await
            .expect("the effect's intent (a synchronous commit) is recorded")
    }
}

/// (a) A model answer journaled and lost with Postgres, with nothing else: position 2's claim,
/// a synchronous commit, made everything before it durable (position 1's effect result and its
/// step commit, which only moved the run on), and the worker died before position 2's effect
/// intent, the next synchronous commit. The run is at position 2 under the claim's lease; the
/// delivery, never acknowledged, comes back and the fresh worker takes the lease of the dead one
/// at once. The lost answer is asked for again (paid twice) and journaled once; position 1's
/// write is not sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_entry_lost_with_postgres_is_asked_for_again_and_journaled_once() {
    let mut w = World::new("journal").await;
    let first = w.serve(Some("journal.after_commit=kill@3"));
    let answered = w.worker_then_postgres_crash(first, 0).await;
    assert_eq!(answered, 3, "answers given before the crash");
    let entries = "SELECT count(*) FROM trailmark.journal WHERE run_id = $1";
    let at_2 = "SELECT count(*) FROM trailmark.journal WHERE run_id = $1 AND seq = 2";
    assert_eq!(
        (
            w.env.scalar(entries, RUN).await,
            w.env.scalar(at_2, RUN).await
        ),
        (2, 0),
        "(journal entries, position 2's): position 2's entry, committed without its flush, was \
         lost, and only it"
    );
    assert_eq!(
        w.stopped_at(2).await,
        1,
        "position 2's claim, a synchronous commit, was lost"
    );
    let result = w
        .effect_result(1)
        .await
        .expect("position 1's effect result, made durable by position 2's claim, was lost");
    assert_eq!(result["created"], json!(true));
    assert_eq!(w.env.chain_ledger(RUN).await, (2, 2));

    let _second = w.finish_and_check(1).await;
    let result = w.effect_result(1).await.expect("the result is recorded");
    assert_eq!(
        result["created"],
        json!(true),
        "position 1's write was sent again, though its result outlived the crash"
    );
    let result = w.effect_result(2).await.expect("the result is recorded");
    assert_eq!(
        result["created"],
        json!(true),
        "position 2's write, never sent before the crash, found a ledger row"
    );
    assert_eq!(
        w.model.answered(),
        STEPS as u64 + 1,
        "the lost answer was asked for once more, no other"
    );
}

/// (b) An effect result lost with Postgres after the write (whose own commit and the intent's
/// were synchronous, as was the step's claim before them): the step runs again, calls again under
/// the same key, the ledger absorbs the repeat, the result is recorded, and the journaled answer
/// is replayed, not asked for again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_result_lost_with_postgres_is_called_again_under_its_key_and_recorded() {
    let mut w = World::new("effect").await;
    let first = w.serve(Some("effect_result.after_commit=kill@3"));
    let answered = w.worker_then_postgres_crash(first, 0).await;
    assert_eq!(answered, 3, "answers given before the crash");
    assert_eq!(
        w.effect_result(2).await,
        None,
        "the effect result committed without its flush survived the crash"
    );
    assert_eq!(
        w.env.chain_ledger(RUN).await,
        (3, 3),
        "the ledger holds position 2's write (the receiver's own synchronous commit)"
    );
    let journaled = w
        .env
        .scalar(
            "SELECT count(*) FROM trailmark.journal WHERE run_id = $1",
            RUN,
        )
        .await;
    assert_eq!(
        journaled, 3,
        "the effect intent flushed the answer journaled before it"
    );
    assert_eq!(
        w.stopped_at(2).await,
        1,
        "position 2's claim, a synchronous commit, was lost"
    );
    assert!(
        w.effect_result(1).await.is_some(),
        "position 1's effect result, made durable by position 2's claim, was lost"
    );

    let _second = w.finish_and_check(1).await;
    let result = w.effect_result(2).await.expect("the result is recorded");
    assert_eq!(
        result["created"],
        json!(false),
        "the write was sent again under the same key and the ledger found it done"
    );
    assert_eq!(
        w.model.answered(),
        STEPS as u64,
        "the journaled answer was replayed, not asked for again"
    );
}

/// (c) The removal of an eagerly published outbox row lost with Postgres: the row (committed
/// synchronously with the run's start) is back, but not the claim made before the removal (a
/// synchronous commit). Position 0 runs again under a lease taken from the dead worker, the
/// relay publishes the row once more, and the worker's inbox drops whichever copy of the message
/// comes second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_outbox_row_back_after_a_postgres_crash_is_republished_and_its_repeat_dropped() {
    let mut w = World::new("outbox").await;
    // The first removal is of the run start's row, position 0's message, gathered for 50 ms after
    // its publish while position 0 waits before its model call. Position 0's claim, a synchronous
    // commit, would make the removal durable if it came after it: a trigger of the test's own
    // holds the removal until the claim is visible (so committed and flushed), leaving the
    // removal the one commit after the last synchronous one whatever the machine's load.
    for sql in [
        "CREATE FUNCTION public.remove_after_the_claim() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             FOR i IN 1..3000 LOOP
                 EXIT WHEN EXISTS (SELECT 1 FROM trailmark.steps
                                    WHERE run_id = 'r-relaxed' AND seq = 0);
                 PERFORM pg_sleep(0.01);
             END LOOP;
             RETURN OLD;
         END $$",
        "CREATE TRIGGER remove_after_the_claim BEFORE DELETE ON trailmark.outbox
             FOR EACH ROW EXECUTE FUNCTION public.remove_after_the_claim()",
    ] {
        sqlx::query(sql).execute(&w.env.pool).await.expect(sql);
    }
    let first = w.serve(Some("outbox.after_forget=kill@1"));
    let answered = w.worker_then_postgres_crash(first, 300).await;
    assert_eq!(answered, 0, "answers given before the crash");
    let back: Vec<(uuid::Uuid, Option<String>)> = sqlx::query_as(
        "SELECT message_id, convert_from(body, 'UTF8')::jsonb ->> 'seq'
           FROM trailmark.outbox WHERE published_at IS NULL",
    )
    .fetch_all(&w.env.pool)
    .await
    .unwrap();
    assert_eq!(
        back.iter().map(|r| r.1.as_deref()).collect::<Vec<_>>(),
        [Some("0")],
        "the removal committed without its flush survived the crash (or the run start's row was \
         lost)"
    );
    assert_eq!(
        w.stopped_at(0).await,
        1,
        "position 0's claim, a synchronous commit, was lost"
    );

    // Position 0 runs again: its delivery (never acknowledged) and the row's second publish
    // bring the same message twice; one claims the position, the other is dropped.
    let _second = w.finish_and_check(1).await;
    let (published, processed): (Option<bool>, i64) = sqlx::query_as(
        "SELECT (SELECT published_at IS NOT NULL FROM trailmark.outbox WHERE message_id = $1),
                (SELECT count(*) FROM trailmark.inbox WHERE message_id = $1)",
    )
    .bind(back[0].0)
    .fetch_one(&w.env.pool)
    .await
    .unwrap();
    assert_eq!(
        published,
        Some(true),
        "the relay did not publish the row that came back"
    );
    assert_eq!(
        processed, 1,
        "the message the row carries was processed once"
    );
    assert_eq!(
        w.model.answered(),
        STEPS as u64,
        "no answer was asked for twice"
    );
}

/// A step commit that only moves the run on, lost with Postgres before the step was published
/// (with the effect result before it; the journal entry, the write and the step's claim were
/// made durable by the effect intent and the write's own commit): the delivery comes back, the
/// fresh worker takes the dead one's lease at once, the step runs again, its write is sent again
/// under its key and the journaled answer is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_advance_lost_with_postgres_before_its_publish_runs_the_step_again() {
    let mut w = World::new("advance").await;
    advance_lost_then_replayed(&mut w, "step.after_commit=kill@3").await;
}

/// The worker kills itself at `failpoint` (the third step's advance committed, relaxed), Postgres
/// crashes, and the run must lose exactly that commit; a fresh worker then finishes it, writing
/// position 2 again under its key (the ledger says it existed) and replaying its answer.
async fn advance_lost_then_replayed(w: &mut World, failpoint: &str) {
    let first = w.serve(Some(failpoint));
    let answered = w.worker_then_postgres_crash(first, 0).await;
    assert_eq!(answered, 3, "answers given before the crash");
    w.lost_position_2_commit().await;
    // 1 when position 2's delivery had been acknowledged, 2 when it comes back too; and
    // position 2's outbox row when its removal was lost.
    let ready = w.ready_step_messages().await;
    let rows = w
        .unpublished_rows(RUN)
        .await
        .expect("count the run's outbox rows");
    eprintln!("after the crash: {ready} step messages queued, {rows} unpublished outbox rows");
    let _second = w.finish_and_check(1).await;
    let result = w.effect_result(2).await.expect("the result is recorded");
    assert_eq!(result["created"], json!(false));
    assert_eq!(
        w.model.answered(),
        STEPS as u64,
        "the journaled answer was replayed"
    );
}

/// The same lost step commit after the step was published and acknowledged: the worker dies
/// as the next position's message arrives, before its claim. That message is ahead of the run
/// and is dropped as stale. The run is at the lost position under the lease of its claim (a
/// synchronous commit): it resumes there once the supervisor finds that lease expired
/// (`worker.lease_secs`, 3 s here, 30 s by default), or sooner if the position's own message
/// comes back (its delivery was not acknowledged after all, the ack being sent beside the
/// publish; or its outbox row is back, its removal lost too) and takes the dead worker's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_advance_lost_with_postgres_after_its_ack_resumes_when_the_lease_expires() {
    let mut w = World::new("acked").await;
    advance_lost_then_replayed(&mut w, "worker.received=kill@4").await;
}

/// A spot a step handler stops at, once, until the test opens it.
#[derive(Default)]
struct Gate {
    armed: AtomicBool,
    reached: Notify,
    open: Notify,
}

impl Gate {
    /// A gate the first handler to pass stops at.
    fn armed() -> Arc<Self> {
        let gate = Self::default();
        gate.armed.store(true, Ordering::SeqCst);
        Arc::new(gate)
    }

    /// Stops the first caller until [`Gate::open`]; later callers pass.
    async fn pass(&self) {
        if self.armed.swap(false, Ordering::SeqCst) {
            self.reached.notify_one();
            self.open.notified().await;
        }
    }

    /// Waits (bounded) until a handler stopped here.
    async fn reached(&self, what: &str) {
        tokio::time::timeout(WAIT, self.reached.notified())
            .await
            .unwrap_or_else(|_| panic!("{what}: not within {WAIT:?}"));
    }

    /// Lets the stopped handler go on.
    fn open(&self) {
        self.open.notify_one();
    }
}

/// `hops`: three steps without an outside write or a model call (like `reconcile`'s reading
/// steps), the first and the last stopping at a gate (while it is armed).
fn hops(first: Arc<Gate>, last: Arc<Gate>) -> Workflow {
    let gated = |gate: Arc<Gate>, outcome: fn() -> StepOutcome| {
        move |_ctx| {
            let gate = gate.clone();
            async move {
                gate.pass().await;
                Ok(outcome())
            }
        }
    };
    Workflow::new("hops", 1)
        .step(
            "one",
            StepKind::Read,
            gated(first, || StepOutcome::next(json!({}))),
        )
        .step("two", StepKind::Read, |_ctx| async {
            Ok(StepOutcome::next(json!({})))
        })
        .step(
            "three",
            StepKind::Read,
            gated(last, || StepOutcome::finish(json!({}))),
        )
}

/// `asks`: a first step that stops at a gate, asks the model and moves the run on (a commit
/// resting on an answer no synchronous commit of its own has flushed), then a step that ends it.
fn asks(gate: Arc<Gate>) -> Workflow {
    Workflow::new("asks", 1)
        .step("ask", StepKind::Model, move |ctx| {
            let gate = gate.clone();
            async move {
                gate.pass().await;
                let request = trailmark::model::ChatRequest {
                    messages: vec![trailmark::model::ChatMessage::user("Which way next?")],
                    max_tokens: Some(16),
                    temperature: Some(0.0),
                };
                ctx.model(&request).await?;
                Ok(StepOutcome::next(json!({})))
            }
        })
        .step("after", StepKind::Read, |_ctx| async {
            Ok(StepOutcome::finish(json!({})))
        })
}

/// `notes`: a first step that stops at a gate, sends a note (`ctx.send`) through the default
/// exchange to `queue` and moves the run on, then a step that ends it.
fn notes(gate: Arc<Gate>, queue: String) -> Workflow {
    Workflow::new("notes", 1)
        .step("note", StepKind::Message, move |ctx| {
            let (gate, queue) = (gate.clone(), queue.clone());
            async move {
                gate.pass().await;
                let key = trailmark::domain::IdempotencyKey::for_step(ctx.run_id(), "note", "1");
                ctx.send("", &queue, &key, b"{\"note\":1}".to_vec());
                Ok(StepOutcome::next(json!({})))
            }
        })
        .step("after", StepKind::Read, |_ctx| async {
            Ok(StepOutcome::finish(json!({})))
        })
}

/// `hold`: one step that stops at a gate, then ends its run (a synchronous commit).
fn hold(gate: Arc<Gate>) -> Workflow {
    Workflow::new("hold", 1).step("hold", StepKind::Read, move |_ctx| {
        let gate = gate.clone();
        async move {
            gate.pass().await;
            Ok(StepOutcome::finish(json!({})))
        }
    })
}

/// An engine in the test's process, one delivery at a time, running `workflows` besides the
/// built-in ones; it serves until the returned guard drops. Its pools are its own: the test's
/// is closed across the crash.
async fn engine(w: &World, workflows: Vec<Workflow>) -> (Arc<trailmark::engine::Engine>, Running) {
    let mut registry = trailmark_testkit::registry();
    for workflow in workflows {
        registry.register(workflow);
    }
    // Model calls go to this world's model server.
    let mut settings = w.env.settings.clone();
    settings.model.base_url = w.model.base_url();
    let engine = trailmark::engine::Engine::new(settings, registry)
        .await
        .expect("engine");
    let running = w.env.spawn_all(engine.clone());
    (engine, running)
}

/// Waits (bounded by [`MOVES_WITHIN`]) for `r-hops` to succeed after the crash, with what it
/// looks like if it does not.
async fn hops_succeed(w: &World) {
    let done = eventually(
        "r-hops to succeed after the crash",
        MOVES_WITHIN,
        || async {
            let run = store::runs::get(&w.env.pool, "r-hops").await.ok()??;
            (run.status == RunStatus::Succeeded).then_some(())
        },
    )
    .await;
    let run = w.run("r-hops").await;
    let rows = w
        .unpublished_rows("r-hops")
        .await
        .expect("count r-hops's outbox rows");
    assert!(
        done.is_some(),
        "r-hops is stuck {MOVES_WITHIN:?} after the crash: {} at position {} ({}), lease {:?}, \
         {rows} of its messages in the outbox, {} step messages queued",
        run.status,
        run.step_seq,
        run.step.map(|s| s.to_string()).unwrap_or_default(),
        run.lease_owner,
        w.ready_step_messages().await
    );
    assert_eq!(w.env.steps_done("r-hops").await, 3, "positions committed");
}

/// The worker goes on after the crash: a run started now succeeds.
async fn a_run_started_after_the_crash_succeeds(w: &World) {
    w.env
        .start_run("chain", "r-after", json!({"steps": 1}))
        .await;
    w.env
        .wait_status("r-after", RunStatus::Succeeded, WAIT)
        .await;
}

/// No kill: a worker (in this process, one delivery at a time) lives through the crash.
/// A run of steps without outside writes, the order of commits a loaded server can see: the
/// run moves from position 0 to 1 and its message for position 1 is published and removed
/// from the outbox while another run's step holds the worker; that run ends (a synchronous
/// commit, flushing both); position 1 is claimed, committed (relaxed) and acknowledged, and
/// position 2 claimed; then Postgres crashes while position 2's handler runs. Position 2's claim
/// is synchronous: it made position 1's commit durable, and its lease (the fence the living
/// worker holds) outlives the crash, so the run is at position 2 and finishes as soon as the
/// handler does, with no person doing anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_keeps_the_acked_step_commit_before_it_and_the_run_finishes_after_a_crash() {
    let mut w = World::with("kept", |s| s.worker.concurrency = 1).await;
    let (first, last, held) = (Gate::armed(), Gate::armed(), Gate::armed());
    let workflows = vec![hops(first.clone(), last.clone()), hold(held.clone())];
    let (_engine, _running) = engine(&w, workflows).await;

    w.env.start_run("hops", "r-hops", json!({})).await;
    first.reached("position 0 of r-hops").await;
    // r-hold is started straight in the store and its step message published by hand: the
    // worker's one delivery slot is r-hops's, which would keep a run-start event waiting too.
    let hold_run = trailmark::domain::RunId::parse("r-hold").unwrap();
    let new = store::runs::NewRun {
        run_id: &hold_run,
        workflow: "hold",
        version: 1,
        first_step: &"hold".into(),
        input: &json!({}),
        parent: None,
        traceparent: None,
        flow_key: None,
        priority: 2,
    };
    assert!(store::runs::insert(&w.env.pool, &new).await.unwrap());
    let message = w
        .env
        .topology()
        .step_message(&hold_run, "hold", 1, &"hold".into(), 0);
    w.env
        .publish(&trailmark::relay::to_outgoing(&message))
        .await;
    let queued = eventually("r-hold's step message queued", WAIT, || async {
        (w.ready_step_messages().await == 1).then_some(())
    })
    .await;
    assert!(
        queued.is_some(),
        "r-hold's step message never waited in the queue"
    );
    first.open();
    held.reached("r-hold's step").await;
    // r-hops's message for position 1 waits behind r-hold's step; its outbox row goes once the
    // worker's removal (gathered for 50 ms) is done.
    let removed = eventually("r-hops's row for position 1 removed", WAIT, || async {
        let rows = w.unpublished_rows("r-hops").await?;
        let queued = w.ready_step_messages().await == 1;
        (rows == 0 && queued).then_some(())
    })
    .await;
    assert!(
        removed.is_some(),
        "r-hops's row for position 1 stayed in the outbox"
    );
    held.open();
    last.reached("position 2 of r-hops").await;
    w.env
        .wait_status("r-hold", RunStatus::Succeeded, WAIT)
        .await;
    w.postgres_crash().await;

    let run = w.run("r-hops").await;
    assert_eq!(
        (run.status, run.step_seq),
        (RunStatus::Running, 2),
        "position 1's commit, made without its flush, was lost though position 2's claim (a \
         synchronous commit) came after it"
    );
    assert!(
        run.lease_owner.is_some(),
        "position 2's claim, a synchronous commit, lost its lease in the crash"
    );
    assert_eq!(w.env.steps_done("r-hops").await, 2);
    assert_eq!(
        (
            w.env.attempts("r-hops", 1).await,
            w.env.attempts("r-hops", 2).await
        ),
        (1, 1),
        "(claims of position 1, of position 2) before the crash"
    );
    last.open();
    a_run_started_after_the_crash_succeeds(&w).await;
    hops_succeed(&w).await;
    assert_eq!(
        (
            w.env.attempts("r-hops", 0).await,
            w.env.attempts("r-hops", 1).await
        ),
        (1, 1),
        "(claims of position 0, of position 1): a position before the crash ran again"
    );
    // Position 2's claims are 1, or 2 when its ending commit met a pool connection that the
    // crash broke and the delivery was retried in place (an infrastructure failure).
}

/// No kill, and this time the crash does lose an acknowledged step commit while the worker
/// lives on: position 0 of a run of steps without outside writes is committed (relaxed, moving
/// the run to position 1) and acknowledged, and the claim of position 1, the synchronous commit
/// that would flush it, is still waiting when Postgres crashes (behind a row of position 1 that
/// the test inserted and never commits). The run comes back at position 0 under the lease of
/// position 0's claim, with no message: position 1's message is ahead of it and dropped as
/// stale, and position 0's was acknowledged. The supervisor re-queues position 0 once that lease
/// expires, and the run finishes with no person doing anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acked_step_commit_lost_while_the_worker_lives_resumes_when_its_claims_lease_expires() {
    let mut w = World::with("lost", |s| s.worker.concurrency = 1).await;
    let first = Gate::armed();
    let workflows = vec![hops(first.clone(), Arc::new(Gate::default()))];
    let (engine, _running) = engine(&w, workflows).await;

    // Position 1's claim inserts the position's attempt row: with this one in a transaction
    // that never commits, it waits to see how that transaction ends.
    let mut blocker = sqlx::PgConnection::connect(&w.pg.url())
        .await
        .expect("connect the blocker");
    for sql in [
        "BEGIN",
        "INSERT INTO trailmark.steps (run_id, seq, step) VALUES ('r-hops', 1, 'two')",
    ] {
        sqlx::query(sql).execute(&mut blocker).await.expect(sql);
    }
    let blocker_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut blocker)
        .await
        .unwrap();
    w.env.start_run("hops", "r-hops", json!({})).await;
    first.reached("position 0 of r-hops").await;
    // The removal of position 0's outbox row (relaxed) made durable: a row back after the crash
    // would be published again and bring position 0 back before its lease expires.
    let removed = eventually("r-hops's row for position 0 removed", WAIT, || async {
        let rows = w.unpublished_rows("r-hops").await?;
        (rows == 0).then_some(())
    })
    .await;
    assert!(
        removed.is_some(),
        "r-hops's row for position 0 stayed in the outbox"
    );
    w.sync_commit().await;
    first.open();
    let waiting = eventually("position 1's claim waiting", WAIT, || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(blocker_pid)
        .fetch_one(&w.env.pool)
        .await
        .ok()?;
        (waiting == 1).then_some(())
    })
    .await;
    assert!(waiting.is_some(), "position 1's claim never waited");
    let run = w.run("r-hops").await;
    assert_eq!(
        (run.step_seq, run.lease_owner),
        (1, None),
        "(position, lease) while position 1's claim waits: position 0's commit is not visible"
    );
    w.postgres_crash().await;
    drop(blocker);

    let run = w.run("r-hops").await;
    assert_eq!(
        (run.status, run.step_seq),
        (RunStatus::Running, 0),
        "position 0's commit, made without its flush, survived the crash"
    );
    let expires = run
        .lease_expires_at
        .expect("position 0's claim, a synchronous commit, lost its lease in the crash");
    assert!(run.lease_owner.is_some());
    assert_eq!(
        (
            w.env.steps_done("r-hops").await,
            w.env.attempts("r-hops", 0).await,
            w.env.attempts("r-hops", 1).await
        ),
        (0, 1, 0),
        "(positions committed, claims of position 0, of position 1) after the crash"
    );
    a_run_started_after_the_crash_succeeds(&w).await;
    hops_succeed(&w).await;
    assert_eq!(
        engine.stats.lease_recoveries.load(Ordering::Relaxed),
        1,
        "steps the supervisor re-queued for an expired lease"
    );
    assert_eq!(
        engine.stats.stale.load(Ordering::Relaxed),
        1,
        "step messages dropped as stale: position 1's, ahead of the run after the crash"
    );
    let resumed: bool = sqlx::query_scalar(
        "SELECT finished_at > $1 FROM trailmark.steps WHERE run_id = 'r-hops' AND seq = 0",
    )
    .bind(expires)
    .fetch_one(&w.env.pool)
    .await
    .unwrap();
    assert!(resumed, "position 0 ran again before its lease expired");
    assert_eq!(
        (
            w.env.attempts("r-hops", 0).await,
            w.env.attempts("r-hops", 1).await,
            w.env.attempts("r-hops", 2).await
        ),
        (2, 1, 1),
        "claims of positions 0, 1 and 2: position 0 runs again once, the claim of position 1 \
         that waited through the crash was never committed"
    );
}

/// Runs `run` (of `workflow`, whose first step stops at `gate` and whose position 1 is `second`)
/// up to its first step's commit with position 1's claim held waiting (behind a row of position
/// 1 that a transaction of the test's inserts and never commits, as in the test above), crashes
/// Postgres, and asserts that the first step's commit, which moved the run to position 1 and was
/// acknowledged, survived: the run is at position 1 or beyond (the living worker retries its
/// claim of position 1 once Postgres is back, and may be through before the test looks), and
/// position 0 was committed once and never claimed again.
async fn advance_survives_a_crash(
    w: &mut World,
    (workflow, run, second): (&str, &str, &str),
    gate: &Gate,
) {
    let mut blocker = sqlx::PgConnection::connect(&w.pg.url())
        .await
        .expect("connect the blocker");
    sqlx::query("BEGIN")
        .execute(&mut blocker)
        .await
        .expect("BEGIN");
    sqlx::query("INSERT INTO trailmark.steps (run_id, seq, step) VALUES ($1, 1, $2)")
        .bind(run)
        .bind(second)
        .execute(&mut blocker)
        .await
        .expect("insert position 1's row");
    let blocker_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut blocker)
        .await
        .unwrap();
    w.env.start_run(workflow, run, json!({})).await;
    gate.reached("position 0").await;
    // Everything so far made durable: what the crash may lose is the first step's own work.
    w.sync_commit().await;
    gate.open();
    let waiting = eventually("position 1's claim waiting", WAIT, || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(blocker_pid)
        .fetch_one(&w.env.pool)
        .await
        .ok()?;
        (waiting == 1).then_some(())
    })
    .await;
    assert!(waiting.is_some(), "position 1's claim never waited");
    let before = w.run(run).await;
    assert_eq!(
        (before.step_seq, before.lease_owner),
        (1, None),
        "(position, lease) while position 1's claim waits"
    );
    w.postgres_crash().await;
    drop(blocker);

    let after = w.run(run).await;
    assert!(
        after.step_seq >= 1,
        "position 0's commit, which had to wait for its flush, was lost in the crash: the run \
         is {} at position {}",
        after.status,
        after.step_seq
    );
    assert_eq!(
        w.env.attempts(run, 0).await,
        1,
        "claims of position 0: it ran again after the crash"
    );
}

/// Waits for `run` (of a workflow of two positions) to succeed and asserts that each position
/// was claimed once: the step before the crash did not run again.
async fn finishes_claiming_each_position_once(w: &World, run: &str, what: &str) {
    w.env
        .wait_status(run, RunStatus::Succeeded, MOVES_WITHIN)
        .await;
    let claims = (w.env.attempts(run, 0).await, w.env.attempts(run, 1).await);
    assert_eq!(
        claims,
        (1, 1),
        "(claims of position 0, of position 1) of {run}: {what}"
    );
}

/// No kill, as in the test above, but the acknowledged step asked the model after its last
/// synchronous commit: its advance rests on an answer nothing had flushed, and asked again the
/// model might choose another next step, so the advance commits synchronously (flushing the
/// answer) and survives the crash. The run goes on from position 1 and the model is not asked
/// again; the test above is the control (an advance resting on nothing unflushed is lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acked_advance_resting_on_a_fresh_model_answer_survives_a_postgres_crash() {
    let mut w = World::with("asked", |s| s.worker.concurrency = 1).await;
    let gate = Gate::armed();
    let (engine, _running) = engine(&w, vec![asks(gate.clone())]).await;
    let what = ("asks", "r-asks", "after");
    advance_survives_a_crash(&mut w, what, &gate).await;
    assert_eq!(w.model.answered(), 1, "answers given before the crash");
    let journaled = w
        .env
        .scalar(
            "SELECT count(*) FROM trailmark.journal WHERE run_id = $1",
            "r-asks",
        )
        .await;
    assert_eq!(journaled, 1, "the answer the advance rests on was lost");

    finishes_claiming_each_position_once(&w, "r-asks", "position 0 ran again").await;
    assert_eq!(w.model.answered(), 1, "the model was asked again");
    a_run_started_after_the_crash_succeeds(&w).await;
    assert_eq!(
        engine.stats.lease_recoveries.load(Ordering::Relaxed),
        0,
        "steps the supervisor re-queued for an expired lease"
    );
}

/// No kill, as above, but the acknowledged step sent a note (`ctx.send`): the note is published
/// at once after the commit, so the commit must not be one a crash can lose (the world would
/// have seen the note of a step that then runs again). The advance commits synchronously and
/// survives the crash; the note went out before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acked_advance_that_sent_a_message_survives_a_postgres_crash() {
    let mut w = World::with("sent", |s| s.worker.concurrency = 1).await;
    // The notes' queue, the test's own (gone with its connection).
    let conn = trailmark::broker::connect(&w.env.settings.broker, "test-notes")
        .await
        .expect("connect RabbitMQ");
    let channel = conn.create_channel().await.expect("open a channel");
    let exclusive = lapin::options::QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    let declared = channel
        .queue_declare("".into(), exclusive, Default::default())
        .await
        .expect("declare the notes' queue");
    let queue = declared.name().as_str().to_owned();
    let notes_queued = || async {
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            exclusive: true,
            ..Default::default()
        };
        channel
            .queue_declare(queue.as_str().into(), passive, Default::default())
            .await
            .expect("the notes' queue")
            .message_count()
    };
    let gate = Gate::armed();
    let (_engine, _running) = engine(&w, vec![notes(gate.clone(), queue.clone())]).await;
    let what = ("notes", "r-notes", "after");
    advance_survives_a_crash(&mut w, what, &gate).await;
    let sent = eventually("the note queued", WAIT, || async {
        (notes_queued().await >= 1).then_some(())
    })
    .await;
    assert!(sent.is_some(), "the note never went out");

    a_run_started_after_the_crash_succeeds(&w).await;
    finishes_claiming_each_position_once(&w, "r-notes", "the step that sent the note ran again")
        .await;
    let _ = conn.close(200, "done".into()).await;
}

/// No kill, as above, but the acknowledged step wrote a ledger row with its commit
/// (`ctx.local_write`): other readers see the row at once, so the commit must not be one a crash
/// can lose (a step run again could write other values). The advance commits synchronously and
/// survives the crash with its one row; the run goes on from position 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acked_advance_carrying_a_local_write_survives_a_postgres_crash() {
    let mut w = World::with("booked", |s| s.worker.concurrency = 1).await;
    let gate = Gate::armed();
    let (_engine, _running) = engine(&w, vec![books(gate.clone())]).await;
    let what = ("books", "r-books", "after");
    advance_survives_a_crash(&mut w, what, &gate).await;
    assert_eq!(
        w.env.chain_ledger("r-books").await,
        (1, 1),
        "(ledger rows, distinct keys) of the step whose commit the crash came after"
    );

    finishes_claiming_each_position_once(&w, "r-books", "the step that wrote the row ran again")
        .await;
    assert_eq!(
        w.env.chain_ledger("r-books").await,
        (1, 1),
        "ledger at the end"
    );
    a_run_started_after_the_crash_succeeds(&w).await;
}

/// `books`: a first step that stops at a gate, writes one `chain_ledger` row with its commit
/// (`ctx.local_write`) and moves the run on, then a step that ends it.
fn books(gate: Arc<Gate>) -> Workflow {
    Workflow::new("books", 1)
        .step("book", StepKind::Write, move |ctx| {
            let gate = gate.clone();
            async move {
                gate.pass().await;
                let row = json!({
                    "reference": "r-books:0",
                    "run_id": ctx.run_id(),
                    "step": 0,
                    "payload": "booked",
                });
                ctx.local_write(&trailmark_testkit::ledger::TABLE, row)?;
                Ok(StepOutcome::next(json!({})))
            }
        })
        .step("after", StepKind::Read, |_ctx| async {
            Ok(StepOutcome::finish(json!({})))
        })
}

/// `posts`: position 0 stops at a gate and moves on; position 1 stops at a gate, then writes
/// one `chain_ledger` row under its key; position 2 ends the run.
fn posts(first: Arc<Gate>, second: Arc<Gate>) -> Workflow {
    Workflow::new("posts", 1)
        .step("one", StepKind::Read, move |_ctx| {
            let gate = first.clone();
            async move {
                gate.pass().await;
                Ok(StepOutcome::next(json!({})))
            }
        })
        .step("two", StepKind::Write, move |ctx| {
            let gate = second.clone();
            async move {
                gate.pass().await;
                let key = trailmark::domain::IdempotencyKey::for_step(ctx.run_id(), "two", "1");
                let (pool, run) = (ctx.pool().clone(), ctx.run_id().to_string());
                ctx.effect(&key, &json!({ "post": 1 }), |_key| async move {
                    let entry = trailmark_testkit::ledger::Entry {
                        reference: "r-posts:1",
                        run_id: &run,
                        step: 1,
                        payload: "posted",
                    };
                    let created = trailmark_testkit::ledger::post(&pool, entry)
                        .await
                        .map_err(|e| trailmark::workflow::StepError::temporary(e.to_string()))?;
                    Ok(json!({ "created": created }))
                })
                .await?;
                Ok(StepOutcome::next(json!({})))
            }
        })
        .step("three", StepKind::Read, |_ctx| async {
            Ok(StepOutcome::finish(json!({})))
        })
}

/// (rows, intents) of `r-posts` in the ledger and the effects table.
async fn posted(w: &World) -> (i64, i64) {
    let effects = "SELECT count(*) FROM trailmark.effects WHERE run_id = $1";
    (
        w.env.chain_ledger("r-posts").await.0,
        w.env.scalar(effects, "r-posts").await,
    )
}

/// A pre-claim rides on the relaxed commit of a step claimed by a claim statement, and a crash
/// of Postgres can lose both while the worker lives on and starts the next step on it. Here, on
/// a worker with one delivery slot: position 0 of `posts` commits (relaxed) with a pre-claim of
/// position 1 (fence f + 1) and is acknowledged, position 1 starts on the pre-claim and stops at
/// its gate, and Postgres crashes. The run is back at position 0 under its claim's lease
/// (fence f). The step started on the forgotten pre-claim, let go now, must write nothing (its
/// heartbeat or its effect intent finds the run elsewhere, even when position 0 was claimed
/// again meanwhile with fence f + 1: the position tells them apart, see `tests/group_commit.rs`
/// `a_fence_writes_only_at_the_position_it_was_handed_out_for`). Position 0 runs again (its
/// message republished after the crash, whose pid check frees its claim's lease, or the
/// supervisor once that lease expires) and the run finishes with its one ledger row, recorded
/// under a fence handed out after the crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_claim_lost_with_postgres_lets_the_step_started_on_it_write_nothing() {
    let mut w = World::with("preclaim-lost", |s| {
        s.worker.preclaim = true;
        s.worker.concurrency = 1;
    })
    .await;
    let (first, second) = (Gate::armed(), Gate::armed());
    let (engine, _running) = engine(&w, vec![posts(first.clone(), second.clone())]).await;
    w.env.start_run("posts", "r-posts", json!({})).await;
    first.reached("position 0 of r-posts").await;
    let claimed = w.run("r-posts").await;
    first.open();
    second
        .reached("position 1 of r-posts, on its pre-claim")
        .await;
    assert_eq!(
        engine.stats.preclaims_used.load(Ordering::Relaxed),
        1,
        "position 1 did not start on the pre-claim"
    );
    w.postgres_crash().await;

    let run = w.run("r-posts").await;
    assert_eq!(
        (run.step_seq, w.env.steps_done("r-posts").await),
        (0, 0),
        "(position, positions committed): position 0's commit and its pre-claim, made without \
         their flush, should be lost"
    );
    second.open();
    w.env
        .wait_status("r-posts", RunStatus::Succeeded, MOVES_WITHIN)
        .await;
    assert!(
        engine.stats.stale.load(Ordering::Relaxed) >= 1,
        "position 1's step on the lost pre-claim was not dropped"
    );
    assert_eq!(posted(&w).await, (1, 1), "(ledger rows, effect intents)");
    let fence: i64 =
        sqlx::query_scalar("SELECT fence FROM trailmark.effects WHERE run_id = 'r-posts'")
            .fetch_one(&w.env.pool)
            .await
            .unwrap();
    assert!(
        fence > claimed.fence + 1,
        "the write was recorded under fence {fence}, the lost pre-claim's (position 0 was \
         claimed with {})",
        claimed.fence
    );
    assert_eq!(w.env.steps_done("r-posts").await, 3, "positions committed");
}

/// A step started on a pre-claim commits synchronously: its lease is the idle one its pre-claim
/// left, which never expires, so no lease would bring the run back if the commit were lost
/// after the delivery's ack. Here `hops` runs on one worker, position 1 on a pre-claim; its
/// commit (which moves the run on, pre-claiming position 2) is acknowledged, position 2 stops at
/// its gate, and Postgres crashes. The run must be at position 2 with its lease, and finish as
/// soon as the gate opens, with no lease expiry in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acked_advance_made_on_a_pre_claim_survives_a_postgres_crash() {
    // One delivery slot: after the crash the relay publishes again the rows whose removal was
    // lost, and a repeat of position 2's message would otherwise take its idle lease at once.
    let mut w = World::with("preclaim-kept", |s| {
        s.worker.preclaim = true;
        s.worker.concurrency = 1;
    })
    .await;
    let last = Gate::armed();
    let (engine, _running) = engine(&w, vec![hops(Arc::new(Gate::default()), last.clone())]).await;
    w.env.start_run("hops", "r-hops", json!({})).await;
    last.reached("position 2 of r-hops").await;
    w.postgres_crash().await;

    let run = w.run("r-hops").await;
    assert_eq!(
        (run.status, run.step_seq),
        (RunStatus::Running, 2),
        "position 1's commit, made on a pre-claim, was lost in the crash"
    );
    assert!(run.lease_owner.is_some(), "position 2's lease was lost");
    assert_eq!(
        engine.stats.preclaims_used.load(Ordering::Relaxed),
        2,
        "positions started on a pre-claim"
    );
    last.open();
    hops_succeed(&w).await;
    assert_eq!(
        engine.stats.lease_recoveries.load(Ordering::Relaxed),
        0,
        "steps the supervisor re-queued for an expired lease"
    );
}
