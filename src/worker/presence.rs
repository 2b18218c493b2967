//! The presence connection: one Postgres connection per worker process whose backend pid is
//! stored with every lease the process takes. When the process dies (kill -9, OOM), the kernel
//! closes its sockets, Postgres ends that backend, and other workers may claim its leases at once
//! instead of waiting for them to expire. A frozen process keeps the connection, and so keeps its
//! leases until they expire; fencing then refuses its late writes.

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
        match store::connect_one(&engine.settings.database).await {
            Ok(mut conn) => {
                backoff = Duration::from_millis(200);
                match store::backend_pid(&mut conn).await {
                    Ok(pid) => engine.presence_pid.store(pid, Ordering::SeqCst),
                    Err(e) => {
                        tracing::warn!(error = %crate::error::Report(&e), "presence connection: cannot read its pid")
                    }
                }
                keep_alive(&mut conn, &shutdown).await;
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

async fn keep_alive(conn: &mut sqlx::PgConnection, shutdown: &CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
        if let Err(e) = conn.ping().await {
            tracing::warn!(error = %crate::error::Report(&e), "presence connection lost; reconnecting");
            return;
        }
    }
}

/// The pid to store with a new lease, if the presence connection is up.
pub(super) fn pid(engine: &Engine) -> Option<i32> {
    Some(engine.presence_pid.load(Ordering::SeqCst)).filter(|p| *p != 0)
}
