//! Every API endpoint in one table (method, path, the role it needs, whether it needs an
//! `Idempotency-Key`), and the OpenAPI 3.1 document (`/api/v1/openapi.json`), generated with
//! utoipa from the handlers' `#[utoipa::path]` declarations and their request and response types.
//! The table adds what the middleware in front of every handler does: the role and the bearer
//! scheme, the Idempotency-Key header, and the refusals of the door (400 for odd text, 401, 403,
//! 413, 415, the key's 409 and 422, 500, 504), each with the one error shape [`ErrorBody`]. The
//! router is checked against the table and the table against the document, and the role-matrix
//! and schema tests call each endpoint.

use serde_json::{Value, json};
use utoipa::OpenApi;

use super::auth::Role;
use super::error::ErrorBody;
use super::{admin, decisions, dlq, events, limits, runs, schedules, start, versions};

/// One endpoint.
#[derive(Debug, Clone, Copy)]
pub struct Endpoint {
    /// `GET` or `POST`.
    pub method: &'static str,
    /// The path, with `{parameters}`.
    pub path: &'static str,
    /// The lowest role that may call it.
    pub role: Role,
    /// What it does.
    pub summary: &'static str,
    /// Whether it needs an `Idempotency-Key` (bulk actions).
    pub keyed: bool,
}

const fn get(path: &'static str, role: Role, summary: &'static str) -> Endpoint {
    Endpoint {
        method: "GET",
        path,
        role,
        summary,
        keyed: false,
    }
}

const fn post(path: &'static str, role: Role, summary: &'static str, keyed: bool) -> Endpoint {
    Endpoint {
        method: "POST",
        path,
        role,
        summary,
        keyed,
    }
}

/// The API under `/api/v1`.
pub const ENDPOINTS: &[Endpoint] = &[
    get(
        "/api/v1/runs",
        Role::Viewer,
        "Runs, newest first; filters status, workflow, since, until, stuck (retrying or stuck); cursor pagination",
    ),
    post(
        "/api/v1/runs",
        Role::Operator,
        "Start a run (workflow, run_id, input), checked as a run-start event is; the run id is the idempotency key: the same start again answers the run (200), another input under the id is 409",
        false,
    ),
    get(
        "/api/v1/runs/counts",
        Role::Viewer,
        "Runs by status, and by workflow and status",
    ),
    get(
        "/api/v1/runs/{run_id}",
        Role::Viewer,
        "One run: its row with the handover note, what it spent, parked items, decisions, progress lines and its newest steps",
    ),
    get(
        "/api/v1/runs/{run_id}/steps",
        Role::Viewer,
        "A run's steps in order (after, limit)",
    ),
    get(
        "/api/v1/runs/{run_id}/journal",
        Role::Viewer,
        "A run's model calls: model, prompt hash, tokens, cost, latency (after, limit)",
    ),
    get(
        "/api/v1/runs/{run_id}/effects",
        Role::Viewer,
        "A run's effects: key, tool, request hash, state done, intent or unknown (after, limit)",
    ),
    get(
        "/api/v1/runs/{run_id}/undo-preview",
        Role::Viewer,
        "What an undo would reverse (scope, leave_partial), without doing it",
    ),
    post(
        "/api/v1/runs/{run_id}/resume",
        Role::Operator,
        "Resume a run in needs_review (reason; after_fix; ask_again: with after_fix, ask the model again instead of replaying the stopped step's answers)",
        false,
    ),
    post(
        "/api/v1/runs/{run_id}/undo",
        Role::Operator,
        "Undo a run (reason, scope, leave_partial)",
        true,
    ),
    post(
        "/api/v1/runs/{run_id}/cancel",
        Role::Operator,
        "Cancel a run (reason)",
        false,
    ),
    post(
        "/api/v1/runs/{run_id}/approve",
        Role::Operator,
        "Approve the step a waiting run stopped at (reason, step)",
        false,
    ),
    post(
        "/api/v1/runs/{run_id}/reject",
        Role::Operator,
        "Reject the step a waiting run stopped at (reason, step)",
        false,
    ),
    post(
        "/api/v1/runs/{run_id}/fork",
        Role::Operator,
        "A new run from this run's checkpoint at a position (reason, from: position or step name, run_id, input, answers_from, live). A shadow fork unless live is true: only a body with \"live\": true makes the fork's outside writes for real",
        true,
    ),
    get(
        "/api/v1/runs/{run_id}/diff/{other}",
        Role::Viewer,
        "Two runs compared position by position: outputs, model answers with token and cost deltas, outside writes",
    ),
    get(
        "/api/v1/decisions/export",
        Role::Viewer,
        "Every decision as JSON lines: checkpoint, evidence, proposed next action, decision, who, why (after, limit)",
    ),
    post(
        "/api/v1/events",
        Role::Operator,
        "Send an event to the runs that wait for it (name, key, id, payload); one no run waits for yet is kept for the first wait that comes. The event id makes it idempotent: the same event again is a duplicate, the id with another payload is 409 event_conflict",
        false,
    ),
    get(
        "/api/v1/events",
        Role::Viewer,
        "Events, newest first: pending (kept for a wait), consumed, expired (state, name, key, limit)",
    ),
    get(
        "/api/v1/dead-letters",
        Role::Viewer,
        "Dead letters by reason with counts, and one page of letters, oldest first (limit, after; next is the following page's after)",
    ),
    get(
        "/api/v1/dead-letters/{id}",
        Role::Viewer,
        "One dead letter's headers; its body hidden",
    ),
    post(
        "/api/v1/dead-letters/{id}/reveal",
        Role::Admin,
        "One dead letter's body (reason; audited)",
        false,
    ),
    post(
        "/api/v1/dead-letters/requeue",
        Role::Operator,
        "Requeue dead letters by ids, reason_code or all (reason; preview counts them first)",
        true,
    ),
    post(
        "/api/v1/dead-letters/purge",
        Role::Admin,
        "Purge dead letters by ids, reason_code or all (reason; preview counts them first)",
        true,
    ),
    get(
        "/api/v1/schedules",
        Role::Viewer,
        "Every schedule: cadence, next tick, paused, runs started, ticks skipped",
    ),
    post(
        "/api/v1/schedules",
        Role::Operator,
        "Create a schedule (name, workflow, input, cron and tz or every, overlap, catch_up, reason); the same again answers it (200), another under the name is 409",
        false,
    ),
    get(
        "/api/v1/schedules/{name}",
        Role::Viewer,
        "One schedule, its next five ticks and its newest runs",
    ),
    post(
        "/api/v1/schedules/{name}/pause",
        Role::Operator,
        "`{\"reason\"}`: nothing starts until it is resumed; audited",
        false,
    ),
    post(
        "/api/v1/schedules/{name}/resume",
        Role::Operator,
        "`{\"reason\"}`: ticks again from the next one after now; audited",
        false,
    ),
    post(
        "/api/v1/schedules/{name}/trigger",
        Role::Operator,
        "`{\"reason\"}`: one run now, whatever the overlap policy; audited",
        false,
    ),
    post(
        "/api/v1/schedules/{name}/backfill",
        Role::Operator,
        "`{\"reason\", \"from\", \"to\"}`: the run of every past tick in the range that has none; audited",
        false,
    ),
    post(
        "/api/v1/schedules/{name}/delete",
        Role::Operator,
        "`{\"reason\"}`: the schedule goes, its runs stay; audited",
        false,
    ),
    get(
        "/api/v1/limits",
        Role::Viewer,
        "Concurrency and rate limits in force (declared and set) and the busiest keys with their runs running, waiting and throttled",
    ),
    post(
        "/api/v1/limits/{workflow}",
        Role::Operator,
        "Set a keyed workflow's limits (key, concurrency, total, rate, reason) for one key or every key; in force within flow.poll_ms; audited",
        false,
    ),
    get(
        "/api/v1/workflows",
        Role::Viewer,
        "The workflows this process runs",
    ),
    get(
        "/api/v1/workflows/{name}/contract",
        Role::Viewer,
        "A workflow's recovery contract",
    ),
    get(
        "/api/v1/workflows/versions",
        Role::Viewer,
        "Every workflow version known to this process, a live worker or a run in flight: who carries it, its runs in flight by status, the oldest one's age, and whether it can be removed from the code",
    ),
    post(
        "/api/v1/workflows/{workflow}/move",
        Role::Operator,
        "Move runs stopped for review or waiting from one version to another (reason, from, to, runs, preview); runs executing a step or at a step the target lacks stay and are listed; each moved run is audited. With preview: true it changes nothing",
        true,
    ),
    get(
        "/api/v1/audit",
        Role::Admin,
        "Who did what, when and why, newest first (target, before, limit)",
    ),
    get("/api/v1/openapi.json", Role::Viewer, "This document"),
];

/// The endpoint a request is for: the table's entry whose method matches and whose path matches
/// segment by segment (`{parameter}` matches any), the most specific first.
pub fn endpoint_for(method: &str, path: &str) -> Option<&'static Endpoint> {
    let asked: Vec<&str> = path.trim_end_matches('/').split('/').collect();
    ENDPOINTS
        .iter()
        .filter(|e| e.method == method)
        .filter_map(|e| {
            let pattern: Vec<&str> = e.path.split('/').collect();
            let fits = pattern.len() == asked.len()
                && pattern
                    .iter()
                    .zip(&asked)
                    .all(|(p, a)| p.starts_with('{') || p == a);
            fits.then(|| (pattern.iter().filter(|p| !p.starts_with('{')).count(), e))
        })
        .max_by_key(|(statics, _)| *statics)
        .map(|(_, e)| e)
}

/// What utoipa generates from the handlers.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "trailmark ops API",
        description = "Runs, decisions, dead letters and the audit trail of a trailmark installation. Send `Authorization: Bearer <token>`; roles viewer < operator < admin (`x-trailmark-role` on each operation). Every error is the one shape ErrorBody.",
    ),
    paths(
        runs::list,
        start::start,
        runs::counts,
        runs::show,
        runs::steps,
        runs::journal,
        runs::effects,
        decisions::undo_preview,
        decisions::resume,
        decisions::undo,
        decisions::cancel,
        decisions::approve,
        decisions::reject,
        decisions::fork,
        decisions::diff,
        decisions::export,
        events::send,
        events::list,
        dlq::list,
        dlq::show,
        dlq::reveal,
        dlq::requeue,
        dlq::purge,
        schedules::list,
        schedules::create,
        schedules::show,
        schedules::pause,
        schedules::resume,
        schedules::trigger,
        schedules::backfill,
        schedules::delete,
        limits::list,
        limits::set,
        admin::workflows,
        admin::contract,
        versions::list,
        versions::move_runs,
        admin::audit,
        openapi_json,
    ),
    components(schemas(ErrorBody)),
)]
struct Generated;

/// This document.
#[utoipa::path(
    get,
    path = "/api/v1/openapi.json",
    operation_id = "openapi_document",
    tag = "meta",
    responses((status = 200, description = "this OpenAPI document", body = Object)),
)]
pub async fn openapi_json() -> axum::Json<&'static Value> {
    axum::Json(&DOCUMENT)
}

/// The document, built on the first GET: it depends only on the code, so every later GET
/// answers the same value.
static DOCUMENT: std::sync::LazyLock<Value> = std::sync::LazyLock::new(document);

/// A refusal the door or the middleware can answer, with the endpoints it applies to.
struct Refusal {
    status: &'static str,
    description: &'static str,
    applies: fn(&Endpoint) -> bool,
}

/// What the middleware in front of every handler may answer (see `edge.rs`, `auth.rs`,
/// `extract.rs`, `idempotency.rs`).
const REFUSALS: &[Refusal] = &[
    Refusal {
        status: "400",
        description: "bad_request: a path segment, query parameter, header or body field does not fit (a NUL byte, a control character, too long, not UTF-8, the wrong type, missing); `field` names it",
        applies: |_| true,
    },
    Refusal {
        status: "401",
        description: "unauthorized: no token, or one that is not known (with WWW-Authenticate: Bearer)",
        applies: |_| true,
    },
    Refusal {
        status: "403",
        description: "forbidden: the token's role is below the one this needs (x-trailmark-role)",
        applies: |e| e.role > Role::Viewer,
    },
    Refusal {
        status: "409",
        description: "conflict: a request with the same Idempotency-Key is still running; wait for its answer",
        applies: |e| e.method == "POST",
    },
    Refusal {
        status: "413",
        description: "too_large: the body is over api.body_limit_bytes",
        applies: |e| e.method == "POST",
    },
    Refusal {
        status: "415",
        description: "unsupported_media_type: the body is not sent as content-type: application/json",
        applies: |e| e.method == "POST",
    },
    Refusal {
        status: "422",
        description: "idempotency_key_reused: the Idempotency-Key was used for another request",
        applies: |e| e.method == "POST",
    },
    Refusal {
        status: "428",
        description: "idempotency_key_required: this touches many things at once; send an Idempotency-Key",
        applies: |e| e.keyed,
    },
    Refusal {
        status: "500",
        description: "internal: trailmark failed to answer; its log has the details under the x-request-id",
        applies: |_| true,
    },
    Refusal {
        status: "504",
        description: "timeout: the request took longer than api.request_timeout_secs",
        applies: |_| true,
    },
];

fn error_response(description: &str) -> Value {
    json!({
        "description": description,
        "content": { "application/json": { "schema": { "$ref": "#/components/schemas/ErrorBody" } } },
    })
}

/// Adds to an endpoint's generated operation what the table and the middleware say about it.
fn finish(e: &Endpoint, op: &mut Value) {
    op["summary"] = json!(e.summary);
    op["x-trailmark-role"] = json!(e.role.as_str());
    op["security"] = json!([{ "bearer": [] }]);
    for r in REFUSALS.iter().filter(|r| (r.applies)(e)) {
        let responses = &mut op["responses"];
        match responses.get_mut(r.status) {
            Some(declared) => {
                let said = declared["description"].as_str().unwrap_or_default();
                declared["description"] = json!(format!("{said}; or {}", r.description));
            }
            None => responses[r.status] = error_response(r.description),
        }
    }
    if e.method == "POST" {
        let key = json!({
            "name": "Idempotency-Key", "in": "header", "required": e.keyed,
            "schema": { "type": "string", "minLength": 1, "maxLength": 255 },
            "description": "a repeat with the same key and body gets the first answer again (idempotent-replayed: true) without running",
        });
        match op["parameters"].as_array_mut() {
            Some(params) => params.push(key),
            None => op["parameters"] = json!([key]),
        }
    }
}

/// The OpenAPI 3.1 document: what utoipa generates from the handlers, finished with the table.
pub fn document() -> Value {
    let mut doc = serde_json::to_value(Generated::openapi()).expect("an OpenAPI document is JSON");
    doc["info"]["version"] = json!(env!("CARGO_PKG_VERSION"));
    doc["components"]["securitySchemes"] = json!({ "bearer": { "type": "http", "scheme": "bearer" } });
    for e in ENDPOINTS {
        if let Some(op) = doc["paths"]
            .get_mut(e.path)
            .and_then(|item| item.get_mut(e.method.to_ascii_lowercase()))
        {
            finish(e, op);
        }
    }
    doc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_finds_its_endpoint_the_most_specific_first() {
        let e = endpoint_for("GET", "/api/v1/runs/counts").unwrap();
        assert_eq!(e.path, "/api/v1/runs/counts");
        let e = endpoint_for("GET", "/api/v1/runs/r-1").unwrap();
        assert_eq!(e.path, "/api/v1/runs/{run_id}");
        let e = endpoint_for("POST", "/api/v1/dead-letters/purge").unwrap();
        assert_eq!(e.role, Role::Admin);
        assert!(endpoint_for("DELETE", "/api/v1/runs").is_none());
        assert!(endpoint_for("GET", "/api/v1/nothing").is_none());
    }

    #[test]
    fn the_fork_body_says_a_fork_is_a_shadow_unless_live() {
        let doc = document();
        let body = &doc["components"]["schemas"]["ForkBody"];
        assert_eq!(body["properties"]["live"]["default"], false, "{body}");
        assert!(body["properties"]["live"]["description"].as_str().unwrap().contains("shadow"));
    }

    #[test]
    fn the_document_has_the_tables_operations_each_with_typed_bodies_and_the_error_shape() {
        let doc = document();
        let mut listed = Vec::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                listed.push(format!("{} {path}", method.to_ascii_uppercase()));
                for (status, response) in op["responses"].as_object().unwrap() {
                    let content = response["content"].as_object();
                    let schema = content.and_then(|c| c.values().next()).map(|m| &m["schema"]);
                    assert!(
                        schema.is_some_and(|s| s.is_object()),
                        "{method} {path} {status} has no schema: {response}"
                    );
                }
                if method == "post" {
                    let body = &op["requestBody"]["content"]["application/json"]["schema"];
                    assert!(body["$ref"].is_string(), "{path}: {body}");
                }
            }
        }
        let mut table: Vec<String> = ENDPOINTS.iter().map(|e| format!("{} {}", e.method, e.path)).collect();
        listed.sort();
        table.sort();
        assert_eq!(listed, table, "the document's operations are the table's");
        let mut ids: Vec<&str> = doc["paths"]
            .as_object()
            .unwrap()
            .values()
            .flat_map(|item| item.as_object().unwrap().values())
            .map(|op| op["operationId"].as_str().expect("an operationId"))
            .collect();
        ids.sort();
        let count = ids.len();
        ids.dedup();
        assert_eq!(ids.len(), count, "operationIds are unique (client generators name methods by them)");
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        for name in ["ErrorBody", "StartBody", "StartedRun", "Overview", "RunRow", "RunStatus"] {
            assert!(schemas.contains_key(name), "no schema {name}");
        }
        let start = &doc["paths"]["/api/v1/runs"]["post"]["responses"];
        for status in ["200", "201", "400", "401", "403", "409", "413", "415", "422", "503"] {
            assert_eq!(
                start[status]["content"]["application/json"]["schema"]["$ref"]
                    .as_str()
                    .map(|r| r.rsplit('/').next().unwrap()),
                Some(if status.starts_with('2') { "StartedRun" } else { "ErrorBody" }),
                "POST /api/v1/runs {status}"
            );
        }
    }

    #[test]
    fn the_document_lists_every_endpoint_with_its_role() {
        let doc = document();
        for e in ENDPOINTS {
            let op = &doc["paths"][e.path][e.method.to_ascii_lowercase()];
            assert_eq!(
                op["x-trailmark-role"],
                e.role.as_str(),
                "{} {}",
                e.method,
                e.path
            );
        }
    }
}
