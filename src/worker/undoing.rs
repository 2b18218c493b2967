//! What a compensation does before its handler, for a step that started child runs: the
//! children's effects are newer than the step's own writes (the step started them), so they
//! are undone first. The first time the run reaches that compensation, the step ends by waiting
//! for them (`WaitFor::UndoneChildren`: its commit starts their undo, `wait::children::undo_at`);
//! once every child is compensated the join moves the run on to the same compensation at the
//! next position, which then runs. Decided here from the plan and one read; the commit does
//! the writes under the run's lock.

use serde_json::json;

use super::ending::{Ending, Verdict};
use crate::domain::{NewWait, StepMessage, UndoPlan, WaitFor};
use crate::engine::Engine;
use crate::store::{self, children};

/// The verdict that replaces the handler of this compensation, if any: wait for the undo of the
/// step's children (not joined yet), or, for a step that declares no compensation and is in the
/// plan only for its children, move on to the next compensation without running anything.
pub(super) async fn before(
    engine: &Engine,
    msg: &StepMessage,
    plan: Option<&UndoPlan>,
) -> store::Result<Option<Verdict>> {
    let Some((_, seq)) = msg.step.undo_of() else {
        return Ok(None);
    };
    let Some((plan, target)) = plan.and_then(|p| Some((p, p.target(seq)?))) else {
        return Ok(None);
    };
    if target.children {
        let undo = children::undo_of(&engine.pool, msg.run_id.as_str(), seq).await?;
        if undo.is_some_and(|u| !u.joined) {
            let wait = NewWait {
                next_step: msg.step.clone(),
                what: WaitFor::UndoneChildren(seq),
            };
            return Ok(Some(Verdict::Commit(Ending::Pause {
                output: json!({ "undoing_children_of": seq }),
                wait,
                sent: Vec::new(),
                parked: Vec::new(),
                writes: Vec::new(),
            })));
        }
    }
    if target.children_only {
        return Ok(Some(Verdict::Commit(Ending::Advance {
            output: json!({ "children_undone": seq, "compensation": "none declared" }),
            next: plan.after(&msg.step),
            sent: Vec::new(),
            parked: Vec::new(),
            writes: Vec::new(),
        })));
    }
    Ok(None)
}
