//! `pychain`, the chain workflow written with the Python SDK, run by real `trailmark serve`
//! processes against the real servers: every link's ledger row written once, every model answer
//! paid once, across a SIGKILL of the Python server at each of its worst moments and of the
//! worker at its own. The protocol's refusals and failure classes are in
//! tests/remote_protocol.rs; the SDK's own tests are pytest's (sdk/python/tests).

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::{ChildGuard, TestEnv, text, wait_exit};
use serde_json::{Value, json};
use trailmark::domain::RunStatus;
use trailmark_standin::model_server::{ModelServer, ModelServerOptions};
use trailmark_testkit::pychain::{self, PyChain};

const WAIT: Duration = Duration::from_secs(90);

/// A test world: the environment, the model server (which counts what it is asked) and the
/// Python server.
struct World {
    env: TestEnv,
    model: ModelServer,
    py: PyChain,
}

impl World {
    async fn new(py_env: &[(&str, &str)]) -> Self {
        let env = TestEnv::new().await;
        let model = ModelServer::start(ModelServerOptions::default())
            .await
            .expect("start the model server");
        let py =
            PyChain::start(&env.settings.database.url, py_env).unwrap_or_else(|e| panic!("{e}"));
        Self { env, model, py }
    }

    /// What a trailmark process needs to call this world's Python server and model.
    fn vars(&self) -> Vec<(&'static str, String)> {
        let mut vars = self.py.worker_env();
        vars.push(("TRAILMARK__MODEL__BASE_URL", self.model.base_url()));
        vars
    }

    /// `trailmark serve` calling this world's Python server and model, armed with `failpoints`.
    fn serve(&self, failpoints: Option<&str>) -> ChildGuard {
        self.env.spawn_process_with(failpoints, &self.vars())
    }

    /// The ledger rows of `run`, and how many distinct references they hold.
    async fn ledger(&self, run: &str) -> (i64, i64) {
        self.env.chain_ledger(run).await
    }

    async fn count(&self, sql: &'static str, run: &str) -> i64 {
        self.env.scalar(sql, run).await
    }

    /// Checks the promises on a finished run of `links` links written through effects.
    async fn assert_once(&self, run: &str, links: i64) {
        assert_eq!(
            self.ledger(run).await,
            (links, links),
            "{run}: one ledger row per link"
        );
        let done = self
            .count("SELECT count(*) FROM trailmark.effects WHERE run_id = $1 AND completed_at IS NOT NULL", run)
            .await;
        assert_eq!(done, links, "{run}: one recorded effect per link");
        let answers = self
            .count(
                "SELECT count(*) FROM trailmark.journal WHERE run_id = $1 AND kind = 'model'",
                run,
            )
            .await;
        assert_eq!(answers, links, "{run}: one journaled answer per link");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pychain_runs_write_each_link_once_through_effects_and_local_writes() {
    let w = World::new(&[]).await;
    let _serve = w.serve(None);
    for i in 0..4 {
        let input = json!({"steps": 5, "ledger": if i % 2 == 0 { "effect" } else { "local" }});
        w.env
            .start_run(pychain::NAME, &format!("py-{i}"), input)
            .await;
    }
    for i in 0..4 {
        let run = format!("py-{i}");
        let row = w.env.wait_status(&run, RunStatus::Succeeded, WAIT).await;
        assert_eq!(
            row.output.as_ref().unwrap()["link"],
            4,
            "{run}: {:?}",
            row.output
        );
        assert_eq!(w.ledger(&run).await, (5, 5), "{run}");
    }
    assert_eq!(
        w.model.answered(),
        20,
        "one model answer per link, none paid twice"
    );
    w.assert_once("py-0", 5).await;
    // The remote workflow is described and shown as a compiled one is.
    let env_vars = w.vars();
    let contract = w
        .env
        .command(&["contract", pychain::NAME])
        .envs(env_vars.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    let (said, err) = text(&contract);
    assert!(contract.status.success(), "{err}");
    assert!(
        said.contains("step link (Write)") && said.contains("key run_id:link:position"),
        "{said}"
    );
    let shown = w.env.command(&["run", "show", "py-1"]).output().unwrap();
    let (said, _) = text(&shown);
    assert!(
        said.contains("pychain") && said.contains("succeeded"),
        "{said}"
    );
}

/// Runs one `pychain` run while the Python server SIGKILLs itself once at `spot`, restarts it
/// when it died, and checks that nothing was lost or doubled.
async fn python_killed_at(spot: &str) {
    let once = tempfile_path(spot);
    let w = World::new(&[("PYCHAIN_KILL_AT", spot), ("PYCHAIN_KILL_ONCE", &once)]).await;
    let mut w = w;
    let _serve = w.serve(None);
    let run = format!("py-kill-{spot}");
    w.env
        .start_run(pychain::NAME, &run, json!({"steps": 3}))
        .await;
    let died = common::eventually("the Python server to kill itself", WAIT, || {
        let status = w.py.exited();
        async move { status }
    })
    .await
    .unwrap_or_else(|| panic!("pychain did not reach {spot}"));
    assert_eq!(
        died.signal(),
        Some(9),
        "{spot}: a SIGKILL, not an exit: {died:?}"
    );
    w.py.restart().unwrap_or_else(|e| panic!("{e}"));
    w.env.wait_status(&run, RunStatus::Succeeded, WAIT).await;
    w.assert_once(&run, 3).await;
    assert_eq!(w.model.answered(), 3, "{spot}: no model answer paid twice");
    let _ = std::fs::remove_file(&once);
}

fn tempfile_path(spot: &str) -> String {
    std::env::temp_dir()
        .join(format!(
            "pychain-killed-{spot}-{}",
            uuid::Uuid::new_v4().simple()
        ))
        .display()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_killed_after_the_model_answered_replays_the_answer() {
    python_killed_at("after_model").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_killed_between_intent_and_write_makes_the_write_once() {
    python_killed_at("after_begin").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_killed_after_the_write_before_its_result_writes_nothing_twice() {
    python_killed_at("after_insert").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_killed_before_its_answer_commits_the_step_once() {
    python_killed_at("before_answer").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_while_a_python_step_is_open_leaves_it_to_another_once() {
    let w = World::new(&[]).await;
    // The armed worker kills itself right after a Python effect reported its result, before the
    // worker recorded it: the outside write is made, the record is not.
    let mut armed = w.serve(Some("effect.after_call=kill@2"));
    w.env
        .start_run(
            pychain::NAME,
            "py-worker",
            json!({"steps": 4, "step_delay_ms": 100}),
        )
        .await;
    let died = wait_exit(&mut armed, WAIT)
        .await
        .expect("the armed worker reaches its failpoint");
    assert_eq!(died.signal(), Some(9), "{died:?}");
    let _other = w.serve(None);
    let row = w
        .env
        .wait_status("py-worker", RunStatus::Succeeded, WAIT)
        .await;
    assert_eq!(
        row.output.as_ref().map(|o| o["link"].clone()),
        Some(Value::from(3))
    );
    w.assert_once("py-worker", 4).await;
    assert_eq!(w.model.answered(), 4, "no model answer paid twice");
}

/// Runs `trailmark args...` with `vars`; returns (exit code, stdout, stderr).
fn trailmark(
    w: &World,
    vars: &[(&'static str, String)],
    args: &[&str],
) -> (Option<i32>, String, String) {
    let out = w
        .env
        .command(args)
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    let (said, err) = text(&out);
    (out.status.code(), said, err)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pychain_run_is_forked_replay_checked_and_undone_as_a_compiled_one() {
    let w = World::new(&[]).await;
    let _serve = w.serve(None);
    let vars = w.vars();
    w.env
        .start_run(pychain::NAME, "py-ops", json!({"steps": 3}))
        .await;
    w.env
        .wait_status("py-ops", RunStatus::Succeeded, WAIT)
        .await;

    // A shadow fork runs the Python code again and writes nothing outside.
    let fork = [
        "run",
        "fork",
        "py-ops",
        "--from",
        "1",
        "--shadow",
        "--run-id",
        "py-shadow",
        "--reason",
        "try",
    ];
    let (code, _, err) = trailmark(&w, &vars, &fork);
    assert_eq!(code, Some(0), "{err}");
    w.env
        .wait_status("py-shadow", RunStatus::Shadowed, WAIT)
        .await;
    assert_eq!(
        w.ledger("py-shadow").await,
        (0, 0),
        "a shadow fork writes nothing"
    );

    // The replay check calls the endpoint as a worker does, serving its callbacks from the history.
    let dir = std::env::temp_dir().join(format!("pyhist-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("py-ops.json");
    let export = [
        "run",
        "export",
        "py-ops",
        "--history",
        "--output",
        file.to_str().unwrap(),
    ];
    let (code, _, err) = trailmark(&w, &vars, &export);
    assert_eq!(code, Some(0), "{err}");
    let check = ["replay-check", file.to_str().unwrap()];
    let (code, said, err) = trailmark(&w, &vars, &check);
    assert_eq!(
        code,
        Some(0),
        "the unchanged Python code replays: {said}{err}"
    );
    let changed = PyChain::start(
        &w.env.settings.database.url,
        &[("PYCHAIN_PROMPT", "Answer in one word.")],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let (code, said, err) = trailmark(&w, &changed.worker_env(), &check);
    assert_eq!(code, Some(1), "a changed prompt is caught: {said}{err}");
    let told = format!("{said}{err}");
    assert!(
        told.contains("py-ops") && told.contains("link"),
        "names run and step: {told}"
    );
    let _ = std::fs::remove_dir_all(&dir);

    // Undo runs the Python compensation, newest first, each reversal once.
    let undo = ["run", "undo", "py-ops", "--yes", "--reason", "wrong tenant"];
    let (code, _, err) = trailmark(&w, &vars, &undo);
    assert_eq!(code, Some(0), "{err}");
    w.env
        .wait_status("py-ops", RunStatus::Compensated, WAIT)
        .await;
    let reversals = w
        .count("SELECT count(*) FROM trailmark.chain_ledger WHERE reference LIKE 'undo:' || $1 || ':%'", "py-ops")
        .await;
    assert_eq!(reversals, 3, "one reversal row per link");
}
