//! `run undo`: run the compensations of completed steps newest first, through the normal
//! message pipeline, each checkpointed, so an interrupted undo resumes where it stopped.

use serde_json::{Value, json};

use super::{Decider, Outcome, Result, enqueue, lock, record, refused, set_run};
use crate::domain::RunStatus;
use crate::engine::Engine;
use crate::workflow::undo_step_name;

/// Starts undoing `run_id`. `scope` (e.g. `{"supplier": "S-07"}`) is handed to every
/// compensation, which reverses only the items it selects; `{}` undoes everything.
pub async fn undo(engine: &Engine, run_id: &str, who: &Decider, scope: Value) -> Result<Outcome> {
    let mut tx = engine.pool.begin().await?;
    let run = lock(&mut tx, run_id).await?;
    if matches!(run.status(), RunStatus::Running | RunStatus::Compensating) {
        return Err(refused(
            &run,
            "undo",
            format!(
                "it is {}; cancel it first (`trailmark run cancel {}`) or wait until it stops",
                run.status, run.run_id
            ),
        ));
    }
    let wf = engine.registry.get(&run.workflow).ok_or_else(|| {
        refused(
            &run,
            "undo",
            format!(
                "workflow {} is not deployed in this build, so its compensations are unknown",
                run.workflow
            ),
        )
    })?;
    let done: Vec<(i32, String)> = sqlx::query_as(
        "SELECT seq, step FROM trailmark.steps WHERE run_id = $1 AND finished_at IS NOT NULL
            AND step NOT LIKE 'undo:%' ORDER BY seq DESC",
    )
    .bind(&run.run_id)
    .fetch_all(&mut *tx)
    .await?;
    let targets: Vec<Value> = done
        .iter()
        .filter(|(_, step)| wf.find(step).is_some_and(|d| d.compensation.is_some()))
        .map(|(seq, step)| json!({ "seq": seq, "step": step }))
        .collect();
    let next_seq: i32 = sqlx::query_scalar(
        "SELECT COALESCE(max(seq), -1) + 1 FROM trailmark.steps WHERE run_id = $1",
    )
    .bind(&run.run_id)
    .fetch_one(&mut *tx)
    .await?;
    let plan = json!({ "scope": scope, "targets": targets });
    sqlx::query("UPDATE trailmark.runs SET undo = $2 WHERE run_id = $1")
        .bind(&run.run_id)
        .bind(&plan)
        .execute(&mut *tx)
        .await?;
    let Some(first) = targets.first() else {
        set_run(
            &mut tx,
            &run,
            RunStatus::Compensated,
            None,
            next_seq,
            run.workflow_version,
        )
        .await?;
        let next = "nothing to undo: no completed step declares a compensation".into();
        return record(
            tx,
            &run,
            "undo",
            who,
            RunStatus::Compensated,
            None,
            run.workflow_version,
            plan,
            next,
        )
        .await;
    };
    let step = undo_step_name(
        first["step"].as_str().unwrap_or_default(),
        first["seq"].as_i64().unwrap_or(0) as i32,
    );
    set_run(
        &mut tx,
        &run,
        RunStatus::Compensating,
        Some(&step),
        next_seq,
        run.workflow_version,
    )
    .await?;
    enqueue(&mut tx, engine, &run, &step, next_seq, run.workflow_version).await?;
    let next = format!(
        "{} compensations run newest first, each keyed undo:<original key>",
        targets.len()
    );
    record(
        tx,
        &run,
        "undo",
        who,
        RunStatus::Compensating,
        None,
        run.workflow_version,
        plan,
        next,
    )
    .await
}
