//! `trailmark bench --quick --json` against the real servers: every figure is reported for both
//! systems, recovery keeps the ledger exact, and the bench removes its own database. No timing
//! assertions: absolute figures depend on the machine (targets are printed, never asserted).

mod common;

use std::process::{Command, Output};

use common::{amqp_url, base_url};
use serde_json::Value;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_bench_reports_every_figure_for_both_systems_and_cleans_up() {
    let out = bench(&["--quick", "--json"]);
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
        for system in ["trailmark", "b3"] {
            let median = f[system]["median"]
                .as_f64()
                .unwrap_or_else(|| panic!("{key}: no {system} median"));
            assert!(median > 0.0, "{key} for {system} is {median}: {f}");
        }
        assert!(
            f["ratio"].as_f64().is_some_and(|r| r > 0.0),
            "{key}: ratio {f}"
        );
    }
    for f in figures {
        for system in ["trailmark", "b3"] {
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
