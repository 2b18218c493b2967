//! The Python step endpoint (`pychain`, the `chain` workflow written with the Python SDK) as the
//! bench and the drill run it: started on their own database, its environment given to every
//! trailmark process they start, killed with SIGKILL and started again without blocking the
//! runtime (starting it waits, on a thread of its own, until it listens).

use std::process::ExitStatus;
use std::time::{Duration, Instant};

use trailmark_testkit::pychain::PyChain;

use super::env::BenchEnv;
use super::{Error, Result};

/// The workflow the endpoint serves.
pub const WORKFLOW: &str = trailmark_testkit::pychain::NAME;

/// A running `pychain` endpoint.
pub struct PythonEndpoint {
    /// `None` only while a thread starts it (again).
    server: Option<PyChain>,
}

impl PythonEndpoint {
    /// Starts one writing its ledger rows to `database_url`, with `extra` environment (its kill
    /// spot); returns once it listens.
    pub async fn start(database_url: &str, extra: Vec<(String, String)>) -> Result<Self> {
        let url = database_url.to_owned();
        let server = blocking(move || {
            let pairs: Vec<(&str, &str)> = extra
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            PyChain::start(&url, &pairs)
        })
        .await?;
        Ok(Self {
            server: Some(server),
        })
    }

    /// What a trailmark process needs to carry `pychain`: the endpoint, its secret, and the
    /// operator's consent to the ledger table its manifest declares.
    pub fn child_env(&self) -> Vec<(String, String)> {
        self.server
            .iter()
            .flat_map(PyChain::worker_env)
            .map(|(k, v)| (k.to_owned(), v))
            .collect()
    }

    /// Gives every process `env` starts from now on [`PythonEndpoint::child_env`].
    pub fn give_to(&self, env: &mut BenchEnv) {
        for (k, v) in self.child_env() {
            env.set_child_env(&k, &v);
        }
    }

    /// SIGKILL from outside (nothing cleaned up, every open step call cut), then started again
    /// on the same port; returns how long it took to listen again.
    pub async fn kill9_and_restart(&mut self) -> Result<Duration> {
        if let Some(server) = self.server.as_mut() {
            server.kill9();
        }
        self.restart().await
    }

    /// Starts the process again (after it died), on the same port; returns how long it took to
    /// listen.
    pub async fn restart(&mut self) -> Result<Duration> {
        let mut server = self
            .server
            .take()
            .ok_or_else(|| Error::Failed("the Python endpoint is already restarting".into()))?;
        let started = Instant::now();
        let (server, restarted) = tokio::task::spawn_blocking(move || {
            let restarted = server.restart();
            (server, restarted)
        })
        .await
        .map_err(|e| Error::Failed(format!("restarting the Python endpoint: {e}")))?;
        self.server = Some(server);
        restarted.map_err(Error::Failed)?;
        Ok(started.elapsed())
    }

    /// How the process ended, once it has (its kill spot fired, or it failed).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.server.as_mut()?.exited()
    }

    /// Its process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.server.as_ref()?.pid()
    }

    /// SIGKILL, for good (also done when it is dropped).
    pub fn stop(&mut self) {
        if let Some(server) = self.server.as_mut() {
            server.kill9();
        }
    }
}

/// Runs `start` on a blocking thread (it polls the port with sleeps until the server listens).
async fn blocking(
    start: impl FnOnce() -> std::result::Result<PyChain, String> + Send + 'static,
) -> Result<PyChain> {
    tokio::task::spawn_blocking(start)
        .await
        .map_err(|e| Error::Failed(format!("starting the Python endpoint: {e}")))?
        .map_err(Error::Failed)
}
