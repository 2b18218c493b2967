//! What a long-running process checks before it says it started: Postgres reachable, its login
//! accepted and its schema the one this build expects; RabbitMQ reachable, its login and vhost
//! accepted. A refusal no retry can fix ends the start at once with what to do; a server that
//! is not reachable yet is waited for, one line per attempt, for at most
//! `process.startup_timeout_secs`. Once started, losing a server is no reason to stop: the
//! components reconnect by themselves.

use std::time::{Duration, Instant};

use crate::config::Settings;
use crate::error::{Reaction, Report};
use crate::{broker, store};

/// Why a process did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Postgres refused, or is not usable by this build.
    #[error("cannot start")]
    Store(#[from] store::Error),
    /// RabbitMQ refused.
    #[error("cannot start")]
    Broker(#[from] broker::Error),
    /// A server stayed unreachable for the whole startup timeout.
    #[error("gave up after {waited_secs} s (process.startup_timeout_secs) and {attempts} attempts")]
    GaveUp {
        /// How long it waited.
        waited_secs: u64,
        /// How many times it tried.
        attempts: u32,
        /// The last failure.
        #[source]
        last: Box<Error>,
    },
}

impl Error {
    fn reaction(&self) -> Reaction {
        crate::reaction::reaction(self)
    }
}

/// Waits until both servers accept this process, or says why they never will.
pub async fn check(settings: &Settings) -> Result<(), Error> {
    let limit = Duration::from_secs(settings.process.startup_timeout_secs);
    let started = Instant::now();
    let mut pause = Duration::from_millis(500);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let failure = match check_once(settings).await {
            Ok(()) => return Ok(()),
            Err(e) if e.reaction() != Reaction::Retry => return Err(e),
            Err(e) => e,
        };
        let waited = started.elapsed();
        let remaining = limit.saturating_sub(waited);
        if remaining.is_zero() {
            return Err(Error::GaveUp {
                waited_secs: waited.as_secs(),
                attempts,
                last: Box::new(failure),
            });
        }
        let pause_now = pause.min(remaining);
        let why: &(dyn std::error::Error + 'static) = match &failure {
            Error::Store(e) => e,
            Error::Broker(e) => e,
            other => other,
        };
        tracing::warn!(
            attempt = attempts,
            retry_in_ms = pause_now.as_millis() as u64,
            gives_up_after_secs = limit.as_secs(),
            "not started yet: {}",
            Report(why)
        );
        tokio::time::sleep(pause_now).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

async fn check_once(settings: &Settings) -> Result<(), Error> {
    let mut conn = store::connect_one(&settings.database).await?;
    if let Some(newer) = store::check_schema(&mut conn, &settings.database).await? {
        tracing::warn!(
            migration = newer,
            "the schema is newer than this build (a rolling upgrade in progress?); it declares itself compatible, so this process starts"
        );
    }
    let _ = sqlx::Connection::close(conn).await;
    let broker = broker::connect(&settings.broker, "startup-check").await?;
    let _ = broker.close(200, "checked".into()).await;
    Ok(())
}
