//! All SQL. Every function takes an executor, so a caller that begins a transaction owns it; the
//! hot path needs none: its claim, effect intent and step commit are one statement each.

pub mod audit;
pub mod checkpoint;
pub mod children;
pub mod console_sessions;
pub mod debounce;
pub mod decisions;
pub mod deployments;
pub mod effects;
mod failover;
pub mod flow;
pub mod forks;
pub mod history;
pub mod idempotency;
pub mod inbox;
pub(crate) mod inspect;
pub mod journal;
pub mod model_usage;
pub mod outbox;
pub mod parked;
pub mod progress;
pub mod records;
pub mod retention;
pub mod runs;
pub mod schedules;
pub mod shadow;
pub mod steps;
pub mod stranded;
mod types;
pub mod versions;
pub mod waits;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{ConnectOptions, PgPool};

use crate::config::DatabaseSettings;
use crate::error::{Cause, Reaction};
use crate::redact;

/// Store errors, split by how the caller reacts to them ([`Error::reaction`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Postgres failed or could not be reached; nothing was decided. Retry later.
    #[error("{what}")]
    Unavailable {
        /// What failed, with what to do about it.
        what: String,
        /// Why.
        #[source]
        source: Option<Cause>,
    },
    /// Postgres refuses what no retry can fix: a malformed URL, a wrong password, a missing
    /// database or role, a schema this build cannot use. A person must fix the configuration.
    #[error("{what}")]
    Misconfigured {
        /// What is wrong, with what to do about it.
        what: String,
        /// Why.
        #[source]
        source: Option<Cause>,
    },
    /// A newer lease holder owns the run: roll back and drop the work.
    #[error(
        "run {run_id}: fenced out (fence {fence} is no longer current); a newer worker owns the run"
    )]
    FencedOut {
        /// The run.
        run_id: String,
        /// The stale fence.
        fence: i64,
    },
    /// The same idempotency key was used with a different request.
    #[error(
        "idempotency key {key} was already used with a different request (stored hash {stored}, new hash {new}); fix the key recipe or the request, then resume"
    )]
    Conflict {
        /// The reused key.
        key: String,
        /// Hash stored with the first use.
        stored: String,
        /// Hash of the new request.
        new: String,
    },
    /// A step's local write (`ctx.local_write`) was refused: a row already standing under its
    /// key holds other values, or the row does not fit its table. Nothing of the step was
    /// committed.
    #[error(
        "run {run_id} step at position {seq}: {what}; nothing of the step was committed: fix the row or the workflow, then resume"
    )]
    LocalWrite {
        /// The run.
        run_id: String,
        /// The step's position.
        seq: i32,
        /// Which write, and what Postgres said.
        what: String,
    },
}

impl Error {
    /// Postgres failed or could not be reached while doing `what`.
    pub fn unavailable(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        Self::Unavailable {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// The configuration is wrong: `what` says what and how to fix it.
    pub fn misconfigured(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        Self::Misconfigured {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// How a caller reacts to this error.
    pub fn reaction(&self) -> Reaction {
        match self {
            Self::Unavailable { .. } => Reaction::Retry,
            Self::Misconfigured { .. } => Reaction::Fix,
            Self::FencedOut { .. } | Self::Conflict { .. } | Self::LocalWrite { .. } => {
                Reaction::Refused
            }
        }
    }

    /// The driver's error behind this one, if any.
    pub fn sqlx_cause(&self) -> Option<&sqlx::Error> {
        match self {
            Self::Unavailable { source, .. } | Self::Misconfigured { source, .. } => {
                source.as_deref()?.downcast_ref()
            }
            _ => None,
        }
    }
}

/// SQLSTATEs no retry can fix: authorization refused (class 28), database missing (3D000),
/// privilege missing (42501), schema or table missing (3F000, 42P01: the database was never
/// migrated).
const MISCONFIGURED_STATES: [&str; 4] = ["3D000", "42501", "3F000", "42P01"];

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        let code = e.as_database_error().and_then(|d| d.code());
        let misconfigured = matches!(e, sqlx::Error::Configuration(_))
            || code
                .as_deref()
                .is_some_and(|c| c.starts_with("28") || MISCONFIGURED_STATES.contains(&c));
        let unreadable = matches!(e, sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_));
        if code.as_deref() == Some("25006") {
            // A standby (or a demoted primary) behind a stale connection: a failover.
            Self::unavailable(
                "the database is read-only (a standby; a failover in progress?): retried until a primary takes writes; with database.hosts trailmark moves to it",
                e,
            )
        } else if misconfigured {
            Self::misconfigured("the database refused the request", e)
        } else if unreadable {
            Self::misconfigured(
                "the database holds a value this build cannot read (written by a newer trailmark?)",
                e,
            )
        } else {
            Self::unavailable("database error", e)
        }
    }
}

/// A Postgres statement being bound (the fragments that several statements share bind into it).
pub(crate) type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// Shorthand for store results.
pub type Result<T> = std::result::Result<T, Error>;

/// The migrations under `migrations/`, compiled in.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Query parameters the Postgres driver does not know and would log with their values, which
/// are secrets: removed before it parses the URL.
const UNSUPPORTED_SECRETS: [&str; 1] = ["sslpassword"];

/// `url` without [`UNSUPPORTED_SECRETS`], saying (without the values) which were dropped.
fn without_unsupported_secrets(url: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else {
        return url.to_owned();
    };
    let pairs: Vec<(String, String)> = parsed
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    let (dropped, kept): (Vec<_>, Vec<_>) = pairs
        .into_iter()
        .partition(|(k, _)| UNSUPPORTED_SECRETS.contains(&k.as_str()));
    if dropped.is_empty() {
        return url.to_owned();
    }
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        for (key, _) in &dropped {
            tracing::warn!(
                "DATABASE_URL sets {key}, which the Postgres driver does not support; it is ignored (use an unencrypted client key)"
            );
        }
    });
    let query = url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(kept)
        .finish();
    parsed.set_query((!query.is_empty()).then_some(query.as_str()));
    parsed.to_string()
}

/// Reads a Postgres URL the way every connection of trailmark does (parameters the driver
/// would print with their secret values removed first). Without `sslmode` in the URL (or
/// `PGSSLMODE`) the connection is not encrypted, as before this build had TLS at all; see
/// [`DEFAULT_SSL_MODE`].
pub fn parse_url(url: &str) -> Result<PgConnectOptions> {
    let options: PgConnectOptions = without_unsupported_secrets(url).parse().map_err(|e| {
        Error::misconfigured(
            format!(
                "DATABASE_URL {} is not a valid Postgres URL",
                redact::url(url)
            ),
            e,
        )
    })?;
    let chosen = url_param(url, &["sslmode", "ssl-mode"]).is_some()
        || std::env::var_os("PGSSLMODE").is_some();
    Ok(if chosen {
        options
    } else {
        options.ssl_mode(DEFAULT_SSL_MODE)
    })
}

/// The TLS mode of a URL that names none. The driver's own default is libpq's `prefer`: TLS
/// whenever the server offers it, without checking its certificate, which protects against
/// nothing but a passive listener and would have switched every existing installation (Debian's
/// Postgres offers TLS out of the box) to encrypted, slower connections on upgrade, unasked.
/// TLS is asked for with `sslmode=verify-full` (or `require`, `verify-ca`).
pub const DEFAULT_SSL_MODE: PgSslMode = PgSslMode::Disable;

/// The first of `names` among a URL's query parameters, decoded.
fn url_param(url: &str, names: &[&str]) -> Option<String> {
    url::Url::parse(url)
        .ok()?
        .query_pairs()
        .find(|(k, _)| names.contains(&k.as_ref()))
        .map(|(_, v)| v.into_owned())
}

/// What a failed TLS setup with Postgres means, with what to fix; `None` when TLS is not what
/// failed. A refused certificate is named with the URL parameter that decides it.
fn tls_refused(settings: &DatabaseSettings, e: &sqlx::Error) -> Option<String> {
    use crate::config::tls::Refusal;
    let at = redact::url(&settings.url);
    let mode = url_param(&settings.url, &["sslmode", "ssl-mode"]).unwrap_or_default();
    if let sqlx::Error::Tls(why) = e {
        let why = why.to_string();
        return Some(if why.contains("does not support TLS") {
            format!(
                "Postgres at {at} does not offer TLS, and DATABASE_URL asks for it (sslmode={mode}): turn `ssl = on` in its postgresql.conf, with a certificate"
            )
        } else {
            format!(
                "the TLS setup for Postgres at {at} failed ({why}): check sslrootcert, sslcert and sslkey in DATABASE_URL"
            )
        });
    }
    let refusal = crate::config::tls::refusal(e)?;
    let host = parse_url(&settings.url)
        .map(|o| o.get_host().to_owned())
        .unwrap_or_default();
    Some(match refusal {
        Refusal::UnknownIssuer => {
            match url_param(&settings.url, &["sslrootcert", "ssl-root-cert", "ssl-ca"]) {
                Some(ca) => format!(
                    "the certificate of Postgres at {at} is not signed by the CA in DATABASE_URL's sslrootcert ({ca}): set sslrootcert to the CA that signed the server's certificate"
                ),
                None => format!(
                    "the certificate of Postgres at {at} is not signed by a CA trailmark trusts (the public web's): name the CA that signed it with sslrootcert=/path/ca.pem in DATABASE_URL"
                ),
            }
        }
        Refusal::WrongName { presented } => format!(
            "the certificate of Postgres at {at} does not name the host {host:?}{}: connect to a name the certificate holds, or give the server a certificate for {host:?} (sslmode=verify-ca would skip the host check)",
            crate::config::tls::it_names(&presented)
        ),
        alert @ Refusal::ServerAlert(_) => format!(
            "Postgres at {at} ended the TLS handshake {alert}: {}",
            if alert.about_client_certificate() {
                "it wants a client certificate or does not accept this one; check sslcert and sslkey in DATABASE_URL"
            } else {
                "check its TLS settings and the sslmode in DATABASE_URL"
            }
        ),
        other => format!(
            "the certificate of Postgres at {at} {other}: the server needs a valid certificate for sslmode={mode}"
        ),
    })
}

fn options(settings: &DatabaseSettings) -> Result<PgConnectOptions> {
    let opts = parse_url(&settings.url)?;
    // Statement logging would print bodies and ids at info level; keep it for debugging only.
    // Every statement trailmark runs looks rows up by key, several keys at a time in the
    // group-commit statements (arrays joined to the tables). The planner settings below keep those
    // plans to one index probe per key whatever the tables' statistics say:
    // - generic plans: with the default, Postgres re-plans the batch statements on every
    //   execution, because a plan made for a known array length always looks cheaper;
    // - nested loops, no sequential scans: with the statistics of a young table (a few hundred
    //   rows) a hash join over a whole table or index (all runs, all effects) looks cheaper than
    //   one probe per key, and that plan stays cached while the table grows. Measured with
    //   `trailmark bench --scale`: Postgres CPU per step 0.72 ms at 1,000 runs and 1.75 ms at
    //   10,000 before; see the README for after. A query with no index to use still scans.
    // - no JIT: a scan the settings above discourage still runs, but its cost now reads ten
    //   billion, far past `jit_above_cost`, so Postgres spent 50-150 ms compiling a query that
    //   runs in a millisecond (the console's counts of a one-row table took 80 ms). Trailmark's
    //   statements are short; none gains from compilation.
    Ok(opts
        .log_statements(tracing::log::LevelFilter::Trace)
        .options([
            ("plan_cache_mode", "force_generic_plan"),
            ("enable_seqscan", "off"),
            ("enable_hashjoin", "off"),
            ("enable_mergejoin", "off"),
            ("jit", "off"),
        ]))
}

/// Why a connection to Postgres failed, with the advice that fits the cause: a server that is
/// not reachable is worth waiting for; a refused login, a missing role or database is not.
fn down(settings: &DatabaseSettings, e: sqlx::Error) -> Error {
    // A certificate no retry will change: a person must fix the URL, the CA file or the server.
    if let Some(what) = tls_refused(settings, &e) {
        return Error::misconfigured(what, e);
    }
    let at = redact::url(&settings.url);
    let (user, database) = parse_url(&settings.url)
        .map(|o| {
            let db = o.get_database().unwrap_or("postgres").to_owned();
            (o.get_username().to_owned(), db)
        })
        .unwrap_or_default();
    let code = e.as_database_error().and_then(|d| d.code());
    match code.as_deref() {
        Some("28P01") => Error::misconfigured(
            format!(
                "Postgres at {at} refused the password of user {user:?}: fix the password in DATABASE_URL"
            ),
            e,
        ),
        Some(c) if c.starts_with("28") => Error::misconfigured(
            format!(
                "Postgres at {at} refused the login of user {user:?}: create the role, or fix the user in DATABASE_URL (or pg_hba.conf)"
            ),
            e,
        ),
        Some("3D000") => Error::misconfigured(
            format!(
                "database {database:?} does not exist at {at}: run `trailmark migrate` (it creates it), or fix the database name in DATABASE_URL"
            ),
            e,
        ),
        Some(_) => Error::unavailable(
            format!("Postgres at {at} is not accepting connections yet"),
            e,
        ),
        None => Error::unavailable(
            format!(
                "cannot connect to Postgres at {at} (is it running? Start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`, or fix the host and port in DATABASE_URL)"
            ),
            e,
        ),
    }
}

/// Opens a pool and checks it with one round trip, so a wrong URL fails at start-up. With
/// `database.hosts`, the pool connects to the host that takes writes and follows a failover
/// (see `failover.rs`).
pub async fn connect(settings: &DatabaseSettings) -> Result<PgPool> {
    let moved = failover::moved_marker();
    let pool = pool_options(settings.max_connections, settings, &moved)
        .acquire_timeout(Duration::from_millis(settings.connect_timeout_ms))
        .connect_with(writable_options(settings).await?)
        .await
        .map_err(|e| down(settings, e))?;
    failover::follow(pool.clone(), settings.clone(), moved);
    Ok(pool)
}

/// What every pool of trailmark shares.
fn pool_options(
    size: u32,
    settings: &DatabaseSettings,
    moved: &std::sync::Arc<std::sync::Mutex<std::time::Instant>>,
) -> PgPoolOptions {
    let pool = PgPoolOptions::new()
        .max_connections(size)
        // No liveness ping on every checkout (a round trip each, ~10% of a step's cost in
        // `trailmark bench`): a connection that died with a Postgres restart fails its first
        // statement instead, and every caller already retries infrastructure failures.
        .test_before_acquire(false);
    if settings.hosts.is_empty() {
        pool
    } else {
        failover::prepare(pool, moved)
    }
}

/// The URL's connect options, pointed at the host of `database.hosts` that takes writes when
/// hosts are listed.
pub async fn writable_options(settings: &DatabaseSettings) -> Result<PgConnectOptions> {
    failover::writable(settings, options(settings)?).await
}

/// A second pool on the same database whose commits do not wait for their WAL flush, for the
/// writes that a later synchronous commit makes durable anyway (journal entries, effect results,
/// step commits that only move a run on, removal of eagerly published outbox rows).
///
/// A record written here is visible at once and survives the worker's death; only a crash of
/// Postgres itself within `wal_writer_delay` can lose it, and then the step's later commits are
/// lost with it (WAL is written in order), so the step runs again. README "Trade-offs made for
/// speed" spells out what that costs.
///
/// Not with `database.hosts` or `database.relaxed_commits = false`: after a failover a step goes
/// on on the new primary, which never received the records its old primary acknowledged
/// without waiting for the standby, so the step's later commit there no longer carries them
/// (the Postgres cluster drill lost effect results that way); then the strict pool is returned.
pub fn relaxed_pool(pool: &PgPool, settings: &DatabaseSettings) -> PgPool {
    if !settings.relaxed_commits || !settings.hosts.is_empty() {
        return pool.clone();
    }
    let options = (*pool.connect_options())
        .clone()
        .options([("synchronous_commit", "off")]);
    let strict = pool.options();
    let moved = failover::moved_marker();
    let relaxed = pool_options(relaxed_size(strict.get_max_connections()), settings, &moved)
        .acquire_timeout(strict.get_acquire_timeout())
        .connect_lazy_with(options);
    failover::follow(relaxed.clone(), settings.clone(), moved);
    // Its first connection now, beside the strict pool's, rather than inside the first step that
    // needs one: there a connect that outlasts the acquire timeout (a name lookup that waits out
    // the resolver's 5 s timeout, seen in a compose network under load) fails the step, each
    // redelivery counts an attempt, and worker.max_attempts of them stop the run for review.
    // Retried for about two minutes, until it succeeds or the pool is closed (a step that comes
    // first opens one itself, as before).
    let first = relaxed.clone();
    tokio::spawn(async move {
        let mut wait = Duration::from_millis(100);
        for _ in 0..30 {
            if first.is_closed() || first.acquire().await.is_ok() {
                return;
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(5));
        }
    });
    relaxed
}

/// Half the strict pool: relaxed statements are short and a step holds one at a time.
fn relaxed_size(pool: u32) -> u32 {
    (pool / 2).max(1)
}

/// Most Postgres connections one process running a worker and a relay (`trailmark serve`) opens
/// with `database.max_connections = pool`: the pool, the relaxed pool, the worker's presence
/// connection, the relay's listener and the `/readyz` schema check (one at a time, however many
/// probes come). Size the server's `max_connections` with it.
pub fn connections_per_process(pool: u32) -> u32 {
    pool + relaxed_size(pool) + 3
}

/// One connection outside the pool, for a process's presence (see `worker::presence`).
pub async fn connect_one(settings: &DatabaseSettings) -> Result<sqlx::PgConnection> {
    writable_options(settings)
        .await?
        .connect()
        .await
        .map_err(|e| down(settings, e))
}

/// [`connect_one`] under an `application_name` of its own, by which other processes find it in
/// `pg_stat_activity` (a worker's presence connection, `stranded::PRESENCE_APPLICATION`).
pub async fn connect_named(
    settings: &DatabaseSettings,
    application_name: &str,
) -> Result<sqlx::PgConnection> {
    writable_options(settings)
        .await?
        .application_name(application_name)
        .connect()
        .await
        .map_err(|e| down(settings, e))
}

/// Creates the database named in the URL when it is missing (connecting to `postgres` first).
pub async fn ensure_database(settings: &DatabaseSettings) -> Result<()> {
    create_database(&writable_options(settings).await?)
        .await
        .map_err(|e| match e.as_database_error() {
            Some(_) => e.into(),
            None => down(settings, e),
        })
}

fn quoted(name: &str) -> String {
    // Identifiers cannot be bound; the name is quoted by doubling any quote in it.
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Creates `target`'s database when it is missing; safe from several processes at once.
pub async fn create_database(target: &PgConnectOptions) -> sqlx::Result<()> {
    let name = target.get_database().unwrap_or("postgres").to_owned();
    let mut conn = target.clone().database("postgres").connect().await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&name)
            .fetch_one(&mut conn)
            .await?;
    if exists {
        return Ok(());
    }
    let sql = format!("CREATE DATABASE {}", quoted(&name));
    match sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await
    {
        // Another process may have created it between our check and our create.
        Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() != Some("42P04") => {
            Err(e)
        }
        _ => Ok(()),
    }
}

/// Drops `target`'s database, ending its sessions (the bench and the demo's outside systems
/// clean up after themselves with this).
pub async fn drop_database(target: &PgConnectOptions) -> sqlx::Result<()> {
    let name = target.get_database().unwrap_or("postgres").to_owned();
    let mut conn = target.clone().database("postgres").connect().await?;
    let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quoted(&name));
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await?;
    Ok(())
}

/// Migrations whose text changed after they were released without changing what they do (a
/// comment reworded), with the checksum of the released text: a database that applied the
/// released text has its recorded checksum brought up to date instead of refusing to migrate.
const REWORDED: [(i64, &str); 2] = [
    (
        20261130000002,
        "a168daaf9eb1ac3041089ec94b2995605c59f4c2c78b35807dbac3e3ac8a94e7481f98ae31847d49bf11a614e080d517",
    ),
    (
        20261130000003,
        "1137d12b4fefdfe2225bb45d7ce5acea2b386d17d1789374873558dfde60cdecb90acadf44f07064b69ccd88a0c9e733",
    ),
];

/// Records the current checksum of the [`REWORDED`] migrations where the released one is stored.
async fn accept_reworded(pool: &PgPool) -> Result<()> {
    let history: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations')::text")
            .fetch_one(pool)
            .await?;
    if history.is_none() {
        return Ok(());
    }
    for (version, released) in REWORDED {
        let Some(current) = MIGRATOR.iter().find(|m| m.version == version) else {
            continue;
        };
        sqlx::query(
            "UPDATE _sqlx_migrations SET checksum = $2 WHERE version = $1 AND checksum = decode($3, 'hex')",
        )
        .bind(version)
        .bind(current.checksum.as_ref())
        .bind(released)
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// Runs pending migrations; safe to call from several processes at once (sqlx takes a lock).
pub async fn migrate(pool: &PgPool) -> Result<()> {
    accept_reworded(pool).await?;
    MIGRATOR
        .run(pool)
        .await
        .map_err(|e| Error::misconfigured("the migrations failed", e))
}

/// Checks that this build can run on the database's schema: every migration of this build
/// applied, and any migration this build does not know (a newer trailmark migrated it, as a
/// rolling upgrade does before it replaces the binaries) declared compatible with it through
/// `trailmark.schema_compat`. Returns the newest such unknown migration, if any.
pub async fn check_schema(
    conn: &mut sqlx::PgConnection,
    settings: &DatabaseSettings,
) -> Result<Option<i64>> {
    let at = redact::url(&settings.url);
    let history: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations')::text")
            .fetch_one(&mut *conn)
            .await?;
    if history.is_none() {
        return Err(Error::Misconfigured {
            what: format!("the database at {at} was never migrated: run `trailmark migrate`"),
            source: None,
        });
    }
    let applied: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
            .fetch_all(&mut *conn)
            .await?;
    let known: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
    if let Some(missing) = MIGRATOR.iter().find(|m| !applied.contains(&m.version)) {
        return Err(Error::Misconfigured {
            what: format!(
                "the schema at {at} is older than this build ({} of {} migrations applied; next: {} {}): run `trailmark migrate`",
                applied.len(),
                known.len(),
                missing.version,
                missing.description
            ),
            source: None,
        });
    }
    let Some(&newest) = applied.iter().rev().find(|v| !known.contains(v)) else {
        return Ok(None);
    };
    let oldest_build: Option<i64> =
        sqlx::query_scalar("SELECT oldest_build FROM trailmark.schema_compat")
            .fetch_optional(&mut *conn)
            .await?;
    let ours = known.iter().copied().max().unwrap_or(0);
    match oldest_build {
        Some(oldest) if ours >= oldest => Ok(Some(newest)),
        oldest => Err(Error::Misconfigured {
            what: format!(
                "the database at {at} was migrated by a newer trailmark (migration {newest} is unknown to this build) that builds before migration {} cannot run on: deploy that version or a newer one",
                oldest.unwrap_or(newest)
            ),
            source: None,
        }),
    }
}

/// How many migrations the database has applied successfully.
pub async fn migrations_applied(db: impl sqlx::PgExecutor<'_>) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
            .fetch_one(db)
            .await?,
    )
}

/// The server process serving this connection: what a process's presence stores with its leases.
pub async fn backend_pid(db: impl sqlx::PgExecutor<'_>) -> Result<i32> {
    Ok(sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(db)
        .await?)
}

/// Runs `items` as one statement through `batch` when there are several and `batchable` says
/// the statement can tell them apart, so each item gets the outcome it would get alone. When the
/// statement is refused because of one item (a stale fence aborts it, two processes' batches
/// deadlock, a value is out of range) the items run one by one through `one`. When Postgres
/// itself failed, every item gets that failure at once: running them one by one would make each
/// wait out the connection timeout, holding up every step behind the batch. The group-commit
/// functions of this module all go through here.
pub(crate) async fn batch_or_each<'a, T, R, BF, OF>(
    what: &str,
    items: &'a [T],
    batchable: bool,
    batch: impl FnOnce(&'a [T]) -> BF,
    one: impl Fn(&'a T) -> OF,
) -> Vec<Result<R>>
where
    BF: std::future::Future<Output = Result<Vec<Result<R>>>>,
    OF: std::future::Future<Output = Result<R>>,
{
    if items.len() > 1 && batchable {
        match batch(items).await {
            Ok(each) => return each,
            Err(e) if !caused_by_one_item(&e) => {
                let failure = crate::error::Report(&e).to_string();
                return items
                    .iter()
                    .map(|_| {
                        Err(Error::Unavailable {
                            what: format!("group {what} failed: {failure}"),
                            source: None,
                        })
                    })
                    .collect();
            }
            Err(e) => {
                tracing::debug!(error = %crate::error::Report(&e), items = items.len(), "group {what} refused; running its items one by one")
            }
        }
    }
    let mut each = Vec::with_capacity(items.len());
    for item in items {
        each.push(one(item).await);
    }
    each
}

/// Whether a failed batch statement may have failed because of one of its items, rather than
/// because Postgres is unreachable: any error Postgres answered with (a refused fence, a
/// deadlock, bad data), as opposed to I/O, pool and protocol failures.
pub(crate) fn caused_by_one_item(e: &Error) -> bool {
    matches!(e.sqlx_cause(), Some(sqlx::Error::Database(_)))
}
