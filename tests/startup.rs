//! A process that cannot work says so and exits 2: refusals no retry can fix end `serve`,
//! `worker` and `relay` at once with what to do; an unreachable server is retried for
//! `process.startup_timeout_secs`, one line per attempt; configuration mistakes are refused
//! before anything connects.

mod common;

use std::process::Output;
use std::time::{Duration, Instant};

use common::{TestEnv, closed_port, text};

/// Runs `trailmark <command>` with `env` and returns its output; the process must end by itself
/// (the timeout only guards the test against a process that looks alive and never exits).
fn run(env: &TestEnv, command: &str, vars: &[(&str, String)]) -> (Output, Duration) {
    let started = Instant::now();
    let mut cmd = env.command(&[command]);
    cmd.envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .env("RUST_LOG", "info");
    let mut child = common::ChildGuard(Some(
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn trailmark"),
    ));
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.0.as_mut().unwrap().try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "trailmark {command} kept running for 60 s instead of exiting"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.0.take().unwrap().wait_with_output().unwrap();
    (out, started.elapsed())
}

fn assert_refused(out: &Output, expected: &[&str], not: &[&str]) {
    let (_, err) = text(out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for e in expected {
        assert!(err.contains(e), "expected {e:?} in: {err}");
    }
    for n in not {
        assert!(!err.contains(n), "unexpected {n:?} in: {err}");
    }
    assert!(
        !err.contains("trailmark started"),
        "it reported started: {err}"
    );
    assert!(!err.contains(" at line "), "driver noise: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_broker_password_or_a_missing_vhost_ends_serve_at_once_with_what_to_fix() {
    let env = TestEnv::new().await;
    let (out, took) = run(
        &env,
        "serve",
        &[("AMQP_URL", "amqp://guest:wrongpw@127.0.0.1:5672/%2f".into())],
    );
    assert_refused(
        &out,
        &["refused the login of user \"guest\"", "AMQP_URL"],
        &["wrongpw", "rabbitmq-server -detached", "not started yet"],
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");

    let (out, _) = run(
        &env,
        "worker",
        &[(
            "AMQP_URL",
            "amqp://guest:guest@127.0.0.1:5672/tm-no-such-vhost".into(),
        )],
    );
    assert_refused(
        &out,
        &[
            "vhost \"tm-no-such-vhost\" does not exist",
            "rabbitmqctl add_vhost",
        ],
        &["not started yet"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_database_or_role_is_refused_with_what_to_do() {
    let env = TestEnv::new().await;
    let server = common::base_url();
    let (out, _) = run(
        &env,
        "relay",
        &[("DATABASE_URL", format!("{server}/tm_no_such_db"))],
    );
    assert_refused(
        &out,
        &[
            "database \"tm_no_such_db\" does not exist",
            "trailmark migrate` (it creates it)",
        ],
        &["pg_ctlcluster"],
    );
    let nobody = server.replace("postgres@", "tm_no_such_role@");
    let (out, _) = run(
        &env,
        "serve",
        &[("DATABASE_URL", format!("{nobody}/{}", env.db_name))],
    );
    assert_refused(
        &out,
        &[
            "refused the login of user \"tm_no_such_role\"",
            "create the role",
        ],
        &["pg_ctlcluster"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_never_migrated_older_or_newer_than_the_binary_is_refused() {
    let env = TestEnv::new().await;
    // A database that exists but was never migrated.
    let bare = format!("{}_bare", env.db_name);
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {bare}")))
        .execute(&env.pool)
        .await
        .unwrap();
    let bare_url = format!("{}/{bare}", common::base_url());
    let (out, _) = run(&env, "serve", &[("DATABASE_URL", bare_url.clone())]);
    let dropped = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {bare} WITH (FORCE)"
    )))
    .execute(&env.pool)
    .await;
    assert_refused(
        &out,
        &["was never migrated", "run `trailmark migrate`"],
        &[],
    );
    dropped.unwrap();

    // A newer trailmark migrated it with a migration older builds cannot run on.
    migrated_by_a_newer_build(&env).await;
    sqlx::query("UPDATE trailmark.schema_compat SET oldest_build = 29991231000000")
        .execute(&env.pool)
        .await
        .unwrap();
    let (out, _) = run(&env, "serve", &[]);
    assert_refused(
        &out,
        &[
            "migrated by a newer trailmark",
            "29991231000000",
            "cannot run on",
        ],
        &[],
    );
    sqlx::query("DELETE FROM _sqlx_migrations WHERE version = 29991231000000")
        .execute(&env.pool)
        .await
        .unwrap();

    // An older one: its last migration not applied.
    sqlx::query(
        "DELETE FROM _sqlx_migrations WHERE version = (SELECT max(version) FROM _sqlx_migrations)",
    )
    .execute(&env.pool)
    .await
    .unwrap();
    let (out, _) = run(&env, "supervisor", &[]);
    assert_refused(
        &out,
        &["is older than this build", "run `trailmark migrate`"],
        &[],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_is_retried_for_the_startup_timeout_then_exit_2() {
    let env = TestEnv::new().await;
    let (out, took) = run(
        &env,
        "serve",
        &[
            (
                "AMQP_URL",
                format!("amqp://guest:guest@127.0.0.1:{}/%2f", closed_port()),
            ),
            ("TRAILMARK__PROCESS__STARTUP_TIMEOUT_SECS", "3".into()),
        ],
    );
    assert_refused(
        &out,
        &[
            "gave up after 3 s",
            "cannot connect to RabbitMQ",
            "rabbitmq-server -detached",
        ],
        &[],
    );
    let (_, err) = text(&out);
    let attempts = err.matches("not started yet").count();
    assert!(attempts >= 2, "one line per attempt expected: {err}");
    assert!(took >= Duration::from_secs(3), "gave up early: {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configuration_mistakes_are_refused_naming_the_key_and_its_range() {
    let env = TestEnv::new().await;
    let (out, _) = run(
        &env,
        "serve",
        &[("TRAILMARK__WORKER__CONCURENCY", "5".into())],
    );
    assert_refused(
        &out,
        &[
            "unknown setting worker.concurency",
            "TRAILMARK__WORKER__CONCURENCY",
            "did you mean worker.concurrency?",
        ],
        &[],
    );
    let (out, _) = run(
        &env,
        "serve",
        &[("TRAILMARK__DATABASE__MAX_CONNECTIONS", "0".into())],
    );
    assert_refused(
        &out,
        &["database.max_connections is 0", "from 1 to"],
        &["panicked"],
    );
    let file = std::env::temp_dir().join(format!("{}.toml", env.prefix));
    std::fs::write(&file, "[relay]\nbatch_sise = 10\n").unwrap();
    let (out, _) = run(
        &env,
        "relay",
        &[("TRAILMARK_CONFIG", file.display().to_string())],
    );
    let _ = std::fs::remove_file(&file);
    assert_refused(
        &out,
        &["unknown setting relay.batch_sise", "relay.batch_size"],
        &[],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_that_declares_itself_compatible_keeps_older_processes_running() {
    // The rolling upgrade's first move: the new build migrated (an additive migration that
    // leaves `schema_compat.oldest_build` alone), the old processes go on.
    let env = TestEnv::new().await;
    migrated_by_a_newer_build(&env).await;
    let mut conn = trailmark::store::connect_one(&env.settings.database)
        .await
        .unwrap();
    let newer = trailmark::store::check_schema(&mut conn, &env.settings.database)
        .await
        .expect("a compatible newer schema is accepted");
    assert_eq!(newer, Some(29991231000000));
    let _serve = env.spawn_process(None);
    env.start_run("chain", "r-rolling", serde_json::json!({"steps": 3}))
        .await;
    env.wait_status(
        "r-rolling",
        trailmark::domain::RunStatus::Succeeded,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(env.chain_ledger("r-rolling").await, (3, 3));
}

/// Records migration 29991231000000, which this build does not know, as applied.
async fn migrated_by_a_newer_build(env: &TestEnv) {
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (29991231000000, 'from the future', true, '\\x00', 0)",
    )
    .execute(&env.pool)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_urls_are_tried_in_turn_so_a_node_that_is_down_does_not_stop_a_process() {
    // A cluster of two addresses whose first node is down: every connect and reconnect goes on
    // to the next, and the process works.
    let env = TestEnv::new().await;
    let down = format!("amqp://guest:guest@127.0.0.1:{}/%2f", closed_port());
    let urls = format!("{down},{}", common::amqp_url());
    let _serve = env.spawn_process_with(None, &[("TRAILMARK__BROKER__URLS", urls)]);
    env.start_run("chain", "r-urls", serde_json::json!({"steps": 3}))
        .await;
    env.wait_status(
        "r-urls",
        trailmark::domain::RunStatus::Succeeded,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(env.chain_ledger("r-urls").await, (3, 3));
    // With every address down, the refusal names them (redacted), like a single URL's.
    let (out, _) = run(
        &env,
        "serve",
        &[
            ("TRAILMARK__BROKER__URLS", format!("{down},{down}")),
            ("TRAILMARK__PROCESS__STARTUP_TIMEOUT_SECS", "1".into()),
        ],
    );
    assert!(!out.status.success());
    let (_, stderr) = text(&out);
    assert!(stderr.contains("127.0.0.1"), "{stderr}");
    assert!(!stderr.contains("guest:guest"), "password shown: {stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_says_the_vhost_is_gone_when_it_is_deleted_under_a_running_serve() {
    let env = TestEnv::new().await;
    let vhost = common::vhost::Vhost::create(format!("tmtest-ready-{}", std::process::id()));
    let port = closed_port();
    let _serve = common::ChildGuard(Some(
        env.command(&["serve"])
            .env("AMQP_URL", vhost.url())
            .env("TRAILMARK__API__LISTEN", format!("127.0.0.1:{port}"))
            .spawn()
            .expect("spawn serve"),
    ));
    let http = reqwest::Client::new();
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    let wait = Duration::from_secs(60);
    env.wait_until("serve to be ready", wait, || async {
        matches!(http.get(&readyz).send().await, Ok(r) if r.status().is_success())
    })
    .await;
    vhost.delete();
    let answer = common::eventually("/readyz to name the missing vhost", wait, || async {
        let r = http.get(&readyz).send().await.ok()?;
        let body: serde_json::Value = r.json().await.ok()?;
        let reasons = body["reasons"].to_string();
        reasons.contains("does not exist").then_some(reasons)
    })
    .await
    .expect("/readyz never said the vhost is missing");
    assert!(
        answer.contains(&format!("vhost \\\"{}\\\"", vhost.0)) && answer.contains("add_vhost"),
        "{answer}"
    );
    assert!(!answer.contains("guest@"), "credentials shown: {answer}");
}
