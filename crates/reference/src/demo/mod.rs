//! `trailmark demo`: the reference story with real processes on this machine's Postgres and
//! RabbitMQ. This is command glue (it reports with `anyhow`); the scenario itself lives in the
//! modules beside it.
//!
//! | module | what it does |
//! |---|---|
//! | [`children`] | child processes that cannot outlive the demo |
//! | [`story`] | migrate, model server, a worker that dies in step 7, a fresh worker, the figures |
//! | [`naive_story`] | the naive version under the same crash |
//! | `progress` | step names and counts on stderr while it runs |

pub mod children;
pub mod naive_story;
mod progress;
pub mod story;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::night::Night;
use super::{mail, orders, outside};
use children::Proc;
use trailmark::config::Settings;

pub use progress::say;

/// What every demo needs: the outside database (prepared, night seeded) and a log directory.
pub struct Stage {
    /// Effective settings (children get the same database, broker and prefix).
    pub settings: Settings,
    /// The outside database.
    pub outside: PgPool,
    /// Its name, for messages.
    pub outside_name: String,
    /// Where children write their logs.
    pub logs: PathBuf,
}

impl Stage {
    /// Prepares the outside database and seeds the night's orders and receipts.
    pub async fn prepare(settings: &Settings, night: &Night, label: &str) -> anyhow::Result<Self> {
        let trailmark: PgConnectOptions = trailmark::store::parse_url(&settings.database.url)
            .with_context(|| {
                format!(
                    "DATABASE_URL {} is not a Postgres URL",
                    trailmark::redact::url(&settings.database.url)
                )
            })?;
        let options = outside::options_for(&trailmark)?;
        let outside_name = outside::name(&options);
        let outside = outside::prepare(&options)
            .await
            .with_context(|| format!("preparing the outside database {outside_name} (is Postgres running? see DATABASE_URL)"))?;
        orders::seed(&outside, night).await?;
        let logs = std::env::temp_dir().join(format!("trailmark-demo-{label}"));
        std::fs::create_dir_all(&logs)
            .with_context(|| format!("creating the log directory {}", logs.display()))?;
        say(&format!("outside systems in database {outside_name}"));
        Ok(Self {
            settings: settings.clone(),
            outside,
            outside_name,
            logs,
        })
    }

    /// The environment of a child: same database, broker and prefix, the demo's model server,
    /// short leases so a dead worker's run is taken over in seconds, and no API key (the stand-in
    /// model must never receive a real one).
    pub fn child_env(&self, model_url: &str) -> Vec<(String, String)> {
        let keep = |name: &str, default: &str| {
            (
                name.to_owned(),
                std::env::var(name).unwrap_or_else(|_| default.to_owned()),
            )
        };
        vec![
            ("DATABASE_URL".into(), self.settings.database.url.clone()),
            ("AMQP_URL".into(), self.settings.broker.url.clone()),
            (
                "TRAILMARK__BROKER__PREFIX".into(),
                self.settings.broker.prefix.clone(),
            ),
            ("TRAILMARK__MODEL__BASE_URL".into(), model_url.to_owned()),
            ("TRAILMARK__MODEL__API_KEY".into(), String::new()),
            keep("TRAILMARK__WORKER__LEASE_SECS", "5"),
            keep("TRAILMARK__WORKER__HEARTBEAT_SECS", "1"),
            keep("RUST_LOG", "warn"),
            // Its workers serve their HTTP surface on a free port: the default one may belong to
            // a trailmark already running here.
            ("TRAILMARK__API__LISTEN".into(), "127.0.0.1:0".into()),
            ("TRAILMARK__PROCESS__DRAIN_DELAY_MS".into(), "0".into()),
        ]
    }
}

/// The stand-in model server as a process of its own, answering extraction requests.
pub struct ModelServerProc {
    proc: Proc,
    /// `http://127.0.0.1:PORT/v1`.
    pub base_url: String,
    http: reqwest::Client,
}

impl ModelServerProc {
    /// Starts `trailmark demo model-server` and learns its address from its first line.
    pub async fn start(stage: &Stage) -> anyhow::Result<Self> {
        let mut proc = Proc::spawn(
            "model-server",
            &["demo", "model-server", "--port", "0"],
            &[],
            &stage.logs,
            true,
        )?;
        let line = proc.first_line(Duration::from_secs(15)).await?;
        let base_url = line
            .rsplit(' ')
            .next()
            .filter(|u| u.starts_with("http://"))
            .with_context(|| format!("model server printed {line:?}, expected its address"))?
            .to_owned();
        say(&format!(
            "model server (stand-in, extraction answers) at {base_url}; logs of the demo's processes in {}",
            stage.logs.display()
        ));
        Ok(Self {
            proc,
            base_url,
            http: reqwest::Client::new(),
        })
    }

    /// Calls the server has answered so far (its own count).
    pub async fn calls(&self) -> anyhow::Result<i64> {
        let stats: serde_json::Value = self
            .http
            .get(format!("{}/stats", self.base_url))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .with_context(|| {
                format!(
                    "asking the model server for its call count; see {}",
                    self.proc.log().display()
                )
            })?
            .json()
            .await?;
        Ok(stats["answered"].as_i64().unwrap_or(0))
    }

    /// Stops the server.
    pub async fn stop(self) {
        self.proc.stop().await;
    }
}

/// The mail sender, run inside the demo process as the suppliers' side of the world.
pub struct MailSender {
    stop: CancellationToken,
    task: Option<JoinHandle<Result<(), mail::SenderError>>>,
}

impl MailSender {
    /// Starts consuming notes into the sink.
    pub fn start(stage: &Stage) -> Self {
        let stop = CancellationToken::new();
        let task = tokio::spawn(mail::run_sender(
            stage.settings.broker.clone(),
            stage.outside.clone(),
            stop.clone(),
        ));
        Self {
            stop,
            task: Some(task),
        }
    }

    /// Stops it; reports if it had failed.
    pub async fn stop(mut self) {
        self.stop.cancel();
        let Some(task) = self.task.take() else { return };
        match tokio::time::timeout(Duration::from_secs(10), task).await {
            Ok(Ok(Err(e))) => say(&format!("the mail sender had stopped: {e}")),
            Ok(Err(e)) => say(&format!("the mail sender crashed: {e}")),
            _ => {}
        }
    }
}

impl Drop for MailSender {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
