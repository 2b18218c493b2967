//! `trailmark drill` against the real servers: the CI profile (every fault: kills and seam
//! kills, pauses past the lease, the broker closing connections, Postgres ending backends,
//! latency with cuts, duplicated deliveries, poison, and the engine seams) on `chain`, on
//! `pychain` (its Python step endpoint killed too) and on `reconcile` keeps every invariant; a drill of `chain` spread over tenants with a low limit
//! keeps each key's limit through kills and strands no run in a line; and a drill whose receiver
//! shows a write done twice fails.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::{amqp_url, base_url};
use serde_json::{Value, json};
use trailmark::config::Settings;
use trailmark_drill::{self as drill, BoxFuture, ChainLedger, Receiver};

/// `trailmark drill ARGS --json` against the local servers; returns the report.
fn drill_cli(args: &[&str]) -> Value {
    let out = Command::new(common::trailmark_bin())
        .arg("drill")
        .args(args)
        .arg("--json")
        .env("DATABASE_URL", format!("{}/postgres", base_url()))
        .env("AMQP_URL", amqp_url())
        .env("RUST_LOG", "warn")
        .env_remove("TRAILMARK_FAILPOINTS")
        .output()
        .expect("run trailmark drill");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("--json prints the report ({e}); stderr: {stderr}"));
    assert!(
        out.status.success(),
        "the drill found a broken promise: {}\nstderr: {stderr}",
        serde_json::to_string_pretty(&report["invariants"]).unwrap()
    );
    report
}

/// The names of the invariants a drill checked, for asserting that a drill's own ones are there.
fn invariant_names(r: &Value) -> Vec<&str> {
    r["invariants"]
        .as_array()
        .expect("invariants")
        .iter()
        .map(|i| i["name"].as_str().expect("an invariant's name"))
        .collect()
}

/// What every passing CI-profile drill must show, beyond its verdicts.
fn assert_kept(r: &Value, runs: i64) {
    for inv in r["invariants"].as_array().expect("invariants") {
        assert_eq!(inv["ok"], true, "invariant failed: {inv}");
    }
    let runs_fig = &r["runs"];
    assert_eq!(runs_fig["started"], runs);
    assert_eq!(runs_fig["lost"], 0, "{runs_fig}");
    assert_eq!(
        runs_fig["succeeded"].as_i64().unwrap() + runs_fig["in_review"].as_i64().unwrap(),
        runs,
        "every run succeeded or is in review with a note: {runs_fig}"
    );
    let e = &r["effects"];
    assert!(e["expected"].as_i64().unwrap() > 0, "{e}");
    assert_eq!(e["keys"], e["expected"], "{e}");
    assert_eq!(e["applied"], e["expected"], "receiver rows = keys: {e}");
    assert_eq!(e["duplicated"], 0, "{e}");
    let d = &r["dead_letters"];
    assert_eq!(d["poison_sent"], 20);
    assert_eq!(d["poison_found"], 20, "{d}");
    assert_eq!(
        d["unexpected"],
        json!([]),
        "no healthy message dead-lettered: {d}"
    );
    assert_eq!(r["fencing"]["double_commits"], json!([]));
    assert_eq!(r["fencing"]["stale_commits"], json!([]));
    // Every fault of the profile was injected (poison in two bursts of ten).
    let faults = r["faults"].as_array().expect("faults");
    for (name, n) in [
        ("kill", 6),
        ("pause", 2),
        ("broker", 2),
        ("postgres", 2),
        ("poison", 2),
        ("latency", 2),
    ] {
        let f = faults
            .iter()
            .find(|f| f["fault"] == name)
            .unwrap_or_else(|| panic!("fault {name} missing: {faults:?}"));
        assert_eq!(f["injected"], n, "{f}");
    }
    assert!(r["engine_seams"]["duplicated_deliveries"].as_u64().unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ci_profile_across_two_builds_side_by_side_keeps_every_promise_and_each_run_on_its_version()
 {
    let r = drill_cli(&[
        "chain",
        "--runs",
        "60",
        "--mixed-versions",
        "--seed",
        "20261204",
    ]);
    assert_kept(&r, 60);
    assert!(invariant_names(&r).contains(&"every link ran on its run's workflow version"));
    let v = &r["versions"];
    assert_eq!(v["mismatched"], 0, "{v}");
    assert_eq!(
        v["v1_runs"].as_i64().unwrap() + v["v2_runs"].as_i64().unwrap(),
        60,
        "{v}"
    );
    assert!(r["replay"].as_str().unwrap().ends_with("--mixed-versions"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ci_profile_on_pychain_with_its_python_endpoint_killed_keeps_every_promise() {
    // The chain written with the Python SDK, served by a Python process the drill starts: the
    // CI faults, and the Python process SIGKILLed from outside twice, each restart armed to kill
    // itself once at its kill spot (seed 20261206 arms `after_insert`: the ledger row written,
    // its result not yet reported). Eight deliveries per worker: the one Python process serves
    // every step in flight at once, and with the default 128 nearly every run would be in flight
    // at every fault.
    let r = drill_cli(&[
        "pychain",
        "--runs",
        "40",
        "--concurrency",
        "8",
        "--seed",
        "20261206",
    ]);
    assert_kept(&r, 40);
    assert_eq!(r["workflow"], "pychain");
    assert_eq!(r["runs"]["steps_per_run"], 10);
    let py = &r["python"];
    assert_eq!(py["killed"], 2, "{py}");
    assert_eq!(py["spot"], "after_insert", "{py}");
    assert!(
        py["restarts"].as_u64().unwrap() >= 2,
        "the endpoint came back after each kill: {py}"
    );
    assert_eq!(py["unexpected_exits"], json!([]), "{py}");
    let kills = r["faults"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["fault"] == "python kill")
        .cloned()
        .expect("python kills reported");
    // Mid-run: steps were committed after at least one of them.
    assert_eq!(kills["injected"], 2, "{kills}");
    assert!(
        kills["without_progress"].as_u64().unwrap() < 2,
        "no step committed after either kill: {kills}"
    );
    assert!(
        r["replay"].as_str().unwrap().ends_with("--python-kill 2"),
        "{}",
        r["replay"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ci_profile_on_chain_keeps_every_promise() {
    let r = drill_cli(&["chain", "--runs", "200", "--seed", "20261201"]);
    assert_kept(&r, 200);
    assert_eq!(r["runs"]["steps_per_run"], 10);
    // The drill forced some runs into review and resumed them (1% of 2,000 positions).
    assert!(
        r["engine_seams"]["reviews_resumed"].as_i64().unwrap() > 0,
        "{}",
        r["engine_seams"]
    );
    assert!(r["engine_seams"]["model_500"].as_i64().unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ci_profile_on_reconcile_keeps_every_promise() {
    let r = drill_cli(&[
        "reconcile",
        "--input",
        r#"{"date":"2026-10-13","invoices":12,"mismatches":3}"#,
        "--runs",
        "30",
        "--seed",
        "20261202",
    ]);
    assert_kept(&r, 30);
}

/// A receiver that holds one row too many: a write done twice, as a broken engine would leave.
struct Doubled;

impl Receiver for Doubled {
    fn count<'a>(
        &'a self,
        pool: &'a sqlx::PgPool,
        runs: &'a [String],
    ) -> BoxFuture<'a, drill::Result<(i64, i64)>> {
        Box::pin(async move {
            let (rows, distinct) = ChainLedger.count(pool, runs).await?;
            Ok((rows + 1, distinct))
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_done_twice_fails_the_drill_called_as_a_library() {
    let mut settings = Settings::load_from(None).expect("default settings");
    settings.database.url = format!("{}/postgres", base_url());
    settings.broker.url = amqp_url();
    let mut cfg = drill::Config::new(5);
    cfg.runs = 10;
    cfg.faults = drill::Faults::none();
    cfg.progress = false;
    cfg.program = Some(common::trailmark_bin());
    let target = drill::Target {
        workflow: "chain".into(),
        input: json!({"steps": 3}),
        receiver: Some(Arc::new(Doubled)),
    };
    let report = drill::drill(&settings, trailmark_reference::registry(), target, &cfg)
        .await
        .expect("the drill runs");
    assert!(!report.ok(), "{report}");
    let failed: Vec<&str> = report
        .invariants
        .iter()
        .filter(|i| !i.ok)
        .map(|i| i.name.as_str())
        .collect();
    assert_eq!(failed, ["applied effects = distinct keys = expected"]);
    assert_eq!(report.effects.duplicated, Some(1));
    assert_eq!(report.runs.succeeded, 10);
    assert!(report.to_string().contains("FAIL applied effects"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_out_four_workers_two_relays_two_supervisors_lose_nothing_when_each_is_killed() {
    // Each of the 8 processes is killed once, in turn, while 2,000 runs move.
    let r = drill_cli(&[
        "chain",
        "--runs",
        "2000",
        "--workers",
        "4",
        "--relays",
        "2",
        "--supervisors",
        "2",
        "--profile",
        "none",
        "--kill",
        "8",
        "--kill-in-turn",
        "--seed",
        "20261218",
    ]);
    for inv in r["invariants"].as_array().expect("invariants") {
        assert_eq!(inv["ok"], true, "invariant failed: {inv}");
    }
    assert_eq!(r["runs"]["succeeded"], 2000, "{}", r["runs"]);
    assert_eq!(r["effects"]["applied"], 20000);
    assert_eq!(r["effects"]["duplicated"], 0);
    let kills = r["faults"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["fault"] == "kill")
        .cloned()
        .expect("kills reported");
    assert_eq!(kills["injected"], 8);
    // The work was spread over all four worker slots (each slot: its first process and the
    // ones that replaced it after a kill).
    let by_process = r["commits_by_process"]
        .as_object()
        .expect("commits by process");
    for slot in 0..4 {
        let prefix = format!("worker-{slot}.");
        let commits: i64 = by_process
            .iter()
            .filter(|(name, _)| name.starts_with(&prefix))
            .map(|(_, n)| n.as_i64().unwrap())
            .sum();
        assert!(
            commits > 0,
            "worker slot {slot} committed nothing: {by_process:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ci_profile_on_chain_runs_that_wait_and_sleep_takes_each_event_once() {
    // Each run waits for its event after link 1 (sent over AMQP: some before the wait, some
    // twice, some again with another payload) and sleeps a second after link 3.
    let input = r#"{"steps": 5, "wait": {"at": 1, "event": "go", "timeout_secs": 600}, "sleep": {"at": 3, "secs": 1}}"#;
    let r = drill_cli(&[
        "chain", "--input", input, "--runs", "80", "--seed", "20261203",
    ]);
    assert_kept(&r, 80);
    let ev = &r["events"];
    assert_eq!(ev["runs"], 80, "{ev}");
    for planned in ["early", "twice", "conflicting"] {
        assert!(
            ev[planned].as_u64().unwrap() > 0,
            "no {planned} event: {ev}"
        );
    }
    // A run stopped in review before its wait is sent nothing; the others' conflicting copies
    // are all refused (the invariant compares them with the copies sent).
    let refused = ev["conflicts_refused"].as_u64().unwrap();
    assert!(
        refused > 0 && refused <= ev["conflicting"].as_u64().unwrap(),
        "{ev}"
    );
    assert_eq!(
        r["dead_letters"]["event_conflicts"],
        ev["conflicts_refused"]
    );
    let names = invariant_names(&r);
    assert!(
        names.contains(&"every wait resumed once, by its own event")
            && names.contains(&"no event lost"),
        "{names:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ci_profile_on_chain_runs_that_fan_out_starts_each_child_once_and_joins_each_parent_once()
 {
    // Each run starts 20 children of 2 links after link 0, 5 at a time: 600 child runs under
    // the faults, the forced reviews and their resumes.
    let input =
        r#"{"steps": 3, "children": {"at": 0, "count": 20, "steps": 2, "max_in_flight": 5}}"#;
    let r = drill_cli(&["chain", "--input", input, "--runs", "30", "--seed", "34"]);
    assert_kept(&r, 30);
    let f = &r["fan_outs"];
    assert_eq!(f["fan_outs"], 30, "{f}");
    assert!(f["joined"].as_i64().unwrap() > 0, "{f}");
    let names = invariant_names(&r);
    assert!(
        names.contains(&"no child run started twice") && names.contains(&"no parent joined twice"),
        "{names:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drill_over_tenants_keeps_each_keys_limit_through_kills_and_strands_no_run() {
    // 60 runs over 3 tenants (20 each) with a limit of 2 per key, while 4 processes are
    // killed and Postgres ends every connection once (the fault that once let a key run over
    // its limit: a worker whose connection dropped had its slots counted free): the line is
    // used all along (each worker takes up to 128 deliveries at once).
    let input = r#"{"steps": 5, "step_delay_ms": 50}"#;
    let r = drill_cli(&[
        "chain",
        "--input",
        input,
        "--runs",
        "60",
        "--profile",
        "none",
        "--kill",
        "4",
        "--postgres",
        "1",
        "--tenants",
        "3",
        "--tenant-limit",
        "2",
        "--seed",
        "35",
    ]);
    for inv in r["invariants"].as_array().expect("invariants") {
        assert_eq!(inv["ok"], true, "invariant failed: {inv}");
    }
    let names = invariant_names(&r);
    for name in [
        "no key had more runs holding a step than its limit",
        "no run left waiting for a slot",
        "no slot reserved for a run that ended",
    ] {
        assert!(names.contains(&name), "{name} not checked: {names:?}");
    }
    assert_eq!(r["runs"]["succeeded"], 60, "{}", r["runs"]);
    assert_eq!(r["effects"]["applied"], 300);
    assert_eq!(r["effects"]["duplicated"], 0);
    let kills = r["faults"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["fault"] == "kill")
        .cloned()
        .expect("kills reported");
    assert_eq!(kills["injected"], 4);
    let k = &r["keys"];
    assert_eq!(
        (
            k["field"].as_str(),
            k["tenants"].as_u64(),
            k["limit"].as_i64()
        ),
        (Some("tenant"), Some(3), Some(2)),
        "{k}"
    );
    // The limit was reached and runs waited for it: the sampler saw the line in use.
    assert_eq!(k["running_max"], 2, "{k}");
    let by_key = k["running_max_by_key"].as_object().expect("per key");
    assert_eq!(by_key.keys().collect::<Vec<_>>(), ["t0", "t1", "t2"], "{k}");
    assert!(k["waits_seen"].as_u64().unwrap() > 0, "{k}");
    assert!(k["samples"].as_u64().unwrap() > 20, "{k}");
    assert_eq!(k["over_limit"], json!([]));
    assert_eq!(k["waiters_left"], json!([]));
    assert_eq!(k["reserved_for_ended"], json!([]));
    assert!(
        r["replay"]
            .as_str()
            .unwrap()
            .ends_with("--tenants 3 --tenant-limit 2"),
        "{}",
        r["replay"]
    );
}
