//! The container image as users get it. `deploy/image/build` makes `trailmark:<version>` (or finds
//! it up to date), and containers of it, run the way deploy/kubernetes runs them (uid 65532, a
//! read-only root filesystem, no capabilities), create a database and topology of the test's own
//! with `migrate`, `serve` a `chain` run to the end, and stop on SIGTERM with exit 0: the
//! graceful drain, not the runtime's SIGKILL (exit 137); so does a container still waiting for
//! its servers. Also `deploy/compose.yaml`: what it starts exists, a stopping worker gets its
//! drain, podman-compose accepts it with the local override, and the whole project, with the
//! server images `deploy/image/build-servers` makes, comes up, runs a run and drains.
//!
//! Needs podman, buildah and runc, and for the compose test debootstrap and python3-venv
//! (scripts/test installs them all). Under CI (`CI=true`) a test whose tool is missing fails,
//! naming the tool and its install command; elsewhere it is skipped with a line on stderr that
//! says the same ([`tools_present`]).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::TestEnv;
use trailmark::config::Settings;
use trailmark::domain::RunStatus;

/// The tag `deploy/image/build` gives: the workspace version, which this package shares.
const IMAGE: &str = concat!("trailmark:", env!("CARGO_PKG_VERSION"));

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn script(name: &str) -> PathBuf {
    repo().join(name)
}

/// podman with the repository's containers.conf (`deploy/image/podman` says why it is needed).
fn podman(args: &[&str]) -> Command {
    let mut cmd = Command::new(script("deploy/image/podman"));
    cmd.args(args);
    cmd
}

/// Runs `cmd` to its end; fails the test with its output when it did not exit 0.
fn run_ok(cmd: &mut Command, what: &str) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: could not start it: {e}"));
    let (stdout, stderr) = common::text(&out);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    out
}

/// A program a test needs from this machine: how to see that it works, and how to install it.
struct Tool {
    name: &'static str,
    probe: &'static [&'static str],
    install: &'static str,
}

const PODMAN: Tool = Tool {
    name: "podman",
    probe: &["podman", "--version"],
    install: "apt-get install podman buildah runc",
};
/// deploy/image/build-servers makes the compose test's server images' base with it.
const DEBOOTSTRAP: Tool = Tool {
    name: "debootstrap",
    probe: &["debootstrap", "--version"],
    install: "apt-get install debootstrap",
};
/// deploy/image/compose installs podman-compose into a virtualenv.
const PYTHON_VENV: Tool = Tool {
    name: "python3-venv",
    probe: &["python3", "-c", "import ensurepip, venv"],
    install: "apt-get install python3-venv",
};

/// Whether `test` can run here: true when every one of `tools` works. When one is missing, a test
/// under CI (`CI` set to anything but `false` or `0`) fails, naming the tool and its install
/// command; elsewhere the test is skipped (false) after saying the same on stderr, so that a
/// passing run without the tools does not pass for a checked one. scripts/test installs them all.
fn tools_present(test: &str, tools: &[&Tool]) -> bool {
    let missing: Vec<&Tool> = tools
        .iter()
        .copied()
        .filter(|tool| {
            !Command::new(tool.probe[0])
                .args(&tool.probe[1..])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    let said = missing
        .iter()
        .map(|t| format!("{} is not installed (Debian: {})", t.name, t.install))
        .collect::<Vec<_>>()
        .join("; ");
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    if ci {
        panic!(
            "{test}: {said}. Under CI every test runs: install it, or run scripts/test, which does"
        );
    }
    eprintln!(
        "SKIPPED {test}: {said}; nothing was checked. scripts/test installs it (under CI=true this test fails)"
    );
    false
}

/// Builds the image with `deploy/image/build`, which rebuilds nothing when the image already holds
/// this binary (.ci/run builds it before the tests, so here it is only checked); returns its size
/// in bytes.
fn build_image() -> u64 {
    let started = Instant::now();
    let out = run_ok(
        Command::new(script("deploy/image/build")).arg("--locked"),
        "deploy/image/build",
    );
    println!(
        "{}deploy/image/build took {:.1} s",
        String::from_utf8_lossy(&out.stdout),
        started.elapsed().as_secs_f64()
    );
    let out = run_ok(
        &mut podman(&["image", "inspect", "--format", "{{.Size}}", IMAGE]),
        "podman image inspect",
    );
    let size: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("podman prints the image size in bytes");
    println!("image {IMAGE}: {:.1} MB", size as f64 / 1e6);
    size
}

/// Like [`run_ok`] for a command that could hang (a compose command, `podman wait`): killed after
/// `within`, and the test fails with what it printed until then.
fn run_within(cmd: &mut Command, what: &str, within: Duration) -> Output {
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let files = ["out", "err"].map(|s| std::env::temp_dir().join(format!("tm-image-{tag}.{s}")));
    let create = |path: &PathBuf| {
        std::fs::File::create(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let mut child = cmd
        .stdout(create(&files[0]))
        .stderr(create(&files[1]))
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: could not start it: {e}"));
    let deadline = Instant::now() + within;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let [stdout, stderr] = files.map(|path| {
        let text = std::fs::read(&path).unwrap_or_default();
        let _ = std::fs::remove_file(&path);
        text
    });
    let out = Output {
        status: status.unwrap_or_else(|| {
            panic!(
                "{what} did not end within {within:?}; it printed:\n--- stdout\n{}\n--- stderr\n{}",
                String::from_utf8_lossy(&stdout),
                String::from_utf8_lossy(&stderr)
            )
        }),
        stdout,
        stderr,
    };
    let (so, se) = common::text(&out);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout\n{so}\n--- stderr\n{se}",
        out.status
    );
    out
}

/// A container of the test's own: removed when dropped, its log printed first if the test failed.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Ok(out) = podman(&["logs", &self.0]).output()
        {
            let (stdout, stderr) = common::text(&out);
            eprintln!("--- log of container {}:\n{stdout}{stderr}", self.0);
        }
        let _ = podman(&["rm", "--force", "--time", "0", &self.0]).output();
    }
}

/// `podman run` options that make a container like deploy/kubernetes' pods: the image's user
/// (65532), a read-only root filesystem without even a writable /tmp, no capabilities, no
/// privilege escalation; on the host's network, where the test's Postgres and RabbitMQ are.
const HARDENED: [&str; 7] = [
    "--network=host",
    "--read-only",
    "--read-only-tmpfs=false",
    "--cap-drop=all",
    "--security-opt=no-new-privileges",
    "--pull=never",
    "--log-driver=k8s-file",
];

/// The environment the test gives its `trailmark` children (its database, prefix, short leases),
/// as `--env` options, with `changes` replacing or adding entries.
fn env_options(env: &TestEnv, changes: &[(&str, &str)]) -> Vec<String> {
    let cmd = env.command(&[]);
    let mut vars: Vec<(String, String)> = cmd
        .get_envs()
        .filter_map(|(k, v)| Some((k.to_str()?.to_owned(), v?.to_str()?.to_owned())))
        .filter(|(k, _)| !changes.iter().any(|(c, _)| c == k))
        .collect();
    vars.extend(changes.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    vars.into_iter()
        .map(|(k, v)| format!("--env={k}={v}"))
        .collect()
}

/// `podman run --rm` of the image with `args`: a one-shot command such as `migrate`.
fn run_once(env: &TestEnv, args: &[&str]) -> Output {
    let options = env_options(env, &[]);
    let mut cmd = podman(&["run", "--rm"]);
    cmd.args(HARDENED).args(&options).arg(IMAGE).args(args);
    run_ok(
        &mut cmd,
        &format!("the image's `trailmark {}`", args.join(" ")),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_migrates_serves_a_chain_run_and_stops_on_sigterm_with_exit_0() {
    if !tools_present(
        "the_image_migrates_serves_a_chain_run_and_stops_on_sigterm_with_exit_0",
        &[&PODMAN],
    ) {
        return;
    }
    let size = build_image();
    let user = run_ok(
        &mut podman(&["image", "inspect", "--format", "{{.Config.User}}", IMAGE]),
        "podman image inspect",
    );
    assert_eq!(
        String::from_utf8_lossy(&user.stdout).trim(),
        "65532:65532",
        "the image must run as the uid deploy/kubernetes names"
    );

    // The test's own database and prefix, emptied: `migrate` in the container must create both.
    let mut env = TestEnv::new().await;
    env.pool.close().await;
    let admin = sqlx::PgPool::connect(&format!("{}/postgres", common::base_url()))
        .await
        .expect("connect to the postgres database");
    let drop = format!("DROP DATABASE \"{}\" WITH (FORCE)", env.db_name);
    sqlx::query(sqlx::AssertSqlSafe(drop))
        .execute(&admin)
        .await
        .expect("drop the test database");
    admin.close().await;
    let conn = trailmark::broker::connect(&env.settings.broker, "image-test")
        .await
        .expect("connect RabbitMQ");
    let ch = conn.create_channel().await.expect("channel");
    env.topology()
        .delete(&ch)
        .await
        .expect("delete the topology");
    let _ = conn.close(200, "emptied".into()).await;

    let out = run_once(&env, &["migrate"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("database ready") && said.contains("broker topology declared"),
        "{said}"
    );
    env.pool = sqlx::PgPool::connect(&env.settings.database.url)
        .await
        .expect("the database `migrate` created");

    // `serve` in the background, with the production drain delay, probed where it listens.
    let port = common::closed_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let name = format!("{}-serve", env.prefix);
    let options = env_options(
        &env,
        &[
            ("TRAILMARK__API__LISTEN", &listen),
            ("TRAILMARK__PROCESS__DRAIN_DELAY_MS", "1000"),
            ("RUST_LOG", "info"),
        ],
    );
    let mut cmd = podman(&["run", "--detach", "--name", &name]);
    cmd.args(HARDENED).args(&options).arg(IMAGE).arg("serve");
    run_ok(&mut cmd, "podman run ... serve");
    let serve = Container(name);
    let readyz = format!("http://{listen}/readyz");
    let http = reqwest::Client::new();
    let ready = common::eventually("/readyz of the container", Duration::from_secs(60), || {
        let probe = http.get(&readyz).send();
        async move { probe.await.ok().filter(|r| r.status().is_success()) }
    })
    .await;
    assert!(
        ready.is_some(),
        "the container never answered 200 on {readyz}"
    );

    run_once(
        &env,
        &[
            "run",
            "start",
            "chain",
            "--run-id",
            "image-chain",
            "--input",
            r#"{"steps":3}"#,
        ],
    );
    env.wait_status("image-chain", RunStatus::Succeeded, Duration::from_secs(60))
        .await;
    let out = run_once(&env, &["run", "show", "image-chain", "--json"]);
    let shown: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("run show --json prints JSON");
    assert_eq!(shown["status"], "succeeded", "{shown}");
    assert_eq!(shown["steps_done"], 3, "{shown}");
    assert_eq!(env.chain_ledger("image-chain").await, (3, 3));

    // SIGTERM, with the time a worker is given in production before SIGKILL: the drain delay, a
    // lease and 5 s (tests/deploy.rs checks the deploy files give that much). Exit code 0 is the
    // graceful path; SIGKILL after the timeout would show as 137.
    let defaults = Settings::load_from(None).expect("default settings");
    let grace = defaults.process.drain_delay_ms.div_ceil(1000) + defaults.worker.lease_secs + 5;
    let stopping = Instant::now();
    run_ok(
        &mut podman(&["stop", "--time", &grace.to_string(), &serve.0]),
        "podman stop",
    );
    let stopped_in = stopping.elapsed();
    let code = run_ok(
        &mut podman(&["inspect", "--format", "{{.State.ExitCode}}", &serve.0]),
        "podman inspect",
    );
    assert_eq!(
        String::from_utf8_lossy(&code.stdout).trim(),
        "0",
        "`podman stop` did not end the container gracefully (137 is SIGKILL after {grace} s)"
    );
    let log = run_ok(&mut podman(&["logs", &serve.0]), "podman logs");
    let (out, err) = common::text(&log);
    assert!(
        err.contains("SIGTERM: shutting down") || out.contains("SIGTERM: shutting down"),
        "the container's log does not show the SIGTERM handler:\n{out}{err}"
    );
    println!(
        "image {IMAGE} ({:.1} MB): migrate, serve, a 3-step chain run, stopped by SIGTERM in {:.1} s (exit 0)",
        size as f64 / 1e6,
        stopped_in.as_secs_f64()
    );
}

/// SIGTERM before startup finished: a container whose servers cannot be reached (it has no
/// network at all) waits for them, as every long-running process does for
/// process.startup_timeout_secs; `podman stop` must still end it at once and cleanly. As PID 1
/// the process gets no default action for SIGTERM, so this holds only because the handler is
/// installed before the startup checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_still_waiting_for_its_servers_stops_on_sigterm_with_exit_0() {
    if !tools_present(
        "a_container_still_waiting_for_its_servers_stops_on_sigterm_with_exit_0",
        &[&PODMAN],
    ) {
        return;
    }
    build_image();
    let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let name = format!("tmtest-{tag}-startup");
    run_ok(
        &mut podman(&[
            "run",
            "--detach",
            "--name",
            &name,
            "--network=none",
            "--read-only",
            "--cap-drop=all",
            "--pull=never",
            "--log-driver=k8s-file",
            "--env=DATABASE_URL=postgres://postgres@127.0.0.1:1/trailmark",
            "--env=AMQP_URL=amqp://guest:guest@127.0.0.1:2/%2f",
            "--env=RUST_LOG=info",
            IMAGE,
            "serve",
        ]),
        "podman run ... serve",
    );
    let container = Container(name);
    let waiting = common::eventually(
        "the container to retry its servers",
        Duration::from_secs(30),
        || {
            let log = podman(&["logs", &container.0]).output().ok();
            let retrying = log.is_some_and(|out| {
                let (stdout, stderr) = common::text(&out);
                stdout.contains("not started yet") || stderr.contains("not started yet")
            });
            async move { retrying.then_some(()) }
        },
    )
    .await;
    assert!(
        waiting.is_some(),
        "the container never reported waiting for Postgres"
    );
    let stopping = Instant::now();
    run_ok(
        &mut podman(&["stop", "--time", "30", &container.0]),
        "podman stop",
    );
    let code = run_ok(
        &mut podman(&["inspect", "--format", "{{.State.ExitCode}}", &container.0]),
        "podman inspect",
    );
    assert_eq!(
        String::from_utf8_lossy(&code.stdout).trim(),
        "0",
        "SIGTERM during startup was not honoured (137 is the SIGKILL 30 s later)"
    );
    println!(
        "stopped during startup in {:.1} s (exit 0)",
        stopping.elapsed().as_secs_f64()
    );
}

/// The two recipes make the same runtime: the Containerfile (for machines with a registry) and
/// the offline one deploy/image/build uses name the same user, port, entrypoint and command, and
/// deploy/kubernetes runs the tag the build makes as that user.
#[test]
fn the_containerfile_and_the_offline_build_make_the_same_runtime() {
    let directives = |path: &str| -> Vec<String> {
        let text = read(path);
        let runtime = text.rsplit("\nFROM ").next().unwrap_or_default().to_owned();
        ["USER ", "EXPOSE ", "ENTRYPOINT ", "CMD "]
            .iter()
            .map(|d| {
                runtime
                    .lines()
                    .find(|l| l.starts_with(d))
                    .unwrap_or_else(|| panic!("{path}: no {d}in the runtime stage"))
                    .to_owned()
            })
            .collect()
    };
    let root = directives("Containerfile");
    assert_eq!(root, directives("deploy/image/Containerfile.offline"));
    assert_eq!(root[0], "USER 65532:65532");
    for path in ["Containerfile", "deploy/image/Containerfile.offline"] {
        assert!(
            read(path).contains("TRAILMARK__API__LISTEN=0.0.0.0:8080"),
            "{path}: the API must listen beyond the container's loopback"
        );
    }
    let manifest = read("deploy/kubernetes/trailmark.yaml");
    assert!(
        manifest.contains(&format!("image: {IMAGE}")),
        "deploy/kubernetes runs {IMAGE}"
    );
    assert!(manifest.contains("runAsUser: 65532"));
}

// ---- deploy/compose.yaml --------------------------------------------------------------------

const COMPOSE: &str = "deploy/compose.yaml";
const COMPOSE_LOCAL: &str = "deploy/compose.local.yaml";

fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The text of each service of the compose file, by name (its lines up to the next service).
fn services(compose: &str) -> Vec<(String, String)> {
    let body = compose
        .split("\nservices:\n")
        .nth(1)
        .expect("a services: section");
    let body = body.split("\nvolumes:\n").next().unwrap_or(body);
    let mut found: Vec<(String, String)> = Vec::new();
    for line in body.lines() {
        if let Some(name) = line.strip_prefix("  ").and_then(|l| l.strip_suffix(':'))
            && !name.starts_with(' ')
        {
            found.push((name.to_owned(), String::new()));
        } else if let Some((_, text)) = found.last_mut() {
            text.push_str(line);
            text.push('\n');
        }
    }
    found
}

/// Seconds of a compose duration such as `45s` or `1m30s`.
fn seconds(duration: &str) -> u64 {
    let (minutes, rest) = duration.split_once('m').unwrap_or(("0", duration));
    let secs = rest.trim_end_matches('s');
    minutes.parse::<u64>().expect("minutes") * 60
        + if secs.is_empty() {
            0
        } else {
            secs.parse::<u64>().expect("seconds")
        }
}

#[test]
fn the_compose_file_starts_real_commands_and_gives_a_stopping_worker_its_drain() {
    let compose = read(COMPOSE);
    let services = services(&compose);
    let names: Vec<&str> = services.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "postgres",
            "rabbitmq",
            "migrate",
            "worker",
            "relay",
            "supervisor",
            "api"
        ]
    );
    // The anchor every trailmark service merges: its grace period, unless a service sets its own.
    let anchor = compose
        .split("\nservices:\n")
        .next()
        .expect("the part before services");
    let grace_of = |text: &str| {
        text.lines()
            .find_map(|l| l.trim().strip_prefix("stop_grace_period:"))
            .map(|v| seconds(v.trim()))
    };
    let defaults = Settings::load_from(None).expect("default settings");
    let needed = defaults.process.drain_delay_ms.div_ceil(1000) + defaults.worker.lease_secs + 5;
    let worker = &services[3].1;
    let grace = grace_of(worker)
        .or(grace_of(anchor))
        .expect("a stop_grace_period");
    assert!(
        grace > needed,
        "a compose worker is killed {grace} s after SIGTERM, before its in-flight steps had their {needed} s"
    );
    for (name, text) in &services[2..] {
        assert!(
            text.contains("<<: *trailmark"),
            "{name} does not merge the trailmark anchor"
        );
        let sub = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("command: [\""))
            .and_then(|c| c.strip_suffix("\"]"))
            .unwrap_or_else(|| panic!("{name} has no command: [\"...\"]"));
        assert_eq!(
            sub,
            name.as_str(),
            "the service {name} runs `trailmark {sub}`"
        );
        let out = Command::new(common::trailmark_bin())
            .args([sub, "--help"])
            .output()
            .expect("run trailmark");
        assert!(
            out.status.success(),
            "{COMPOSE} starts `trailmark {sub}`, which the binary refuses"
        );
    }
    for (name, replicas) in [("worker", 3), ("relay", 2)] {
        let text = &services.iter().find(|(n, _)| n == name).expect(name).1;
        assert!(
            text.contains(&format!("replicas: {replicas}")),
            "{name}: {replicas} replicas"
        );
    }
    assert!(
        anchor.contains(&format!("image: {IMAGE}")),
        "the trailmark services run {IMAGE}, the tag deploy/image/build makes"
    );
}

/// `podman-compose config` reads the compose file with the local override: both are valid
/// compose files, and the override changes only the server images.
#[test]
fn podman_compose_reads_the_compose_file_with_the_local_override() {
    if !tools_present(
        "podman_compose_reads_the_compose_file_with_the_local_override",
        &[&PODMAN, &PYTHON_VENV],
    ) {
        return;
    }
    let out = run_ok(
        Command::new(script("deploy/image/compose"))
            .args(["-f", COMPOSE, "-f", COMPOSE_LOCAL, "config"])
            .current_dir(repo()),
        "podman-compose config",
    );
    let merged = String::from_utf8_lossy(&out.stdout);
    let services = services(&merged);
    let image_of = |name: &str| {
        let text = &services
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no service {name} in:\n{merged}"))
            .1;
        text.lines()
            .find_map(|l| l.trim().strip_prefix("image: "))
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(image_of("postgres"), "localhost/trailmark-postgres:15");
    assert_eq!(image_of("rabbitmq"), "localhost/trailmark-rabbitmq:3.10");
    for name in ["migrate", "worker", "relay", "supervisor", "api"] {
        assert_eq!(image_of(name), IMAGE, "{name}");
    }
    for (name, replicas) in [("worker", "3"), ("relay", "2")] {
        let text = &services.iter().find(|(n, _)| n == name).expect(name).1;
        assert!(
            text.lines()
                .any(|l| l.trim() == format!("replicas: {replicas}")),
            "{name} should have {replicas} replicas:\n{text}"
        );
    }
}

/// A compose project of the test's own (its own name, so its own containers, network and
/// volumes); `down --volumes` when dropped, after printing its logs if the test failed.
struct Project {
    name: String,
    api_port: String,
    ui_port: String,
}

impl Project {
    fn compose(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(script("deploy/image/compose"));
        cmd.args([
            "--project-name",
            &self.name,
            "-f",
            COMPOSE,
            "-f",
            COMPOSE_LOCAL,
        ])
        .args(args)
        .current_dir(repo())
        .env("TRAILMARK_API_PORT", &self.api_port)
        .env("TRAILMARK_RABBITMQ_UI_PORT", &self.ui_port);
        cmd
    }

    /// Names of the project's containers of `service`.
    fn containers(&self, service: &str) -> Vec<String> {
        let out = run_ok(
            &mut podman(&[
                "ps",
                "--all",
                "--filter",
                &format!("label=com.docker.compose.project={}", self.name),
                "--filter",
                &format!("label=com.docker.compose.service={service}"),
                "--format",
                "{{.Names}}",
            ]),
            "podman ps",
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// `podman exec` in the first container of `service`; None when it did not exit 0.
    fn exec(&self, service: &str, args: &[&str]) -> Option<String> {
        let container = self.containers(service).into_iter().next()?;
        let out = podman(&["exec", &container]).args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Ok(out) = self.compose(&["logs"]).output()
        {
            let (stdout, stderr) = common::text(&out);
            eprintln!(
                "--- logs of compose project {}:\n{stdout}{stderr}",
                self.name
            );
        }
        let _ = self
            .compose(&["down", "--volumes", "--timeout", "0"])
            .output();
    }
}

/// The whole compose file with the local server images: Postgres and RabbitMQ come up, `migrate`
/// runs once, 3 workers, 2 relays, a supervisor and the API start from the image, the API's
/// /readyz turns 200, a `chain` run started through the API container succeeds, and `compose
/// stop` ends every trailmark process with exit 0 within its grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_up_runs_a_chain_run_and_compose_stop_drains_every_process() {
    if !tools_present(
        "compose_up_runs_a_chain_run_and_compose_stop_drains_every_process",
        &[&PODMAN, &DEBOOTSTRAP, &PYTHON_VENV],
    ) {
        return;
    }
    build_image();
    let started = Instant::now();
    let out = run_ok(
        &mut Command::new(script("deploy/image/build-servers")),
        "deploy/image/build-servers",
    );
    println!(
        "{}deploy/image/build-servers took {:.1} s",
        String::from_utf8_lossy(&out.stdout),
        started.elapsed().as_secs_f64()
    );
    let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let project = Project {
        name: format!("tmtest-{tag}"),
        api_port: common::closed_port().to_string(),
        ui_port: common::closed_port().to_string(),
    };
    let began = Instant::now();

    // The servers first. Podman 4.3 runs no healthchecks without systemd, so podman-compose
    // cannot wait for "healthy" there: the test asks the servers itself, with the same commands
    // the compose file's healthchecks run, before it starts what depends on them.
    run_within(
        &mut project.compose(&["up", "--detach", "postgres", "rabbitmq"]),
        "podman-compose up postgres rabbitmq",
        Duration::from_secs(180),
    );
    let healthy = common::eventually(
        "Postgres and RabbitMQ of the compose project",
        Duration::from_secs(180),
        || {
            let up = project
                .exec(
                    "postgres",
                    &["pg_isready", "-h", "127.0.0.1", "-U", "postgres"],
                )
                .is_some()
                && project
                    .exec(
                        "rabbitmq",
                        &["rabbitmq-diagnostics", "-q", "check_port_connectivity"],
                    )
                    .is_some();
            async move { up.then_some(()) }
        },
    )
    .await;
    assert!(
        healthy.is_some(),
        "the compose project's servers never came up"
    );

    // Then the migration, alone, to its end; then the rest. `--no-deps`, as the compose file
    // says: podman 4.3 cannot start a container whose dependency has dependencies of its own.
    run_within(
        &mut project.compose(&["up", "--detach", "--no-deps", "migrate"]),
        "podman-compose up migrate",
        Duration::from_secs(120),
    );
    let migrate = project.containers("migrate");
    assert_eq!(migrate.len(), 1, "{migrate:?}");
    let code = run_within(
        &mut podman(&["wait", &migrate[0]]),
        "podman wait (migrate)",
        Duration::from_secs(180),
    );
    assert_eq!(
        String::from_utf8_lossy(&code.stdout).trim(),
        "0",
        "migrate in the compose project failed"
    );
    run_within(
        &mut project.compose(&[
            "up",
            "--detach",
            "--no-deps",
            "worker",
            "relay",
            "supervisor",
            "api",
        ]),
        "podman-compose up worker relay supervisor api",
        Duration::from_secs(180),
    );
    let readyz = format!("http://127.0.0.1:{}/readyz", project.api_port);
    let http = reqwest::Client::new();
    let ready = common::eventually("the API's /readyz", Duration::from_secs(120), || {
        let probe = http.get(&readyz).send();
        async move { probe.await.ok().filter(|r| r.status().is_success()) }
    })
    .await;
    assert!(
        ready.is_some(),
        "the compose API never answered 200 on {readyz}"
    );
    println!(
        "compose project up and ready in {:.1} s",
        began.elapsed().as_secs_f64()
    );

    let counts: Vec<(&str, usize)> = ["worker", "relay", "supervisor", "api"]
        .into_iter()
        .map(|s| (s, project.containers(s).len()))
        .collect();
    assert_eq!(
        counts,
        [("worker", 3), ("relay", 2), ("supervisor", 1), ("api", 1)]
    );

    let started = project.exec(
        "api",
        &[
            "trailmark",
            "run",
            "start",
            "chain",
            "--run-id",
            "compose-chain",
            "--input",
            r#"{"steps":5}"#,
        ],
    );
    assert!(started.is_some(), "run start in the API container failed");
    // A deadline, not a timing: the project's nine containers share 2 cores with the rest of
    // the suite, and each probe starts a process in the API container.
    let shown = common::eventually(
        "run compose-chain to succeed",
        Duration::from_secs(240),
        || {
            let shown = project
                .exec(
                    "api",
                    &["trailmark", "run", "show", "compose-chain", "--json"],
                )
                .and_then(|out| serde_json::from_str::<serde_json::Value>(&out).ok())
                .filter(|run| run["status"] == "succeeded");
            async move { shown }
        },
    )
    .await
    .unwrap_or_else(|| {
        let last = project.exec("api", &["trailmark", "run", "show", "compose-chain"]);
        let worker = project
            .containers("worker")
            .into_iter()
            .next()
            .and_then(|c| podman(&["logs", "--tail", "30", &c]).output().ok())
            .map(|o| String::from_utf8_lossy(&o.stderr).into_owned());
        panic!(
            "run compose-chain did not succeed within 240 s; run show: {last:?}; a worker's last lines: {worker:?}"
        )
    });
    assert_eq!(shown["steps_done"], 5, "{shown}");

    // `compose stop` sends SIGTERM and waits each service's stop_grace_period; exit 0 everywhere
    // is the graceful drain (SIGKILL would be 137), migrate's included (it ended by itself). The
    // servers stay up meanwhile: podman-compose stops the services it is given all at once, and
    // a drain without Postgres would prove nothing about the image.
    let stopping = Instant::now();
    run_within(
        &mut project.compose(&["stop", "worker", "relay", "supervisor", "api"]),
        "podman-compose stop",
        Duration::from_secs(180),
    );
    let stopped_in = stopping.elapsed();
    for service in ["migrate", "worker", "relay", "supervisor", "api"] {
        for container in project.containers(service) {
            let code = run_ok(
                &mut podman(&["inspect", "--format", "{{.State.ExitCode}}", &container]),
                "podman inspect",
            );
            assert_eq!(
                String::from_utf8_lossy(&code.stdout).trim(),
                "0",
                "{container} did not exit 0 on SIGTERM"
            );
        }
    }
    println!(
        "compose: 1 migrate, 3 workers, 2 relays, 1 supervisor, 1 API; a 5-step chain run; \
         stopped in {:.1} s, every process exit 0; {:.1} s in all",
        stopped_in.as_secs_f64(),
        began.elapsed().as_secs_f64()
    );
}
