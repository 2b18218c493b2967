//! The replay check (`trailmark replay-check`, `src/replay/`): the recorded histories of `chain`
//! and `reconcile` kept in `tests/histories/` replay on today's workflows through the binary,
//! which needs no database and no broker for it (the check CI runs); a run exported through the
//! binary replays too; deliberately incompatible edits of `chain` (another next step, an outside
//! call more, a changed prompt, a version the binary no longer carries) fail naming the run, the
//! step and the position; and the binary exits 1 on a history its code does not replay.
//!
//! `record_histories` (ignored) makes `tests/histories/` again by running the workflows for
//! real; `docs/TESTING.md` says when to run it.

mod common;
mod reference_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use common::{TestEnv, text, trailmark_bin};
use reference_support::RefEnv;
use trailmark::domain::{IdempotencyKey, RunStatus};
use trailmark::model::{ChatMessage, ChatRequest};
use trailmark::replay::{self, DifferenceKind, History, NoteKind, Report};
use trailmark::workflow::{Handler, Registry, StepContext, StepOutcome};
use trailmark_reference::outside;

const WAIT: Duration = Duration::from_secs(90);

/// The recorded histories' directory.
fn histories() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/histories")
}

/// The recorded history `name` (`chain-plain`, ...).
fn recorded(name: &str) -> History {
    let path = histories().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    History::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `trailmark replay-check ARGS` with no database and no broker reachable: the check needs
/// neither. (exit code, stdout, stderr).
fn replay_check(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(trailmark_bin())
        .arg("replay-check")
        .args(args)
        .env(
            "DATABASE_URL",
            format!("postgres://nobody@127.0.0.1:{}/none", common::closed_port()),
        )
        .env(
            "AMQP_URL",
            format!("amqp://nobody@127.0.0.1:{}/%2f", common::closed_port()),
        )
        .env("RUST_LOG", "warn")
        .env_remove("TRAILMARK_FAILPOINTS")
        .env_remove("TRAILMARK_CHAIN_VERSIONS")
        .env_remove(outside::URL_VAR)
        .output()
        .expect("run trailmark replay-check");
    let (stdout, stderr) = text(&out);
    (out.status.code(), stdout, stderr)
}

/// A scratch directory of this test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let dir = std::env::temp_dir().join(format!("tm-replay-{tag}"));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        Self(dir)
    }
    fn file(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn the_recorded_histories_of_chain_and_reconcile_replay_through_the_binary_without_any_server() {
    let dir = histories().display().to_string();
    let (code, stdout, stderr) = replay_check(&[&dir]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let checked: Vec<&str> = stdout.lines().filter(|l| l.contains(": ok, ")).collect();
    assert!(
        checked.len() >= 7,
        "every recorded history is checked: {stdout}"
    );
    assert!(stdout.contains("(chain v1): ok"), "{stdout}");
    assert!(stdout.contains("(reconcile v1): ok"), "{stdout}");
}

#[tokio::test]
async fn each_recorded_history_replays_and_only_reconciles_reads_of_live_systems_go_unchecked() {
    let registry = trailmark_reference::registry();
    let mut names: Vec<String> = std::fs::read_dir(histories())
        .expect("tests/histories")
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in names.iter().filter_map(|n| n.strip_suffix(".json")) {
        let history = recorded(name);
        let report = replay::check(&registry, &history).await.expect(name);
        assert!(report.is_ok(), "{name}: {:#?}", report.differences);
        let unchecked: Vec<(i32, NoteKind)> = (report.notes.iter())
            .filter(|n| n.kind == NoteKind::LiveSystem)
            .map(|n| (n.seq, n.kind))
            .collect();
        if history.run.workflow == "reconcile" {
            // fetch_invoices, match_purchase_orders and read_stock_received read the outside
            // systems themselves; every other step, the writes included, is checked.
            let live = vec![
                (0, NoteKind::LiveSystem),
                (2, NoteKind::LiveSystem),
                (3, NoteKind::LiveSystem),
            ];
            assert_eq!(unchecked, live, "{name}: {:#?}", report.notes);
            assert_eq!(report.replayed, 10, "{name}");
        } else {
            assert_eq!(unchecked, vec![], "{name}: {:#?}", report.notes);
            assert_eq!(report.replayed, report.positions, "{name}");
        }
    }
    assert!(
        names.iter().any(|n| n.starts_with("reconcile")),
        "{names:?}"
    );
    let review = recorded("chain-review");
    assert_eq!(
        review.run.status, "needs_review",
        "one history stopped for review"
    );
}

/// `chain` with its one step's handler replaced by `edit(original)`.
fn edited_chain(edit: impl FnOnce(Handler) -> Handler) -> Registry {
    let mut chain = trailmark_testkit::chain::workflow();
    let original = chain.steps[0].handler.clone();
    chain.steps[0].handler = edit(original);
    let mut registry = Registry::new();
    registry.register(chain);
    registry
}

/// A handler that runs `before` and then `original`.
fn around<F, Fut>(original: Handler, before: F) -> Handler
where
    F: Fn(StepContext) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Option<StepOutcome>, trailmark::workflow::StepError>>
        + Send
        + 'static,
{
    let before = Arc::new(before);
    Arc::new(move |ctx: StepContext| {
        let (original, before) = (original.clone(), before.clone());
        Box::pin(async move {
            match before(ctx.clone()).await? {
                Some(instead) => Ok(instead),
                None => original(ctx).await,
            }
        })
    })
}

async fn check(registry: &Registry, history: &History) -> Report {
    replay::check(registry, history)
        .await
        .expect("the history replays")
}

#[tokio::test]
async fn a_chain_whose_link_now_fails_temporarily_without_reaching_anything_differs() {
    let history = recorded("chain-plain");
    // The edit: link 1 now gives up with a temporary error of its own making (a stricter
    // parse, say): a live worker would retry it into review, so the check must fail.
    let registry = edited_chain(|original| {
        around(original, |ctx: StepContext| async move {
            if ctx.seq() == 1 {
                return Err(trailmark::workflow::StepError::temporary(
                    "answer too short",
                ));
            }
            Ok(None)
        })
    });
    let report = check(&registry, &history).await;
    let differs = &report.differences;
    // The calls link 1 no longer makes, and its failure; nothing is a mere note.
    assert!(differs.iter().all(|d| d.seq == Some(1)), "{differs:#?}");
    let failed = differs.iter().find(|d| d.kind == DifferenceKind::Failed);
    let failed = failed.unwrap_or_else(|| panic!("no failure among {differs:#?}"));
    assert!(failed.found.contains("answer too short"), "{failed:?}");
    assert!(report.notes.is_empty(), "{:#?}", report.notes);
}

#[tokio::test]
async fn a_chain_that_ends_a_link_early_differs_at_that_link_naming_run_step_and_position() {
    let history = recorded("chain-plain");
    let registry = edited_chain(|original| {
        Arc::new(move |ctx: StepContext| {
            let original = original.clone();
            Box::pin(async move {
                let outcome = original(ctx.clone()).await?;
                // The edit: link 1 ends the run instead of going on.
                Ok(if ctx.seq() == 1 {
                    StepOutcome::finish(outcome.output)
                } else {
                    outcome
                })
            })
        })
    });
    let report = check(&registry, &history).await;
    assert_eq!(report.differences.len(), 1, "{:#?}", report.differences);
    let d = &report.differences[0];
    assert_eq!(
        (d.seq, d.step.as_deref(), d.kind),
        (Some(1), Some("link"), DifferenceKind::Next)
    );
    assert_eq!(d.run_id, history.run.id);
    assert_eq!(d.expected, "the run went on with step link");
    assert_eq!(d.found, "the step ends the run");
    let said = d.to_string();
    assert!(
        said.starts_with(&format!(
            "run {} step link (position 1): next step",
            history.run.id
        )),
        "{said}"
    );
}

#[tokio::test]
async fn a_chain_that_makes_an_outside_call_more_differs_and_the_call_is_never_made() {
    let history = recorded("chain-plain");
    let called = Arc::new(AtomicBool::new(false));
    let seen = called.clone();
    let registry = edited_chain(move |original| {
        around(original, move |ctx: StepContext| {
            let called = seen.clone();
            async move {
                if ctx.seq() == 2 {
                    // The edit: a notification before link 2's ledger write.
                    let key = IdempotencyKey::for_step(ctx.run_id(), "link", "notify-2");
                    ctx.effect(&key, &json!({"notify": 2}), |_| async move {
                        called.store(true, Ordering::SeqCst);
                        Ok(json!("sent"))
                    })
                    .await?;
                }
                Ok(None)
            }
        })
    });
    let report = check(&registry, &history).await;
    assert!(!report.is_ok());
    assert!(
        !called.load(Ordering::SeqCst),
        "a replay never calls outside"
    );
    for d in &report.differences {
        assert_eq!((d.seq, d.kind), (Some(2), DifferenceKind::Effect), "{d}");
        assert_eq!(d.run_id, history.run.id);
    }
    let first = &report.differences[0];
    let key = format!("{}:link:2", history.run.id);
    assert!(first.expected.contains(&key), "{first}");
    assert!(first.found.contains(":link:notify-2"), "{first}");
}

#[tokio::test]
async fn a_chain_that_skips_a_links_calls_differs_naming_the_first_call_not_made() {
    let history = recorded("chain-plain");
    let registry = edited_chain(|original| {
        around(original, |ctx: StepContext| async move {
            // The edit: link 1 asks and writes nothing, and goes on.
            let skip = ctx.seq() == 1;
            Ok(skip.then(|| StepOutcome::goto(json!({"link": 1}), "link")))
        })
    });
    let report = check(&registry, &history).await;
    let kinds: Vec<_> = (report.differences.iter())
        .map(|d| (d.seq, d.kind))
        .collect();
    let at_1 = |kind| (Some(1), kind);
    assert_eq!(
        kinds,
        vec![
            at_1(DifferenceKind::ModelCall),
            at_1(DifferenceKind::Effect)
        ]
    );
    let effect = &report.differences[1];
    assert_eq!(effect.expected, "1 outside call here");
    let key = format!("{}:link:1", history.run.id);
    assert!(
        effect
            .found
            .starts_with(&format!("0 made; the first not made: key {key}")),
        "{effect}"
    );
}

#[tokio::test]
async fn a_chain_whose_prompt_changed_differs_at_its_first_model_call() {
    let history = recorded("chain-plain");
    let registry = edited_chain(|original| {
        around(original, |ctx: StepContext| async move {
            // The edit: the prompt reworded without a new version or a patch.
            let request = ChatRequest {
                messages: vec![ChatMessage::system(
                    "You are one link of a chain. Be terse.",
                )],
                max_tokens: Some(64),
                temperature: Some(0.0),
            };
            ctx.model(&request).await?;
            Ok(None)
        })
    });
    let report = check(&registry, &history).await;
    let first = report.differences.first().expect("a difference");
    assert_eq!(
        (first.seq, first.step.as_deref()),
        (Some(0), Some("link")),
        "{first}"
    );
    assert_eq!(first.kind, DifferenceKind::ModelCall, "{first}");
    assert!(first.found.contains("another request"), "{first}");
    assert_eq!(
        report.differences.len(),
        history.positions.len(),
        "one per link"
    );
}

#[tokio::test]
async fn a_change_guarded_by_ctx_patched_replays_on_the_old_path_the_recorded_run_took() {
    let history = recorded("chain-plain");
    let taken = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = taken.clone();
    let registry = edited_chain(move |original| {
        Arc::new(move |ctx: StepContext| {
            let (original, seen) = (original.clone(), seen.clone());
            Box::pin(async move {
                // Patch points before the link's model call and after all of its calls: the
                // recorded run, made before the change, took neither new path.
                let early = ctx.patched("chain.early").await?;
                let outcome = original(ctx.clone()).await?;
                let late = ctx.patched("chain.late").await?;
                seen.lock().unwrap().push((early, late));
                Ok(outcome)
            })
        })
    });
    let report = check(&registry, &history).await;
    assert!(report.is_ok(), "{:#?}", report.differences);
    let taken = taken.lock().unwrap().clone();
    assert_eq!(taken, vec![(false, false); history.positions.len()]);
}

#[tokio::test]
async fn a_run_pinned_to_a_version_the_binary_no_longer_carries_is_a_difference_naming_it() {
    let mut history = recorded("chain-plain");
    history.run.version = 7;
    let report = check(&trailmark_reference::registry(), &history).await;
    assert_eq!(report.differences.len(), 1);
    let d = &report.differences[0];
    assert_eq!((d.kind, d.seq), (DifferenceKind::Version, None));
    assert_eq!(d.expected, "a run of chain v7");
    assert!(d.found.contains("carries chain v1 only"), "{d}");
    assert_eq!(report.replayed, 0);
}

#[test]
fn the_binary_fails_on_a_history_its_code_does_not_replay_naming_run_step_and_position() {
    let scratch = Scratch::new();
    let mut history: Value = serde_json::from_str(
        &std::fs::read_to_string(histories().join("chain-plain.json")).unwrap(),
    )
    .unwrap();
    // As if link 2 had been run with another prompt: its journaled request is not today's.
    let entry = (history["journal"].as_array_mut().unwrap().iter_mut())
        .find(|e| e["seq"] == 2)
        .expect("link 2's journal entry");
    entry["request_hash"] = json!("0".repeat(64));
    let edited = scratch.file("edited.json");
    std::fs::write(&edited, history.to_string()).unwrap();
    let run_id = history["run"]["id"].as_str().unwrap();
    let plain = histories().join("chain-plain.json").display().to_string();
    let (code, stdout, stderr) = replay_check(&[&plain, &edited]);
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("chain-plain.json: run"),
        "the good file is still checked: {stdout}"
    );
    let named = format!("run {run_id} step link (position 2): model call");
    assert!(stdout.contains(&named), "{stdout}");
    assert!(
        stderr.contains("1 of 2 histories do not replay"),
        "{stderr}"
    );

    let (code, _, stderr) = replay_check(&[&scratch.file("missing.json")]);
    assert_eq!(code, Some(1), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_exported_through_the_binary_replays_and_the_archive_document_is_refused_with_advice()
{
    let env = TestEnv::new().await;
    let _running = env.spawn_all(env.engine());
    let input = json!({"steps": 3, "sleep": {"at": 0, "secs": 0.2}});
    env.start_run("chain", "exported", input).await;
    env.wait_status("exported", RunStatus::Succeeded, WAIT)
        .await;
    let scratch = Scratch::new();
    let file = scratch.file("exported.json");
    let out = (env.command(&["run", "export", "exported", "--history", "--output", &file]))
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let history = History::parse(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(history.format, replay::FORMAT);
    assert_eq!(history.positions.len(), 3);
    assert_eq!(history.positions[0].pause, Some(replay::PauseRecord::Sleep));
    assert_eq!(history.positions[2].then, Some(replay::Then::Finish));
    assert_eq!((history.journal.len(), history.effects.len()), (3, 3));
    let (code, stdout, stderr) = replay_check(&[&file]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("run exported (chain v1): ok, 3 of 3 positions replayed"),
        "{stdout}"
    );

    // The archive's document is not a history: refused, saying what to export instead.
    let archive = scratch.file("archive.json");
    let out = (env.command(&["run", "export", "exported", "--output", &archive]))
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let (code, stdout, _) = replay_check(&[&archive]);
    assert_eq!(code, Some(1));
    assert!(stdout.contains("\"trailmark.run.v1\" document"), "{stdout}");
    assert!(
        stdout.contains("`trailmark run export ID --history`"),
        "{stdout}"
    );

    let out = env
        .command(&["run", "export", "nope", "--history"])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("run nope not found"), "{stderr}");
}

/// The histories `record_histories` makes: (file name, workflow, run id, input, how it ends).
fn chain_runs() -> Vec<(&'static str, &'static str, Value, RunStatus)> {
    vec![
        (
            "chain-plain",
            "history-chain-plain",
            json!({"steps": 4}),
            RunStatus::Succeeded,
        ),
        (
            "chain-local",
            "history-chain-local",
            json!({"steps": 3, "ledger": "local"}),
            RunStatus::Succeeded,
        ),
        (
            "chain-sleep",
            "history-chain-sleep",
            json!({"steps": 3, "sleep": {"at": 0, "secs": 0.5}}),
            RunStatus::Succeeded,
        ),
        (
            "chain-wait",
            "history-chain-wait",
            json!({"steps": 3, "wait": {"at": 1, "event": "approved", "timeout_secs": 600}}),
            RunStatus::Succeeded,
        ),
        (
            "chain-children",
            "history-chain-children",
            json!({"steps": 2, "children": {"at": 0, "count": 3}}),
            RunStatus::Succeeded,
        ),
        (
            "chain-review",
            "history-chain-review",
            json!({"steps": 2, "fail": true}),
            RunStatus::NeedsReview,
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "rewrites tests/histories/ by running the workflows: run it when their recorded behaviour changes on purpose (docs/TESTING.md)"]
async fn record_histories() {
    let world = RefEnv::new().await;
    let env = &world.env;
    let _running = env.spawn_all(env.engine());
    // Sent before its run reaches the wait: kept, then taken by it.
    let sent = env
        .command(&[
            "event",
            "send",
            "approved",
            "--key",
            "history-chain-wait",
            "--id",
            "history-approval",
        ])
        .args(["--payload", r#"{"by": "olga"}"#])
        .output()
        .unwrap();
    assert!(sent.status.success(), "{:?}", text(&sent));
    let mut made = Vec::new();
    for (file, run_id, input, ends) in chain_runs() {
        env.start_run("chain", run_id, input).await;
        made.push((file.to_owned(), run_id.to_owned(), ends));
    }
    let night = RefEnv::night(12, 3);
    world.start(&night).await;
    made.push((
        "reconcile".into(),
        night.run_id().to_string(),
        RunStatus::Succeeded,
    ));
    let registry = trailmark_reference::registry();
    std::fs::create_dir_all(histories()).expect("tests/histories");
    for (file, run_id, ends) in made {
        env.wait_status(&run_id, ends, WAIT).await;
        let history = replay::export(&env.pool, &run_id).await.expect("export");
        let report = replay::check(&registry, &history).await.expect("replay");
        assert!(report.is_ok(), "{file}: {:#?}", report.differences);
        let text = serde_json::to_string_pretty(&history).unwrap() + "\n";
        std::fs::write(histories().join(format!("{file}.json")), text).expect("write the history");
    }
}
