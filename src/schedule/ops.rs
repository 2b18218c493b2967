//! What operators do with schedules (the CLI and the API call these): create, list, show,
//! pause, resume, trigger, backfill and delete. Each change is one transaction with its audit row.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};

use super::fire;
use super::{
    Cadence, Error, LONGEST, MAX_BACKFILL_TICKS, Overlap, Spec, check_name, invalid, run_id,
};
use crate::engine::Engine;
use crate::operator::{self, Decider};
use crate::store::schedules::{self, NewSchedule, ScheduleRow};
use crate::store::runs;

/// What to create.
#[derive(Debug, Clone)]
pub struct Create {
    /// Name.
    pub name: String,
    /// Workflow.
    pub workflow: String,
    /// Input (an object).
    pub input: Value,
    /// Cadence.
    pub cadence: Cadence,
    /// `cron` text and zone name as given, for storing (none for an interval).
    pub cron_text: Option<(String, String)>,
    /// Overlap policy.
    pub overlap: Overlap,
    /// Catch-up window.
    pub catch_up: Duration,
}

impl Create {
    /// A schedule of `workflow` with `input`, ticking on exactly one of `cron` (in `tz`, UTC when
    /// absent) and `every`, with the default overlap (`skip`) and catch-up window
    /// ([`super::DEFAULT_CATCH_UP`]) until [`Create::overlap`] and [`Create::catch_up`] say
    /// otherwise: the one reading of what the CLI's flags and the API's body ask for.
    pub fn new(
        name: String,
        workflow: String,
        input: Value,
        cron: Option<String>,
        tz: Option<String>,
        every: Option<String>,
    ) -> Result<Self, Error> {
        let cadence = match (&cron, &every) {
            (Some(expr), None) => Cadence::cron(expr, tz.as_deref())?,
            (None, Some(every)) => Cadence::every(every)?,
            _ => return Err(invalid("every", "give exactly one of cron and every")),
        };
        Ok(Self {
            name,
            workflow,
            input,
            cadence,
            cron_text: cron.map(|c| (c, tz.unwrap_or_else(|| "UTC".into()))),
            overlap: Overlap::Skip,
            catch_up: super::DEFAULT_CATCH_UP,
        })
    }

    /// With the overlap policy named `text` (`skip`, `buffer-one`, `allow`).
    pub fn overlap(mut self, text: &str) -> Result<Self, Error> {
        self.overlap = text.parse()?;
        Ok(self)
    }

    /// With the catch-up window `text` (`90s`, `15m`, ...).
    pub fn catch_up(mut self, text: &str) -> Result<Self, Error> {
        self.catch_up = super::duration("catch_up", text)?;
        Ok(self)
    }
}

/// A schedule as `show` and `list` present it: the row, its next ticks and its newest runs.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Shown {
    /// The stored schedule.
    #[serde(flatten)]
    pub schedule: ScheduleRow,
    /// The next few ticks (none while paused).
    pub upcoming: Vec<DateTime<Utc>>,
    /// Its newest runs.
    pub recent_runs: Vec<RecentRun>,
}

/// One of a schedule's runs.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct RecentRun {
    /// The run (`<name>:<tick>`).
    pub run_id: String,
    /// Where it stands.
    pub status: String,
}

/// What a backfill or trigger did.
#[derive(Debug, Clone, Default, Serialize)]
#[cfg_attr(feature = "ops-http", derive(utoipa::ToSchema))]
pub struct Started {
    /// Runs created.
    pub started: Vec<String>,
    /// Ticks whose run existed already (started by the schedule or an earlier backfill).
    pub existed: Vec<String>,
}

/// Creates a schedule; the same schedule again is not an error (`false`: it existed), another
/// one under the name is.
pub async fn create(
    engine: &Engine,
    c: &Create,
    who: &Decider,
) -> Result<(ScheduleRow, bool), Error> {
    check_name(&c.name)?;
    check_input(engine, &c.name, &c.workflow, &c.input)?;
    if c.catch_up > LONGEST {
        return Err(invalid("catch_up", "must be at most 366d"));
    }
    let mut tx = engine.pool.begin().await?;
    let now = schedules::now(&mut *tx).await?;
    let next_tick = c
        .cadence
        .next_after(now)
        .ok_or_else(|| invalid("cron", "the expression has no tick in the future"))?;
    let every_secs = match &c.cadence {
        Cadence::Every(d) => Some(d.as_secs() as i64),
        Cadence::Cron { .. } => None,
    };
    let new = NewSchedule {
        name: &c.name,
        workflow: &c.workflow,
        input: &c.input,
        cron: c.cron_text.as_ref().map(|(e, z)| (e.as_str(), z.as_str())),
        every_secs,
        overlap: c.overlap.as_str(),
        catch_up_secs: c.catch_up.as_secs() as i64,
        next_tick,
    };
    if !schedules::insert(&mut *tx, &new).await? {
        let existing = schedules::get(&mut *tx, &c.name, false)
            .await?
            .ok_or_else(|| Error::NotFound(c.name.clone()))?;
        let same = existing.workflow == c.workflow
            && existing.input == c.input
            && existing.cron.as_deref() == new.cron.map(|c| c.0)
            && existing.tz.as_deref() == new.cron.map(|c| c.1)
            && existing.every_secs == every_secs
            && existing.overlap == new.overlap
            && existing.catch_up_secs == new.catch_up_secs;
        return if same {
            Ok((existing, false))
        } else {
            Err(Error::Conflict(c.name.clone()))
        };
    }
    let details = json!({ "workflow": c.workflow, "cron": new.cron.map(|c| c.0), "tz": new.cron.map(|c| c.1),
        "every_secs": every_secs, "overlap": new.overlap, "catch_up_secs": new.catch_up_secs });
    audited(&mut tx, who, "schedule.create", &c.name, details).await?;
    let row = schedules::get(&mut *tx, &c.name, false).await?;
    tx.commit().await?;
    Ok((row.ok_or_else(|| Error::NotFound(c.name.clone()))?, true))
}

/// Every schedule.
pub async fn list(engine: &Engine) -> Result<Vec<ScheduleRow>, Error> {
    Ok(schedules::list(&engine.pool).await?)
}

/// One schedule with its next ticks and newest runs.
pub async fn show(engine: &Engine, name: &str) -> Result<Shown, Error> {
    let row = schedules::get(&engine.pool, name, false)
        .await?
        .ok_or_else(|| Error::NotFound(name.to_owned()))?;
    let spec = Spec::from_row(&row)?;
    let mut upcoming = Vec::new();
    let mut next = (!row.paused).then_some(row.next_tick);
    while let Some(t) = next.filter(|_| upcoming.len() < 5) {
        upcoming.push(t);
        next = spec.cadence.next_after(t);
    }
    let recent_runs = runs::with_prefix(&engine.pool, &format!("{name}:"), 10)
        .await?
        .into_iter()
        .map(|(run_id, status)| RecentRun { run_id, status })
        .collect();
    Ok(Shown {
        schedule: row,
        upcoming,
        recent_runs,
    })
}

/// Pauses (nothing starts) or resumes (the next tick after now; ticks while paused are not made
/// up). Returns the schedule as it is now.
pub async fn set_paused(
    engine: &Engine,
    name: &str,
    paused: bool,
    who: &Decider,
) -> Result<ScheduleRow, Error> {
    let mut tx = engine.pool.begin().await?;
    let row = locked(&mut tx, name).await?;
    let next = match paused {
        true => None,
        false => {
            let now = schedules::now(&mut *tx).await?;
            Spec::from_row(&row)?.cadence.next_after(now)
        }
    };
    schedules::set_paused(&mut *tx, name, paused, next).await?;
    let action = if paused {
        "schedule.pause"
    } else {
        "schedule.resume"
    };
    audited(&mut tx, who, action, name, json!({ "was_paused": row.paused })).await?;
    let now = locked(&mut tx, name).await?;
    tx.commit().await?;
    Ok(now)
}

/// Starts one run of the schedule now, whatever its overlap policy (a person asked for it):
/// run id `<name>:<now>`.
pub async fn trigger(engine: &Engine, name: &str, who: &Decider) -> Result<Started, Error> {
    let mut tx = engine.pool.begin().await?;
    let starter = starter(engine, &mut tx, name).await?;
    let now = schedules::now(&mut *tx).await?;
    let done = start_all(engine, &mut tx, &starter, vec![run_id(name, now)]).await?;
    audited(&mut tx, who, "schedule.trigger", name, json!(done)).await?;
    tx.commit().await?;
    Ok(done)
}

/// Starts the run of every tick in `[from, to]` that has none: a backfill run twice starts each
/// tick once. The range must be in the past, at most 366 days and [`MAX_BACKFILL_TICKS`] ticks.
pub async fn backfill(
    engine: &Engine,
    name: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    who: &Decider,
) -> Result<Started, Error> {
    let mut tx = engine.pool.begin().await?;
    let starter = starter(engine, &mut tx, name).await?;
    let spec = starter.spec();
    let now = schedules::now(&mut *tx).await?;
    if to > now {
        return Err(invalid("to", format!("{to} is in the future; a backfill starts ticks that have passed (now is {now})")));
    }
    if from > to {
        return Err(invalid("from", "must not be after --to"));
    }
    if (to - from).to_std().unwrap_or_default() > LONGEST {
        return Err(invalid("from", "the range is longer than the catch-up limit, 366d"));
    }
    let ticks = spec.cadence.ticks_between(from, to, MAX_BACKFILL_TICKS);
    if ticks.len() > MAX_BACKFILL_TICKS {
        return Err(invalid(
            "from",
            format!("the range holds more than {MAX_BACKFILL_TICKS} ticks; backfill it in parts"),
        ));
    }
    let ids = ticks.into_iter().map(|t| spec.run_of(t)).collect();
    let done = start_all(engine, &mut tx, &starter, ids).await?;
    let details = json!({ "from": from, "to": to, "started": done.started.len(), "existed": done.existed.len() });
    audited(&mut tx, who, "schedule.backfill", name, details).await?;
    tx.commit().await?;
    Ok(done)
}

/// Deletes the schedule; the runs it started stay.
pub async fn delete(engine: &Engine, name: &str, who: &Decider) -> Result<(), Error> {
    let mut tx = engine.pool.begin().await?;
    let row = locked(&mut tx, name).await?;
    schedules::delete(&mut *tx, name).await?;
    audited(&mut tx, who, "schedule.delete", name, json!({ "workflow": row.workflow, "started": row.started })).await?;
    tx.commit().await?;
    Ok(())
}

/// The input must be an object the workflow accepts, in a start event that fits the message
/// limit with the run id a tick gets (their ids all have the same length), as for any run start.
fn check_input(engine: &Engine, name: &str, workflow: &str, input: &Value) -> Result<(), Error> {
    if !input.is_object() {
        return Err(invalid("input", "must be a JSON object"));
    }
    let limit = engine.settings.worker.max_message_bytes;
    let event = crate::domain::RunStartEvent::new(run_id(name, Utc::now()), workflow, input.clone());
    crate::worker::start_message(&engine.registry, &engine.topology, limit, &event).map_err(
        |refused| match refused {
            crate::workflow::StartRefused::UnknownWorkflow { .. } => {
                invalid("workflow", refused.to_string())
            }
            _ => invalid("input", refused.to_string()),
        },
    )?;
    Ok(())
}

/// The locked schedule's starter: its runs can be started from this process.
async fn starter(
    engine: &Engine,
    tx: &mut sqlx::PgConnection,
    name: &str,
) -> Result<fire::Starter, Error> {
    let row = locked(tx, name).await?;
    fire::Starter::of(engine, Spec::from_row(&row)?)
}

/// Starts a run under each id that has none.
async fn start_all(
    engine: &Engine,
    tx: &mut sqlx::PgConnection,
    starter: &fire::Starter,
    ids: Vec<crate::domain::RunId>,
) -> Result<Started, Error> {
    let mut done = Started::default();
    for id in ids {
        let shown = id.to_string();
        match starter.start(engine, tx, id).await? {
            true => done.started.push(shown),
            false => done.existed.push(shown),
        }
    }
    Ok(done)
}

async fn locked(tx: &mut sqlx::PgConnection, name: &str) -> Result<ScheduleRow, Error> {
    schedules::get(&mut *tx, name, true)
        .await?
        .ok_or_else(|| Error::NotFound(name.to_owned()))
}

async fn audited(
    tx: &mut sqlx::PgConnection,
    who: &Decider,
    action: &str,
    name: &str,
    details: Value,
) -> Result<(), Error> {
    let target = format!("schedule:{name}");
    operator::record_action(&mut *tx, who, action, &target, &details)
        .await
        .map_err(|e| match e {
            operator::Error::Store(e) => Error::Store(e),
            other => Error::Store(crate::store::Error::unavailable("the audit row", other)),
        })
}
