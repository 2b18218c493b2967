//! The presence connection: one Postgres connection per worker process whose backend pid is
//! stored with every lease the process takes. When the process dies (kill -9, OOM), the kernel
//! closes its sockets, Postgres ends that backend, and other workers may claim its leases at once
//! instead of waiting for them to expire. A frozen process keeps the connection, and so keeps its
//! leases until they expire; fencing then refuses its late writes. The connection also beats (a
//! query every `worker.heartbeat_secs`) under an `application_name` naming the worker, so that
//! the others see a frozen process by its silence (`sweep.rs`). Each beat also renews the leases
//! of the process's executing steps (`lease.rs`): a connection of its own, that busy steps
//! cannot hold, keeps them; while it is down, they are renewed through the pool.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::Connection;
use tokio_util::sync::CancellationToken;

use crate::engine::Engine;
use crate::store;

/// Holds the presence connection until `shutdown`, reconnecting if it drops.
pub(super) async fn hold(engine: Arc<Engine>, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(200);
    while !shutdown.is_cancelled() {
        let name = format!("{}{}", store::stranded::PRESENCE_APPLICATION, engine.worker_id);
        match store::connect_named(&engine.settings.database, &name).await {
            Ok(mut conn) => {
                backoff = Duration::from_millis(200);
                match store::backend_pid(&mut conn).await {
                    Ok(pid) => engine.presence_pid.store(pid, Ordering::SeqCst),
                    Err(e) => {
                        tracing::warn!(error = %crate::error::Report(&e), "presence connection: cannot read its pid")
                    }
                }
                keep_alive(&engine, &mut conn, &shutdown).await;
                engine.presence_pid.store(0, Ordering::SeqCst);
                let _ = conn.close().await;
            }
            Err(e) => {
                tracing::warn!(error = %crate::error::Report(&e), "presence connection failed; leases fall back to expiry")
            }
        }
        renew(&engine, &engine.pool, None).await;
        tokio::select! {
            _ = tokio::time::sleep(backoff.min(engine.settings.worker.heartbeat())) => {}
            _ = shutdown.cancelled() => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
    // Stopping: the versions it carries are no longer carried here (a step of them that
    // another worker meets waits only for the live ones).
    if let Err(e) = store::deployments::unregister(&engine.pool, &engine.worker_id).await {
        tracing::warn!(error = %crate::error::Report(&e), "could not remove this worker's workflow versions from trailmark.deployments; they stop counting when its presence backend ends");
    }
}

/// Records the workflow versions this process carries, under its presence backend's `pid`;
/// `false`: it could not, and the next beat tries again.
async fn announce(engine: &Engine, conn: &mut sqlx::PgConnection, pid: i32) -> bool {
    let deployed = engine.registry.deployed();
    match store::deployments::register(conn, &engine.worker_id, pid, &deployed).await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %crate::error::Report(&e), "could not record this worker's workflow versions in trailmark.deployments; trying again at the next beat (meanwhile a step of a version only this worker carries, met by another worker, waits a lease, then stops its run for review)");
            false
        }
    }
}

/// Announces the versions the process carries (again at each beat until that succeeds), then
/// beats and renews the process's leases every `worker.heartbeat_secs` until `shutdown` or
/// until the connection fails.
async fn keep_alive(engine: &Engine, conn: &mut sqlx::PgConnection, shutdown: &CancellationToken) {
    let mut ticker = tokio::time::interval(engine.settings.worker.heartbeat());
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut announced = false;
    loop {
        if !announced && let Some(pid) = pid(engine) {
            announced = announce(engine, conn, pid).await;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        if let Err(e) = store::stranded::beat(&mut *conn).await {
            tracing::warn!(error = %crate::error::Report(&e), "presence connection lost; reconnecting");
            return;
        }
        renew(engine, &mut *conn, pid(engine)).await;
    }
}

/// Renews the process's leases through `db`; a failure is told and the next beat tries again
/// (a lease outlasts several beats: `worker.heartbeat_secs` is checked to be below it).
async fn renew(engine: &Engine, db: impl sqlx::PgExecutor<'_>, presence_pid: Option<i32>) {
    let lease = engine.settings.worker.lease_secs as f64;
    if let Err(e) = engine.leases.renew(db, lease, presence_pid).await {
        tracing::warn!(error = %crate::error::Report(&e), "lease renewal failed; will try again at the next beat");
    }
}

/// The pid to store with a new lease, if the presence connection is up.
pub(super) fn pid(engine: &Engine) -> Option<i32> {
    Some(engine.presence_pid.load(Ordering::SeqCst)).filter(|p| *p != 0)
}
