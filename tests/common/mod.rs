//! Test harness: every test gets its own Postgres database and its own broker name prefix,
//! talks to the real servers, and removes both when it ends.

#![allow(dead_code)]

pub mod servers;
pub mod vhost;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use trailmark::broker::{self, Outgoing, Publisher, Topology};
use trailmark::config::Settings;
use trailmark::domain::{RunId, RunStartEvent, RunStatus};
use trailmark::engine::Engine;
use trailmark::failpoint::Failpoints;
use trailmark::process::{self, Components};
use trailmark::store::{self, runs};
use trailmark::workflow::Registry;

/// One isolated environment on the local servers.
pub struct TestEnv {
    pub settings: Settings,
    pub pool: PgPool,
    pub db_name: String,
    pub prefix: String,
    /// Components spawned in this process and not yet ended: the teardown waits for them, since
    /// a worker still draining would declare the deleted queues again.
    live: Arc<std::sync::atomic::AtomicUsize>,
}

/// The `trailmark` binary of this build. It belongs to the workspace member `trailmark-cli`, so
/// cargo does not hand its path to these tests; it lies next to their own directory
/// (`target/<profile>/deps/..`). `scripts/test` builds it before running them.
pub fn trailmark_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from target/<profile>/deps");
    let bin = dir.join("trailmark");
    assert!(
        bin.exists(),
        "{} is missing: build it first with `cargo build -p trailmark-cli` (scripts/test does)",
        bin.display()
    );
    bin
}

/// A finished command's stdout and stderr as text.
pub fn text(out: &std::process::Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs each `trailmark` command of `cases` and checks that it is refused (exit 1) with the
/// expected words on stderr.
pub fn assert_each_refused(env: &TestEnv, cases: &[(&[&str], &str)]) {
    for (args, expected) in cases {
        let out = env.command(args).output().unwrap();
        let (_, err) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(expected), "{args:?}: {err}");
    }
}

/// A port on 127.0.0.1 that nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    listener.local_addr().expect("its address").port()
}

/// Polls `probe` every 50 ms until it yields a value, for at most `within`; `None` when it never
/// did. Every wait in the tests goes through here: a bounded wait for an observable state, never
/// a sleep standing in for one.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut probe: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(found) = probe().await {
            return Some(found);
        }
        if Instant::now() >= deadline {
            eprintln!("gave up after {within:?} waiting for {what}");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (bounded) for `child` to exit by itself, e.g. by a failpoint that kills it; `None` when
/// it is still running after `within`.
pub async fn wait_exit(
    child: &mut ChildGuard,
    within: Duration,
) -> Option<std::process::ExitStatus> {
    let status = eventually("the process to exit", within, || {
        let exited = child
            .0
            .as_mut()
            .expect("process")
            .try_wait()
            .expect("try_wait");
        async move { exited }
    })
    .await;
    if status.is_some() {
        child.0 = None;
    }
    status
}

/// The Postgres server tests use (`TRAILMARK_TEST_PG`), without a database name.
pub fn base_url() -> String {
    std::env::var("TRAILMARK_TEST_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

/// The RabbitMQ server tests use (`TRAILMARK_TEST_AMQP`).
pub fn amqp_url() -> String {
    std::env::var("TRAILMARK_TEST_AMQP")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

impl TestEnv {
    /// Creates a one-step `chain` run directly in the store (no start event, no step message).
    /// The message of `chain`'s first step (`link` at position 0) of `run_id`, as the engine
    /// publishes it.
    pub fn chain_first_step(
        run_id: &trailmark::domain::RunId,
        message_id: trailmark::domain::MessageId,
    ) -> trailmark::domain::StepMessage {
        trailmark::domain::StepMessage {
            v: 1,
            message_id,
            run_id: run_id.clone(),
            workflow: "chain".into(),
            version: 1,
            step: "link".into(),
            seq: 0,
            trace: None,
        }
    }

    pub async fn insert_chain_run(&self, id: &str) -> trailmark::domain::RunId {
        self.insert_chain_run_at(id, 1).await
    }

    /// A one-link `chain` run on `version`, at position 0, as a start would make it.
    pub async fn insert_chain_run_at(&self, id: &str, version: i32) -> trailmark::domain::RunId {
        let run_id = trailmark::domain::RunId::parse(id).unwrap();
        let input = serde_json::json!({"steps": 1});
        let new = trailmark::store::runs::NewRun {
            run_id: &run_id,
            workflow: "chain",
            version,
            first_step: &"link".into(),
            input: &input,
            parent: None,
            traceparent: None,
            flow_key: None,
            priority: 2,
        };
        assert!(
            trailmark::store::runs::insert(&self.pool, &new)
                .await
                .unwrap(),
            "run {id} already existed"
        );
        run_id
    }
    /// A fresh database (migrated) and a fresh topology prefix. Short leases keep crash tests fast.
    pub async fn new() -> Self {
        Self::with(|_| {}).await
    }

    /// Like [`TestEnv::new`], with settings changed before the database and topology are
    /// created (the work queues are declared with `settings.broker.delivery_limit`).
    pub async fn with(customize: impl FnOnce(&mut Settings)) -> Self {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let db_name = format!("tm_test_{tag}");
        let prefix = format!("tmtest-{tag}");
        let mut settings = Settings::load_from(None).expect("default settings");
        settings.database.url = format!("{}/{db_name}", base_url());
        settings.database.max_connections = 12;
        settings.broker.url = amqp_url();
        settings.broker.prefix = prefix.clone();
        settings.broker.heartbeat_secs = 2;
        settings.worker.lease_secs = 3;
        settings.worker.heartbeat_secs = 1;
        settings.worker.busy_retry_ms = 1000;
        settings.relay.poll_interval_ms = 200;
        settings.supervisor.interval_ms = 250;
        // In-process engines serve no HTTP (tests that need it bind their own port) and stop
        // without the drain delay meant for orchestrators.
        settings.api.listen = String::new();
        settings.process.drain_delay_ms = 0;
        customize(&mut settings);
        store::ensure_database(&settings.database)
            .await
            .expect("create test database");
        let pool = store::connect(&settings.database)
            .await
            .expect("connect test database");
        store::migrate(&pool).await.expect("migrate");
        let conn = broker::connect(&settings.broker, "test-setup")
            .await
            .expect("connect RabbitMQ");
        Topology::from_settings(&settings.broker)
            .declare(&conn)
            .await
            .expect("declare topology");
        let _ = conn.close(200, "setup done".into()).await;
        Self {
            settings,
            pool,
            db_name,
            prefix,
            live: Arc::default(),
        }
    }

    pub fn topology(&self) -> Topology {
        Topology::from_settings(&self.settings.broker)
    }

    /// An engine with the built-in workflows (plus `extra`) and the given failpoints.
    pub fn engine_with(&self, registry: Registry, failpoints: Failpoints) -> Arc<Engine> {
        Engine::with_pool(
            self.settings.clone(),
            registry,
            failpoints,
            self.pool.clone(),
        )
        .expect("engine")
    }

    pub fn engine(&self) -> Arc<Engine> {
        self.engine_with(trailmark_reference::registry(), Failpoints::default())
    }

    /// Runs worker + relay + supervisor in this process until the returned guard stops them.
    pub fn spawn(&self, engine: Arc<Engine>, components: Components) -> Running {
        let shutdown = CancellationToken::new();
        let (live, stop) = (LiveGuard::enter(&self.live), shutdown.clone());
        let handle = tokio::spawn(async move {
            let _live = live;
            process::run(engine, components, stop).await
        });
        Running {
            shutdown,
            handle: Some(handle),
        }
    }

    pub fn spawn_all(&self, engine: Arc<Engine>) -> Running {
        self.spawn(engine, Components::ALL)
    }

    /// Publishes a run-start event, exactly as an upstream service would.
    pub async fn start_run(&self, workflow: &str, run_id: &str, input: serde_json::Value) {
        let event = RunStartEvent::new(RunId::parse(run_id).unwrap(), workflow, input);
        self.publish(&self.topology().run_start(&event)).await;
    }

    /// Publishes raw messages with confirms.
    pub async fn publish(&self, msg: &Outgoing) {
        self.publish_all(std::slice::from_ref(msg)).await
    }

    pub async fn publish_all(&self, msgs: &[Outgoing]) {
        let conn = broker::connect(&self.settings.broker, "test-publisher")
            .await
            .expect("connect");
        let publisher = Publisher::open(&conn, Duration::from_secs(10))
            .await
            .expect("publisher");
        for r in publisher.publish_all(msgs).await {
            r.expect("publish confirmed");
        }
        let _ = conn.close(200, "done".into()).await;
    }

    /// Waits (polling the database, bounded) until the run reaches `status`.
    pub async fn wait_status(
        &self,
        run_id: &str,
        status: RunStatus,
        within: Duration,
    ) -> runs::RunRow {
        let what = format!("run {run_id} to reach {status}");
        let found = eventually(&what, within, || async {
            let run = runs::get(&self.pool, run_id).await.expect("read run");
            run.filter(|r| r.status == status)
        })
        .await;
        match found {
            Some(run) => run,
            None => panic!(
                "run {run_id} did not reach {status} within {within:?}: {:?}",
                runs::get(&self.pool, run_id)
                    .await
                    .ok()
                    .flatten()
                    .map(|r| (r.status, r.step_seq, r.error))
            ),
        }
    }

    /// Waits (bounded) until `probe` returns true.
    pub async fn wait_until<F, Fut>(&self, what: &str, within: Duration, mut probe: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let done = eventually(what, within, || {
            let ready = probe();
            async move { ready.await.then_some(()) }
        })
        .await;
        assert!(
            done.is_some(),
            "timed out after {within:?} waiting for {what}"
        );
    }

    pub async fn scalar(&self, sql: &'static str, run_id: &str) -> i64 {
        sqlx::query_scalar(sql)
            .bind(run_id)
            .fetch_one(&self.pool)
            .await
            .expect(sql)
    }

    /// (rows, distinct references) in `chain_ledger` for a run.
    pub async fn chain_ledger(&self, run_id: &str) -> (i64, i64) {
        sqlx::query_as("SELECT count(*), count(DISTINCT reference) FROM trailmark.chain_ledger WHERE run_id = $1")
            .bind(run_id)
            .fetch_one(&self.pool)
            .await
            .expect("ledger counts")
    }

    /// Committed steps of a run.
    pub async fn steps_done(&self, run_id: &str) -> i64 {
        self.scalar(
            "SELECT count(*) FROM trailmark.steps WHERE run_id = $1 AND finished_at IS NOT NULL",
            run_id,
        )
        .await
    }

    /// How many times position `seq` of a run was claimed (0 when never).
    pub async fn attempts(&self, run_id: &str, seq: i32) -> i64 {
        sqlx::query_scalar(
            "SELECT COALESCE(sum(attempts), 0)::bigint FROM trailmark.steps WHERE run_id = $1 AND seq = $2",
        )
        .bind(run_id)
        .bind(seq)
        .fetch_one(&self.pool)
        .await
        .expect("read attempts")
    }

    /// The `trailmark` binary with this environment's settings.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(trailmark_bin());
        cmd.args(args)
            .env("DATABASE_URL", &self.settings.database.url)
            .env("AMQP_URL", &self.settings.broker.url)
            .env("TRAILMARK__BROKER__PREFIX", &self.prefix)
            // The test's pool, not the production default of 24: tests run in parallel and two
            // children at the default could alone take most of the server's 100 connections.
            .env(
                "TRAILMARK__DATABASE__MAX_CONNECTIONS",
                self.settings.database.max_connections.to_string(),
            )
            .env(
                "TRAILMARK__BROKER__HEARTBEAT_SECS",
                self.settings.broker.heartbeat_secs.to_string(),
            )
            .env(
                "TRAILMARK__WORKER__LEASE_SECS",
                self.settings.worker.lease_secs.to_string(),
            )
            .env(
                "TRAILMARK__WORKER__HEARTBEAT_SECS",
                self.settings.worker.heartbeat_secs.to_string(),
            )
            .env(
                "TRAILMARK__WORKER__PRECLAIM",
                self.settings.worker.preclaim.to_string(),
            )
            .env("TRAILMARK__RELAY__POLL_INTERVAL_MS", "200")
            .env("TRAILMARK__API__LISTEN", &self.settings.api.listen)
            .env(
                "TRAILMARK__PROCESS__DRAIN_DELAY_MS",
                self.settings.process.drain_delay_ms.to_string(),
            )
            .env("TRAILMARK__SUPERVISOR__INTERVAL_MS", "250")
            .env(
                "TRAILMARK__BROKER__DELIVERY_LIMIT",
                self.settings.broker.delivery_limit.to_string(),
            )
            .env(
                "TRAILMARK__WORKER__MAX_MESSAGE_BYTES",
                self.settings.worker.max_message_bytes.to_string(),
            )
            .env("RUST_LOG", "warn")
            .env_remove("TRAILMARK_FAILPOINTS");
        cmd
    }

    /// Starts `trailmark serve` as a real child process (killed when the guard drops).
    pub fn spawn_process(&self, failpoints: Option<&str>) -> ChildGuard {
        self.spawn_process_with(failpoints, &[])
    }

    /// [`TestEnv::spawn_process`] with extra environment variables for the child.
    pub fn spawn_process_with(
        &self,
        failpoints: Option<&str>,
        env: &[(&str, String)],
    ) -> ChildGuard {
        let mut cmd = self.command(&["serve"]);
        cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        if let Some(fp) = failpoints {
            cmd.env("TRAILMARK_FAILPOINTS", fp);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn trailmark serve");
        ChildGuard(Some(child))
    }

    async fn teardown(settings: Settings, db_name: String, prefix: String) {
        if let Ok(conn) = broker::connect(&settings.broker, "test-teardown").await
            && let Ok(ch) = conn.create_channel().await
        {
            let _ = Topology::new(&prefix, settings.broker.delivery_limit)
                .delete(&ch)
                .await;
            let _ = conn.close(200, "teardown".into()).await;
        }
        let mut admin = settings.database.clone();
        admin.url = format!("{}/postgres", base_url());
        if let Ok(pool) = store::connect(&admin).await {
            let sql = format!("DROP DATABASE IF EXISTS \"{db_name}\" WITH (FORCE)");
            let _ = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await;
        }
    }
}

impl Drop for TestEnv {
    /// Drops the database and deletes the topology, even when the test failed.
    fn drop(&mut self) {
        self.await_components();
        let (settings, db, prefix) = (
            self.settings.clone(),
            self.db_name.clone(),
            self.prefix.clone(),
        );
        // Drop cannot await; a helper thread with its own runtime does the async teardown.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(Self::teardown(settings, db, prefix));
        })
        .join();
    }
}

impl TestEnv {
    /// Waits (bounded) for components dropped without [`Running::stop`] to end. A runtime with
    /// one thread cannot run them while its thread waits here; their tasks end with it instead.
    fn await_components(&self) {
        use std::sync::atomic::Ordering;
        let multi = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        let deadline = Instant::now() + Duration::from_secs(30);
        while multi && self.live.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Counts a spawned component task as live until the task ends (or is dropped).
struct LiveGuard(Arc<std::sync::atomic::AtomicUsize>);

impl LiveGuard {
    fn enter(live: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        live.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self(live.clone())
    }
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// In-process components; stopped (gracefully) when dropped or by [`Running::stop`].
pub struct Running {
    pub shutdown: CancellationToken,
    handle: Option<tokio::task::JoinHandle<Result<(), process::Error>>>,
}

impl Running {
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(h) = self.handle.take() {
            h.await
                .expect("components task")
                .expect("components ended cleanly");
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A child process killed with SIGKILL when dropped.
pub struct ChildGuard(pub Option<Child>);

impl ChildGuard {
    /// `kill -9`: no destructors, no flush, no ack.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the process to end by itself (e.g. a failpoint killed it); returns its status.
    pub fn wait(&mut self) -> std::process::ExitStatus {
        self.0.take().expect("process").wait().expect("wait")
    }

    pub fn pid(&self) -> u32 {
        self.0.as_ref().expect("process").id()
    }

    /// Sends `signal` (SIGSTOP freezes the process with its connections and leases held, so
    /// what it holds can be read without racing it; SIGCONT wakes it).
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: signalling our own child, whose pid cannot be reused before we reap it.
        unsafe { libc::kill(self.pid() as libc::pid_t, signal) };
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The commit of position 0 of `run_id` by `fence` (moving it to position 1), parking `parked`
/// and queueing `queued` step messages, from a fresh message id.
pub fn first_step_commit(
    env: &TestEnv,
    run_id: &RunId,
    fence: trailmark::domain::Fence,
    parked: &[&str],
    queued: usize,
) -> trailmark::store::checkpoint::StepCommit {
    use trailmark::domain::{MessageId, STEP_ROUTING_KEY};
    use trailmark::store::checkpoint::{Advance, StepCommit};
    let message = |_| trailmark::domain::OutgoingMessage {
        message_id: MessageId::new(),
        exchange: env.topology().steps_exchange(),
        routing_key: STEP_ROUTING_KEY.into(),
        headers: Default::default(),
        body: b"{}".to_vec(),
        relay_after_ms: 0,
        holder_pid: None,
    };
    StepCommit {
        run_id: run_id.clone(),
        fence,
        step: "link".into(),
        to: Advance {
            seq: 0,
            next_step: Some("link".into()),
            status: RunStatus::Running.move_to(RunStatus::Running).unwrap(),
            output: None,
            error: None,
            handover: None,
        },
        step_output: Some(serde_json::json!({ "link": run_id.as_str() })),
        finished: true,
        inbox: ("steps", MessageId::new()),
        parked: parked
            .iter()
            .map(|i| (i.to_string(), "unreadable".to_owned()))
            .collect(),
        outbox: (0..queued).map(message).collect(),
        local_writes: Vec::new(),
        preclaim: None,
        wait: None,
        ends_child_of: None,
    }
}
