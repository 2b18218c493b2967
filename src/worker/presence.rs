//! The presence connection: one Postgres connection per worker process whose backend pid is
//! stored with every lease the process takes. When the process dies (kill -9, OOM), the kernel
//! closes its sockets, Postgres ends that backend, and other workers may claim its leases at once
//! instead of waiting for them to expire. A frozen process keeps the connection, and so keeps its
//! leases until they expire; fencing then refuses its late writes. The connection also beats (a
//! query every `worker.heartbeat_secs`) under an `application_name` naming the worker, so that
//! the others see a frozen process by its silence (`sweep.rs`).

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
                keep_alive(&mut conn, engine.settings.worker.heartbeat(), &shutdown).await;
                engine.presence_pid.store(0, Ordering::SeqCst);
                let _ = conn.close().await;
            }
            Err(e) => {
                tracing::warn!(error = %crate::error::Report(&e), "presence connection failed; leases fall back to expiry")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.cancelled() => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Beats every `period` until `shutdown` or until the connection fails.
async fn keep_alive(conn: &mut sqlx::PgConnection, period: Duration, shutdown: &CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        if let Err(e) = store::stranded::beat(&mut *conn).await {
            tracing::warn!(error = %crate::error::Report(&e), "presence connection lost; reconnecting");
            return;
        }
    }
}

/// The pid to store with a new lease, if the presence connection is up.
pub(super) fn pid(engine: &Engine) -> Option<i32> {
    Some(engine.presence_pid.load(Ordering::SeqCst)).filter(|p| *p != 0)
}
