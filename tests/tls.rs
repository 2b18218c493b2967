//! TLS to both servers, on loopback, with a CA of the test's own (`scripts/tls-certs`): a
//! Postgres and a RabbitMQ node that the test starts for itself and that accept nothing but TLS
//! (`hostssl` only in pg_hba.conf; no plain AMQP listener, and the node wants a client
//! certificate). `trailmark migrate`, `serve` and `run start` reach them with
//! `sslmode=verify-full&sslrootcert=` and `amqps://` with `broker.ca_file` and a client
//! certificate, and a `chain` run finishes; the mistakes a person makes with certificates end
//! `serve` at once (exit 2, no retrying) with what failed and what to set, and no password.
//!
//! The main servers on 5432 and 5672 are not touched: the test's own listen on free ports, the
//! node has its own name, cookie and directories, and everything is stopped and removed when the
//! test ends, also when it fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::servers::{TempDir, alive, append, as_postgres, is_root, pg_bin, run_ok, set_mode};
use common::{closed_port, eventually, text, trailmark_bin};
use trailmark::config::Settings;
use trailmark::domain::RunStatus;
use trailmark::store::{self, runs};

/// A Postgres cluster of the test's own on 127.0.0.1 and 127.0.0.2, TLS only, with the
/// certificate of `certs`; stopped when dropped.
struct Postgres {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
}

impl Postgres {
    fn start(dir: &Path, certs: &Path) -> Self {
        let bin = pg_bin();
        let data = dir.join("pg");
        std::fs::create_dir_all(&data).unwrap();
        if is_root() {
            run_ok(
                Command::new("chown").arg("postgres:").arg(&data),
                "chown the data directory",
            );
        }
        run_ok(
            as_postgres(&bin.join("initdb"))
                .args(["-U", "postgres", "-A", "trust", "--no-sync", "-D"])
                .arg(&data),
            "initdb",
        );
        let port = closed_port();
        for file in ["server.pem", "server.key"] {
            let to = data.join(file);
            std::fs::copy(certs.join(file), &to).unwrap();
            if is_root() {
                run_ok(Command::new("chown").arg("postgres:").arg(&to), "chown");
            }
        }
        // Postgres refuses a key others can read.
        set_mode(&data.join("server.key"), 0o600);
        let conf = format!(
            "listen_addresses = '127.0.0.1,127.0.0.2'\nport = {port}\nunix_socket_directories = '{}'\n\
             ssl = on\nssl_cert_file = 'server.pem'\nssl_key_file = 'server.key'\n\
             fsync = off\nmax_connections = 60\n",
            data.display()
        );
        append(&data.join("postgresql.conf"), &conf);
        // TLS or nothing: a connection that did not negotiate TLS finds no entry and is refused.
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhostssl all all 127.0.0.0/8 trust\n",
        )
        .unwrap();
        let cluster = Self { bin, data, port };
        run_ok(
            as_postgres(&cluster.bin.join("pg_ctl"))
                .args(["-w", "-t", "60", "-l"])
                .arg(cluster.data.join("log"))
                .arg("-D")
                .arg(&cluster.data)
                .arg("start")
                .stdout(Stdio::null()),
            "pg_ctl start",
        );
        cluster
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // Immediate: nothing in it is worth a checkpoint. pg_ctl waits until it has stopped.
        let _ = as_postgres(&self.bin.join("pg_ctl"))
            .args(["-w", "-m", "immediate", "-D"])
            .arg(&self.data)
            .arg("stop")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// A RabbitMQ node of the test's own with a TLS listener on 127.0.0.1 and 127.0.0.2 and no
/// plain one, which wants a client certificate signed by the test's CA; stopped when dropped.
///
/// Started with `/usr/lib/rabbitmq/bin/*` directly (the `/usr/sbin` wrappers switch to the
/// rabbitmq user and to the main node's cookie), with its own HOME and cookie, node name,
/// directories and ports, and an empty env file (the system's names the main node).
struct Rabbit {
    node: String,
    env: Vec<(&'static str, String)>,
    pid_file: PathBuf,
    child: Option<Child>,
    port: u16,
}

const RABBIT_BIN: &str = "/usr/lib/rabbitmq/bin";

impl Rabbit {
    fn start(dir: &Path, certs: &Path, tag: &str) -> Self {
        let base = dir.join("rabbit");
        let home = base.join("home");
        std::fs::create_dir_all(&home).unwrap();
        let cookie = home.join(".erlang.cookie");
        std::fs::write(&cookie, format!("TMTLS{}", tag.to_ascii_uppercase())).unwrap();
        set_mode(&cookie, 0o400);
        let port = closed_port();
        let cert = |f: &str| certs.join(f).display().to_string();
        let conf = base.join("rabbitmq.conf");
        std::fs::write(
            &conf,
            format!(
                "listeners.tcp = none\nlisteners.ssl.1 = 127.0.0.1:{port}\nlisteners.ssl.2 = 127.0.0.2:{port}\n\
                 ssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\n\
                 ssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = true\n\
                 loopback_users = none\n",
                cert("ca.pem"),
                cert("server.pem"),
                cert("server.key")
            ),
        )
        .unwrap();
        std::fs::write(base.join("enabled_plugins"), "[].\n").unwrap();
        std::fs::write(base.join("empty.env"), "").unwrap();
        let node = format!("tmtls{tag}@localhost");
        let path = |p: &str| base.join(p).display().to_string();
        let env: Vec<(&'static str, String)> = vec![
            ("HOME", home.display().to_string()),
            ("RABBITMQ_NODENAME", node.clone()),
            // No plain listener is configured; the port is still the node's own, so the
            // default (5672, the main node's) appears nowhere.
            ("RABBITMQ_NODE_PORT", closed_port().to_string()),
            ("RABBITMQ_DIST_PORT", closed_port().to_string()),
            ("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1".into()),
            (
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}".into(),
            ),
            ("RABBITMQ_CONF_ENV_FILE", path("empty.env")),
            ("RABBITMQ_CONFIG_FILE", conf.display().to_string()),
            ("RABBITMQ_ENABLED_PLUGINS_FILE", path("enabled_plugins")),
            ("RABBITMQ_MNESIA_BASE", path("mnesia")),
            ("RABBITMQ_LOG_BASE", path("log")),
            ("RABBITMQ_PID_FILE", path("pid")),
        ];
        let log = std::fs::File::create(base.join("server.out")).unwrap();
        let child = Command::new(format!("{RABBIT_BIN}/rabbitmq-server"))
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start rabbitmq-server");
        let rabbit = Self {
            node,
            env,
            pid_file: base.join("pid"),
            child: Some(child),
            port,
        };
        // Returns once the node runs its applications (or fails, when the node died).
        let waited = rabbit
            .ctl(&["wait", "--timeout", "90"])
            .arg(&rabbit.pid_file)
            .output()
            .expect("rabbitmqctl wait");
        if !waited.status.success() {
            let log = std::fs::read_to_string(base.join("server.out")).unwrap_or_default();
            panic!(
                "the test's RabbitMQ node did not start: {:?}\n{log}",
                text(&waited)
            );
        }
        rabbit
    }

    /// `rabbitmqctl -n <this node> args`, with the node's HOME (its cookie).
    fn ctl(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(format!("{RABBIT_BIN}/rabbitmqctl"));
        cmd.envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .args(["-n", &self.node])
            .args(args)
            .stdin(Stdio::null());
        cmd
    }
}

impl Drop for Rabbit {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(&self.pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok());
        let _ = self.ctl(&["stop"]).output();
        // `stop` returns before the VM has exited: wait for it, then make sure.
        if let Some(pid) = pid {
            let deadline = Instant::now() + Duration::from_secs(30);
            while alive(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            if alive(pid) {
                // SAFETY: the node's own VM, named by its pid file.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Environment variables for a `trailmark` process.
type Vars = Vec<(&'static str, String)>;

/// `trailmark ARGS` against the test's servers: `database_url`, `amqp_url` and the broker's TLS
/// settings in `vars`.
fn trailmark(args: &[&str], vars: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(trailmark_bin());
    cmd.args(args)
        .env_remove("TRAILMARK_FAILPOINTS")
        .env_remove("TRAILMARK_CONFIG")
        .env_remove("PGSSLMODE")
        .env("TRAILMARK__BROKER__PREFIX", "tmtest-tls")
        .env("TRAILMARK__DATABASE__MAX_CONNECTIONS", "4")
        .env("TRAILMARK__API__LISTEN", "")
        .env("TRAILMARK__PROCESS__DRAIN_DELAY_MS", "0")
        .env("TRAILMARK__RELAY__POLL_INTERVAL_MS", "200")
        // The default log filter, as an operator has it, unless a caller sets one.
        .env_remove("RUST_LOG")
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null());
    cmd
}

/// Runs `trailmark serve` with `vars` until it exits by itself, which it must within 30 s (its
/// startup timeout is 60 s: a failure it retried would still be running).
fn serve_refused(vars: &[(&str, String)]) -> (String, Duration) {
    let started = Instant::now();
    let mut child = common::ChildGuard(Some(
        trailmark(&["serve"], vars)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn trailmark serve"),
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.0.as_mut().unwrap().try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "trailmark serve kept running for 30 s instead of refusing: {vars:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.0.take().unwrap().wait_with_output().unwrap();
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("trailmark started"), "{err}");
    // One refusal line; before it at most a retry or two of a connection the node reset while
    // it sent its TLS alert (seen under load: the client read the reset before the alert).
    let lines: Vec<&str> = err.trim().lines().collect();
    let (last, before) = lines.split_last().expect("serve said why it stopped");
    assert!(last.starts_with("error: "), "{err}");
    assert!(
        before.len() <= 2 && before.iter().all(|l| l.contains("not started yet")),
        "one refusal line expected, retries aside: {err}"
    );
    (err.clone(), started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_over_tls_to_both_servers_succeeds_and_a_wrong_ca_or_host_is_refused_saying_so() {
    let began = Instant::now();
    let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let dir = TempDir::new(&tag);
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/tls-certs");
    let (ca, other) = (dir.0.join("ca"), dir.0.join("other-ca"));
    run_ok(
        Command::new(&scripts)
            .arg(&ca)
            .args(["localhost", "127.0.0.1"]),
        "scripts/tls-certs",
    );
    // A second CA, just as self-signed, that signed neither server's certificate.
    run_ok(Command::new(&scripts).arg(&other), "scripts/tls-certs");

    // Both servers start at once: the node takes most of the time.
    let (pg, rabbit) = std::thread::scope(|s| {
        let rabbit = s.spawn(|| Rabbit::start(&dir.0, &ca, &tag));
        let pg = Postgres::start(&dir.0, &ca);
        (pg, rabbit.join().expect("the RabbitMQ node started"))
    });
    eprintln!("servers up after {:?}", began.elapsed());

    let file = |dir: &Path, name: &str| dir.join(name).display().to_string();
    let database_url = |host: &str, ca_dir: &Path| {
        format!(
            "postgres://postgres:Pg5ecret@{host}:{}/trailmark?sslmode=verify-full&sslrootcert={}",
            pg.port,
            file(ca_dir, "ca.pem")
        )
    };
    let good: Vars = vec![
        ("DATABASE_URL", database_url("127.0.0.1", &ca)),
        (
            "AMQP_URL",
            format!("amqps://guest:guest@localhost:{}/%2f", rabbit.port),
        ),
        ("TRAILMARK__BROKER__CA_FILE", file(&ca, "ca.pem")),
        (
            "TRAILMARK__BROKER__CLIENT_CERT_FILE",
            file(&ca, "client.pem"),
        ),
        (
            "TRAILMARK__BROKER__CLIENT_KEY_FILE",
            file(&ca, "client.key"),
        ),
    ];
    let with = |changes: &[(&'static str, String)]| {
        let mut vars = good.clone();
        for (key, value) in changes {
            vars.retain(|(k, _)| k != key);
            vars.push((key, value.clone()));
        }
        vars
    };

    // The run: migrate, a worker, a start, over TLS only.
    let out = run_ok(&mut trailmark(&["migrate"], &good), "trailmark migrate");
    let (said, _) = text(&out);
    assert!(
        said.contains("database ready") && said.contains("broker topology declared"),
        "{said}"
    );
    assert!(!said.contains("Pg5ecret"), "{said}");
    let _serve = common::ChildGuard(Some(
        trailmark(&["serve"], &good)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn trailmark serve"),
    ));
    let run_id = "tls-chain-1";
    run_ok(
        &mut trailmark(
            &[
                "run",
                "start",
                "chain",
                "--run-id",
                run_id,
                "--input",
                r#"{"steps":3}"#,
                "--wait",
            ],
            &good,
        ),
        "trailmark run start --wait",
    );
    let mut settings = Settings::load_from(None).expect("default settings");
    settings.database.url = database_url("127.0.0.1", &ca);
    settings.database.max_connections = 2;
    let pool = store::connect(&settings.database)
        .await
        .expect("the test connects over TLS too");
    let finished = eventually(
        "the chain run to succeed",
        Duration::from_secs(60),
        || async {
            let run = runs::get(&pool, run_id).await.expect("read the run")?;
            (run.status == RunStatus::Succeeded).then_some(run)
        },
    )
    .await;
    assert!(finished.is_some(), "the run over TLS did not succeed");
    let (rows, keys): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT reference) FROM trailmark.chain_ledger WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((rows, keys), (3, 3), "one ledger row per step");
    // Every backend of the worker's database speaks TLS (pg_hba.conf admits nothing else; this
    // shows the worker is among them), and so does every AMQP connection (no plain listener).
    let (plain, tls): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE NOT s.ssl), count(*) FILTER (WHERE s.ssl)
         FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.datname = 'trailmark'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(plain, 0);
    assert!(tls > 2, "the worker's connections are TLS: {tls}");
    let connections = run_ok(
        &mut rabbit.ctl(&[
            "list_connections",
            "-q",
            "--no-table-headers",
            "client_properties",
            "ssl",
        ]),
        "rabbitmqctl list_connections",
    );
    let (connections, _) = text(&connections);
    assert!(
        connections.contains("trailmark-worker-")
            && connections
                .lines()
                .filter(|l| !l.trim().is_empty())
                .all(|l| l.trim_end().ends_with("true")),
        "{connections}"
    );
    pool.close().await;
    eprintln!("run over TLS done after {:?}", began.elapsed());

    // What a person gets wrong, each refused at once with what failed.
    let cases: Vec<(&str, Vars, Vec<String>)> = vec![
        (
            "Postgres's certificate checked against another CA",
            with(&[("DATABASE_URL", database_url("127.0.0.1", &other))]),
            vec![
                "the certificate of Postgres at".into(),
                format!(
                    "is not signed by the CA in DATABASE_URL's sslrootcert ({})",
                    file(&other, "ca.pem")
                ),
            ],
        ),
        (
            "Postgres reached at an address its certificate does not name",
            with(&[("DATABASE_URL", database_url("127.0.0.2", &ca))]),
            vec![
                "does not name the host \"127.0.0.2\" (it names localhost, 127.0.0.1)".into(),
                "sslmode=verify-ca".into(),
            ],
        ),
        (
            "the broker's certificate checked against another CA",
            with(&[
                (
                    "AMQP_URL",
                    format!("amqps://guest:Mq5ecret@localhost:{}/%2f", rabbit.port),
                ),
                ("TRAILMARK__BROKER__CA_FILE", file(&other, "ca.pem")),
            ]),
            vec![format!(
                "the certificate of RabbitMQ at amqps://guest:***@localhost:{}/%2f is not signed by broker.ca_file ({})",
                rabbit.port,
                file(&other, "ca.pem")
            )],
        ),
        (
            "the broker reached at an address its certificate does not name",
            with(&[(
                "AMQP_URL",
                format!("amqps://guest:Mq5ecret@127.0.0.2:{}/%2f", rabbit.port),
            )]),
            vec!["does not name the host \"127.0.0.2\" (it names localhost, 127.0.0.1)".into()],
        ),
        (
            "no client certificate for a broker that wants one",
            with(&[
                ("TRAILMARK__BROKER__CLIENT_CERT_FILE", String::new()),
                ("TRAILMARK__BROKER__CLIENT_KEY_FILE", String::new()),
            ]),
            vec![
                "ended the TLS handshake".into(),
                "set broker.client_cert_file and broker.client_key_file".into(),
            ],
        ),
        (
            "a CA file that is not there",
            with(&[("TRAILMARK__BROKER__CA_FILE", file(&dir.0, "missing.pem"))]),
            vec![format!(
                "broker.ca_file names {}, which cannot be read",
                file(&dir.0, "missing.pem")
            )],
        ),
    ];
    for (case, vars, expected) in &cases {
        let (err, took) = serve_refused(vars);
        for e in expected {
            assert!(err.contains(e.as_str()), "{case}: expected {e:?} in: {err}");
        }
        for secret in ["Pg5ecret", "Mq5ecret"] {
            assert!(!err.contains(secret), "{case}: password shown: {err}");
        }
        assert!(
            took < Duration::from_secs(20),
            "{case}: took {took:?}, retried?"
        );
        eprintln!("{case}: refused in {took:?}: {}", err.trim());
    }
    eprintln!("all done after {:?}", began.elapsed());
}
