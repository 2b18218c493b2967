//! Group commit: the statements that concurrent work reaches at the same moment are gathered
//! and run as one statement, so N steps pay one round trip, one executor set-up and one commit
//! instead of N. Used by the step transaction (`step_tx.rs`) for lease claims, effect intents,
//! journal entries and effect results, and step commits.
//!
//! Nothing waits on a timer: a batch is whatever queued while the previous batch of its kind was
//! running. An unloaded process therefore runs each statement alone and at once (no added
//! latency), and a loaded one batches more as its load grows.
//!
//! Each kind runs one batch at a time, on a connection of its own that it keeps between
//! batches: no pool checkout per statement, and none of the liveness round trip the pool makes
//! on every connection given back. A connection whose batch failed on Postgres itself (not on
//! one of its items) is given back and the next batch takes a fresh one, so a restarted server
//! or a failover costs one failed batch.

use std::future::Future;
use std::pin::Pin;

use sqlx::PgPool;
use sqlx::pool::PoolConnection;
use tokio::sync::{mpsc, oneshot};

use crate::store::{Error, Result};

/// One queued request and where its answer goes.
type Pending<Req, T> = (Req, oneshot::Sender<Result<T>>);

/// What a batch function returns: one answer per request, in order, borrowing the connection.
pub(crate) type BatchFuture<'c, T> = Pin<Box<dyn Future<Output = Vec<Result<T>>> + Send + 'c>>;

/// Runs requests of one kind in batches, one task per kind.
pub(crate) struct Batcher<Req, T> {
    queue: mpsc::UnboundedSender<Pending<Req, T>>,
}

impl<Req: Send + 'static, T: Send + 'static> Batcher<Req, T> {
    /// Starts the task that runs up to `max` requests at a time through `run`, on a connection
    /// of `pool` it keeps; `run` must answer each request, in order. The task ends when the
    /// batcher is dropped.
    pub fn start<F>(max: usize, pool: PgPool, run: F) -> Self
    where
        F: for<'c> Fn(&'c mut sqlx::PgConnection, Vec<Req>) -> BatchFuture<'c, T>
            + Send
            + Sync
            + 'static,
    {
        let (queue, rx) = mpsc::unbounded_channel();
        tokio::spawn(drive(rx, max.max(1), pool, run));
        Self { queue }
    }

    /// Queues `req` and waits for its answer. If the batch task is gone (it panicked, or its
    /// batch answered the wrong number of requests) the error is an infrastructure one, so the
    /// delivery is retried.
    pub async fn call(&self, req: Req) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        self.queue.send((req, tx)).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

fn gone() -> Error {
    Error::Unavailable {
        what: "a group-commit task of this process stopped; retrying".into(),
        source: None,
    }
}

async fn drive<Req, T, F>(
    mut rx: mpsc::UnboundedReceiver<Pending<Req, T>>,
    max: usize,
    pool: PgPool,
    run: F,
) where
    Req: Send + 'static,
    T: Send + 'static,
    F: for<'c> Fn(&'c mut sqlx::PgConnection, Vec<Req>) -> BatchFuture<'c, T> + Send + Sync,
{
    let mut pending = Vec::with_capacity(max);
    let mut held: Option<PoolConnection<sqlx::Postgres>> = None;
    while rx.recv_many(&mut pending, max).await > 0 {
        let (reqs, replies): (Vec<Req>, Vec<oneshot::Sender<Result<T>>>) =
            pending.drain(..).unzip();
        let mut conn = match held.take() {
            Some(conn) => conn,
            None => match pool.acquire().await {
                Ok(conn) => conn,
                Err(e) => {
                    let failure = crate::error::Report(&e).to_string();
                    for reply in replies {
                        let _ = reply.send(Err(Error::Unavailable {
                            what: format!("no database connection for a group commit: {failure}"),
                            source: None,
                        }));
                    }
                    continue;
                }
            },
        };
        let answers = run(&mut conn, reqs).await;
        // Kept unless Postgres itself failed under it; a refusal of one item leaves it sound.
        if !answers
            .iter()
            .any(|a| matches!(a, Err(Error::Unavailable { .. })))
        {
            held = Some(conn);
        }
        // Answers are matched to askers by position: a batch function that answered a
        // different number would hand outcomes to the wrong steps. Nobody gets one then; every
        // asker sees the task as gone and retries (the function is a bug to fix).
        if answers.len() == replies.len() {
            // A reply whose asker gave up (its delivery was abandoned) is simply dropped.
            for (reply, answer) in replies.into_iter().zip(answers) {
                let _ = reply.send(answer);
            }
        } else {
            tracing::error!(
                asked = replies.len(),
                answered = answers.len(),
                "a group-commit batch answered the wrong number of requests; its steps are retried"
            );
        }
    }
}
