//! One run is one trace, across a kill -9 and across a fan-out: `trailmark serve` exports its
//! spans with OTLP/HTTP to a small receiver in this test. Killed by SIGKILL inside a step, a
//! process loses the span of the attempt it was running; the process that takes the lease over
//! records that attempt from what Postgres knows (reconstructed, status error) beside its own.
//! A parent's children continue the parent's trace.

mod common;

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use common::{TestEnv, eventually};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use prost::Message;
use serde_json::json;
use trailmark::broker::{Outgoing, map_to_headers};
use trailmark::domain::{RunId, RunStartEvent, RunStatus};

const WAIT: Duration = Duration::from_secs(90);
/// The caller's context: the run's trace must continue this trace id, under this span.
const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// One received span, flattened: ids in hex, attributes as strings.
#[derive(Debug, Clone)]
struct Got {
    trace: String,
    id: String,
    parent: String,
    name: String,
    attrs: HashMap<String, String>,
    /// The status code (2: error) and message.
    status: (i32, String),
    /// Start and end, nanoseconds since the epoch.
    times: (u64, u64),
}

impl Got {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attrs.get(key).map(String::as_str)
    }
}

/// An OTLP/HTTP (protobuf) trace receiver on a free port; returns its base URL and what it got.
async fn receiver() -> (String, Arc<Mutex<Vec<Got>>>) {
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = got.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let sink = sink.clone();
            async move {
                let request = ExportTraceServiceRequest::decode(body).expect("an OTLP request");
                let spans = request
                    .resource_spans
                    .into_iter()
                    .flat_map(|r| r.scope_spans)
                    .flat_map(|s| s.spans);
                sink.lock().unwrap().extend(spans.map(|s| {
                    Got {
                        trace: hex::encode(&s.trace_id),
                        id: hex::encode(&s.span_id),
                        parent: hex::encode(&s.parent_span_id),
                        name: s.name,
                        status: s
                            .status
                            .map_or((0, String::new()), |st| (st.code, st.message)),
                        times: (s.start_time_unix_nano, s.end_time_unix_nano),
                        attrs: s
                            .attributes
                            .into_iter()
                            .map(|kv| (kv.key, shown(kv.value.and_then(|v| v.value))))
                            .collect(),
                    }
                }));
                // An empty ExportTraceServiceResponse: everything accepted.
                (
                    [("content-type", "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, got)
}

fn shown(value: Option<Any>) -> String {
    match value {
        Some(Any::StringValue(s)) => s,
        Some(Any::IntValue(n)) => n.to_string(),
        Some(Any::DoubleValue(d)) => d.to_string(),
        Some(Any::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

/// The step attempt spans received for `run`, keyed by (position, attempt).
fn attempts(got: &[Got], run: &str) -> HashMap<(i64, i64), Got> {
    got.iter()
        .filter(|s| s.name.starts_with("step ") && s.attr("trailmark.run.id") == Some(run))
        .map(|s| {
            let at = |k| s.attr(k).and_then(|v| v.parse().ok()).unwrap_or(-1);
            (
                (at("trailmark.step.position"), at("trailmark.step.attempt")),
                s.clone(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_killed_mid_step_is_one_trace_with_its_restarted_attempt_under_the_run() {
    let env = TestEnv::new().await;
    let (url, got) = receiver().await;
    let run = "r-traced";
    let tracing = [
        ("TRAILMARK__TRACING__OTLP_ENDPOINT", url.clone()),
        ("TRAILMARK__TRACING__EXPORT_INTERVAL_MS", "50".to_owned()),
    ];
    // Killed on the third outside write: inside link 2, after its model answer was journaled
    // and its write made, before the write's result was recorded.
    let mut first = env.spawn_process_with(Some("effect.after_call=kill@3"), &tracing);
    // Each link sleeps first, so the links before the kill end (and are exported) well before it.
    let event = RunStartEvent::new(
        RunId::parse(run).unwrap(),
        "chain",
        json!({"steps": 5, "step_delay_ms": 300}),
    );
    let mut start: Outgoing = env.topology().run_start(&event);
    let traceparent = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    start.headers = map_to_headers(&[("traceparent".to_owned(), traceparent)].into());
    env.publish(&start).await;
    let status = tokio::task::spawn_blocking(move || first.wait())
        .await
        .unwrap();
    assert_eq!(
        status.signal(),
        Some(9),
        "the failpoint should have killed the process: {status:?}"
    );
    assert_eq!(env.steps_done(run).await, 2, "killed inside link 2");

    let _second = env.spawn_process_with(None, &tracing);
    env.wait_status(run, RunStatus::Succeeded, WAIT).await;
    assert_eq!(
        env.attempts(run, 2).await,
        2,
        "the interrupted link ran again"
    );
    // The spans of the last links are exported within the interval after they end.
    let spans = eventually("the last link's span", WAIT, || {
        let got = got.lock().unwrap().clone();
        async move { attempts(&got, run).contains_key(&(4, 1)).then_some(got) }
    })
    .await
    .expect("spans of the run");

    // One trace: the caller's, for every span of the run.
    // (The receiver is this test's: every span it got is of this run.)
    let ours: Vec<&Got> = spans.iter().collect();
    let traces: std::collections::BTreeSet<&str> = ours.iter().map(|s| s.trace.as_str()).collect();
    assert_eq!(
        traces.into_iter().collect::<Vec<_>>(),
        [CALLER_TRACE],
        "one trace id, the caller's"
    );

    // The run's span is the caller's child; every step attempt is the run span's child.
    let run_span = ours
        .iter()
        .find(|s| s.name == "run chain")
        .expect("the run span (exported by the first process before the kill)");
    assert_eq!(run_span.parent, CALLER_SPAN);
    let steps = attempts(&spans, run);
    for key in [(0, 1), (1, 1), (2, 1), (2, 2), (3, 1), (4, 1)] {
        let step = steps.get(&key).unwrap_or_else(|| {
            panic!(
                "no span for link (position, attempt) {key:?}: {:?}",
                steps.keys()
            )
        });
        assert_eq!(
            step.parent, run_span.id,
            "link {key:?} is a child of the run span"
        );
        assert_eq!(step.attr("trailmark.step"), Some("link"));
        assert!(
            step.attr("trailmark.fence")
                .is_some_and(|f| f.parse::<i64>().unwrap() > 0)
        );
    }
    // The interrupted attempt's own span died with the process; the attempt that took its
    // lease over recorded it from the step row: from the step's first claim to the takeover,
    // an error, one fence below its own. The restarted attempt is an ordinary span.
    let (lost, again) = (&steps[&(2, 1)], &steps[&(2, 2)]);
    assert_eq!(
        lost.status.0, 2,
        "the interrupted attempt is an error: {lost:?}"
    );
    assert!(lost.status.1.starts_with("attempt interrupted"), "{lost:?}");
    assert_eq!(lost.attr("trailmark.step.reconstructed"), Some("true"));
    assert_eq!(lost.attr("trailmark.step.outcome"), Some("interrupted"));
    let fence = |s: &Got| s.attr("trailmark.fence").unwrap().parse::<i64>().unwrap();
    assert_eq!(fence(lost) + 1, fence(again));
    assert!(
        lost.times.0 < lost.times.1 && lost.times.1 <= again.times.0 + 1_000_000_000,
        "the interrupted attempt lies before the restarted one: {:?} {:?}",
        lost.times,
        again.times
    );
    assert!(
        steps[&(1, 1)].times.0 <= lost.times.0,
        "it began after link 1 began"
    );
    assert_ne!(
        again.status.0, 2,
        "the restarted attempt ended well: {again:?}"
    );
    assert_eq!(again.attr("trailmark.step.outcome"), Some("committed"));

    // Children: a model call and an outside write under each attempt that made them.
    let children = |step: &Got, prefix: &str| -> Vec<Got> {
        spans
            .iter()
            .filter(|s| s.parent == step.id && s.name.starts_with(prefix))
            .cloned()
            .collect()
    };
    for key in [(0, 1), (1, 1), (3, 1), (4, 1)] {
        let step = &steps[&key];
        let chats = children(step, "chat ");
        assert_eq!(chats.len(), 1, "one model call span under link {key:?}");
        assert_eq!(chats[0].attr("gen_ai.operation.name"), Some("chat"));
        assert!(chats[0].attr("gen_ai.usage.input_tokens").is_some());
        assert!(chats[0].attr("gen_ai.usage.output_tokens").is_some());
        assert!(chats[0].attr("trailmark.gen_ai.cost").is_some());
        let writes = children(step, "effect ");
        assert_eq!(writes.len(), 1, "one outside write span under link {key:?}");
        assert_eq!(
            writes[0].attr("trailmark.effect.key"),
            Some(format!("{run}:link:{}", key.0).as_str())
        );
        assert_eq!(writes[0].attr("trailmark.effect.outcome"), Some("called"));
        assert_eq!(step.attr("trailmark.model.journaled_answers"), Some("0"));
    }
    // The restarted attempt read its model answer from the journal (no model span, counted on
    // the step span) and made its write again under the same key, its outcome unknown.
    let again = &steps[&(2, 2)];
    assert!(
        children(again, "chat ").is_empty(),
        "a journaled answer makes no span"
    );
    assert_eq!(again.attr("trailmark.model.journaled_answers"), Some("1"));
    let writes = children(again, "effect ");
    assert_eq!(writes.len(), 1);
    assert_eq!(
        writes[0].attr("trailmark.effect.key"),
        Some(format!("{run}:link:2").as_str())
    );
    assert_eq!(
        writes[0].attr("trailmark.effect.outcome"),
        Some("called_again")
    );

    // The run's context (its span, in the caller's trace) is stored on its row for re-queues.
    let stored: Option<String> =
        sqlx::query_scalar("SELECT traceparent FROM trailmark.runs WHERE run_id = $1")
            .bind(run)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(
        stored,
        Some(format!("00-{CALLER_TRACE}-{}-01", run_span.id))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parents_children_continue_its_trace_under_its_run_span() {
    let env = TestEnv::new().await;
    let (url, got) = receiver().await;
    let run = "r-fan";
    let tracing = [
        ("TRAILMARK__TRACING__OTLP_ENDPOINT", url.clone()),
        ("TRAILMARK__TRACING__EXPORT_INTERVAL_MS", "50".to_owned()),
    ];
    let _process = env.spawn_process_with(None, &tracing);
    // No caller context: the parent begins a new trace, its children continue it.
    let event = RunStartEvent::new(
        RunId::parse(run).unwrap(),
        "chain",
        json!({"steps": 2, "children": {"at": 0, "count": 2, "steps": 1}}),
    );
    env.publish(&env.topology().run_start(&event)).await;
    env.wait_status(run, RunStatus::Succeeded, WAIT).await;
    let kids = [format!("{run}:0:0"), format!("{run}:0:1")];
    for kid in &kids {
        env.wait_status(kid, RunStatus::Succeeded, WAIT).await;
    }
    let spans = eventually("the spans of the parent and both children", WAIT, || {
        let got = got.lock().unwrap().clone();
        let kids = kids.clone();
        async move {
            let all = attempts(&got, run).contains_key(&(1, 1))
                && kids.iter().all(|k| attempts(&got, k).contains_key(&(0, 1)));
            all.then_some(got)
        }
    })
    .await
    .expect("spans of the fan-out");

    let run_span = |id: &str| -> Got {
        spans
            .iter()
            .find(|s| s.name == "run chain" && s.attr("trailmark.run.id") == Some(id))
            .unwrap_or_else(|| panic!("no run span for {id}"))
            .clone()
    };
    let parent = run_span(run);
    assert_eq!(parent.parent, "", "the parent begins its own trace");
    let traces: std::collections::BTreeSet<&str> = spans.iter().map(|s| s.trace.as_str()).collect();
    assert_eq!(
        traces.into_iter().collect::<Vec<_>>(),
        [parent.trace.as_str()],
        "one trace id for the parent and its children"
    );
    for kid in &kids {
        let child = run_span(kid);
        assert_eq!(
            child.parent, parent.id,
            "{kid}'s run span is under the parent's"
        );
        let step = &attempts(&spans, kid)[&(0, 1)];
        assert_eq!(
            step.parent, child.id,
            "{kid}'s step is under its own run span"
        );
        let stored: Option<String> =
            sqlx::query_scalar("SELECT traceparent FROM trailmark.runs WHERE run_id = $1")
                .bind(kid)
                .fetch_one(&env.pool)
                .await
                .unwrap();
        assert_eq!(stored, Some(format!("00-{}-{}-01", parent.trace, child.id)));
    }
    for key in [(0, 1), (1, 1)] {
        assert_eq!(attempts(&spans, run)[&key].parent, parent.id);
    }
}

#[test]
fn the_api_document_names_the_optional_traceparent_header_of_a_run_start() {
    let doc = trailmark::api::document();
    let params = doc["paths"]["/api/v1/runs"]["post"]["parameters"]
        .as_array()
        .expect("parameters of POST /api/v1/runs");
    let header = params
        .iter()
        .find(|p| p["name"] == "traceparent")
        .expect("the traceparent parameter");
    assert_eq!(header["in"], "header");
    assert_eq!(header["required"], false);
}
