//! Following a Postgres failover. The driver takes one host per URL (libpq's
//! `host1:5432,host2:5432` with `target_session_attrs=read-write` is refused), so the standby
//! hosts are a list of their own, `database.hosts`: trailmark connects only to the host that
//! takes writes, and a task per pool moves the pool to the new primary when that changes.
//!
//! Why checking once a second is enough: every statement sent to a lost or demoted primary
//! fails (connection refused or reset, or SQLSTATE 25006 on a standby) and is retried like any
//! other infrastructure failure, so the check only bounds how long those retries go on; a
//! failover itself takes longer (about 10 s with pg_auto_failover's shortest health checks).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

use super::{Error, Result};
use crate::config::DatabaseSettings;

/// How often a pool checks that its host still takes writes.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// How long that check may take before the hosts are asked which one takes writes.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether `pool`'s host takes writes, asked on an idle connection of the pool or, when all are
/// busy, on a connection of its own: through `acquire` a lost host would cost the whole acquire
/// timeout, the pool retrying the refused connect until then.
async fn still_writable(pool: &PgPool) -> sqlx::Result<bool> {
    match pool.try_acquire() {
        Some(mut conn) => takes_writes(&mut conn).await,
        None => probe(&pool.connect_options()).await,
    }
}

/// `base` pointed at each of `settings.hosts` (`host` or `host:port`; the port defaults to the
/// URL's), in the order given.
fn candidates(settings: &DatabaseSettings, base: &PgConnectOptions) -> Vec<PgConnectOptions> {
    settings
        .hosts
        .iter()
        .map(|h| {
            let (host, port) = crate::config::split_host(h);
            base.clone()
                .host(host)
                .port(port.unwrap_or(base.get_port()))
        })
        .collect()
}

/// Whether the server behind `conn` takes writes: libpq's own test for
/// `target_session_attrs=read-write` (a standby, or a primary set read-only, says `on`).
async fn takes_writes(conn: &mut PgConnection) -> sqlx::Result<bool> {
    let read_only: String = sqlx::query_scalar("SHOW transaction_read_only")
        .fetch_one(conn)
        .await?;
    Ok(read_only == "off")
}

fn at(o: &PgConnectOptions) -> String {
    format!("{}:{}", o.get_host(), o.get_port())
}

/// Whether the host of `candidate` takes writes, asked in the URL's database or, while that
/// does not exist yet (before `migrate` creates it), in `postgres`.
async fn probe(candidate: &PgConnectOptions) -> sqlx::Result<bool> {
    let mut conn = match candidate.connect().await {
        Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("3D000") => {
            candidate.clone().database("postgres").connect().await?
        }
        other => other?,
    };
    let writes = takes_writes(&mut conn).await;
    let _ = conn.close().await;
    writes
}

/// The options of the first of `settings.hosts` that takes writes (`base` itself when no hosts
/// are listed). Refused logins on every host are a configuration error; anything else is worth
/// waiting for (a failover in progress).
pub(super) async fn writable(
    settings: &DatabaseSettings,
    base: PgConnectOptions,
) -> Result<PgConnectOptions> {
    if settings.hosts.is_empty() {
        return Ok(base);
    }
    let timeout = Duration::from_millis(settings.connect_timeout_ms);
    let mut why = Vec::new();
    let mut refusals = 0;
    for candidate in candidates(settings, &base) {
        match tokio::time::timeout(timeout, probe(&candidate)).await {
            Ok(Ok(true)) => return Ok(candidate),
            Ok(Ok(false)) => why.push(format!("{} is read-only (a standby?)", at(&candidate))),
            Ok(Err(e)) => {
                let refused = matches!(super::down(settings, e), Error::Misconfigured { .. });
                refusals += usize::from(refused);
                why.push(format!(
                    "{} {}",
                    at(&candidate),
                    if refused {
                        "refused the login"
                    } else {
                        "cannot be reached"
                    }
                ));
            }
            Err(_) => why.push(format!("{} did not answer in {timeout:?}", at(&candidate))),
        }
    }
    let what = format!(
        "no host of database.hosts takes writes ({}): a failover may be in progress; trailmark goes on trying, or fix database.hosts",
        why.join("; ")
    );
    if refusals == settings.hosts.len() {
        return Err(Error::misconfigured(
            format!(
                "every host of database.hosts refused the login: fix the user, password or database in DATABASE_URL ({})",
                why.join("; ")
            ),
            std::io::Error::other("login refused"),
        ));
    }
    Err(Error::unavailable(
        what,
        std::io::Error::other("no primary"),
    ))
}

/// When the pool last moved to another host: connections opened before it go to the old one.
type Moved = Arc<Mutex<Instant>>;

/// Adds to `pool` what following a failover needs: connections opened before the pool last
/// moved are dropped at checkout instead of failing their first statement.
pub(super) fn prepare(pool: PgPoolOptions, moved: &Moved) -> PgPoolOptions {
    let moved = moved.clone();
    pool.before_acquire(move |_, meta| {
        let since_move = moved.lock().map(|m| m.elapsed()).unwrap_or_default();
        Box::pin(async move { Ok(meta.age < since_move) })
    })
}

/// A fresh marker for [`prepare`] and [`follow`].
pub(super) fn moved_marker() -> Moved {
    Arc::new(Mutex::new(Instant::now()))
}

/// Checks once a second that `pool`'s host takes writes and, when it does not (or cannot be
/// reached), moves the pool to the host that does, with the pool's own session settings.
/// Ends when the pool is closed.
pub(super) fn follow(pool: PgPool, settings: DatabaseSettings, moved: Moved) {
    if settings.hosts.is_empty() {
        return;
    }
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            if pool.is_closed() {
                return;
            }
            if let Ok(Ok(true)) = tokio::time::timeout(CHECK_TIMEOUT, still_writable(&pool)).await {
                continue;
            }
            let current = at(&pool.connect_options());
            let base = (*pool.connect_options()).clone();
            match writable(&settings, base).await {
                Ok(next) if at(&next) != current => {
                    tracing::warn!(
                        from = %current,
                        to = %at(&next),
                        "the Postgres primary moved (failover): new connections go to the host that takes writes"
                    );
                    pool.set_connect_options(next);
                    if let Ok(mut m) = moved.lock() {
                        *m = Instant::now();
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "waiting for a Postgres host that takes writes")
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use crate::config::split_host;

    #[test]
    fn hosts_are_read_with_and_without_their_port() {
        assert_eq!(split_host("db1:5433"), ("db1", Some(5433)));
        assert_eq!(split_host(" db2 "), ("db2", None));
        assert_eq!(split_host("[::1]:5432"), ("::1", Some(5432)));
        assert_eq!(split_host("10.0.0.7"), ("10.0.0.7", None));
    }
}
