//! Retention: finished runs are removed after their workflow's keep time (archived first when
//! `retention.archive_dir` is set), leaving a tombstone that keeps a late start of the same run
//! id from starting it again; tombstones, processed message ids and audit rows age out.
//!
//! A pass works in small batches, each one transaction: take the pruner's turn (one process at
//! a time, `store::retention::take_turn`), lock up to `retention.batch` due runs (`SKIP
//! LOCKED`), write their archive files, remove them with every row that belongs to them and
//! leave their tombstones, commit. A run is never removed before its archive file is written
//! (fsynced); a crash between the file and the commit leaves the run, and the next pass
//! writes the file again. The hot path never waits for it: the batches touch only finished
//! runs, which no step locks. `trailmark prune` runs the same pass by hand.

mod archive;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

pub use archive::file_name;

use crate::config::RetentionSettings;
use crate::engine::Engine;
use crate::health::Loop;
use crate::store::{self, retention as sql};
use crate::store::retention::{Aged, Removed, Scope};

/// Retention errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A run's archive file could not be written; the run and every later one stay.
    #[error(
        "run {run_id} could not be archived to {path}: {source}; it is kept (with the rest of its batch) until its file can be written: check the directory's permissions and free space, or clear retention.archive_dir to remove runs without an archive"
    )]
    Archive {
        /// The run.
        run_id: String,
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Another process prunes and did not give its turn within a minute.
    #[error(
        "another process has been pruning for a minute; try again later, or let the background pruner (retention.interval_secs) do it"
    )]
    Busy,
    /// Postgres failed; the batch under way was rolled back, earlier batches stay done.
    #[error("pruning failed in Postgres")]
    Store(#[from] store::Error),
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Store(e.into())
    }
}

/// What a pass removes and keeps: the settings, or a by-hand override.
#[derive(Debug, Clone)]
pub struct Policy {
    keep_secs: u64,
    workflows: BTreeMap<String, u64>,
    archive_dir: Option<PathBuf>,
    tombstone_secs: u64,
    inbox_secs: u64,
    audit_secs: u64,
    batch: i64,
    duty_percent: u32,
}

impl Policy {
    /// The configured policy.
    pub fn from_settings(s: &RetentionSettings) -> Self {
        Self {
            keep_secs: s.keep_secs,
            workflows: s.workflows.clone(),
            archive_dir: (!s.archive_dir.is_empty()).then(|| PathBuf::from(&s.archive_dir)),
            tombstone_secs: s.tombstone_secs,
            inbox_secs: s.inbox_secs,
            audit_secs: s.audit_secs,
            batch: s.batch as i64,
            duty_percent: s.duty_percent.clamp(1, 100) as u32,
        }
    }

    /// The same, spending `percent` (1-100) of its time in batches (`trailmark prune --duty`).
    pub fn duty(mut self, percent: u32) -> Self {
        self.duty_percent = percent.clamp(1, 100);
        self
    }

    /// Rests after a batch that took `took`, so that batches fill `duty_percent` of the time:
    /// on a busy machine a batch takes longer and the rest with it, so the pruner's share of
    /// the machine stays bounded whatever its speed.
    /// `beat` is called at least once a second while it rests, so the loop's liveness
    /// (`/livez`) does not take a long rest for a stuck pruner.
    async fn rest(&self, took: Duration, mut beat: impl FnMut()) {
        let mut left = self.rest_after(took);
        while !left.is_zero() {
            let slice = left.min(Duration::from_secs(1));
            tokio::time::sleep(slice).await;
            left -= slice;
            beat();
        }
    }

    fn rest_after(&self, took: Duration) -> Duration {
        let duty = self.duty_percent;
        took * (100 - duty) / duty
    }

    /// The same, with every workflow's finished runs kept only `older_than` (`trailmark prune
    /// --older-than`).
    pub fn older_than(mut self, older_than: Duration) -> Self {
        self.keep_secs = older_than.as_secs().max(1);
        self.workflows.clear();
        self
    }

    /// Whether any finished run is ever removed under it.
    pub fn removes_runs(&self) -> bool {
        self.keep_secs > 0 || self.workflows.values().any(|k| *k > 0)
    }

    /// Each workflow with a keep time of its own or deployed here, and its keep time (0: for
    /// ever), then the keep time of every other workflow.
    fn scopes(&self, deployed: Vec<String>) -> (Vec<(String, u64)>, u64) {
        let mut named: BTreeMap<String, u64> =
            deployed.into_iter().map(|w| (w, self.keep_secs)).collect();
        named.extend(self.workflows.clone());
        (named.into_iter().collect(), self.keep_secs)
    }
}

/// What a pass removed (or, in a dry run, would remove).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Pruned {
    /// Whether nothing was removed (a dry run).
    pub dry_run: bool,
    /// Rows removed with runs, by table.
    pub removed: Removed,
    /// Runs written to the archive directory.
    pub archived: u64,
    /// The runs, oldest first within each workflow (a dry run lists at most
    /// `retention.batch` per workflow).
    pub run_ids: Vec<String>,
    /// Tombstones, inbox ids and audit rows aged out (a dry run counts at most a batch each).
    pub aged: BTreeMap<&'static str, i64>,
}

/// One pass: every due run in batches, then what aged out. `on_batch` sees the totals after
/// each batch and at least once a second while the pruner rests (the CLI prints progress, the
/// background pruner beats its liveness).
pub async fn prune(
    engine: &Engine,
    policy: &Policy,
    dry_run: bool,
    mut on_batch: impl FnMut(&Pruned),
) -> Result<Pruned, Error> {
    let mut done = Pruned {
        dry_run,
        ..Pruned::default()
    };
    let (named, default_keep) = policy.scopes(engine.registry.names());
    let names: Vec<String> = named.iter().map(|(w, _)| w.clone()).collect();
    let mut scopes: Vec<(Scope<'_>, u64)> = named
        .iter()
        .map(|(w, keep)| (Scope::Workflow(w), *keep))
        .collect();
    scopes.push((Scope::Others(&names), default_keep));
    for (scope, keep) in scopes.into_iter().filter(|(_, keep)| *keep > 0) {
        loop {
            let (n, worked) = batch(engine, policy, scope, keep, dry_run, &mut done).await?;
            on_batch(&done);
            // Not only a full batch calls for another: a removed parent makes its children
            // due, which the next batch takes.
            if dry_run || n == 0 {
                break;
            }
            policy.rest(worked, || on_batch(&done)).await;
        }
    }
    for (what, secs) in [
        (Aged::Tombstones, policy.tombstone_secs),
        (Aged::Debounced, policy.tombstone_secs),
        (Aged::Inbox, policy.inbox_secs),
        (Aged::Audit, policy.audit_secs),
    ] {
        if secs > 0 {
            let n = age_out(engine, policy, (what, secs), dry_run, &mut || on_batch(&done)).await?;
            *done.aged.entry(what.name()).or_default() += n;
        }
    }
    Ok(done)
}

/// One batch of one scope in one transaction; returns how many runs were due and how long the
/// batch worked once it had the pruner's turn (what its rest is measured from: waiting for
/// another process's batch is not work).
async fn batch(
    engine: &Engine,
    policy: &Policy,
    scope: Scope<'_>,
    keep: u64,
    dry_run: bool,
    done: &mut Pruned,
) -> Result<(usize, Duration), Error> {
    let mut tx = my_turn(engine).await?;
    let started = std::time::Instant::now();
    let due = sql::due(&mut tx, scope, keep as i64, policy.batch).await?;
    let ids: Vec<String> = due.iter().map(|d| d.run_id.clone()).collect();
    if dry_run || ids.is_empty() {
        done.run_ids.extend(ids);
        tx.rollback().await?;
        return Ok((due.len(), started.elapsed()));
    }
    let archived_to = match &policy.archive_dir {
        Some(dir) => {
            let docs = sql::export(&mut *tx, &ids).await?;
            let paths = archive::write(dir, docs).await?;
            ids.iter().map(|id| paths.get(id).cloned()).collect()
        }
        None => vec![None; ids.len()],
    };
    let removed = sql::remove(&mut tx, &ids, &archived_to).await?;
    tx.commit().await?;
    let archived = archived_to.iter().flatten().count() as u64;
    crate::metrics::pruned(&removed, archived);
    tracing::info!(runs = removed.runs, steps = removed.steps, journal = removed.journal, archived, "finished runs removed");
    done.removed.add(removed);
    done.archived += archived;
    done.run_ids.extend(ids);
    Ok((due.len(), started.elapsed()))
}

/// Removes (or counts) what of `what` is older than `secs`, a batch at a time, calling `beat`
/// after each batch and while it rests.
async fn age_out(
    engine: &Engine,
    policy: &Policy,
    (what, secs): (Aged, u64),
    dry_run: bool,
    beat: &mut impl FnMut(),
) -> Result<i64, Error> {
    let mut total = 0;
    loop {
        let mut tx = my_turn(engine).await?;
        let started = std::time::Instant::now();
        let n = sql::forget(&mut *tx, what, secs as i64, policy.batch, dry_run).await?;
        tx.commit().await?;
        total += n;
        beat();
        if dry_run || n < policy.batch {
            crate::metrics::aged_out(what.name(), total);
            return Ok(total);
        }
        policy.rest(started.elapsed(), &mut *beat).await;
    }
}

/// A transaction holding the pruner's turn, waiting up to a minute for another process's
/// batch to end.
async fn my_turn(engine: &Engine) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, Error> {
    for _ in 0..600 {
        let mut tx = engine.pool.begin().await?;
        if sql::take_turn(&mut tx).await? {
            return Ok(tx);
        }
        tx.rollback().await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(Error::Busy)
}

/// The background pruner: a pass every `retention.interval_secs` until `shutdown` fires. It
/// beats every second while it sleeps, so `/livez` never takes a long interval for a stuck loop.
pub async fn run(engine: Arc<Engine>, shutdown: CancellationToken) -> Result<(), store::Error> {
    let policy = Policy::from_settings(&engine.settings.retention);
    let period = Duration::from_secs(engine.settings.retention.interval_secs);
    engine.health.runs(Loop::Pruner);
    let mut next = tokio::time::Instant::now();
    loop {
        engine.health.beat(Loop::Pruner);
        if tokio::time::Instant::now() >= next {
            let pass = prune(&engine, &policy, false, |_| engine.health.beat(Loop::Pruner));
            // A pass over a long history takes minutes at its duty; a shutdown does not wait
            // for it. Dropping it mid-batch rolls that batch's transaction back (an archive file
            // it wrote is written again by the next pass).
            let done = tokio::select! {
                done = pass => done,
                _ = shutdown.cancelled() => return Ok(()),
            };
            match done {
                Ok(_) => crate::metrics::prune_finished(),
                Err(Error::Busy) => {}
                Err(e) => {
                    tracing::warn!(error = %crate::error::Report(&e), "pruning failed; will try again")
                }
            }
            next = tokio::time::Instant::now() + period;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_secs(1).min(period)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(duty: u64) -> Policy {
        let mut s = crate::config::Settings::load_from(None).expect("default settings");
        s.retention.duty_percent = duty;
        Policy::from_settings(&s.retention)
    }

    #[test]
    fn a_pruner_rests_so_that_its_batches_fill_its_duty_of_the_time() {
        let took = Duration::from_millis(30);
        assert_eq!(policy(10).rest_after(took), Duration::from_millis(270));
        assert_eq!(policy(50).rest_after(took), took);
        assert_eq!(policy(100).rest_after(took), Duration::ZERO);
        assert_eq!(policy(100).duty(25).rest_after(took), Duration::from_millis(90));
        // Out of range: the configuration refuses it; the policy keeps to 1..=100 anyway.
        assert_eq!(policy(10).duty(0).rest_after(took), took * 99);
    }
}
