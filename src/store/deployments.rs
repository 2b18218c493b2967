//! Which live worker processes carry which workflow versions: what routes a step of a version
//! the worker that received it does not carry (wait for one that does, or stop for review),
//! and what `trailmark workflow versions` shows. A row counts while the presence backend it
//! names is alive (`worker::presence`; `trailmark.presence_alive` matches its pid, database
//! and application name), so a killed process stops counting at once.

use sqlx::PgExecutor;

use super::Result;

/// Records that `worker_id`, whose presence backend is `pid`, carries `deployed` (names and
/// versions as [`crate::workflow::Registry::deployed`]), replacing what it recorded before, and
/// forgets the rows of processes whose presence backend is gone.
pub async fn register(
    conn: &mut sqlx::PgConnection,
    worker_id: &str,
    pid: i32,
    deployed: &(Vec<String>, Vec<i32>),
) -> Result<()> {
    sqlx::query(
        "DELETE FROM trailmark.deployments d
          WHERE d.worker_id = $1
             OR NOT trailmark.presence_alive(d.presence_pid, d.worker_id)",
    )
    .bind(worker_id)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO trailmark.deployments (worker_id, workflow, version, presence_pid)
         SELECT $1, name, version, $2 FROM unnest($3::text[], $4::int[]) AS d(name, version)",
    )
    .bind(worker_id)
    .bind(pid)
    .bind(&deployed.0)
    .bind(&deployed.1)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Forgets what `worker_id` carries: it is stopping.
pub async fn unregister(db: impl PgExecutor<'_>, worker_id: &str) -> Result<()> {
    sqlx::query("DELETE FROM trailmark.deployments WHERE worker_id = $1")
        .bind(worker_id)
        .execute(db)
        .await?;
    Ok(())
}

/// Whether a live worker process other than `except` carries `version` of `workflow`.
pub async fn carried_elsewhere(
    db: impl PgExecutor<'_>,
    workflow: &str,
    version: i32,
    except: &str,
) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM trailmark.deployments d
                         WHERE d.workflow = $1 AND d.version = $2 AND d.worker_id <> $3
                           AND trailmark.presence_alive(d.presence_pid, d.worker_id))",
    )
    .bind(workflow)
    .bind(version)
    .bind(except)
    .fetch_one(db)
    .await?)
}

/// One workflow version as the live fleet carries it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct Carried {
    /// The workflow.
    pub workflow: String,
    /// The version.
    pub version: i32,
    /// The live worker processes that carry it.
    pub workers: i64,
}

/// Every workflow version some live worker process carries, with how many carry it.
pub async fn live(db: impl PgExecutor<'_>) -> Result<Vec<Carried>> {
    Ok(sqlx::query_as(
        "SELECT d.workflow, d.version, count(*) AS workers FROM trailmark.deployments d
          WHERE trailmark.presence_alive(d.presence_pid, d.worker_id)
          GROUP BY d.workflow, d.version ORDER BY d.workflow, d.version",
    )
    .fetch_all(db)
    .await?)
}
