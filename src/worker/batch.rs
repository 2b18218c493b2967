//! The worker's group-commit statements: lease claims and step commits (see [`crate::batch`]).

use std::sync::Arc;

use crate::batch::Batcher;
use crate::engine::Engine;
use crate::store::{self, checkpoint, runs};

/// The worker's batched statements.
#[derive(Clone)]
pub(super) struct Batches {
    /// Lease claims of step deliveries.
    pub claims: Batcher<runs::ClaimRequest, store::Result<runs::ClaimOutcome>>,
    /// Step commits.
    pub commits: Batcher<checkpoint::StepCommit, store::Result<bool>>,
}

impl Batches {
    /// Starts both batchers on the engine's pool; `worker.max_batch` of 1 runs every statement alone.
    pub fn start(engine: &Arc<Engine>) -> Self {
        let max = engine.settings.worker.max_batch;
        let pool = engine.pool.clone();
        let claims = Batcher::start(max, move |reqs| {
            let pool = pool.clone();
            async move { runs::claim_all(&pool, &reqs).await }
        });
        let pool = engine.pool.clone();
        let commits = Batcher::start(max, move |steps| {
            let pool = pool.clone();
            async move { checkpoint::commit_all(&pool, &steps).await }
        });
        Self { claims, commits }
    }
}
