//! The ops console in a real browser (headless Chromium through WebDriver) against trailmark on
//! the real servers: a run stopped for review found, read and resumed; a dead letter revealed,
//! fixed and requeued; what each role may see and send; the scoped undo of one supplier previewed
//! exactly and then done; a run of 10,000 positions opened a page at a time; a run waiting for
//! an event shown waiting, then with the event it received; a schedule paused, resumed, triggered.

mod common;
mod console_support;
mod dlq_support;
mod reference_support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use console_support::{Browser, Tokens, WAIT, serve, serve_at};
use reference_support::{RefEnv, expected_mismatches};
use serde_json::json;
use trailmark::domain::RunStatus;
use trailmark::workflow::{Registry, StepError, StepKind, StepOutcome, Workflow};

/// A workflow whose one step fails with an error nobody understands while `broken` is set.
fn fragile(broken: Arc<AtomicBool>) -> Workflow {
    Workflow::new("fragile", 1).step("check", StepKind::Read, move |_ctx| {
        let broken = broken.clone();
        async move {
            if broken.load(Ordering::SeqCst) {
                return Err(StepError::Unknown(
                    "the supplier API answered nonsense".into(),
                ));
            }
            Ok(StepOutcome::finish(json!({ "checked": true })))
        }
    })
}

/// A workflow this process does not have at first; counts its step's runs.
fn later(runs: Arc<AtomicUsize>) -> Workflow {
    Workflow::new("later", 1).step("only", StepKind::Read, move |_ctx| {
        let runs = runs.clone();
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(StepOutcome::finish(json!({ "done": true })))
        }
    })
}

fn registry_with(wfs: Vec<Workflow>) -> Registry {
    let mut r = trailmark_testkit::registry();
    for wf in wfs {
        r.register(wf);
    }
    r
}

/// "actor via action target" of every audit row, oldest first.
async fn audit(env: &common::TestEnv) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT actor || ' ' || via || ' ' || action || ' ' || target FROM trailmark.audit ORDER BY id",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stopped_for_review_is_found_read_and_resumed_from_the_console() {
    let env = common::TestEnv::new().await;
    let tokens = Tokens::new();
    let broken = Arc::new(AtomicBool::new(true));
    let registry = registry_with(vec![fragile(broken.clone())]);
    let (base, running) = serve(&env, &tokens, registry).await;
    env.start_run("fragile", "r-review", json!({})).await;
    env.wait_status("r-review", RunStatus::NeedsReview, WAIT)
        .await;

    let login = reqwest::get(format!("{base}/login")).await.unwrap();
    let csp = login.headers()["content-security-policy"].to_str().unwrap();
    assert!(
        csp.contains("style-src 'self';") && !csp.contains("unsafe-inline"),
        "{csp}"
    );
    let env = &env;
    Browser::open(&base, "review")
        .await
        .run(|b| async move {
            b.login(&tokens.operator).await;
            // Home lists it under "Needs review", with the reason in one line.
            let row = b.text("#review + table tbody tr").await;
            assert!(
                row.contains("r-review") && row.contains("answered nonsense"),
                "{row}"
            );
            b.shot_for_docs("home").await;
            assert_eq!(b.inline_styles().await, 0, "inline styles the CSP refuses");
            b.click("#review + table a[href='/runs/r-review']").await;
            let error = b.text("#handover-error").await;
            assert!(
                error.contains("the supplier API answered nonsense"),
                "{error}"
            );
            b.shot_for_docs("run-review").await;

            broken.store(false, Ordering::SeqCst);
            b.fill(
                "form[data-action=resume] input[name=reason]",
                "the supplier fixed its API",
            )
            .await;
            b.click("form[data-action=resume] button").await;
            b.wait_text("p.done", "resume: needs_review → running")
                .await;
            // The page follows the run until it ends, then shows its final status.
            b.wait_text("#live-status", "succeeded").await;
            assert_eq!(audit(env).await, ["otto console resume r-review"]);
        })
        .await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_is_revealed_by_an_admin_then_requeued_after_the_fix_and_runs_once() {
    let env = common::TestEnv::new().await;
    let tokens = Tokens::new();
    let (base, running) = serve(&env, &tokens, registry_with(vec![])).await;
    env.start_run("later", "r-later", json!({ "note": "from upstream" }))
        .await;
    dlq_support::wait_dlq_depth(&env, 1).await;

    let handled = Arc::new(AtomicUsize::new(0));
    let (env, handled_by_flow) = (&env, handled.clone());
    let mut running = Some(running);
    let slot = &mut running;
    Browser::open(&base, "dead-letters")
        .await
        .run(|b| async move {
            b.login(&tokens.admin).await;
            b.goto("/dead-letters").await;
            let reasons = b.text("#by-reason").await;
            assert!(reasons.contains("unknown_workflow"), "{reasons}");
            b.shot_for_docs("dead-letters").await;
            b.click("#letters a").await;
            assert_eq!(b.text("#reason").await, "unknown_workflow");
            assert!(
                b.all("#body").await.is_empty(),
                "the body shows before it is revealed"
            );
            let letter = b.path().await;
            b.fill(
                "form[action$='/reveal'] input[name=reason]",
                "which workflow does upstream want?",
            )
            .await;
            b.click("form[action$='/reveal'] button").await;
            let body = b.text("#body").await;
            assert!(
                body.contains("later") && body.contains("from upstream"),
                "{body}"
            );

            // The fix: a build that has the workflow takes over the same address.
            slot.take().unwrap().stop().await;
            let registry = registry_with(vec![later(handled_by_flow)]);
            let (_, fixed) = serve_at(env, &tokens, registry, Some(&b.base)).await;
            *slot = Some(fixed);

            b.goto(&letter).await;
            b.click("a[href^='/dead-letters/act/requeue']").await;
            assert_eq!(b.text("#count").await, "1");
            b.fill("input[name=reason]", "workflow later is deployed")
                .await;
            b.click("form.box button").await;
            b.wait_text("p.done", "requeued 1 of 1").await;
            env.wait_status("r-later", RunStatus::Succeeded, WAIT).await;
            let letter_id = letter.trim_start_matches("/dead-letters/").to_owned();
            assert_eq!(
                audit(env).await,
                [
                    format!("ada console dlq.reveal {letter_id}"),
                    format!("ada console dlq.requeue {letter_id}"),
                ]
            );
        })
        .await;
    assert_eq!(
        handled.load(Ordering::SeqCst),
        1,
        "the requeued start ran its step once"
    );
    running.unwrap().stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewer_sees_no_decisions_a_forged_form_is_refused_and_no_session_shows_no_page() {
    let env = common::TestEnv::new().await;
    let tokens = Tokens::new();
    let registry = registry_with(vec![fragile(Arc::new(AtomicBool::new(true)))]);
    let (base, running) = serve(&env, &tokens, registry).await;
    env.start_run("fragile", "r-roles", json!({})).await;
    env.wait_status("r-roles", RunStatus::NeedsReview, WAIT)
        .await;

    let env = &env;
    Browser::open(&base, "roles")
        .await
        .run(|b| async move {
            // No session: every page sends the browser to the login form, and shows nothing.
            b.goto("/runs/r-roles").await;
            b.find("input[name=token]").await;
            assert!(
                b.path().await.starts_with("/login?next="),
                "{}",
                b.path().await
            );
            let page = b.text("main").await;
            assert!(!page.contains("r-roles"), "{page}");

            b.login(&tokens.viewer).await;
            b.goto("/runs/r-roles").await;
            b.find("#handover").await;
            assert!(
                b.all("form[data-action]").await.is_empty(),
                "a viewer sees decision forms"
            );
            assert!(b.all("#decide").await.is_empty());
            // A cancel forged by hand, with the viewer's own session and CSRF secret, is refused.
            let csrf = b
                .find("form.who input[name=csrf]")
                .await
                .attr("value")
                .await
                .unwrap()
                .unwrap();
            let forged = format!("csrf={csrf}&action=cancel&reason=forged");
            let status = post_from_page(&b, "/runs/r-roles/decide", &forged).await;
            assert_eq!(status, 403, "a viewer's forged decision");
            // And without the CSRF secret, even an operator's form is refused.
            b.goto("/").await;
            b.click("form.who button").await;
            b.login(&tokens.operator).await;
            let status = post_from_page(&b, "/runs/r-roles/decide", "action=cancel&reason=x").await;
            assert_eq!(status, 403, "a form without the CSRF secret");
            assert_eq!(
                trailmark::store::runs::get(&env.pool, "r-roles")
                    .await
                    .unwrap()
                    .unwrap()
                    .status,
                RunStatus::NeedsReview,
                "nothing was decided"
            );
            assert!(audit(env).await.is_empty());

            // A form shown before someone else decided: the refusal appears where it was sent.
            b.goto("/runs/r-roles").await;
            let elsewhere = trailmark::operator::Decider::cli("maria.ops", "duplicate of r-other");
            trailmark::operator::cancel(&env.engine(), "r-roles", &elsewhere)
                .await
                .unwrap();
            b.fill("form[data-action=resume] input[name=reason]", "try again")
                .await;
            b.click("form[data-action=resume] button").await;
            let refused = b.text("#decide + p.error").await;
            assert!(
                refused.contains("cannot resume run r-roles")
                    && refused.contains("it is cancelled"),
                "{refused}"
            );
        })
        .await;
    running.stop().await;
}

/// Posts `body` as a form from the page's own origin (cookies included); the HTTP status.
async fn post_from_page(b: &Browser, path: &str, body: &str) -> u64 {
    let script = r#"
        const [path, body, done] = arguments;
        fetch(path, { method: "POST", body, redirect: "manual",
                      headers: { "content-type": "application/x-www-form-urlencoded" } })
            .then(r => done(r.status)).catch(e => done(-1));
    "#;
    b.client
        .execute_async(script, vec![json!(path), json!(body)])
        .await
        .expect("script ran")
        .as_u64()
        .expect("a status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scoped_undo_of_one_supplier_shows_exactly_its_reversals_then_writes_them_once() {
    let mut r = RefEnv::new().await;
    r.start_mail_sender();
    let tokens = Tokens::new();
    let night = RefEnv::night(312, 40);
    let run_id = night.run_id().to_string();
    let (base, running) = serve(&r.env, &tokens, trailmark_reference::registry()).await;
    r.start(&night).await;
    r.env.wait_status(&run_id, RunStatus::Succeeded, WAIT).await;
    let mut per_supplier: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for m in expected_mismatches(&night) {
        per_supplier
            .entry(m.matched.item.supplier.clone())
            .or_default()
            .insert(format!("undo:{}", m.key));
    }
    let (supplier, expected) = per_supplier
        .into_iter()
        .max_by_key(|(_, keys)| keys.len())
        .unwrap();

    let (r_ref, run) = (&r, run_id.clone());
    Browser::open(&base, "undo")
        .await
        .run(|b| async move {
            b.login(&tokens.operator).await;
            b.goto(&format!("/runs/{run}")).await;
            b.fill(
                "form[data-action=undo-preview] input[name=scope]",
                &format!(r#"{{"supplier": "{supplier}"}}"#),
            )
            .await;
            b.click("form[data-action=undo-preview] button").await;
            // The preview arrives after the click: wait for its first row before reading all
            // (under load the read came before the page and found none).
            let first = "table.reversals[data-step=post_ledger_adjustments] td.reversal";
            b.find(first).await;
            let cells = b.all(first).await;
            let mut listed = BTreeSet::new();
            for c in cells {
                listed.insert(c.text().await.unwrap());
            }
            assert_eq!(
                listed, expected,
                "the preview lists exactly that supplier's reversals"
            );
            b.shot_for_docs("undo-preview").await;
            b.fill(
                "form.box input[name=reason]",
                &format!("{supplier} corrected its invoices"),
            )
            .await;
            b.click("form.box button").await;
            b.wait_text("p.done", "undo:").await;
            r_ref
                .env
                .wait_status(&run, RunStatus::Compensated, WAIT)
                .await;
            let written: Vec<(String, i64)> = sqlx::query_as(
                "SELECT reference, count(*) FROM reference.entries
                  WHERE run_id = $1 AND reverses IS NOT NULL GROUP BY reference",
            )
            .bind(&run)
            .fetch_all(&r_ref.outside)
            .await
            .unwrap();
            let keys: BTreeSet<String> = written.iter().map(|(k, _)| k.clone()).collect();
            assert_eq!(keys, expected, "the undo wrote what the preview listed");
            assert!(
                written.iter().all(|(_, n)| *n == 1),
                "a reversal twice: {written:?}"
            );
        })
        .await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_ten_thousand_positions_opens_a_page_at_a_time() {
    let env = common::TestEnv::new().await;
    let tokens = Tokens::new();
    let (base, running) = serve(&env, &tokens, registry_with(vec![])).await;
    let run_id = "r-long";
    seed_long_run(&env, run_id, 10_000).await;

    Browser::open(&base, "long")
        .await
        .run(|b| async move {
            b.login(&tokens.viewer).await;
            let started = Instant::now();
            b.goto(&format!("/runs/{run_id}")).await;
            b.find("#steps").await;
            let took = started.elapsed();
            assert_eq!(b.text("#steps").await, "Steps 9900–9999 of 10000");
            let rows = b.all("#steps ~ table tbody tr").await.len();
            assert!(rows >= 100, "a page shows 100 positions, saw {rows} rows");
            b.click("a[href$='after=-1#steps']").await;
            b.wait_text("#steps", "Steps 0–99 of 10000").await;
            // A figure, not a target: the README reports it; the machine's speed varies.
            eprintln!(
                "a run of 10,000 positions opened in the browser in {} ms",
                took.as_millis()
            );
        })
        .await;
    running.stop().await;
}

/// A finished `chain` run of `n` positions, written directly (steps, journal entries, effects):
/// what the page reads, without waiting for 10,000 steps to run.
async fn seed_long_run(env: &common::TestEnv, run_id: &str, n: i32) {
    let pool = &env.pool;
    sqlx::query(
        "INSERT INTO trailmark.runs (run_id, workflow, workflow_version, status, step, step_seq, input)
         VALUES ($1, 'chain', 1, 'succeeded', NULL, $2, $3)",
    )
    .bind(run_id)
    .bind(n)
    .bind(json!({ "steps": n }))
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO trailmark.steps (run_id, seq, step, attempts, output, started_at, finished_at)
         SELECT $1, g, 'link', 1, '{}'::jsonb, now(), now() FROM generate_series(0, $2 - 1) g",
    )
    .bind(run_id)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO trailmark.journal (run_id, seq, call_no, kind, request_hash, response, tokens)
         SELECT $1, g, 0, 'model', md5(g::text), '{}'::jsonb, 33 FROM generate_series(0, $2 - 1) g",
    )
    .bind(run_id)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_pauses_resumes_and_triggers_a_schedule_from_the_console() {
    let env = common::TestEnv::new().await;
    let tokens = Tokens::new();
    let (base, running) = serve(&env, &tokens, registry_with(vec![])).await;
    let out = env
        .command(&[
            "schedule",
            "create",
            "nightly",
            "--workflow",
            "chain",
            "--cron",
            "0 2 * * *",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", common::text(&out));

    let env = &env;
    Browser::open(&base, "schedules")
        .await
        .run(|b| async move {
            b.login(&tokens.operator).await;
            b.goto("/schedules").await;
            let row = "tr[data-schedule=nightly]";
            assert_eq!(b.text(&format!("{row} td.state")).await, "active");
            for (action, done) in [
                ("pause", "paused nightly"),
                ("resume", "resumed nightly"),
                ("trigger", "triggered nightly:"),
            ] {
                let form = format!("{row} form[data-action={action}]");
                b.fill(&format!("{form} input[name=reason]"), "console check")
                    .await;
                b.click(&format!("{form} button")).await;
                b.wait_text("p.done", done).await;
            }
            assert_eq!(b.text(&format!("{row} td.state")).await, "active");
            let rows = audit(env).await;
            assert!(
                rows[0].ends_with("cli schedule.create schedule:nightly"),
                "{rows:?}"
            );
            assert_eq!(
                rows[1..],
                [
                    "otto console schedule.pause schedule:nightly",
                    "otto console schedule.resume schedule:nightly",
                    "otto console schedule.trigger schedule:nightly",
                ]
            );
        })
        .await;
    let triggered: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trailmark.runs WHERE run_id LIKE 'nightly:%'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(triggered, 1, "one run triggered");
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_sets_a_tenants_limit_from_the_console_and_it_is_in_force() {
    let env = common::TestEnv::new().await;
    let tokens = Tokens::new();
    let (base, running) = serve(&env, &tokens, registry_with(vec![])).await;
    let env = &env;
    Browser::open(&base, "limits")
        .await
        .run(|b| async move {
            b.login(&tokens.operator).await;
            b.goto("/limits").await;
            b.fill("#set-limit input[name=key]", "acme").await;
            b.fill("#set-limit input[name=concurrency]", "3").await;
            b.fill("#set-limit input[name=reason]", "acme's burst")
                .await;
            b.click("#set-limit button").await;
            b.wait_text("p.done", "set chain key acme: concurrency 3")
                .await;
            let table = b.text("#limits").await;
            assert!(table.contains("acme"), "{table}");
            let rows = audit(env).await;
            assert_eq!(rows, ["otto console limit.set chain/acme"]);
        })
        .await;
    let set: Option<i32> = sqlx::query_scalar(
        "SELECT concurrency FROM trailmark.flow_limits WHERE workflow = 'chain' AND key = 'acme'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(set, Some(3));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_waiting_for_an_event_shows_what_it_waits_for_then_the_event_it_received() {
    let env = common::TestEnv::new().await;
    let tokens = Tokens::new();
    let (base, running) = serve(&env, &tokens, registry_with(vec![])).await;
    let input = json!({"steps": 3, "wait": {"at": 1, "event": "go", "timeout_secs": 3600}});
    env.start_run("chain", "r-event", input).await;
    env.wait_status("r-event", RunStatus::Waiting, WAIT).await;

    let env = &env;
    Browser::open(&base, "waits")
        .await
        .run(|b| async move {
            b.login(&tokens.operator).await;
            b.goto("/runs/r-event").await;
            let row = b.text("#waits + table tbody tr").await;
            assert!(
                row.contains("event go (key r-event)") && row.contains("waiting now"),
                "{row}"
            );
            // Waiting for an event is not waiting for a person: no approve to be refused.
            let moves_on = b.text("#moves-on").await;
            assert!(
                moves_on.contains("trailmark event send go --key r-event"),
                "{moves_on}"
            );
            assert!(b.all("form[data-action=approve]").await.is_empty());

            let out = env
                .command(&[
                    "event",
                    "send",
                    "go",
                    "--key",
                    "r-event",
                    "--id",
                    "ev-1",
                    "--payload",
                    r#"{"reply": "yes"}"#,
                ])
                .output()
                .unwrap();
            assert!(out.status.success(), "{:?}", common::text(&out));
            b.wait_text("#live-status", "succeeded").await;
            b.goto("/runs/r-event").await;
            let row = b.text("#waits + table tbody tr").await;
            assert!(
                row.contains(r#"ev-1: {"reply":"yes"}"#) && !row.contains("waiting now"),
                "{row}"
            );
        })
        .await;
    assert_eq!(
        env.chain_ledger("r-event").await,
        (3, 3),
        "ledger rows, distinct keys"
    );
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_page_lists_its_children_by_state_and_links_both_ways() {
    let env = common::TestEnv::new().await;
    let tokens = Tokens::new();
    let (base, running) = serve(&env, &tokens, registry_with(vec![])).await;
    // The first 2 of 3 children: the third sleeps, and the join cancels it.
    let children = json!({"at": 0, "count": 3, "steps": 2, "first": 2, "slow": [2]});
    env.start_run("chain", "r-fam", json!({"steps": 2, "children": children}))
        .await;
    env.wait_status("r-fam", RunStatus::Succeeded, WAIT).await;

    Browser::open(&base, "children")
        .await
        .run(|b| async move {
            b.login(&tokens.viewer).await;
            b.goto("/runs/r-fam").await;
            assert_eq!(b.text("#children").await, "Children of position 0");
            let counts = b.text("#children + p").await;
            assert!(
                counts.contains("3 in all: 2 succeeded, 1 failed, 0 running")
                    && counts.contains("join first 2"),
                "{counts}"
            );
            let mut rows = Vec::new();
            for row in b.all("#children ~ table tbody tr").await {
                rows.push(row.text().await.unwrap_or_default());
            }
            assert_eq!(rows.len(), 3, "{rows:?}");
            assert!(
                rows[0].contains("r-fam:0:0") && rows[0].contains("succeeded"),
                "{rows:?}"
            );
            assert!(
                rows[2].contains("r-fam:0:2")
                    && rows[2].contains("cancelled")
                    && rows[2].contains("first 2"),
                "{rows:?}"
            );
            b.click("a[href='/runs/r-fam:0:2']").await;
            b.wait_text("#parent", "child run of r-fam").await;
            b.click("#parent a").await;
            b.wait_text("#children", "Children of position 0").await;
        })
        .await;
    running.stop().await;
}
