//! `trailmark bench --quick --json --peer dbos` against the real servers: every figure is
//! reported for every system (trailmark with its ledger rows as local writes and as effects, B3,
//! B3 with in-process answers, the DBOS peer), each
//! ledger holds exactly one row per step, recovery keeps the ledger exact, and the bench removes
//! its own database and queues. No timing assertions: absolute figures depend on the machine
//! (targets are printed, never asserted). The DBOS peer's binary is built by scripts/test
//! (`cargo build --workspace --bins`).

mod common;

use std::process::{Command, Output};

use common::{amqp_url, base_url};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde_json::Value;
use trailmark::broker::{self, Topology};
use trailmark::config::Settings;

/// Every column of the report's figures, by its JSON key.
const SYSTEMS: [&str; 5] = ["trailmark", "trailmark_effect", "b3", "b3_local", "dbos"];

/// Figures that are positive for any system that did any work.
const ALWAYS_POSITIVE: [&str; 7] = [
    "steps_per_s",
    "gap_p50_ms",
    "idle_gap_p50_ms",
    "run_p50_ms",
    "cpu_ms_per_step",
    "proc_cpu_ms_per_step",
    "peak_rss_mib",
];

/// `trailmark bench ARGS` against the local servers; the bench makes its own database and prefix.
fn bench(args: &[&str]) -> Output {
    Command::new(common::trailmark_bin())
        .arg("bench")
        .args(args)
        .env("DATABASE_URL", format!("{}/postgres", base_url()))
        .env("AMQP_URL", amqp_url())
        .env("RUST_LOG", "warn")
        .env_remove("TRAILMARK_FAILPOINTS")
        .output()
        .expect("run trailmark bench")
}

/// Whether `queue` exists, by a passive declare (a missing queue closes only that channel).
async fn queue_exists(conn: &lapin::Connection, queue: &str) -> bool {
    let channel = conn.create_channel().await.expect("open a channel");
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_bench_reports_every_figure_for_every_system_and_cleans_up() {
    let out = bench(&["--quick", "--json", "--peer", "dbos"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("--json prints JSON ({e}); stderr: {stderr}"));

    let figures = report["figures"].as_array().expect("figures");
    for key in ALWAYS_POSITIVE {
        let f = figures
            .iter()
            .find(|f| f["key"] == key)
            .unwrap_or_else(|| panic!("figure {key} missing"));
        for system in SYSTEMS {
            let median = f[system]["median"]
                .as_f64()
                .unwrap_or_else(|| panic!("{key}: no {system} median"));
            assert!(median > 0.0, "{key} for {system} is {median}: {f}");
        }
        for ratio in ["ratio", "ratio_dbos"] {
            assert!(
                f[ratio].as_f64().is_some_and(|r| r > 0.0),
                "{key}: {ratio} {f}"
            );
        }
    }
    let target = |key: &str| {
        let f = figures.iter().find(|f| f["key"] == key).unwrap();
        f["target_dbos"]["text"].as_str().map(str::to_owned)
    };
    assert_eq!(target("steps_per_s").as_deref(), Some("≥ 1.3 × DBOS"));
    assert_eq!(target("run_p50_ms").as_deref(), Some("< DBOS"));
    for f in figures {
        for system in SYSTEMS {
            let v = &f[system];
            let [min, median, max] = ["min", "median", "max"].map(|k| {
                v[k].as_f64()
                    .unwrap_or_else(|| panic!("{system} {k} missing: {f}"))
            });
            assert!(min <= median && median <= max, "{f}");
        }
    }
    assert!(
        report["fsync"]["p50_ms"].as_f64().is_some_and(|v| v > 0.0),
        "fsync probe: {}",
        report["fsync"]
    );

    // --quick keeps each process's pool small, so the bench fits beside the parallel tests.
    assert_eq!(report["workload"]["pool"], 4, "{}", report["workload"]);
    let peer = report["workload"]["peer"]
        .as_str()
        .expect("the peer's setup");
    assert!(peer.contains("DBOS"), "{peer}");

    // Every system's loaded runs left exactly one ledger row per step (the DBOS peer's ledger
    // row is written by a DBOS step, keyed run:seq).
    let runs = report["workload"]["runs"].as_i64().unwrap();
    let steps = report["workload"]["steps"].as_i64().unwrap();
    let ledger = report["ledger"].as_array().expect("ledger");
    for system in [
        "trailmark",
        "trailmark effect",
        "B3",
        "B3 in-process",
        "DBOS",
    ] {
        let l = ledger
            .iter()
            .find(|l| l["system"] == system)
            .unwrap_or_else(|| panic!("no ledger check for {system}: {ledger:?}"));
        assert_eq!(l["expected"].as_i64(), Some(runs * steps), "{l}");
        assert_eq!(l["rows"].as_i64(), Some(runs * steps), "{l}");
        assert_eq!(l["distinct"].as_i64(), Some(runs * steps), "{l}");
    }

    // Both step shapes are broken down: the local write's (3 segments), the effect's (4).
    for (key, segments) in [("breakdown", 3), ("breakdown_effect", 4)] {
        let parts = report[key].as_array().expect(key);
        assert_eq!(parts.len(), segments, "{key}: {parts:?}");
        assert!(
            parts
                .iter()
                .all(|p| p["p50_ms"]["median"].as_f64().is_some()),
            "{key}: {parts:?}"
        );
    }

    let recovery = report["recovery"].as_array().expect("recovery");
    assert_eq!(recovery.len(), 2, "both recovery scenarios: {recovery:?}");
    for r in recovery {
        let expected = r["runs"].as_i64().unwrap() * r["steps"].as_i64().unwrap();
        assert!(r["next_commit_ms"].as_f64().is_some_and(|v| v > 0.0), "{r}");
        assert_eq!(
            r["ledger_rows"].as_i64(),
            Some(expected),
            "one ledger row per step after a kill -9: {r}"
        );
        assert_eq!(r["ledger_distinct"].as_i64(), Some(expected), "{r}");
    }

    let db = report["setup"]["database"]
        .as_str()
        .expect("database name")
        .to_owned();
    let pool = sqlx::PgPool::connect(&format!("{}/postgres", base_url()))
        .await
        .expect("connect");
    let left: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&db)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!left, "the bench left its database {db} behind");

    // The broker objects under its prefix (trailmark's topology, B3's queue) are gone too; the
    // DBOS peer keeps everything in the dropped database.
    let prefix = report["setup"]["broker_prefix"].as_str().expect("prefix");
    let mut settings = Settings::load_from(None).expect("default settings");
    settings.broker.url = amqp_url();
    let conn = broker::connect(&settings.broker, "test-bench-leftovers")
        .await
        .expect("connect RabbitMQ");
    let mut queues: Vec<String> = Topology::new(prefix, settings.broker.delivery_limit)
        .queues()
        .into_iter()
        .map(|q| q.name)
        .collect();
    // B3's work queue (`trailmark_bench::baseline::queue`).
    queues.push(format!("{prefix}.b3"));
    for queue in &queues {
        assert!(
            !queue_exists(&conn, queue).await,
            "the bench left queue {queue} behind"
        );
    }
    let _ = conn.close(200, "checked".into()).await;
}

/// A scale point the server cannot hold (1,000 processes) stops the scale phase; the points
/// measured before it are still reported, with the reason, and the command exits non-zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_scale_point_keeps_the_points_before_it_and_exits_1() {
    let out = bench(&[
        "--quick",
        "--no-recovery",
        "--json",
        "--scale",
        "--scale-runs",
        "20",
        "--scale-workers",
        "1,1000",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("the report is printed before the error ({e}); stderr: {stderr}")
    });
    let points = report["scale"].as_array().expect("scale");
    assert_eq!(points.len(), 1, "the 1-process point is kept: {points:?}");
    assert_eq!(points[0]["workers"], 1);
    let why = report["scale_failure"].as_str().expect("scale_failure");
    assert!(why.contains("max_connections"), "{why}");
    assert!(stderr.contains("scale phase stopped early"), "{stderr}");
}
