//! Steps written in other languages: workflows whose steps are served by an HTTP endpoint that
//! speaks the step protocol (`trailmark-step/1`, docs/STEP_PROTOCOL.md). The worker calls the
//! endpoint once per attempt, signed with the endpoint's secret, and serves its callbacks
//! (model calls, effects, local writes, progress) through the attempt's own step context, so
//! the engine stays the only writer and every promise holds as for a step compiled in.
//!
//! | file | what it does |
//! |---|---|
//! | `manifest` | reads an endpoint's manifest and makes its workflows |
//! | `call` | one attempt: the call, the callbacks while it is open, the answer's meaning |
//! | `ops` | each callback, done through the step context |
//! | `attempts` | the open attempts' tokens, fences and call numbers |
//! | `listener` | the HTTP listener callbacks arrive on |
//! | `signing` | the HMAC signatures both ways |
//! | `wire` | the protocol's JSON |

mod attempts;
mod call;
mod listener;
mod manifest;
mod ops;
pub mod signing;
mod wire;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

pub use listener::listen;
pub use manifest::{load, register};

use crate::domain::LocalTable;
use crate::workflow::StepError;

/// Why remote workflows cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A `remote.endpoints` entry is not `name=url`.
    #[error(
        "remote.endpoints entry {0:?} is not name=url (e.g. py=http://agents:8001/trailmark); fix the setting"
    )]
    BadEntry(String),
    /// The endpoint's secret is missing or too short.
    #[error(
        "endpoint {endpoint}: {why}; set {var} to the secret the endpoint was given (at least {} bytes)",
        signing::MIN_SECRET_BYTES
    )]
    Secret {
        /// The endpoint.
        endpoint: String,
        /// The environment variable it is read from.
        var: String,
        /// What is wrong.
        why: &'static str,
    },
    /// The manifest could not be read.
    #[error(
        "endpoint {endpoint} ({url}): its manifest could not be read: {why}; start the endpoint or fix remote.endpoints"
    )]
    Unreachable {
        /// The endpoint.
        endpoint: String,
        /// Its URL.
        url: String,
        /// What failed.
        why: String,
    },
    /// The manifest says something the worker cannot accept.
    #[error("endpoint {endpoint}: its manifest is refused: {why}")]
    BadManifest {
        /// The endpoint.
        endpoint: String,
        /// What is wrong, and how to fix it.
        why: String,
    },
    /// An endpoint serves a workflow whose name a workflow of this binary has.
    #[error("an endpoint serves workflow {0}, which this binary already has; rename one of them")]
    NameTaken(String),
    /// The callback listener could not bind.
    #[error(
        "the step protocol's callback listener cannot listen on {addr} (remote.callback_listen)"
    )]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// An endpoint as a worker calls it.
pub struct Endpoint {
    /// Its name in `remote.endpoints`.
    pub name: String,
    /// Its base URL; `manifest` and `step` are paths under it.
    pub url: url::Url,
    secret: Arc<[u8]>,
    client: reqwest::Client,
    /// How long an attempt waits for the answer (`worker.step_timeout_secs`).
    deadline: Duration,
    /// The local tables its workflows may write, by name.
    tables: HashMap<String, &'static LocalTable>,
}

impl Endpoint {
    /// The URL of `path` under the endpoint.
    fn url_of(&self, path: &str) -> url::Url {
        let mut url = self.url.clone();
        let base = url.path().trim_end_matches('/').to_owned();
        url.set_path(&format!("{base}/{path}"));
        url
    }

    /// A request to `path` under the endpoint, signed.
    fn signed(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Vec<u8>,
    ) -> reqwest::RequestBuilder {
        let url = self.url_of(path);
        let ts = signing::now();
        let signature = signing::sign(&self.secret, ts, method.as_str(), url.path(), &body);
        self.client
            .request(method, url)
            .header(signing::TIMESTAMP, ts.to_string())
            .header(signing::SIGNATURE, signature)
            .header("content-type", "application/json")
            .body(body)
    }

    /// A signed POST of a JSON body to `path`.
    fn signed_post(&self, path: &str, body: Vec<u8>) -> reqwest::RequestBuilder {
        self.signed(reqwest::Method::POST, path, body)
    }

    /// The declared local table `name`, if the manifest declared it and the worker allows it.
    fn table(&self, name: &str) -> Result<&'static LocalTable, StepError> {
        self.tables.get(name).copied().ok_or_else(|| {
            StepError::Unknown(format!(
                "local write to {name}: endpoint {} declared no such table, or remote.local_tables does not allow it; declare it in the workflow and allow it in the worker's settings, then resume after the fix",
                self.name
            ))
        })
    }
}
