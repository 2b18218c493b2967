//! Postgres failover under a running worker: a primary and a synchronous streaming standby of
//! the test's own (beside the main server, on free ports), `database.hosts` listing the standby
//! first. The worker must connect to the primary only; when the primary is killed with `kill -9`
//! mid-run and the standby promoted, it must move to the new primary by itself and every run
//! must finish with one ledger row per step: no committed step lost (the standby is synchronous),
//! none done twice, every effect with its recorded result, the worker process never restarted.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::servers::{TempDir, append, as_postgres, is_root, pg_bin, run_ok, set_mode};
use common::{TestEnv, closed_port, eventually};
use trailmark::config::DatabaseSettings;
use trailmark::store;

/// One Postgres server of the test's own; stopped (immediately) when dropped.
struct Node {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
}

/// The name the standby gives itself, which the primary waits for on every commit.
const STANDBY: &str = "tm_standby";

impl Node {
    fn ctl(&self, args: &[&str]) -> Command {
        let mut cmd = as_postgres(&self.bin.join("pg_ctl"));
        cmd.args(["-w", "-t", "60", "-D"])
            .arg(&self.data)
            .args(args)
            .stdout(Stdio::null());
        cmd
    }

    fn start(&self) {
        let logs = self.data.parent().unwrap().join("logs");
        Self::owned_dir(&logs);
        let log = logs.join(self.data.file_name().unwrap());
        let started = self
            .ctl(&["-l", log.to_str().unwrap(), "start"])
            .status()
            .expect("run pg_ctl");
        assert!(
            started.success(),
            "pg_ctl start of {}: {}",
            self.data.display(),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    fn owned_dir(path: &Path) {
        std::fs::create_dir_all(path).unwrap();
        if is_root() {
            run_ok(Command::new("chown").arg("postgres:").arg(path), "chown");
        }
    }

    /// A primary that waits for [`STANDBY`] on every commit.
    fn primary(dir: &Path) -> Self {
        let node = Self {
            bin: pg_bin(),
            data: dir.join("primary"),
            port: closed_port(),
        };
        Self::owned_dir(&node.data);
        run_ok(
            as_postgres(&node.bin.join("initdb"))
                .args(["-U", "postgres", "-A", "trust", "--no-sync", "-D"])
                .arg(&node.data),
            "initdb",
        );
        append(
            &node.data.join("postgresql.conf"),
            &format!(
                "listen_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
                 max_connections = 80\nsynchronous_standby_names = '{STANDBY}'\n",
                node.port,
                node.data.display()
            ),
        );
        std::fs::write(
            node.data.join("pg_hba.conf"),
            "local all all trust\nhost all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n",
        )
        .unwrap();
        node.start();
        node
    }

    /// A streaming standby of `primary`, copied with pg_basebackup. Once promoted it waits for
    /// no standby of its own (it has none).
    fn standby(dir: &Path, primary: &Node) -> Self {
        let node = Self {
            bin: primary.bin.clone(),
            data: dir.join("standby"),
            port: closed_port(),
        };
        Self::owned_dir(&node.data);
        set_mode(&node.data, 0o700);
        run_ok(
            as_postgres(&node.bin.join("pg_basebackup"))
                .args(["-h", "127.0.0.1", "-U", "postgres", "-R", "-X", "stream"])
                .args(["-p", &primary.port.to_string(), "--checkpoint=fast", "-D"])
                .arg(&node.data),
            "pg_basebackup",
        );
        append(
            &node.data.join("postgresql.auto.conf"),
            &format!(
                "port = {}\nunix_socket_directories = '{}'\nsynchronous_standby_names = ''\n\
                 primary_conninfo = 'host=127.0.0.1 port={} user=postgres application_name={STANDBY}'\n",
                node.port,
                node.data.display(),
                primary.port
            ),
        );
        node.start();
        node
    }

    /// `kill -9` of the postmaster, then of every backend it left: the machine is gone.
    fn kill9(&self) {
        let pid_file = std::fs::read_to_string(self.data.join("postmaster.pid")).unwrap();
        let pid: i32 = pid_file.lines().next().unwrap().trim().parse().unwrap();
        // SAFETY: signalling a process of this test's own cluster.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let _ = Command::new("pkill")
            .args(["-KILL", "-P", &pid.to_string()])
            .status();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self
            .ctl(&["-m", "immediate", "stop"])
            .stderr(Stdio::null())
            .status();
    }
}

/// A pool on `url` through `hosts`, as every trailmark process makes it.
async fn pool_on(url: &str, hosts: &[String]) -> sqlx::PgPool {
    let settings = DatabaseSettings {
        url: url.to_owned(),
        hosts: hosts.to_vec(),
        relaxed_commits: true,
        max_connections: 2,
        connect_timeout_ms: 2000,
    };
    store::connect(&settings).await.expect("connect")
}

async fn scalar_i64(pool: &sqlx::PgPool, sql: &'static str) -> Option<i64> {
    sqlx::query_scalar(sql).fetch_one(pool).await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_follows_a_failover_to_a_synchronous_standby_and_loses_no_committed_step() {
    let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let dir = TempDir::new(&format!("failover-{tag}"));
    let primary = Node::primary(&dir.0);
    let standby = Node::standby(&dir.0, &primary);
    let hosts = vec![
        format!("127.0.0.1:{}", standby.port),
        format!("127.0.0.1:{}", primary.port),
    ];
    let url = format!("postgres://postgres@127.0.0.1:{}/trailmark", primary.port);
    let admin = pool_on(&url.replace("/trailmark", "/postgres"), &hosts).await;
    let sync = eventually(
        "the standby to stream synchronously",
        Duration::from_secs(30),
        || async {
            let state: Option<String> = sqlx::query_scalar(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = $1",
            )
            .bind(STANDBY)
            .fetch_optional(&admin)
            .await
            .ok()?;
            (state.as_deref() == Some("sync")).then_some(())
        },
    )
    .await;
    assert!(sync.is_some(), "the standby never became synchronous");
    admin.close().await;

    let env = TestEnv::with(|s| {
        s.database.url = url.clone();
        s.database.hosts = hosts.clone();
        s.database.max_connections = 4;
    })
    .await;
    // The standby is listed first: the test's own pool (migrated, so it writes) is on the primary.
    assert_eq!(
        scalar_i64(&env.pool, "SELECT inet_server_port()::bigint").await,
        Some(i64::from(primary.port))
    );
    // With hosts, records wait for the standby too: a step that goes on after a failover on the
    // new primary must not commit there without its effect results and journal entries.
    let relaxed = store::relaxed_pool(&env.pool, &env.settings.database);
    let mode: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&relaxed)
        .await
        .unwrap();
    assert_eq!(mode, "on");
    let mut worker =
        env.spawn_process_with(None, &[("TRAILMARK__DATABASE__HOSTS", hosts.join(","))]);
    let runs: Vec<String> = (0..20).map(|i| format!("failover-{i}")).collect();
    for run in &runs {
        env.start_run(
            "chain",
            run,
            serde_json::json!({"steps": 10, "step_delay_ms": 150}),
        )
        .await;
    }
    let some = eventually("40 steps committed", Duration::from_secs(60), || async {
        let n = scalar_i64(
            &env.pool,
            "SELECT count(*) FROM trailmark.steps WHERE finished_at IS NOT NULL",
        )
        .await?;
        (n >= 40).then_some(n)
    })
    .await;
    assert!(some.is_some(), "the runs did not start moving");

    primary.kill9();
    run_ok(&mut standby.ctl(&["promote"]), "pg_ctl promote");
    let promoted = chrono::Utc::now();

    let done = eventually(
        "every run to succeed on the promoted standby",
        Duration::from_secs(120),
        || async {
            let n = scalar_i64(
                &env.pool,
                "SELECT count(*) FROM trailmark.runs WHERE status = 'succeeded'",
            )
            .await?;
            (n == runs.len() as i64).then_some(n)
        },
    )
    .await;
    assert!(done.is_some(), "not every run succeeded after the failover");
    assert_eq!(
        scalar_i64(&env.pool, "SELECT inet_server_port()::bigint").await,
        Some(i64::from(standby.port)),
        "the test's pool did not move to the promoted standby"
    );
    let (rows, keys): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT reference) FROM trailmark.chain_ledger")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        (rows, keys),
        (200, 200),
        "one ledger row per step of each run"
    );
    let after: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trailmark.steps WHERE finished_at > $1")
            .bind(promoted)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert!(after > 0, "no step was committed on the new primary");
    let unfinished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trailmark.effects WHERE completed_at IS NULL")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(unfinished, 0, "effects whose result the failover lost");
    assert!(
        worker.0.as_mut().unwrap().try_wait().unwrap().is_none(),
        "the worker exited instead of following the failover"
    );
    worker.kill9();
}
