//! Group commit: the statements that concurrent work reaches at the same moment are gathered
//! and run as one statement, so N steps pay one round trip, one executor set-up and one commit
//! instead of N. Used by the step transaction (`step_tx.rs`) for lease claims, effect intents,
//! journal entries and effect results, and step commits.
//!
//! Nothing waits on a timer: a batch is whatever queued while the previous batch of its kind was
//! running. An unloaded process therefore runs each statement alone and at once (no added
//! latency), and a loaded one batches more as its load grows.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::store::{Error, Result};

/// One queued request and where its answer goes.
type Pending<Req, T> = (Req, oneshot::Sender<Result<T>>);

/// Runs requests of one kind in batches, one task per kind.
pub(crate) struct Batcher<Req, T> {
    queue: mpsc::UnboundedSender<Pending<Req, T>>,
}

impl<Req: Send + 'static, T: Send + 'static> Batcher<Req, T> {
    /// Starts the task that runs up to `max` requests at a time through `run`, which must answer
    /// each request, in order. The task ends when the batcher is dropped.
    pub fn start<F, Fut>(max: usize, run: F) -> Self
    where
        F: Fn(Vec<Req>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<Result<T>>> + Send + 'static,
    {
        let (queue, rx) = mpsc::unbounded_channel();
        tokio::spawn(drive(rx, max.max(1), run));
        Self { queue }
    }

    /// Queues `req` and waits for its answer. If the batch task is gone (it panicked, or its
    /// batch answered the wrong number of requests) the error is an infrastructure one, so the
    /// delivery is retried.
    pub async fn call(&self, req: Req) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        let gone = || Error::Unavailable {
            what: "a group-commit task of this process stopped; retrying".into(),
            source: None,
        };
        self.queue.send((req, tx)).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

/// Batches in flight at once per kind. One: requests that arrive while a batch runs wait for it
/// and go together in the next. Measured with `trailmark bench` (1,000 runs): two lanes split the
/// batches (1.8 steps per batch instead of 2.5) and cost more CPU per step than they saved in wait.
const LANES: usize = 1;

async fn drive<Req, T, F, Fut>(mut rx: mpsc::UnboundedReceiver<Pending<Req, T>>, max: usize, run: F)
where
    Req: Send + 'static,
    T: Send + 'static,
    F: Fn(Vec<Req>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<Result<T>>> + Send + 'static,
{
    let lanes = Arc::new(Semaphore::new(LANES));
    let mut pending = Vec::with_capacity(max);
    loop {
        let lane = lanes.clone().acquire_owned().await.expect("never closed");
        if rx.recv_many(&mut pending, max).await == 0 {
            return;
        }
        let (reqs, replies): (Vec<Req>, Vec<oneshot::Sender<Result<T>>>) =
            pending.drain(..).unzip();
        let answers = run(reqs);
        tokio::spawn(async move {
            let answers = answers.await;
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
            drop(lane);
        });
    }
}
