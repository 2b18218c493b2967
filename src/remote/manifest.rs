//! An endpoint's manifest: the workflows it serves, their steps and the local tables they write.
//! Read when a process starts (the code is the one truth about its steps); checked where it
//! enters, since it comes from another service.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use backon::{ConstantBuilder, Retryable};
use serde::Deserialize;

use super::{Endpoint, Error, call, signing, wire};
use crate::config::Settings;
use crate::domain::{LocalTable, check_name};
use crate::workflow::{Compensation, StepDef, StepKind, Workflow};

#[derive(Debug, Deserialize)]
struct Manifest {
    protocol: String,
    workflows: Vec<WorkflowEntry>,
}

#[derive(Debug, Deserialize)]
struct WorkflowEntry {
    name: String,
    version: i32,
    steps: Vec<StepEntry>,
    #[serde(default)]
    local_tables: Vec<TableEntry>,
}

#[derive(Debug, Deserialize)]
struct StepEntry {
    name: String,
    kind: String,
    #[serde(default)]
    key_recipe: Option<String>,
    #[serde(default)]
    compensation: Option<String>,
}

#[derive(Debug, Deserialize)]
struct TableEntry {
    name: String,
    key: String,
    columns: Vec<String>,
}

/// The workflows of every endpoint in `remote.endpoints`. With `wait`, each manifest is asked
/// for again until `remote.manifest_wait_secs` have passed (a worker starting beside its
/// endpoint); without, once.
pub async fn load(settings: &Settings, wait: bool) -> Result<Vec<Workflow>, Error> {
    let mut workflows = Vec::new();
    for entry in &settings.remote.endpoints {
        let endpoint = endpoint(settings, entry)?;
        let manifest = read(&endpoint, wait, settings.remote.manifest_wait_secs).await?;
        workflows.extend(make(endpoint, manifest, &settings.remote.local_tables)?);
    }
    Ok(workflows)
}

/// Adds the workflows of every endpoint in `remote.endpoints` to `registry` (see [`load`]); a
/// workflow whose name the registry already has is refused, so a compiled workflow is never
/// shadowed by a service.
pub async fn register(
    settings: &Settings,
    registry: &mut crate::workflow::Registry,
    wait: bool,
) -> Result<usize, Error> {
    let workflows = load(settings, wait).await?;
    for w in &workflows {
        if registry.get(&w.name).is_some() {
            return Err(Error::NameTaken(w.name.clone()));
        }
    }
    let count = workflows.len();
    for w in workflows {
        registry.register(w);
    }
    Ok(count)
}

/// The endpoint an entry names, with its secret from the environment.
fn endpoint(settings: &Settings, entry: &str) -> Result<Endpoint, Error> {
    let bad = || Error::BadEntry(entry.to_owned());
    let (name, url) = entry.split_once('=').ok_or_else(bad)?;
    let name = name.trim();
    check_name(name).map_err(|_| bad())?;
    let url = url::Url::parse(url.trim()).map_err(|_| bad())?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad());
    }
    let var = format!(
        "TRAILMARK_REMOTE_SECRET_{}",
        name.to_ascii_uppercase().replace(['-', '.', ':'], "_")
    );
    let secret = std::env::var(&var).unwrap_or_default();
    let why = match secret.len() {
        0 => Some("no secret is set"),
        n if n < signing::MIN_SECRET_BYTES => Some("the secret is too short"),
        _ => None,
    };
    if let Some(why) = why {
        return Err(Error::Secret {
            endpoint: name.to_owned(),
            var,
            why,
        });
    }
    // A redirect would be signed for another path: refused by the endpoint, or worse, sent
    // where the operator did not say.
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| Error::Unreachable {
            endpoint: name.to_owned(),
            url: url.to_string(),
            why: crate::error::Report(&e).to_string(),
        })?;
    Ok(Endpoint {
        name: name.to_owned(),
        url,
        secret: Arc::from(secret.into_bytes()),
        client,

        deadline: Duration::from_secs(settings.worker.step_timeout_secs),
        tables: HashMap::new(),
    })
}

async fn read(endpoint: &Endpoint, wait: bool, wait_secs: u64) -> Result<Manifest, Error> {
    if !wait {
        return read_once(endpoint).await;
    }
    // Tries until the deadline, not a count of tries: a try that hangs takes its own time.
    let deadline = std::time::Instant::now() + Duration::from_secs(wait_secs);
    (|| read_once(endpoint))
        .retry(
            ConstantBuilder::default()
                .with_delay(Duration::from_secs(1))
                .without_max_times(),
        )
        .when(|e| matches!(e, Error::Unreachable { .. }) && std::time::Instant::now() < deadline)
        .notify(|e, _| tracing::warn!(error = %e, "waiting for a step endpoint's manifest"))
        .await
}

/// One read of the manifest: unreachable (worth another try) or refused (a person must fix it).
async fn read_once(endpoint: &Endpoint) -> Result<Manifest, Error> {
    let unreachable = |why: String| Error::Unreachable {
        endpoint: endpoint.name.clone(),
        url: endpoint.url.to_string(),
        why,
    };
    let refused = |why: String| Error::BadManifest {
        endpoint: endpoint.name.clone(),
        why,
    };
    let response = endpoint
        .signed(reqwest::Method::GET, "manifest", Vec::new())
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| unreachable(crate::error::Report(&e).to_string()))?;
    let status = response.status();
    let body = response
        .bytes()
        .await
        .map_err(|e| unreachable(crate::error::Report(&e).to_string()))?;
    let begins = || String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
    if status.is_client_error() {
        return Err(refused(format!(
            "it answered HTTP {status}: {}; check that TRAILMARK_REMOTE_SECRET_* holds the endpoint's secret and that the URL is the endpoint's base (the manifest is at <url>/manifest)",
            begins()
        )));
    }
    if !status.is_success() {
        return Err(unreachable(format!("HTTP {status}: {}", begins())));
    }
    serde_json::from_slice::<Manifest>(&body)
        .map_err(|e| refused(format!("it is not a manifest: {e}")))
}

/// The manifest's workflows, their steps handled by the endpoint.
fn make(mut endpoint: Endpoint, m: Manifest, allowed: &[String]) -> Result<Vec<Workflow>, Error> {
    let name = endpoint.name.clone();
    let refuse = |why: String| Error::BadManifest {
        endpoint: name.clone(),
        why,
    };
    if m.protocol != wire::PROTOCOL {
        return Err(refuse(format!(
            "it speaks {:?}; this worker speaks {}",
            m.protocol,
            wire::PROTOCOL
        )));
    }
    for w in &m.workflows {
        for t in &w.local_tables {
            let table = local_table(t).map_err(&refuse)?;
            if !allowed.iter().any(|a| a == &t.name) {
                return Err(refuse(format!(
                    "workflow {} writes the local table {}, which remote.local_tables does not allow; add it there if the endpoint may write it",
                    w.name, t.name
                )));
            }
            endpoint.tables.insert(t.name.clone(), table);
        }
    }
    let endpoint = Arc::new(endpoint);
    m.workflows
        .into_iter()
        .map(|w| workflow(&endpoint, w).map_err(refuse))
        .collect()
}

/// A table declaration, kept for the process's life (as a compiled workflow's `static` is).
fn local_table(t: &TableEntry) -> Result<&'static LocalTable, String> {
    let leak = |s: &str| -> &'static str { Box::leak(s.to_owned().into_boxed_str()) };
    let columns: Vec<&'static str> = t.columns.iter().map(|c| leak(c)).collect();
    let table: &'static LocalTable = Box::leak(Box::new(LocalTable::new(
        leak(&t.name),
        leak(&t.key),
        Box::leak(columns.into_boxed_slice()),
    )));
    table
        .row(serde_json::Value::Object(
            std::iter::once(&t.key)
                .chain(&t.columns)
                .map(|c| (c.clone(), serde_json::json!("x")))
                .collect(),
        ))
        .map_err(|e| format!("local table {}: {e}", t.name))?;
    Ok(table)
}

fn workflow(endpoint: &Arc<Endpoint>, w: WorkflowEntry) -> Result<Workflow, String> {
    check_name(&w.name).map_err(|e| format!("workflow name {:?}: {e}", w.name))?;
    if w.version < 1 {
        return Err(format!(
            "workflow {} has version {}; versions start at 1",
            w.name, w.version
        ));
    }
    if w.steps.is_empty() {
        return Err(format!("workflow {} declares no step", w.name));
    }
    let mut seen = HashSet::new();
    let mut workflow = Workflow::new(&w.name, w.version);
    for s in w.steps {
        check_name(&s.name).map_err(|e| format!("workflow {} step {:?}: {e}", w.name, s.name))?;
        if !seen.insert(s.name.clone()) {
            return Err(format!(
                "workflow {} declares step {} twice",
                w.name, s.name
            ));
        }
        let handler = call::handler(endpoint.clone());
        workflow.steps.push(StepDef {
            kind: kind(&s.kind).map_err(|e| format!("workflow {} step {}: {e}", w.name, s.name))?,
            compensation: s.compensation.map(|note| Compensation {
                note,
                handler: handler.clone(),
                reversals: None,
            }),
            handler,
            key_recipe: s.key_recipe,
            freeze_unless_clear: false,
            on_reject: None,
            name: s.name,
        });
    }
    Ok(workflow)
}

fn kind(kind: &str) -> Result<StepKind, String> {
    Ok(match kind {
        "read" => StepKind::Read,
        "model" => StepKind::Model,
        "write" => StepKind::Write,
        "message" => StepKind::Message,
        "human" => StepKind::Human,
        other => {
            return Err(format!(
                "kind {other:?} is none of read, model, write, message, human"
            ));
        }
    })
}
