//! The OpenAPI document against the API's real answers: every endpoint is called (as the
//! role-matrix test calls them) for its answer and for the refusals the door, the middleware and
//! the handler make, and every answer's status is one its operation lists, with a schema its
//! body validates against (`$ref`s resolved into the document's components).

mod api_support;
mod common;
mod dlq_support;

use api_support::{Api, WAIT, fragile, registry_with};
use reqwest::header::{HeaderMap, HeaderValue};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use trailmark::api::{ENDPOINTS, Endpoint, Role};
use trailmark::domain::RunStatus;

/// The document, and every answer checked against it.
struct Checked {
    doc: Value,
    /// `METHOD path status` of every answer checked.
    seen: Vec<String>,
}

impl Checked {
    /// Fails unless `status` is listed for `e` with the answer's content type, and the body
    /// validates against that response's schema.
    fn check(&mut self, e: &Endpoint, status: StatusCode, headers: &HeaderMap, body: &Value) {
        let what = format!("{} {} answered {status}", e.method, e.path);
        let op = &self.doc["paths"][e.path][e.method.to_ascii_lowercase()];
        let response = &op["responses"][status.as_str()];
        assert!(
            response.is_object(),
            "{what}, which the document does not list: {body}"
        );
        let content_type = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .unwrap_or_default();
        let media = &response["content"][content_type];
        assert!(
            media.is_object(),
            "{what} as {content_type:?}, which the document does not list: {response}"
        );
        let instances: Vec<Value> = match content_type {
            "application/json" => vec![body.clone()],
            // JSON lines: each line is one object (one line alone was read as JSON already).
            _ => match body {
                Value::String(text) => text
                    .lines()
                    .map(|l| serde_json::from_str(l).expect("a JSON line"))
                    .collect(),
                one => vec![one.clone()],
            },
        };
        let schema = match content_type {
            "application/json" => media["schema"].clone(),
            _ => json!({ "type": "object" }),
        };
        for instance in &instances {
            let errors = violations(&self.doc, &schema, instance);
            assert!(
                errors.is_empty(),
                "{what}: the body does not fit the documented schema: {errors:?}\n{instance}"
            );
        }
        self.seen
            .push(format!("{} {} {}", e.method, e.path, status.as_u16()));
    }
}

/// How `instance` departs from `schema`, a schema of the document `doc` (its `$ref`s resolved
/// into the document's components); empty when it fits.
fn violations(doc: &Value, schema: &Value, instance: &Value) -> Vec<String> {
    let mut schema = schema.clone();
    schema["$schema"] = json!("https://json-schema.org/draft/2020-12/schema");
    schema["components"] = doc["components"].clone();
    let validator = jsonschema::Validator::new(&schema)
        .unwrap_or_else(|e| panic!("the documented schema does not compile: {e}: {schema}"));
    validator
        .iter_errors(instance)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect()
}

#[test]
fn the_check_finds_a_body_off_its_schema_through_the_refs() {
    let doc = trailmark::api::document();
    let started = json!({ "$ref": "#/components/schemas/StartedRun" });
    let fits = json!({
        "run_id": "r-1", "workflow": "chain", "workflow_version": 1, "status": "running",
        "step": "link", "created": true, "created_at": "2026-12-03T10:00:00Z",
        "links": {"run": "/api/v1/runs/r-1", "steps": "s", "journal": "j", "effects": "e"},
    });
    assert_eq!(violations(&doc, &started, &fits), Vec::<String>::new());
    let mut off = fits.clone();
    off["status"] = json!("sleeping");
    assert!(
        !violations(&doc, &started, &off).is_empty(),
        "an unknown status fits"
    );
    off = fits.clone();
    off["links"].as_object_mut().unwrap().remove("run");
    assert!(
        !violations(&doc, &started, &off).is_empty(),
        "a missing link fits"
    );
    let error = json!({ "$ref": "#/components/schemas/ErrorBody" });
    assert!(
        violations(
            &doc,
            &error,
            &json!({"error": "x", "message": "y", "field": "run_id"})
        )
        .is_empty()
    );
    assert!(
        !violations(&doc, &error, &json!({"message": "y"})).is_empty(),
        "an error without its code fits"
    );
}

/// A request as a client makes it; `None` token: no Authorization header at all.
struct Ask<'a> {
    path: String,
    token: Option<&'a str>,
    content_type: Option<&'a str>,
    body: Vec<u8>,
    key: Option<String>,
}

impl<'a> Ask<'a> {
    fn to(path: &str, token: Option<&'a str>) -> Self {
        Self {
            path: path.to_owned(),
            token,
            content_type: None,
            body: Vec::new(),
            key: None,
        }
    }

    fn json(mut self, body: &Value) -> Self {
        self.content_type = Some("application/json");
        self.body = body.to_string().into_bytes();
        self
    }

    fn keyed(mut self) -> Self {
        self.key = Some(uuid::Uuid::new_v4().to_string());
        self
    }
}

/// Sends `ask` to `e`, checks the answer against the document, returns its status and body.
async fn probe(api: &Api, doc: &mut Checked, e: &Endpoint, ask: Ask<'_>) -> (StatusCode, Value) {
    let method = Method::from_bytes(e.method.as_bytes()).unwrap();
    let auth = HeaderValue::from_str(&match ask.token {
        Some(t) => format!("Bearer {t}"),
        None => String::new(),
    })
    .unwrap();
    let mut headers = vec![("authorization", auth)];
    if let Some(k) = &ask.key {
        headers.push(("idempotency-key", HeaderValue::from_str(k).unwrap()));
    }
    let (status, answer_headers, body) = api
        .raw(method, &ask.path, ask.content_type, ask.body, &headers)
        .await;
    doc.check(e, status, &answer_headers, &body);
    (status, body)
}

/// The path of `e` with its parameters filled in.
fn concrete(e: &Endpoint, run: &str) -> String {
    e.path
        .replace("{run_id}", run)
        .replace("{other}", "r-ok")
        .replace("{id}", "poison-1")
        .replace("{name}", "chain")
        .replace("{workflow}", "chain")
}

/// The run each decision is tried on, and the body of the call that should go through.
fn happy_post(e: &Endpoint) -> (&'static str, Value) {
    let path = e.path;
    match path.rsplit('/').next().unwrap() {
        "runs" => (
            "",
            json!({"workflow": "chain", "run_id": "r-new", "input": {"steps": 1}}),
        ),
        "resume" => ("r-review", json!({"reason": "try again"})),
        "undo" => ("r-undo", json!({"reason": "posted twice"})),
        "cancel" => ("r-cancel", json!({"reason": "give up"})),
        // No run waits at a human step here: a 409 naming the status.
        "approve" | "reject" => ("r-ok", json!({"reason": "looked", "step": "link"})),
        "fork" => (
            "r-ok",
            json!({"reason": "eval", "from": 1, "run_id": "r-fork"}),
        ),
        "reveal" => ("", json!({"reason": "look"})),
        // The schedule `chain` ({name} of every schedule path), created first in ENDPOINTS.
        "schedules" => (
            "",
            json!({"name": "chain", "workflow": "chain", "every": "1h", "input": {"steps": 1}, "reason": "hourly"}),
        ),
        "pause" | "trigger" | "delete" => ("", json!({"reason": "looked"})),
        "backfill" => (
            "",
            json!({"reason": "missed", "from": "2026-01-01T00:00:00Z", "to": "2026-01-01T02:00:00Z"}),
        ),
        "events" => (
            "",
            json!({"name": "supplier.reply", "key": "r-ok", "id": "evt-1", "payload": {"price": 41.5}}),
        ),
        "requeue" | "purge" => (
            "",
            json!({"reason": "count", "reason_code": "undecodable", "preview": true}),
        ),
        "{workflow}" => (
            "",
            json!({"key": "tenant-1", "concurrency": 3, "reason": "a burst"}),
        ),
        // No run of chain is at v0: an empty plan.
        "move" => (
            "",
            json!({"reason": "retire v0", "from": 0, "to": 1, "preview": true}),
        ),
        other => panic!("no body for POST {other}: add one to happy_post"),
    }
}

/// Statuses every operation must have been seen answering.
fn expected(e: &Endpoint) -> Vec<u16> {
    let mut statuses = vec![400, 401];
    if e.role > Role::Viewer {
        statuses.push(403);
    }
    if e.method == "POST" {
        statuses.extend([413, 415, 422]);
    }
    if e.keyed {
        statuses.push(428);
    }
    statuses
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_of_every_endpoint_is_documented_and_fits_its_schema() {
    let api = Api::start_with(registry_with(fragile()), |s| {
        s.api.body_limit_bytes = 16 * 1024;
        s.worker.max_message_bytes = 4096;
    })
    .await;
    let env = &api.env;
    for (workflow, run, status) in [
        ("chain", "r-ok", RunStatus::Succeeded),
        ("chain", "r-undo", RunStatus::Succeeded),
        ("fragile", "r-review", RunStatus::NeedsReview),
        ("fragile", "r-cancel", RunStatus::NeedsReview),
    ] {
        env.start_run(workflow, run, json!({"steps": 2})).await;
        env.wait_status(run, status, WAIT).await;
    }
    let poison = dlq_support::message(
        env.topology().steps_exchange(),
        trailmark::domain::STEP_ROUTING_KEY,
        "poison-1",
        b"{not json".to_vec(),
    );
    env.publish(&poison).await;
    dlq_support::wait_dlq_depth(env, 1).await;

    let viewer = Some(api.token(Role::Viewer));
    let (status, doc) = api
        .call(Method::GET, "/api/v1/openapi.json", viewer, None, None)
        .await;
    assert_eq!(status, StatusCode::OK, "{doc}");
    let mut doc = Checked { doc, seen: vec![] };

    // Mutations first, so that the reads after them show decisions, forks and audit rows.
    let (posts, gets): (Vec<&Endpoint>, Vec<&Endpoint>) =
        ENDPOINTS.iter().partition(|e| e.method == "POST");
    for e in posts {
        let token = Some(api.token(e.role));
        let (run, body) = happy_post(e);
        let path = concrete(e, run);
        if e.keyed {
            // Without a key, and not a preview: 428.
            let mut unkeyed = body.clone();
            unkeyed.as_object_mut().unwrap().remove("preview");
            let ask = Ask::to(&path, token).json(&unkeyed);
            let (status, _) = probe(&api, &mut doc, e, ask).await;
            assert_eq!(status, StatusCode::PRECONDITION_REQUIRED, "POST {path}");
        }
        let (status, answer) =
            probe(&api, &mut doc, e, Ask::to(&path, token).json(&body).keyed()).await;
        assert!(
            status.is_success() || status == StatusCode::CONFLICT,
            "POST {path}: {status} {answer}"
        );
        posts_refused(&api, &mut doc, e, &path).await;
    }
    starts_refused(&api, &mut doc).await;
    debounced_starts(&api, &mut doc).await;
    events_refused(&api, &mut doc).await;
    for e in gets {
        let token = Some(api.token(e.role));
        for run in ["r-ok", "r-review"] {
            probe(&api, &mut doc, e, Ask::to(&concrete(e, run), token)).await;
        }
        let odd = format!("{}?x=%00", concrete(e, "r-ok"));
        let (status, _) = probe(&api, &mut doc, e, Ask::to(&odd, token)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "GET {odd}");
        refused_at_the_door(&api, &mut doc, e, &concrete(e, "r-ok")).await;
        if e.path.contains("{run_id}") {
            let (status, _) =
                probe(&api, &mut doc, e, Ask::to(&concrete(e, "r-none"), token)).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "GET {}", e.path);
        }
    }

    for e in ENDPOINTS {
        for status in expected(e) {
            let seen = format!("{} {} {status}", e.method, e.path);
            assert!(
                doc.seen.contains(&seen),
                "never saw {seen}; the test must ask for it"
            );
        }
    }
}

/// 401 without a token, 403 below the endpoint's role.
async fn refused_at_the_door(api: &Api, doc: &mut Checked, e: &Endpoint, path: &str) {
    let (status, _) = probe(api, doc, e, Ask::to(path, None)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{} {path}", e.method);
    if e.role > Role::Viewer {
        let ask = Ask::to(path, Some(api.token(Role::Viewer))).json(&json!({"reason": "x"}));
        let (status, _) = probe(api, doc, e, ask).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{} {path}", e.method);
    }
}

/// What every POST refuses: a body that does not fit, not JSON, too large, a reused key.
async fn posts_refused(api: &Api, doc: &mut Checked, e: &Endpoint, path: &str) {
    let token = Some(api.token(e.role));
    refused_at_the_door(api, doc, e, path).await;
    let odd = Ask::to(path, token).json(&json!({"no_such_field": 1}));
    let (status, _) = probe(api, doc, e, odd).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "POST {path}");
    let mut text = Ask::to(path, token).json(&json!({"reason": "x"}));
    text.content_type = Some("text/plain");
    let (status, _) = probe(api, doc, e, text).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "POST {path}");
    let big = Ask::to(path, token).json(&json!({"reason": "y".repeat(20 * 1024)}));
    let (status, _) = probe(api, doc, e, big).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "POST {path}");
    let first = Ask::to(path, token)
        .json(&json!({"no_such_field": 1}))
        .keyed();
    let key = first.key.clone();
    probe(api, doc, e, first).await;
    let mut other = Ask::to(path, token).json(&json!({"no_such_field": 2}));
    other.key = key;
    let (status, _) = probe(api, doc, e, other).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "POST {path}");
}

/// The refusals of a run start: the same start again, another input, an unknown workflow, an
/// input the workflow refuses, an event over the message limit.
async fn starts_refused(api: &Api, doc: &mut Checked) {
    let e = ENDPOINTS
        .iter()
        .find(|e| e.method == "POST" && e.path == "/api/v1/runs")
        .unwrap();
    let token = Some(api.token(Role::Operator));
    let start = |workflow: &str, input: Value| {
        let body = json!({"workflow": workflow, "run_id": "r-new", "input": input});
        Ask::to(e.path, token).json(&body)
    };
    for (ask, expected) in [
        (start("chain", json!({"steps": 1})), StatusCode::OK),
        (start("chain", json!({"steps": 2})), StatusCode::CONFLICT),
        (start("nope", json!({})), StatusCode::UNPROCESSABLE_ENTITY),
        (
            start("chain", json!({"steps": "many"})),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            start("chain", json!({"blob": "z".repeat(8 * 1024)})),
            StatusCode::PAYLOAD_TOO_LARGE,
        ),
    ] {
        let (status, body) = probe(api, doc, e, ask).await;
        assert_eq!(status, expected, "{body}");
    }
}

/// Starts of a debounced workflow: held (202), the superseded start again (202), another input
/// under its id (409), a missing key (422), and the superseded start read as a run (404).
async fn debounced_starts(api: &Api, doc: &mut Checked) {
    let find = |method: &str, path: &str| {
        ENDPOINTS
            .iter()
            .find(|e| e.method == method && e.path == path)
            .unwrap()
    };
    let e = find("POST", "/api/v1/runs");
    let token = Some(api.token(Role::Operator));
    let start = |run_id: &str, input: Value| {
        let body = json!({"workflow": "debounced", "run_id": run_id, "input": input});
        Ask::to(e.path, token).json(&body)
    };
    for (ask, expected) in [
        (start("d-1", json!({"key": "k"})), StatusCode::ACCEPTED),
        (start("d-2", json!({"key": "k"})), StatusCode::ACCEPTED),
        (start("d-1", json!({"key": "k"})), StatusCode::ACCEPTED),
        (
            start("d-1", json!({"key": "k", "n": 1})),
            StatusCode::CONFLICT,
        ),
        (start("d-3", json!({})), StatusCode::UNPROCESSABLE_ENTITY),
    ] {
        let (status, body) = probe(api, doc, e, ask).await;
        assert_eq!(status, expected, "{body}");
    }
    let show = find("GET", "/api/v1/runs/{run_id}");
    let ask = Ask::to("/api/v1/runs/d-1", Some(api.token(Role::Viewer)));
    let (status, body) = probe(api, doc, show, ask).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
}

/// The refusals of an event: the same event again (a duplicate, 200), its id with another
/// payload (409), a bad field (400 naming it), an event over the message limit (400).
async fn events_refused(api: &Api, doc: &mut Checked) {
    let e = ENDPOINTS
        .iter()
        .find(|e| e.method == "POST" && e.path == "/api/v1/events")
        .unwrap();
    let token = Some(api.token(Role::Operator));
    let event = |name: &str, key: &str, payload: Value| {
        let body = json!({"name": name, "key": key, "id": "evt-1", "payload": payload});
        Ask::to(e.path, token).json(&body)
    };
    for (ask, expected, field) in [
        (
            event("supplier.reply", "r-ok", json!({"price": 41.5})),
            StatusCode::OK,
            None,
        ),
        (
            event("supplier.reply", "r-ok", json!({"price": 40})),
            StatusCode::CONFLICT,
            Some("id"),
        ),
        (
            event("", "r-ok", json!({})),
            StatusCode::BAD_REQUEST,
            Some("name"),
        ),
        (
            event("supplier.reply", "", json!({})),
            StatusCode::BAD_REQUEST,
            Some("key"),
        ),
        (
            event(
                "supplier.reply",
                "r-ok",
                json!({"blob": "z".repeat(8 * 1024)}),
            ),
            StatusCode::BAD_REQUEST,
            Some("payload"),
        ),
    ] {
        let (status, body) = probe(api, doc, e, ask).await;
        assert_eq!(status, expected, "{body}");
        if let Some(field) = field {
            assert_eq!(body["field"], field, "{body}");
        } else {
            assert_eq!(body["outcome"], "duplicate", "{body}");
        }
    }
}
