//! Every API endpoint in one table, and the OpenAPI 3.1 document built from it
//! (`/api/v1/openapi.json`). The router is checked against the table (every endpoint answers,
//! none is missing from the document), and the role-matrix test calls each endpoint with each
//! role.

use serde_json::{Map, Value, json};

use super::auth::Role;

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
    get(
        "/api/v1/dead-letters",
        Role::Viewer,
        "Dead letters by reason with counts, and the oldest letters",
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

/// The fork's body: a shadow fork unless `live` is true.
fn fork_body() -> Value {
    json!({
        "type": "object",
        "required": ["reason", "from"],
        "additionalProperties": false,
        "properties": {
            "reason": { "type": "string", "maxLength": super::input::MAX_REASON, "description": "why (recorded with the fork)" },
            "from": { "oneOf": [{ "type": "integer" }, { "type": "string" }], "description": "a position, or a step name (its first visit)" },
            "run_id": { "type": "string", "description": "the fork's id (default <run>-fork-<8 hex>)" },
            "input": { "description": "a new input (default: the parent's)" },
            "answers_from": { "type": "string", "description": "a run whose journaled answers from the fork point on are replayed" },
            "live": { "type": "boolean", "default": false, "description": "true: the fork makes its outside writes for real. Absent or false: a shadow fork, whose outside writes are recorded, not made" },
            "shadow": { "type": "boolean", "default": true, "deprecated": true, "description": "the default; true together with live is refused" },
        },
    })
}

/// The OpenAPI 3.1 document.
pub fn document() -> Value {
    let mut paths = Map::new();
    for e in ENDPOINTS {
        let params: Vec<Value> = e
            .path
            .split('/')
            .filter_map(|part| part.strip_prefix('{')?.strip_suffix('}'))
            .map(|name| json!({ "name": name, "in": "path", "required": true, "schema": { "type": "string" } }))
            .collect();
        let mut op = json!({
            "summary": e.summary,
            "x-trailmark-role": e.role.as_str(),
            "parameters": params,
            "security": [{ "bearer": [] }],
            "responses": {
                "200": { "description": "done", "content": { "application/json": {} } },
                "401": { "description": "no valid token" },
                "403": { "description": format!("the token's role is below {}", e.role.as_str()) },
            },
        });
        if e.method == "POST" {
            op["requestBody"] = json!({ "required": true, "content": { "application/json": {} } });
            op["responses"]["409"] = json!({ "description": "does not fit the current state (the body says which status), or the same Idempotency-Key is still running" });
            op["responses"]["422"] =
                json!({ "description": "the Idempotency-Key was used for another request" });
            op["parameters"]
                .as_array_mut()
                .expect("a list")
                .push(json!({
                    "name": "Idempotency-Key", "in": "header", "required": e.keyed,
                    "schema": { "type": "string" },
                    "description": "a repeat with the same key and body gets the first response",
                }));
        }
        if e.path == "/api/v1/runs/{run_id}/fork" {
            op["requestBody"]["content"]["application/json"] = json!({ "schema": fork_body() });
        }
        let entry = paths.entry(e.path).or_insert_with(|| json!({}));
        entry[e.method.to_ascii_lowercase()] = op;
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "trailmark ops API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Runs, decisions, dead letters and the audit trail of a trailmark installation. Send `Authorization: Bearer <token>`; roles viewer < operator < admin.",
        },
        "components": { "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } } },
        "paths": paths,
    })
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
        let body = &doc["paths"]["/api/v1/runs/{run_id}/fork"]["post"]["requestBody"]["content"]
            ["application/json"]["schema"];
        assert_eq!(body["properties"]["live"]["default"], false, "{body}");
        assert!(body["properties"]["live"]["description"].as_str().unwrap().contains("shadow"));
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
