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
const SYSTEMS: [&str; 7] = [
    "trailmark",
    "trailmark_effect",
    "b3",
    "b3_journal",
    "b3_fenced",
    "b3_local",
    "dbos",
];

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
    assert_eq!(target("steps_per_s").as_deref(), Some("≥ 2 × DBOS"));
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
        "B3 +journal",
        "B3 +journal +fencing",
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

    // The price list: B3, then each promise's records added, then trailmark; every line has
    // every priced figure, and each line after the first its ratio to the line above.
    let lines = report["price_list"].as_array().expect("price_list");
    let systems: Vec<&str> = lines
        .iter()
        .map(|l| l["system"].as_str().unwrap())
        .collect();
    assert_eq!(
        systems,
        ["B3", "B3 +journal", "B3 +journal +fencing", "trailmark"],
        "{lines:?}"
    );
    for (i, line) in lines.iter().enumerate() {
        let priced = line["figures"].as_array().expect("figures");
        assert_eq!(priced.len(), 5, "{line}");
        for p in priced {
            assert!(p["median"].as_f64().is_some_and(|m| m > 0.0), "{line}");
            assert_eq!(p["vs_above"].is_null(), i == 0, "{line}");
        }
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

/// `--growth --quick`: the history is put in place (real template runs copied in bulk, with
/// their journal, effects and inbox rows), the load runs beside it and beside `trailmark prune`,
/// pruning removes only history older than a day, and both databases are removed at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_growth_bench_loads_the_history_prunes_it_beside_the_load_and_cleans_up() {
    let pool = sqlx::PgPool::connect(&format!("{}/postgres", base_url()))
        .await
        .expect("connect");
    let out = bench(&["--growth", "--quick", "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("--json prints JSON ({e}); stderr: {stderr}"));

    // 10 template runs of 4 steps, copied until 4,000 steps: 100 copies, 1,000 runs.
    assert_eq!(report["history_steps"].as_u64(), Some(4_000), "{report}");
    assert_eq!(report["history_runs"].as_u64(), Some(1_000), "{report}");
    let sides = report["sides"].as_array().expect("sides");
    let names: Vec<&str> = sides.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["empty", "history", "history, pruning"]);
    for side in sides {
        for key in [
            "steps_per_s",
            "idle_gap_p50_ms",
            "gap_p99_ms",
            "wal_kib_per_step",
        ] {
            assert!(
                side[key]["median"].as_f64().is_some_and(|v| v > 0.0),
                "{key}: {side}"
            );
        }
    }
    // The history's tables hold the copies' rows (as ANALYZE counted them): one step row, journal
    // entry, effect record and ledger row per step, beside the template's; the empty side none.
    let rows = |side: &Value, table: &str| {
        side["tables"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["table"] == table)
            .and_then(|t| t["rows"].as_i64())
            .unwrap_or_else(|| panic!("no {table} in {side}"))
    };
    for table in ["steps", "journal", "effects", "chain_ledger", "inbox"] {
        assert!(rows(&sides[1], table) >= 4_040, "{table}: {}", sides[1]);
        assert_eq!(rows(&sides[0], table), 0, "{table}: {}", sides[0]);
    }
    assert!(rows(&sides[1], "runs") >= 1_010, "{}", sides[1]);
    // Copy k of 100 finished k x 6/100 days ago: copies 17 to 100 are older than a day, 840
    // runs. The pruner rests between batches (`retention.duty_percent`), so how many of them it
    // removed while the load ran depends on the machine; none it removed was younger.
    let pruning = &report["pruning"];
    let removed = pruning["runs_removed"].as_i64().unwrap();
    assert!((1..=840).contains(&removed), "{pruning}");
    assert_eq!(pruning["younger_removed"].as_i64(), Some(0), "{pruning}");

    // Both databases are gone.
    let databases: Vec<String> = report["databases"]
        .as_array()
        .expect("databases")
        .iter()
        .map(|d| d.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(databases.len(), 2, "{report}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = ANY($1)")
        .bind(&databases)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "the growth bench left {databases:?} behind");
}
