//! The ops API against the real servers: every endpoint for every role (401, 403, allowed), one
//! audit row per mutation and none for reads, the Idempotency-Key (replay, reuse, in progress),
//! readiness while draining, metrics that move, progress lines `run watch` sees, and exactly one
//! lifecycle event for a run that stops for review.

mod api_support;
mod common;
mod dlq_support;

use std::time::Duration;

use api_support::{Api, WAIT, fragile, registry_with};
use common::{TestEnv, closed_port};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sha2::Digest;
use trailmark::api::{ENDPOINTS, Role};
use trailmark::domain::{RunStatus, StepAddress};
use trailmark::workflow::{StepError, StepKind, StepOutcome, Workflow};

impl Api {
    /// Forks run `r-base` as an operator with `body`, under a fresh Idempotency-Key.
    async fn fork_base(&self, body: Value) -> (StatusCode, Value) {
        let key = uuid::Uuid::new_v4().to_string();
        let op = Some(self.token(Role::Operator));
        let path = "/api/v1/runs/r-base/fork";
        self.call(Method::POST, path, op, Some(body), Some(&key))
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_answers_401_without_a_token_403_below_its_role_and_audits_each_mutation() {
    let api = Api::start(registry_with(fragile())).await;
    let env = &api.env;
    env.start_run("chain", "r-ok", json!({"steps": 2})).await;
    env.wait_status("r-ok", RunStatus::Succeeded, WAIT).await;
    env.start_run("fragile", "r-review", json!({})).await;
    env.wait_status("r-review", RunStatus::NeedsReview, WAIT)
        .await;
    let poison = dlq_support::message(
        env.topology().steps_exchange(),
        trailmark::domain::STEP_ROUTING_KEY,
        "poison-1",
        b"{not json".to_vec(),
    );
    env.publish(&poison).await;
    dlq_support::wait_dlq_depth(env, 1).await;
    // The schedule every `{name}` path names: created (201), then the same again (200).
    let hourly = json!({"name": "chain", "workflow": "chain", "every": "1h", "reason": "hourly"});
    for want in [StatusCode::CREATED, StatusCode::OK] {
        let op = Some(api.token(Role::Operator));
        let (status, body) = api
            .call(
                Method::POST,
                "/api/v1/schedules",
                op,
                Some(hourly.clone()),
                None,
            )
            .await;
        assert_eq!(
            (status, &body["every_secs"]),
            (want, &json!(3600)),
            "{body}"
        );
    }

    for e in ENDPOINTS {
        let path = e
            .path
            .replace("{run_id}", "r-ok")
            .replace("{other}", "r-ok")
            .replace("{id}", "poison-1")
            .replace("{name}", "chain");
        let method = Method::from_bytes(e.method.as_bytes()).unwrap();
        let (status, _) = api.call(method.clone(), &path, None, None, None).await;
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "{} {path} without a token",
            e.method
        );
        let (status, _) = api
            .call(method.clone(), &path, Some("tm_not_a_token"), None, None)
            .await;
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "{} {path} with a wrong token",
            e.method
        );
        for role in [Role::Viewer, Role::Operator]
            .into_iter()
            .filter(|r| *r < e.role)
        {
            let body = Some(json!({"reason": "matrix", "step": "link"}));
            let key = uuid::Uuid::new_v4().to_string();
            let (status, _) = api
                .call(
                    method.clone(),
                    &path,
                    Some(api.token(role)),
                    body,
                    Some(&key),
                )
                .await;
            assert_eq!(
                status,
                StatusCode::FORBIDDEN,
                "{} {path} as {role:?}",
                e.method
            );
        }
        if e.method == "GET" {
            let before = api.audit_rows().await;
            let (status, body) = api
                .call(method, &path, Some(api.token(e.role)), None, None)
                .await;
            assert_eq!(status, StatusCode::OK, "GET {path} as {:?}: {body}", e.role);
            assert_eq!(
                api.audit_rows().await,
                before,
                "a read wrote an audit row: {path}"
            );
        }
    }

    // Mutations: a refused one changes nothing and records nothing; a done one records one row.
    let op = Some(api.token(Role::Operator));
    let reason = |r: &str| Some(json!({"reason": r}));
    let before = api.audit_rows().await;
    let (status, body) = api
        .call(
            Method::POST,
            "/api/v1/runs/r-ok/resume",
            op,
            reason("again"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["status"], "succeeded", "{body}");
    assert_eq!(api.audit_rows().await, before);
    let (status, body) = api
        .call(
            Method::POST,
            "/api/v1/runs/r-review/resume",
            op,
            reason("retry it"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status_after"], "running", "{body}");
    assert_eq!(api.audit_rows().await, before + 1);
    env.wait_status("r-review", RunStatus::NeedsReview, WAIT)
        .await;
    let (status, body) = api
        .call(
            Method::POST,
            "/api/v1/runs/r-review/cancel",
            op,
            reason("give up"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(api.audit_rows().await, before + 2);
    let (status, _) = api
        .call(
            Method::POST,
            "/api/v1/runs/r-ok/cancel",
            op,
            Some(json!({"reason": " "})),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "a blank reason is refused");

    let admin = Some(api.token(Role::Admin));
    let (status, body) = api
        .call(
            Method::POST,
            "/api/v1/dead-letters/poison-1/reveal",
            admin,
            reason("look"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body["body"]["head_hex"],
        json!(hex::encode(b"{not json")),
        "{body}"
    );
    assert_eq!(
        api.audit_rows().await,
        before + 3,
        "revealing a body is audited"
    );
    let entry: (String, String, String, Option<String>) = sqlx::query_as(
        "SELECT actor, role, action, request_id FROM trailmark.audit ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(
        (&entry.0[..], &entry.1[..], &entry.2[..]),
        ("ada", "admin", "dlq.reveal")
    );
    assert!(entry.3.is_some(), "the request id is recorded");
    let (status, body) = api
        .call(
            Method::POST,
            "/api/v1/dead-letters/purge",
            admin,
            Some(json!({"reason": "count", "reason_code": "undecodable", "preview": true})),
            None,
        )
        .await;
    assert_eq!(
        (status, &body["would_touch"]),
        (StatusCode::OK, &json!(1)),
        "{body}"
    );
    assert_eq!(
        api.audit_rows().await,
        before + 3,
        "a preview changes nothing"
    );
}

/// `POST /api/v1/runs` with `body` as `role`: status, headers, body.
async fn start_over_http(
    api: &Api,
    role: Role,
    body: Value,
) -> (StatusCode, reqwest::header::HeaderMap, Value) {
    let auth = format!("Bearer {}", api.token(role));
    let auth = reqwest::header::HeaderValue::from_str(&auth).unwrap();
    api.raw(
        Method::POST,
        "/api/v1/runs",
        Some("application/json"),
        body.to_string().into_bytes(),
        &[("authorization", auth)],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_started_over_http_runs_to_its_end_and_a_second_start_is_the_same_run_or_a_409() {
    let api = Api::start_with(trailmark_testkit::registry(), |s| {
        s.worker.max_message_bytes = 4096;
    })
    .await;
    let env = &api.env;
    let start = json!({"workflow": "chain", "run_id": "r-http", "input": {"steps": 3}, "reason": "nightly"});
    let (status, headers, run) = start_over_http(&api, Role::Operator, start.clone()).await;
    assert_eq!(status, StatusCode::CREATED, "{run}");
    assert_eq!(headers["location"], "/api/v1/runs/r-http");
    assert_eq!(
        (
            &run["run_id"],
            &run["workflow"],
            &run["status"],
            &run["created"]
        ),
        (
            &json!("r-http"),
            &json!("chain"),
            &json!("running"),
            &json!(true)
        ),
        "{run}"
    );
    assert_eq!(run["links"]["steps"], "/api/v1/runs/r-http/steps", "{run}");
    env.wait_status("r-http", RunStatus::Succeeded, WAIT).await;
    assert_eq!(env.chain_ledger("r-http").await, (3, 3));

    // The same start again (a retry after a timeout): the run as it stands, nothing new.
    let (status, _, again) = start_over_http(&api, Role::Operator, start.clone()).await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(
        (&again["run_id"], &again["status"], &again["created"]),
        (&json!("r-http"), &json!("succeeded"), &json!(false))
    );
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM trailmark.audit WHERE action = 'run.start' AND target = 'r-http' AND actor = 'otto' AND reason = 'nightly'",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(audited, 1, "one audit row for the one start");

    // Another input under the id: 409 naming the run, which is kept as it was.
    let other = json!({"workflow": "chain", "run_id": "r-http", "input": {"steps": 4}});
    let (status, _, why) = start_over_http(&api, Role::Operator, other).await;
    assert_eq!(status, StatusCode::CONFLICT, "{why}");
    assert_eq!(
        (
            why["error"].as_str(),
            why["field"].as_str(),
            why["status"].as_str()
        ),
        (Some("run_conflict"), Some("run_id"), Some("succeeded"))
    );
    assert!(
        why["message"]
            .as_str()
            .unwrap()
            .contains("run r-http exists"),
        "{why}"
    );
    let kept = trailmark::store::runs::get(&env.pool, "r-http")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kept.input, json!({"steps": 3}));
    assert_eq!(env.chain_ledger("r-http").await, (3, 3));

    // Starts a worker would refuse, refused with the worker's words and reason codes.
    let registry = trailmark_testkit::registry();
    let topology = env.topology();
    for (workflow, version, input, status, code, field) in [
        (
            "nope",
            None,
            json!({}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown_workflow",
            "workflow",
        ),
        (
            "chain",
            Some(7),
            json!({"steps": 1}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown_version",
            "version",
        ),
        (
            "chain",
            None,
            json!({"steps": "many"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "bad_input",
            "input",
        ),
        (
            "chain",
            None,
            json!({"blob": "z".repeat(8 * 1024)}),
            StatusCode::PAYLOAD_TOO_LARGE,
            "oversized",
            "input",
        ),
    ] {
        let run_id = trailmark::domain::RunId::parse("r-refused").unwrap();
        let event = trailmark::domain::RunStartEvent {
            version,
            ..trailmark::domain::RunStartEvent::new(run_id, workflow, input.clone())
        };
        let Err(refused) = trailmark::worker::start_message(&registry, &topology, 4096, &event)
        else {
            panic!("{workflow}: the start is refused");
        };
        let words = refused.to_string();
        let body = json!({"workflow": workflow, "run_id": "r-refused", "input": input, "version": version});
        let (s, _, why) = start_over_http(&api, Role::Operator, body).await;
        assert_eq!(
            (s, why["error"].as_str(), why["field"].as_str()),
            (status, Some(code), Some(field)),
            "{why}"
        );
        assert!(
            why["message"].as_str().unwrap().contains(&words),
            "{why} lacks {words:?}"
        );
    }
    assert!(no_run(&api, "r-refused").await);

    // A viewer may read runs, not start them; a run id that is not one is a 400 naming it.
    let (status, _, why) = start_over_http(
        &api,
        Role::Viewer,
        json!({"workflow": "chain", "run_id": "r-viewer"}),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{why}");
    let (status, _, why) = start_over_http(
        &api,
        Role::Operator,
        json!({"workflow": "chain", "run_id": "has space"}),
    )
    .await;
    assert_eq!(
        (status, why["field"].as_str()),
        (StatusCode::BAD_REQUEST, Some("run_id")),
        "{why}"
    );
    let (status, _, why) =
        start_over_http(&api, Role::Operator, json!({"run_id": "r-no-workflow"})).await;
    assert_eq!(
        (status, why["field"].as_str()),
        (StatusCode::BAD_REQUEST, Some("workflow")),
        "{why}"
    );
    for id in ["r-viewer", "r-no-workflow"] {
        assert!(no_run(&api, id).await, "{id}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_of_one_run_id_at_the_same_moment_make_one_run_and_refuse_the_other_input() {
    let api = Api::start(trailmark_testkit::registry()).await;
    let start = |run: &str, steps: i64| json!({"workflow": "chain", "run_id": run, "input": {"steps": steps}});
    for round in 0..5 {
        let (same, other) = (format!("r-same-{round}"), format!("r-other-{round}"));
        let (a, b, c, d) = tokio::join!(
            start_over_http(&api, Role::Operator, start(&same, 1)),
            start_over_http(&api, Role::Operator, start(&same, 1)),
            start_over_http(&api, Role::Operator, start(&other, 1)),
            start_over_http(&api, Role::Operator, start(&other, 2)),
        );
        let mut same_answers = [a.0, b.0];
        same_answers.sort();
        assert_eq!(
            same_answers,
            [StatusCode::OK, StatusCode::CREATED],
            "{} {}",
            a.2,
            b.2
        );
        let mut other_answers = [c.0, d.0];
        other_answers.sort();
        assert_eq!(
            other_answers,
            [StatusCode::CREATED, StatusCode::CONFLICT],
            "{} {}",
            c.2,
            d.2
        );
        let winner = if c.0 == StatusCode::CREATED { 1 } else { 2 };
        let run = trailmark::store::runs::get(&api.env.pool, &other)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            run.input,
            json!({"steps": winner}),
            "the run is the one answered 201"
        );
    }
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM trailmark.runs")
        .fetch_one(&api.env.pool)
        .await
        .unwrap();
    assert_eq!(runs, 10);
}

/// Whether no run `run_id` exists.
async fn no_run(api: &Api, run_id: &str) -> bool {
    trailmark::store::runs::get(&api.env.pool, run_id)
        .await
        .unwrap()
        .is_none()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_replays_its_first_answer_refuses_another_request_and_a_running_one() {
    let api = Api::start(trailmark_testkit::registry()).await;
    let env = &api.env;
    env.start_run("chain", "r-undo", json!({"steps": 3})).await;
    env.wait_status("r-undo", RunStatus::Succeeded, WAIT).await;
    let op = Some(api.token(Role::Operator));
    let body = json!({"reason": "the run posted to the wrong ledger"});
    let path = "/api/v1/runs/r-undo/undo";

    let (status, _) = api
        .call(Method::POST, path, op, Some(body.clone()), None)
        .await;
    assert_eq!(
        status,
        StatusCode::PRECONDITION_REQUIRED,
        "undo without a key"
    );
    let key = uuid::Uuid::new_v4().to_string();
    let (first, answer) = api
        .call(Method::POST, path, op, Some(body.clone()), Some(&key))
        .await;
    assert_eq!(first, StatusCode::OK, "{answer}");
    // A double-click: the same answer, the undo decided once.
    let (again, replayed) = api
        .call(Method::POST, path, op, Some(body.clone()), Some(&key))
        .await;
    assert_eq!((again, &replayed), (StatusCode::OK, &answer));
    let undos: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trailmark.decisions WHERE action = 'undo'")
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(undos, 1);
    let (reused, _) = api
        .call(
            Method::POST,
            path,
            op,
            Some(json!({"reason": "other"})),
            Some(&key),
        )
        .await;
    assert_eq!(reused, StatusCode::UNPROCESSABLE_ENTITY);

    // A request still running under a key (as its row says) makes a repeat wait: 409.
    let busy = uuid::Uuid::new_v4().to_string();
    let cancel = json!({"reason": "stop"});
    let mut fingerprint = sha2::Sha256::new();
    fingerprint.update(b"POST /api/v1/runs/r-undo/cancel\n");
    fingerprint.update(cancel.to_string().as_bytes());
    sqlx::query("INSERT INTO trailmark.api_idempotency (key, request_hash) VALUES ($1, $2)")
        .bind(&busy)
        .bind(hex::encode(fingerprint.finalize()))
        .execute(&env.pool)
        .await
        .unwrap();
    let (status, body) = api
        .call(
            Method::POST,
            "/api/v1/runs/r-undo/cancel",
            op,
            Some(cancel),
            Some(&busy),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("still running"),
        "{body}"
    );
}

/// A workflow whose step fails once (a temporary error), parks an item, and says what it does.
fn bumpy() -> Workflow {
    Workflow::new("bumpy", 1).step("work", StepKind::Read, |ctx| async move {
        ctx.progress("reading 3 invoices");
        if ctx.attempt() == 1 {
            return Err(StepError::temporary("the supplier API is busy (429)"));
        }
        ctx.park("inv-2", "the scan is unreadable");
        ctx.progress("2 of 3 invoices read; inv-2 parked");
        Ok(StepOutcome::finish(json!({"read": 2})))
    })
}

fn metric(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_after_a_retry_a_parked_item_and_a_poison_message_and_run_watch_sees_progress()
{
    let api = Api::start(registry_with(bumpy())).await;
    let env = &api.env;
    let scrape = || async {
        let (_, body) = api.call(Method::GET, "/metrics", None, None, None).await;
        body.as_str().unwrap_or_default().to_owned()
    };
    let before = scrape().await;
    env.start_run("bumpy", "r-bumpy", json!({})).await;
    env.wait_status("r-bumpy", RunStatus::Succeeded, WAIT).await;
    let poison = dlq_support::message(
        env.topology().steps_exchange(),
        trailmark::domain::STEP_ROUTING_KEY,
        "poison-m",
        b"\x80\x01".to_vec(),
    );
    env.publish(&poison).await;
    dlq_support::wait_dlq_depth(env, 1).await;

    let moved = |name: &str, before: &str, after: &str| metric(after, name) - metric(before, name);
    let after = scrape().await;
    assert_eq!(
        moved(
            "trailmark_step_retries_total{class=\"temporary\"}",
            &before,
            &after
        ),
        1.0,
        "{after}"
    );
    assert_eq!(
        moved(
            "trailmark_resumes_total{cause=\"redelivery\"}",
            &before,
            &after
        ),
        1.0
    );
    assert_eq!(
        moved(
            "trailmark_dead_lettered_total{reason=\"undecodable\"}",
            &before,
            &after
        ),
        1.0
    );
    assert_eq!(
        moved(
            "trailmark_step_duration_seconds_count{workflow=\"bumpy\",step=\"work\",outcome=\"committed\"}",
            &before,
            &after
        ),
        1.0
    );
    assert!(!after.contains("r-bumpy"), "a run id became a label");
    let parked = trailmark::store::parked::list(&env.pool, "r-bumpy")
        .await
        .unwrap();
    assert_eq!(parked.len(), 1);
    // Finished runs are counted once a minute (unfinished ones every 5 s): refresh at once.
    trailmark::metrics::refresh_once(&env.pool).await.unwrap();
    env.wait_until("the runs gauge to count the run", WAIT, || async {
        metric(
            &scrape().await,
            "trailmark_runs{workflow=\"bumpy\",status=\"succeeded\"}",
        ) == 1.0
    })
    .await;

    // `run watch` of the finished run prints its progress lines, the engine's retry line too.
    let out = env.command(&["run", "watch", "r-bumpy"]).output().unwrap();
    let (stdout, stderr) = common::text(&out);
    assert!(out.status.success(), "{stderr}");
    for line in [
        "reading 3 invoices",
        "failed temporarily, attempt 1 of 5: the supplier API is busy (429)",
        "attempt 2: the previous attempt did not finish",
        "2 of 3 invoices read; inv-2 parked",
        "run r-bumpy is succeeded",
    ] {
        assert!(stdout.contains(line), "{line:?} missing from:\n{stdout}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_stopping_for_review_publishes_exactly_one_event_with_its_error() {
    let api = Api::start(registry_with(fragile())).await;
    let env = &api.env;
    let conn = trailmark::broker::connect(&env.settings.broker, "test-events")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let queue = format!("{}.test-events", env.prefix);
    let opts = lapin::options::QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    ch.queue_declare(queue.as_str().into(), opts, Default::default())
        .await
        .unwrap();
    ch.queue_bind(
        queue.as_str().into(),
        env.topology().events_exchange().into(),
        "run.#".into(),
        Default::default(),
        Default::default(),
    )
    .await
    .unwrap();
    env.start_run("fragile", "r-event", json!({})).await;
    env.wait_status("r-event", RunStatus::NeedsReview, WAIT)
        .await;
    let first = common::eventually("the event", WAIT, || async {
        let got = ch
            .basic_get(queue.as_str().into(), Default::default())
            .await
            .unwrap();
        got.map(|m| (m.delivery.routing_key.to_string(), m.delivery.data.clone()))
    })
    .await;
    let events: Vec<(String, Vec<u8>)> = first.into_iter().collect();
    // Anything else would have been published with the same commit: nothing more comes.
    let more = ch
        .basic_get(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    assert!(more.is_none(), "a second event");
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0, "run.needs_review.fragile");
    let event: trailmark::domain::Event = serde_json::from_slice(&events[0].1).unwrap();
    assert_eq!(event.run_id.as_ref().map(|r| r.as_str()), Some("r-event"));
    assert_eq!(event.step, Some(StepAddress::step("break")));
    assert_eq!(event.error_class.as_deref(), Some("unknown"));
    assert!(event.error.unwrap().contains("answered nonsense"));
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sigterm_readyz_turns_503_before_the_process_stops() {
    let env = TestEnv::with(|s| s.process.drain_delay_ms = 3000).await;
    let port = closed_port();
    let mut serve = common::ChildGuard(Some(
        env.command(&["serve"])
            .env("TRAILMARK__API__LISTEN", format!("127.0.0.1:{port}"))
            .spawn()
            .unwrap(),
    ));
    let http = reqwest::Client::new();
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    env.wait_until("serve to be ready", WAIT, || async {
        matches!(http.get(&readyz).send().await, Ok(r) if r.status() == StatusCode::OK)
    })
    .await;
    serve.signal(libc::SIGTERM);
    let answer = common::eventually("/readyz to answer 503", WAIT, || async {
        let r = http.get(&readyz).send().await.ok()?;
        (r.status() == StatusCode::SERVICE_UNAVAILABLE).then_some(())?;
        r.json::<Value>().await.ok()
    })
    .await
    .expect("/readyz never answered 503 while draining");
    assert!(
        answer["reasons"][0].as_str().unwrap().contains("draining"),
        "{answer}"
    );
    let status = common::wait_exit(&mut serve, Duration::from_secs(30)).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0));
}

/// The value after `marker` on the first line that has it.
fn after<'a>(text: &'a str, marker: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.split_once(marker).map(|(_, v)| v.trim()))
        .unwrap_or_else(|| panic!("no {marker:?} in:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_made_token_opens_the_api_at_its_role_and_a_cli_decision_is_audited_and_watched() {
    let env = TestEnv::new().await;
    let out = env
        .command(&["token", "new", "--name", "carol", "--role", "operator"])
        .output()
        .unwrap();
    let (stdout, stderr) = common::text(&out);
    assert!(out.status.success(), "{stderr}");
    let secret = after(&stdout, "shown once:").to_owned();
    let entry = after(&stdout, "TRAILMARK__API__TOKENS=").to_owned();
    assert!(
        !entry.contains(&secret),
        "the configuration line holds the token itself"
    );
    let port = closed_port();
    let _serve = env.spawn_process_with(
        None,
        &[
            ("TRAILMARK__API__TOKENS", entry),
            ("TRAILMARK__API__LISTEN", format!("127.0.0.1:{port}")),
        ],
    );

    // A run long enough to be cancelled while `run watch` follows it.
    env.command(&[
        "run",
        "start",
        "chain",
        "--run-id",
        "r-long",
        "--input",
        r#"{"steps":100000}"#,
    ])
    .output()
    .unwrap();
    let mut watch = common::ChildGuard(Some(
        env.command(&["run", "watch", "r-long"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    env.wait_status("r-long", RunStatus::Running, WAIT).await;
    let out = env
        .command(&[
            "run",
            "cancel",
            "r-long",
            "--actor",
            "carol",
            "--reason",
            "wrong supplier list",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::text(&out).1);
    let watched = watch.0.take().unwrap().wait_with_output().unwrap();
    let (seen, why) = common::text(&watched);
    assert_eq!(
        watched.status.code(),
        Some(1),
        "watch of a cancelled run: {seen}"
    );
    assert!(why.contains("run r-long is cancelled"), "{why}");
    assert!(
        seen.contains("cancel by carol: wrong supplier list"),
        "{seen}"
    );

    let out = env
        .command(&["audit", "--target", "r-long", "--json"])
        .output()
        .unwrap();
    let entries: Value = serde_json::from_slice(&out.stdout).expect("audit --json");
    let entries = entries.as_array().unwrap();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let e = &entries[0];
    assert_eq!(
        (e["actor"].as_str(), e["via"].as_str(), e["action"].as_str()),
        (Some("carol"), Some("cli"), Some("cancel"))
    );
    assert_eq!(e["reason"], "wrong supplier list");
    assert_eq!(
        (e["status_before"].as_str(), e["status_after"].as_str()),
        (Some("running"), Some("cancelled"))
    );

    // The token works at its role, and only there.
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    env.wait_until("the API to answer", WAIT, || async {
        http.get(format!("{base}/livez")).send().await.is_ok()
    })
    .await;
    let get = |path: &str, token: &str| http.get(format!("{base}{path}")).bearer_auth(token).send();
    let run: Value = get("/api/v1/runs/r-long", &secret)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(run["run"]["status"], "cancelled", "{run}");
    assert_eq!(
        get("/api/v1/audit", &secret).await.unwrap().status(),
        StatusCode::FORBIDDEN
    );
    let wrong = get("/api/v1/runs", "not-the-token").await.unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);

    // `run start --follow` follows a run to its end and exits 0 when it succeeded.
    let out = env
        .command(&[
            "run",
            "start",
            "chain",
            "--run-id",
            "r-short",
            "--input",
            r#"{"steps":3}"#,
            "--follow",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = common::text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("run r-short is succeeded"), "{stdout}");
}

#[test]
fn the_operations_guide_lists_every_endpoint_with_its_role() {
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/OPERATIONS.md"))
        .expect("docs/OPERATIONS.md");
    for e in ENDPOINTS {
        let row = format!("| `{} {}` | {} |", e.method, e.path, e.role.as_str());
        assert!(guide.contains(&row), "docs/OPERATIONS.md has no row {row}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_fork_through_the_api_ends_shadowed_and_its_diff_is_served() {
    let api = Api::start(trailmark_testkit::registry()).await;
    let env = &api.env;
    env.start_run("chain", "r-base", json!({"steps": 4})).await;
    env.wait_status("r-base", RunStatus::Succeeded, WAIT).await;
    let op = Some(api.token(Role::Operator));
    let body = json!({"reason": "eval", "from": 2, "shadow": true, "run_id": "r-shadow"});
    let (status, body_back) = api
        .call(
            Method::POST,
            "/api/v1/runs/r-base/fork",
            op,
            Some(body.clone()),
            None,
        )
        .await;
    assert_eq!(
        status,
        StatusCode::PRECONDITION_REQUIRED,
        "no Idempotency-Key: {body_back}"
    );
    let (status, plan) = api.fork_base(body).await;
    assert_eq!(status, StatusCode::OK, "{plan}");
    assert_eq!(
        (plan["from_seq"].as_i64(), plan["shadow"].as_bool()),
        (Some(2), Some(true))
    );
    env.wait_status("r-shadow", RunStatus::Shadowed, WAIT).await;
    assert_eq!(
        env.chain_ledger("r-shadow").await,
        (0, 0),
        "a shadow run wrote the ledger"
    );

    let viewer = Some(api.token(Role::Viewer));
    let (status, d) = api
        .call(
            Method::GET,
            "/api/v1/runs/r-base/diff/r-shadow",
            viewer,
            None,
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{d}");
    assert_eq!(
        (d["inherited_before"].as_i64(), d["compared"].as_i64()),
        (Some(2), Some(2))
    );
    let (status, _) = api
        .call(
            Method::GET,
            "/api/v1/runs/r-base/diff/nope",
            viewer,
            None,
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let bad = json!({"reason": "eval", "from": "no_such_step"});
    let (status, why) = api.fork_base(bad).await;
    assert_eq!(status, StatusCode::CONFLICT, "{why}");
    assert!(why.to_string().contains("has no step"), "{why}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_without_live_is_a_shadow_and_writes_nothing_outside() {
    let api = Api::start(trailmark_testkit::registry()).await;
    let env = &api.env;
    env.start_run("chain", "r-base", json!({"steps": 4})).await;
    env.wait_status("r-base", RunStatus::Succeeded, WAIT).await;
    let body = json!({"reason": "look again", "from": 1, "run_id": "r-quiet"});
    let (status, plan) = api.fork_base(body).await;
    assert_eq!(status, StatusCode::OK, "{plan}");
    assert_eq!(plan["shadow"].as_bool(), Some(true), "{plan}");
    env.wait_status("r-quiet", RunStatus::Shadowed, WAIT).await;
    assert_eq!(
        env.chain_ledger("r-quiet").await,
        (0, 0),
        "the fork wrote outside"
    );

    let both = json!({"reason": "x", "from": 1, "live": true, "shadow": true});
    let (status, why) = api.fork_base(both).await;
    assert_eq!(
        (status, why["field"].as_str()),
        (StatusCode::BAD_REQUEST, Some("live")),
        "{why}"
    );

    let live = json!({"reason": "redo for real", "from": 1, "run_id": "r-live", "live": true});
    let (status, plan) = api.fork_base(live).await;
    assert_eq!(
        (status, plan["shadow"].as_bool()),
        (StatusCode::OK, Some(false)),
        "{plan}"
    );
    env.wait_status("r-live", RunStatus::Succeeded, WAIT).await;
    assert!(
        env.chain_ledger("r-live").await.0 > 0,
        "a live fork writes outside"
    );
}

/// An error body in the documented shape: `error` and `message` strings, and `field` if asked.
fn assert_documented(what: &str, status: StatusCode, body: &Value, field: Option<&str>) {
    assert!(
        status.is_client_error(),
        "{what}: {status} is not a 4xx: {body}"
    );
    assert!(
        body["error"].is_string() && body["message"].is_string(),
        "{what}: {status} off the documented shape: {body}"
    );
    if let Some(field) = field {
        assert_eq!(body["field"].as_str(), Some(field), "{what}: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_class_of_refusal_is_the_documented_json() {
    let api = Api::start(trailmark_testkit::registry()).await;
    let json_ct = Some("application/json");
    let decide = "/api/v1/runs/r-none/cancel";
    let (s, _, b) = api
        .raw(Method::POST, decide, json_ct, b"{}".to_vec(), &[])
        .await;
    assert_documented("a missing field", s, &b, Some("reason"));
    let (s, _, b) = api
        .raw(Method::POST, decide, json_ct, b"{\"reason\":".to_vec(), &[])
        .await;
    assert_documented("broken JSON", s, &b, None);
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _, b) = api
        .raw(
            Method::POST,
            decide,
            json_ct,
            br#"{"reason": 7}"#.to_vec(),
            &[],
        )
        .await;
    assert_documented("a mistyped field", s, &b, Some("reason"));
    let (s, _, b) = api
        .raw(Method::GET, "/api/v1/runs?limit=abc", None, vec![], &[])
        .await;
    assert_documented("?limit=abc", s, &b, Some("limit"));
    let (s, _, b) = api
        .raw(
            Method::POST,
            decide,
            Some("text/plain"),
            br#"{"reason":"x"}"#.to_vec(),
            &[],
        )
        .await;
    assert_eq!(s, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{b}");
    assert_documented("a wrong content type", s, &b, None);
    // Refused from its announced length, before a byte of it is read.
    let (s, b) = api.announced_body(decide, 2 * 1024 * 1024).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{b}");
    assert_documented("an oversized body", s, &b, None);
    let (s, _, b) = api
        .raw(Method::GET, "/api/v1/nothing-here", None, vec![], &[])
        .await;
    assert_documented("an unknown path", s, &b, None);
    let (s, _, b) = api
        .raw(Method::DELETE, "/api/v1/runs", None, vec![], &[])
        .await;
    assert_documented("a wrong method", s, &b, None);
    let long = json!({"reason": "y".repeat(900 * 1024 / 10)}).to_string();
    let (s, _, b) = api
        .raw(Method::POST, decide, json_ct, long.into_bytes(), &[])
        .await;
    assert_documented("a 90 KB reason", s, &b, Some("reason"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_of_a_missing_run_are_404_and_every_answer_has_security_headers() {
    let api = Api::start(trailmark_testkit::registry()).await;
    let viewer = Some(api.token(Role::Viewer));
    for part in ["steps", "journal", "effects"] {
        let path = format!("/api/v1/runs/r-never/{part}");
        let (status, body) = api.call(Method::GET, &path, viewer, None, None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
        assert!(
            body["message"].as_str().unwrap().contains("r-never"),
            "{body}"
        );
    }
    let (_, headers, _) = api
        .raw(Method::GET, "/api/v1/runs", None, vec![], &[])
        .await;
    let login = api
        .http
        .get(format!("{}/login", api.base))
        .send()
        .await
        .unwrap();
    for (what, h) in [("the API", &headers), ("the console", login.headers())] {
        let csp = h["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("frame-ancestors 'none'"), "{what}: {csp}");
        assert_eq!(h["x-content-type-options"], "nosniff", "{what}");
        assert_eq!(h["cache-control"], "no-store", "{what}");
    }
}

/// ERROR lines of this process's log (each test runs in a process of its own under nextest).
fn error_log() -> std::sync::Arc<std::sync::Mutex<Vec<u8>>> {
    use std::sync::{Arc, Mutex, OnceLock};
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        struct Into(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Into {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let to = log.clone();
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::ERROR)
            .with_ansi(false)
            .with_writer(move || Into(to.clone()))
            .try_init();
        log
    })
    .clone()
}

/// A console session for `token`: its cookie and its CSRF secret.
async fn console_login(api: &Api, token: &str) -> (String, String) {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let resp = http
        .post(format!("{}/login", api.base))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={token}&next=%2F"))
        .send()
        .await
        .unwrap();
    let cookie = resp.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let page = http
        .get(format!("{}/dead-letters", api.base))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let csrf = after(&page, "name=\"csrf\" value=\"")
        .split('"')
        .next()
        .unwrap()
        .to_owned();
    (cookie, csrf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_text_anywhere_is_a_4xx_naming_the_field_never_a_503_or_an_error_log() {
    let log = error_log();
    let api = Api::start(trailmark_testkit::registry()).await;
    let long = "x".repeat(20_000);
    // Percent-encoded as a client sends them: NUL, ESC, a bell, 20 KB, bytes that are not
    // UTF-8, a broken escape.
    let refused: Vec<&str> = vec![
        "a%00b",
        "%1B%5B31m",
        "r%07",
        &long,
        "%FF%FE",
        "%C3%28",
        "bad%zz",
    ];
    // Text that is fine but carries separators: a 404 or 400, never a 5xx.
    let separators = ["a%2Fb%3Fc", "%3F", "%2F%2E%2E"];
    for e in ENDPOINTS {
        let method = Method::from_bytes(e.method.as_bytes()).unwrap();
        let params: Vec<&str> = e.path.split('/').filter(|p| p.starts_with('{')).collect();
        for param in &params {
            for odd in refused.iter().chain(separators.iter()) {
                let mut path = e.path.replace(param, odd);
                for other in &params {
                    path = path.replace(other, "r-none");
                }
                let (s, _, b) = api
                    .raw(
                        method.clone(),
                        &path,
                        Some("application/json"),
                        b"{}".to_vec(),
                        &[],
                    )
                    .await;
                let what = format!("{} {path}", e.method);
                assert_documented(&what, s, &b, None);
                if refused.contains(odd) {
                    let name = param.trim_matches(['{', '}']);
                    assert_eq!(
                        (s, b["field"].as_str()),
                        (StatusCode::BAD_REQUEST, Some(name)),
                        "{what}: {b}"
                    );
                }
            }
        }
        let concrete = e
            .path
            .replace("{run_id}", "r-none")
            .replace("{other}", "r-none")
            .replace("{id}", "none")
            .replace("{name}", "chain");
        if e.method == "GET" {
            for name in [
                "status", "workflow", "cursor", "limit", "after", "scope", "target", "since",
            ] {
                for odd in &refused {
                    let path = format!("{concrete}?{name}={odd}");
                    let (s, _, b) = api.raw(Method::GET, &path, None, vec![], &[]).await;
                    assert_documented(&path, s, &b, Some(name));
                }
            }
        } else {
            let nul = "a\u{0}b".to_owned();
            let big = "y".repeat(100 * 1024);
            for odd in [nul.as_str(), "\u{1b}[31m", "bell\u{7}", big.as_str()] {
                // A run start is fuzzed from a body that would start a run.
                let starts = e.path == "/api/v1/runs";
                let base = if starts {
                    json!({"workflow": "chain", "run_id": "r-fuzz", "input": {}})
                } else {
                    json!({"reason": "fuzz", "from": 1})
                };
                for field in [
                    "reason",
                    "step",
                    "run_id",
                    "answers_from",
                    "reason_code",
                    "workflow",
                ] {
                    let mut body = base.clone();
                    body[field] = json!(odd);
                    let what = format!(
                        "{} {concrete} {field}={:?}",
                        e.method,
                        &odd[..odd.len().min(12)]
                    );
                    let (s, _, b) = api
                        .raw(
                            Method::POST,
                            &concrete,
                            Some("application/json"),
                            body.to_string().into_bytes(),
                            &[],
                        )
                        .await;
                    assert_documented(&what, s, &b, None);
                    assert!(!s.is_success(), "{what}: {s}");
                    if starts && ["run_id", "workflow", "reason"].contains(&field) {
                        assert_eq!(
                            (s, b["field"].as_str()),
                            (StatusCode::BAD_REQUEST, Some(field)),
                            "{what}: {b}"
                        );
                    }
                }
                let body = json!({"reason": "fuzz", "from": 1, "ids": [odd], "input": {"k": odd}});
                let (s, _, b) = api
                    .raw(
                        Method::POST,
                        &concrete,
                        Some("application/json"),
                        body.to_string().into_bytes(),
                        &[],
                    )
                    .await;
                assert_documented(&concrete, s, &b, None);
            }
            let (s, _, b) = api
                .raw(
                    Method::POST,
                    &concrete,
                    Some("application/json"),
                    b"{\"reason\":\"\xff\xfe\"}".to_vec(),
                    &[],
                )
                .await;
            assert_documented("a body that is not UTF-8", s, &b, None);
        }
    }
    // The headers the API reads.
    use reqwest::header::HeaderValue;
    let not_text = HeaderValue::from_bytes(b"caf\xe9").unwrap();
    let tab = HeaderValue::from_static("a\tb");
    let huge = HeaderValue::from_str(&"k".repeat(100 * 1024)).unwrap();
    for name in ["idempotency-key", "x-request-id"] {
        for value in [&not_text, &tab, &huge] {
            let (s, h, b) = api
                .raw(
                    Method::POST,
                    "/api/v1/runs/r-none/cancel",
                    Some("application/json"),
                    br#"{"reason":"x"}"#.to_vec(),
                    &[(name, value.clone())],
                )
                .await;
            assert_documented(name, s, &b, Some(name));
            // A refused request id is not echoed: the answer carries a fresh one.
            let id = h["x-request-id"].to_str().unwrap_or_default();
            assert!(uuid::Uuid::parse_str(id).is_ok(), "{name}: {id:?}");
        }
    }
    let (s, _, b) = api
        .raw(
            Method::GET,
            "/api/v1/runs",
            None,
            vec![],
            &[("authorization", not_text.clone())],
        )
        .await;
    assert_documented("authorization", s, &b, None);

    // The console: its pages and forms answer with their own page, never Postgres's words.
    let (cookie, csrf) = console_login(&api, &api.admin).await;
    let console = |path: String, form: Option<String>| {
        let req = match form {
            Some(f) => api
                .http
                .post(format!("{}{path}", api.base))
                .header("content-type", "application/x-www-form-urlencoded")
                .body(f),
            None => api.http.get(format!("{}{path}", api.base)),
        };
        req.header("cookie", &cookie).send()
    };
    let forms = [
        "/runs/r-none/decide",
        "/runs/r-none/undo",
        "/dead-letters/none/reveal",
        "/dead-letters/act/requeue",
        "/login",
    ];
    for odd in &refused {
        let mut asked = vec![
            (format!("/runs/{odd}"), None),
            (format!("/runs/{odd}/live"), None),
            (format!("/dead-letters/{odd}"), None),
            (format!("/runs?status={odd}"), None),
            (format!("/audit?target={odd}"), None),
            (format!("/login?next={odd}"), None),
        ];
        for form in forms {
            for field in [
                "reason",
                "action",
                "step",
                "scope",
                "ids",
                "reason_code",
                "token",
                "next",
            ] {
                asked.push((
                    form.to_owned(),
                    Some(format!("csrf={csrf}&action=cancel&{field}={odd}")),
                ));
            }
        }
        for (path, form) in asked {
            let resp = console(path.clone(), form.clone()).await.unwrap();
            let status = resp.status();
            let page = resp.text().await.unwrap();
            assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {form:?}: {page}");
            assert!(
                page.contains("<html"),
                "{path}: not the console's page: {page}"
            );
            assert!(!page.to_lowercase().contains("postgres"), "{path}: {page}");
        }
    }
    let log = String::from_utf8_lossy(&log.lock().unwrap()).into_owned();
    assert!(!log.contains("ERROR"), "the log has errors:\n{log}");
    let runs: i64 = sqlx::query_scalar("SELECT count(*) FROM trailmark.runs")
        .fetch_one(&api.env.pool)
        .await
        .unwrap();
    assert_eq!(runs, 0, "odd text started a run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_page_of_an_unknown_dead_letter_is_404() {
    let api = Api::start(trailmark_testkit::registry()).await;
    let (cookie, _) = console_login(&api, &api.viewer).await;
    let resp = api
        .http
        .get(format!("{}/dead-letters/no-such-letter", api.base))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let page = resp.text().await.unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND, "{page}");
    assert!(page.contains("no-such-letter"), "{page}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_children_of_a_run_are_listed_by_parent_and_its_page_counts_them_by_state() {
    let api = Api::start(trailmark_testkit::registry()).await;
    let env = &api.env;
    let input =
        json!({"steps": 2, "children": {"at": 0, "count": 3, "steps": 2, "first": 2, "slow": [2]}});
    env.start_run("chain", "fam", input).await;
    env.wait_status("fam", RunStatus::Succeeded, WAIT).await;
    let viewer = Some(api.token(Role::Viewer));
    let api = &api;
    let get = |path: String| async move { api.call(Method::GET, &path, viewer, None, None).await };
    let (status, page) = get("/api/v1/runs?parent=fam&limit=2".into()).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let mut listed: Vec<String> = page["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            assert_eq!(r["parent_run_id"], "fam", "{r}");
            r["run_id"].as_str().unwrap().to_owned()
        })
        .collect();
    let cursor = page["next_cursor"]
        .as_str()
        .expect("a second page")
        .to_owned();
    let (status, rest) = get(format!("/api/v1/runs?parent=fam&limit=2&cursor={cursor}")).await;
    assert_eq!(status, StatusCode::OK, "{rest}");
    listed.extend(
        rest["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["run_id"].as_str().unwrap().to_owned()),
    );
    listed.sort();
    assert_eq!(listed, ["fam:0:0", "fam:0:1", "fam:0:2"]);
    let (_, none) = get("/api/v1/runs?parent=fam:0:0".into()).await;
    assert_eq!(
        none["runs"],
        json!([]),
        "a child with no children of its own"
    );
    let (status, run) = get("/api/v1/runs/fam".into()).await;
    assert_eq!(status, StatusCode::OK, "{run}");
    let family = &run["family"];
    assert_eq!(family["parent"], Value::Null, "{family}");
    let fan = &family["fan_outs"][0];
    assert_eq!(
        (fan["seq"].as_i64(), fan["join"].as_str()),
        (Some(0), Some("first 2")),
        "{fan}"
    );
    assert!(fan["joined_at"].is_string(), "{fan}");
    assert_eq!(
        fan["children"],
        json!({"total": 3, "pending": 0, "running": 0, "succeeded": 2, "failed": 1, "skipped": 0}),
        "the slow child was cancelled by the join: {fan}"
    );
    let (_, child) = get("/api/v1/runs/fam:0:2".into()).await;
    assert_eq!(child["family"]["parent"], "fam", "{child}");
    assert_eq!(child["run"]["status"], "cancelled", "{child}");
}
