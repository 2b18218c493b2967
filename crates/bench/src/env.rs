//! The bench's own environment: a fresh database and broker prefix (removed at the end), a
//! publisher for run starts, and the child processes it measures, all started from the current
//! executable so that CPU and peak RSS are those of real `trailmark` processes.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lapin::Connection;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use sqlx::PgPool;

use super::{Error, Result, baseline, measure};
use trailmark::broker::{self, Outgoing, Publisher, Topology};
use trailmark::config::Settings;
use trailmark::store;

/// `application_name` of the bench's own Postgres connections (not counted as the system's CPU).
pub const APPLICATION_NAME: &str = "trailmark-bench";

/// Connections kept free for anything else on the server (an operator's psql, the bench's
/// NOTIFY listener).
const SPARE_CONNECTIONS: i64 = 4;

/// The setting that sizes a child's Postgres pool.
const POOL_ENV: &str = "TRAILMARK__DATABASE__MAX_CONNECTIONS";

/// One isolated place to measure in, on the configured servers.
pub struct BenchEnv {
    /// Settings pointing at the bench database and prefix (children get them through env).
    pub settings: Settings,
    /// The bench's own small pool, for resets and progress queries.
    pub pool: PgPool,
    /// Name of the bench database.
    pub db_name: String,
    /// Broker name prefix.
    pub prefix: String,
    /// Where child processes write their logs.
    pub log_dir: PathBuf,
    /// The configured pool size of one process (children use it unless told otherwise).
    pub child_pool: u32,
    /// The program children are started from (the current executable unless set).
    pub exe: PathBuf,
    /// Whether this is the bench's environment (with B3's schema and queue).
    bench: bool,
    conn: std::sync::Arc<Connection>,
    publisher: Publisher,
    child_env: Vec<(String, String)>,
}

impl BenchEnv {
    /// Creates the database (migrated, plus the B3 schema) and declares the topology.
    pub async fn create(base: &Settings, child_pool: Option<u32>) -> Result<Self> {
        Self::create_named(base, child_pool, "bench").await
    }

    /// Like [`BenchEnv::create`] for another tool (`drill`): its database is `tm_<tool>_<tag>`,
    /// its prefix `tm<tool>-<tag>`; only the bench gets the B3 schema.
    pub async fn create_named(
        base: &Settings,
        child_pool: Option<u32>,
        tool: &str,
    ) -> Result<Self> {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
        let (db_name, prefix) = (format!("tm_{tool}_{tag}"), format!("tm{tool}-{tag}"));
        let exe =
            std::env::current_exe().map_err(|e| Error::io("finding the current executable", e))?;
        let child_pool = child_pool.unwrap_or(base.database.max_connections);
        let mut settings = base.clone();
        settings.database.url = with_database(&base.database.url, &db_name)?;
        settings.database.max_connections = 4;
        settings.broker.prefix = prefix.clone();
        // The broker first: when it is down, nothing has been created yet to clean up.
        let conn = broker::connect(&settings.broker, "bench").await?;
        let publisher = Publisher::open(&conn, Duration::from_secs(30)).await?;
        store::ensure_database(&settings.database).await?;
        let mut own = settings.database.clone();
        own.url = with_app_name(&settings.database.url)?;
        let pool = store::connect(&own).await?;
        store::migrate(&pool).await?;
        let bench = tool == "bench";
        if bench {
            baseline::create_schema(&pool).await?;
        }
        let topology = Topology::new(&prefix, settings.broker.delivery_limit);
        topology.declare(&conn).await?;
        if bench {
            publisher
                .channel()
                .queue_declare(baseline::queue(&prefix).into(), durable(), quorum())
                .await?;
        }
        let log_dir = std::env::temp_dir().join(format!("trailmark-{tool}-{tag}"));
        std::fs::create_dir_all(&log_dir)
            .map_err(|e| Error::io(format!("creating {}", log_dir.display()), e))?;
        let child_env = vec![
            ("DATABASE_URL".into(), settings.database.url.clone()),
            ("AMQP_URL".into(), settings.broker.url.clone()),
            ("TRAILMARK__BROKER__PREFIX".into(), prefix.clone()),
            (POOL_ENV.into(), child_pool.to_string()),
            // Each serve process serves its HTTP surface (API, health, metrics) as in production,
            // on a port of its own.
            ("TRAILMARK__API__LISTEN".into(), "127.0.0.1:0".into()),
            ("TRAILMARK__PROCESS__DRAIN_DELAY_MS".into(), "0".into()),
        ];
        Ok(Self {
            settings,
            pool,
            db_name,
            prefix,
            log_dir,
            child_pool,
            exe,
            bench,
            conn,
            publisher,
            child_env,
        })
    }

    /// Sets an extra environment variable for every child started from now on.
    pub fn set_child_env(&mut self, key: &str, value: &str) {
        self.child_env.retain(|(k, _)| k != key);
        self.child_env.push((key.into(), value.into()));
    }

    /// Gives children started from now on a Postgres pool of `size` (the scale phase sizes it
    /// per point); [`BenchEnv::child_pool`] is the size to return to.
    pub fn set_child_pool(&mut self, size: u32) {
        self.set_child_env(POOL_ENV, &size.to_string());
    }

    /// What the server has left for the bench's children: its limit, less what is open, the
    /// bench's own pool at its maximum and a few to spare.
    pub async fn connection_budget(&self) -> Result<ConnectionBudget> {
        let (max, reserved, open): (i32, i32, i64) = sqlx::query_as(
            "SELECT current_setting('max_connections')::int,
                    current_setting('superuser_reserved_connections')::int,
                    (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')",
        )
        .fetch_one(&self.pool)
        .await?;
        // The bench's own pool may still grow to its maximum.
        let own = i64::from(self.settings.database.max_connections);
        Ok(ConnectionBudget {
            max,
            reserved,
            open,
            free: i64::from(max - reserved) - open - own - SPARE_CONNECTIONS,
        })
    }

    /// The largest pool (up to the configured one) that lets `processes` children fit in what
    /// the server has left, so that no process is refused connections midway ("too many
    /// clients" made a 4-process scale point at 100,000 runs fail after 20 minutes when this was
    /// a fixed budget).
    pub async fn pool_for(&self, processes: usize) -> Result<u32> {
        let budget = self.connection_budget().await?;
        let each = u32::try_from(budget.free / processes.max(1) as i64).unwrap_or(0);
        (1..=self.child_pool.max(1))
            .rev()
            .find(|&p| store::connections_per_process(p) <= each)
            .ok_or_else(|| {
                Error::Failed(format!(
                    "{budget}: too few for {processes} trailmark processes of {} connections each; raise max_connections or start fewer processes",
                    store::connections_per_process(1)
                ))
            })
    }

    /// Stops passing `key` to children started from now on.
    pub fn remove_child_env(&mut self, key: &str) {
        self.child_env.retain(|(k, _)| k != key);
    }

    /// The names of everything declared under the prefix.
    pub fn topology(&self) -> Topology {
        Topology::new(&self.prefix, self.settings.broker.delivery_limit)
    }

    /// Publishes with confirms, in pipelined chunks.
    pub async fn publish(&self, msgs: &[Outgoing]) -> Result<()> {
        for chunk in msgs.chunks(500) {
            for r in self.publisher.publish_all(chunk).await {
                r?;
            }
        }
        Ok(())
    }

    /// Publishes the run-start events of `chain` runs `ids` with `input`, as `trailmark run
    /// start` does.
    pub async fn start_chain(&self, ids: &[String], input: &serde_json::Value) -> Result<()> {
        let topology = self.topology();
        let msgs = ids
            .iter()
            .map(|id| {
                let run_id = trailmark::domain::RunId::parse(id)
                    .map_err(|e| Error::Failed(format!("run id {id}: {e}")))?;
                let event = trailmark::domain::RunStartEvent::new(
                    run_id,
                    trailmark_testkit::chain::NAME,
                    input.clone(),
                );
                Ok(topology.run_start(&event))
            })
            .collect::<Result<Vec<_>>>()?;
        self.publish(&msgs).await
    }

    /// Waits until `queue` has at least `n` consumers (the children are connected).
    pub async fn wait_consumers(&self, queue: &str, n: u32, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        loop {
            let q = self
                .publisher
                .channel()
                .queue_declare(queue.into(), passive, FieldTable::default())
                .await?;
            if q.consumer_count() >= n {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::Failed(format!(
                    "queue {queue} has {} of {n} consumers after {within:?}; the children did not connect (logs in {})",
                    q.consumer_count(),
                    self.log_dir.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts `trailmark ARGS` with the bench's settings; output goes to `<log_dir>/<name>.log`.
    pub fn spawn(&self, name: &str, args: &[&str]) -> Result<Proc> {
        self.spawn_with(name, args, &[])
    }

    /// Like [`BenchEnv::spawn`], with extra environment for this child only (failpoints).
    pub fn spawn_with(
        &self,
        name: &str,
        args: &[&str],
        extra: &[(String, String)],
    ) -> Result<Proc> {
        self.spawn_program(name, &self.exe, args, extra)
    }

    /// Like [`BenchEnv::spawn_with`] for another program (the DBOS peer's binary), with the
    /// same environment and log file.
    pub fn spawn_program(
        &self,
        name: &str,
        exe: &std::path::Path,
        args: &[&str],
        extra: &[(String, String)],
    ) -> Result<Proc> {
        let log_path = self.log_dir.join(format!("{name}.log"));
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| Error::io(format!("opening {}", log_path.display()), e))?;
        let log2 = log
            .try_clone()
            .map_err(|e| Error::io("duplicating a log handle", e))?;
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .env("RUST_LOG", "warn")
            .env_remove("TRAILMARK_FAILPOINTS");
        for (k, v) in self.child_env.iter().chain(extra) {
            cmd.env(k, v);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| Error::io(format!("starting {} {}", exe.display(), args.join(" ")), e))?;
        Ok(Proc {
            name: name.to_owned(),
            child: Some(child),
        })
    }

    async fn teardown_broker(&self) -> Result<()> {
        let conn = broker::connect(&self.settings.broker, "bench-teardown").await?;
        let ch = conn.create_channel().await?;
        self.topology().delete(&ch).await?;
        if self.bench {
            ch.queue_delete(
                baseline::queue(&self.prefix).as_str().into(),
                QueueDeleteOptions::default(),
            )
            .await?;
        }
        let _ = conn.close(200, "bench done".into()).await;
        Ok(())
    }

    /// Removes the database and everything under the prefix; returns what could not be removed.
    pub async fn teardown(self) -> Vec<String> {
        let mut left = Vec::new();
        // A connection of its own: a drill's broker faults may have closed the first one.
        let _ = self.conn.close(200, "bench done".into()).await;
        match self.teardown_broker().await {
            Ok(()) => {}
            Err(e) => left.push(format!("broker objects under prefix {}: {e}", self.prefix)),
        }
        self.pool.close().await;
        // The host that takes writes now: with database.hosts, a failover may have moved it.
        let dropped = match store::writable_options(&self.settings.database).await {
            Ok(target) => store::drop_database(&target)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = dropped {
            left.push(format!("database {}: {e}", self.db_name));
        }
        left
    }
}

/// `n` environments for a bench that compares several sides, `f` on them, then each one torn
/// down whatever `f` returned (what could not be removed is said on stderr).
pub async fn with_envs<T>(
    base: &Settings,
    n: usize,
    pool: Option<u32>,
    f: impl AsyncFnOnce(&mut [BenchEnv]) -> Result<T>,
) -> Result<T> {
    let mut envs = Vec::with_capacity(n);
    let mut made = Ok(());
    for _ in 0..n {
        match BenchEnv::create(base, pool).await {
            Ok(env) => envs.push(env),
            Err(e) => {
                made = Err(e);
                break;
            }
        }
    }
    let result = match made {
        Ok(()) => f(&mut envs).await,
        Err(e) => Err(e),
    };
    for env in envs {
        for left in env.teardown().await {
            super::progress(&format!("could not remove {left}; remove it by hand"));
        }
    }
    result
}

/// Stops `procs` (SIGTERM, then SIGKILL after 10 s).
pub async fn stop_all(procs: &mut [Proc]) {
    for p in procs {
        p.stop(Duration::from_secs(10)).await;
    }
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

fn quorum() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args
}

/// Postgres connections at one moment, as [`BenchEnv::connection_budget`] reads them.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionBudget {
    /// `max_connections`.
    pub max: i32,
    /// `superuser_reserved_connections`.
    pub reserved: i32,
    /// Client connections open (anyone's).
    pub open: i64,
    /// What the bench's children may open.
    pub free: i64,
}

impl std::fmt::Display for ConnectionBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Postgres allows {} connections ({} reserved) and {} are open",
            self.max, self.reserved, self.open
        )
    }
}

/// The same Postgres URL with another database name.
fn with_database(url: &str, db: &str) -> Result<String> {
    let mut parsed = url::Url::parse(url).map_err(|e| {
        Error::Failed(format!(
            "database URL {} is not a URL ({e}); set DATABASE_URL",
            trailmark::redact::url(url)
        ))
    })?;
    parsed.set_path(&format!("/{db}"));
    Ok(parsed.to_string())
}

/// The same Postgres URL with the bench's `application_name`.
fn with_app_name(url: &str) -> Result<String> {
    let mut parsed =
        url::Url::parse(url).map_err(|e| Error::Failed(format!("database URL: {e}")))?;
    parsed
        .query_pairs_mut()
        .append_pair("application_name", APPLICATION_NAME);
    Ok(parsed.to_string())
}

/// A child process, killed with SIGKILL when dropped.
pub struct Proc {
    /// What it is (also its log file's name).
    pub name: String,
    child: Option<Child>,
}

impl Proc {
    /// Its pid (0 once it has been stopped).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// CPU time used so far, in milliseconds.
    pub fn cpu_ms(&self) -> Result<f64> {
        measure::process_cpu_ms(self.pid())
    }

    /// Peak RSS so far, in KiB.
    pub fn peak_rss_kib(&self) -> Result<u64> {
        measure::peak_rss_kib(self.pid())
    }

    /// Fails if the process has already exited.
    pub fn check_alive(&mut self) -> Result<()> {
        let name = self.name.clone();
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => Ok(()),
            Some(Ok(Some(status))) => Err(Error::Failed(format!(
                "child {name} exited early ({status}); see its log"
            ))),
            Some(Err(e)) => Err(Error::io(format!("checking child {name}"), e)),
            None => Err(Error::Failed(format!("child {name} was already stopped"))),
        }
    }

    /// How it ended, once it has (reaped then; `None` while it runs or after a stop).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(status)
    }

    /// SIGSTOP: the process keeps its connections, leases and unacked deliveries but does
    /// nothing, so what it holds can be read without racing it.
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT after [`Proc::freeze`].
    pub fn thaw(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, sig: libc::c_int) {
        if let Some(child) = &self.child {
            // SAFETY: signalling our own child, whose pid cannot be reused before we reap it.
            unsafe { libc::kill(child.id() as libc::pid_t, sig) };
        }
    }

    /// `kill -9`: no shutdown, no ack, no flush.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub async fn stop(&mut self, grace: Duration) {
        self.signal(libc::SIGTERM);
        let Some(child) = self.child.as_mut() else {
            return;
        };
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                self.child = None;
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.kill9();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}
