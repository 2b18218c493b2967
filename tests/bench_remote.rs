//! `trailmark bench --remote --quick --json` against the real servers and the Python SDK's
//! chain: `chain` and `pychain` are measured side by side on one fleet, every figure reported
//! for both with Python / Rust beside it, each loaded phase's ledger holds one row per link, and
//! the bench removes its database. No timing assertions: absolute figures and their ratio
//! depend on the machine. Needs the SDK's virtualenv (`target/pyvenv`, made by scripts/setup).

mod common;

use std::process::Command;

use common::{amqp_url, base_url};
use serde_json::Value;

/// `trailmark bench --remote --quick --json` against the local servers; its report.
fn remote_bench() -> Value {
    let out = Command::new(common::trailmark_bin())
        .args(["bench", "--remote", "--quick", "--json"])
        .env("DATABASE_URL", format!("{}/postgres", base_url()))
        .env("AMQP_URL", amqp_url())
        .env("RUST_LOG", "warn")
        .env_remove("TRAILMARK_FAILPOINTS")
        .output()
        .expect("run trailmark bench --remote");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("--json prints JSON ({e}); stderr: {stderr}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_remote_bench_measures_python_steps_beside_rust_steps_and_cleans_up() {
    let pool = sqlx::PgPool::connect(&format!("{}/postgres", base_url()))
        .await
        .expect("connect");
    let report = remote_bench();
    let sides = report["sides"].as_array().expect("sides");
    let names: Vec<&str> = sides.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["chain (Rust)", "pychain (Python)"]);
    for side in sides {
        for key in [
            "steps_per_s",
            "step_p50_ms",
            "step_p95_ms",
            "idle_step_p50_ms",
            "run_p50_ms",
            "cpu_ms_per_step",
        ] {
            assert!(
                side[key]["median"].as_f64().is_some_and(|v| v > 0.0),
                "{key}: {side}"
            );
        }
        // Where an unloaded step's time goes: claim, intent, ledger row and commit, all seen.
        let segments = side["segments"].as_array().expect("segments");
        assert_eq!(segments.len(), 4, "{side}");
        assert!(
            segments[1]["p50_ms"]["median"]
                .as_f64()
                .is_some_and(|v| v > 0.0),
            "{side}"
        );
    }
    assert!(sides[0]["endpoint_cpu_ms_per_step"].is_null());
    assert!(
        sides[1]["endpoint_cpu_ms_per_step"]["median"]
            .as_f64()
            .is_some_and(|v| v > 0.0),
        "the Python process's CPU was read: {}",
        sides[1]
    );
    let ratios = report["ratios"].as_array().expect("ratios");
    assert_eq!(ratios[0]["figure"], "steps/s, loaded");
    assert!(
        ratios
            .iter()
            .all(|r| r["python_over_rust"].as_f64().is_some_and(|v| v > 0.0))
    );
    // --quick: one repetition of 20 runs x 4 links per side, each link's row once.
    let ledger = report["ledger"].as_array().expect("ledger");
    assert_eq!(ledger.len(), 2, "{report}");
    for l in ledger {
        assert_eq!(l["expected"], 80, "{l}");
        assert_eq!(l["rows"], l["expected"], "{l}");
        assert_eq!(l["distinct"], l["rows"], "{l}");
    }
    let database = report["database"].as_str().expect("database").to_owned();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
        .bind(&database)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "the remote bench left {database} behind");
}
