//! Claims a process's commits made on their runs' next positions (`checkpoint::PreClaim`),
//! kept until the next step's delivery comes back to this process, so that it starts without
//! a claim statement.
//!
//! Only a first delivery uses one: a redelivered message may have been started by another
//! worker meanwhile (its claim took the idle lease), and goes through the claim statement. An
//! entry that no delivery took (the message went to another worker) is dropped after a lease
//! length; the lease it names was idle, and that worker's claim took it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::domain::{Fence, MessageId, RunId};
use crate::store::checkpoint::NextClaim;
use crate::store::runs::Claim;

/// Above this many entries, an insert drops those older than a lease length, at most once per
/// lease: with several workers about half the entries are never taken (their messages went
/// elsewhere), and a scan on every insert would put the whole table on each commit's path.
const PRUNE_ABOVE: usize = 4096;

/// What a delivery found among its process's pre-claims.
pub(crate) enum Taken {
    /// None for its message.
    Nothing,
    /// One to start on without a claim statement.
    Claim(Claim),
    /// One it may not start on (too old, or the message was redelivered and another worker may
    /// have taken the idle lease), which this process never started: its claim counts no
    /// second attempt when it finds that lease still idle.
    Unstarted,
}

/// The pre-claims of one process, by the message id of the step they wait for.
#[derive(Default)]
pub(crate) struct PreClaims {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    by_message: HashMap<MessageId, Held>,
    pruned: Option<Instant>,
}

struct Held {
    run_id: RunId,
    seq: i32,
    /// The lease owner the commit recorded, which the delivery then uses for its claims.
    owner: String,
    claim: Claim,
    since: Instant,
}

/// A pre-claim's lease owner, for the delivery of `message`.
pub(crate) fn owner(worker_id: &str, message: MessageId) -> String {
    format!("{worker_id}/{}", message.0.simple())
}

impl PreClaims {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().expect("pre-claims lock")
    }

    /// Keeps `claim` (at position `seq` of `run_id`) for the delivery of `message`.
    pub fn keep(
        &self,
        message: MessageId,
        (run_id, seq): (RunId, i32),
        owner: String,
        claim: Claim,
        lease: Duration,
    ) {
        let mut table = self.lock();
        let since = Instant::now();
        let due = table
            .pruned
            .is_none_or(|at| since.duration_since(at) >= lease);
        if table.by_message.len() >= PRUNE_ABOVE && due {
            table.by_message.retain(|_, h| h.since.elapsed() < lease);
            table.pruned = Some(since);
        }
        table.by_message.insert(
            message,
            Held {
                run_id,
                seq,
                owner,
                claim,
                since,
            },
        );
    }

    /// The lease owner a pre-claim for `message` recorded, if this process holds one.
    pub fn owner(&self, message: MessageId) -> Option<String> {
        let table = self.lock();
        table.by_message.get(&message).map(|h| h.owner.clone())
    }

    /// Takes the pre-claim for `message` at `seq` of `run_id`, with the run's age brought up to
    /// now: usable by a first delivery while younger than `lease`; otherwise the claim statement
    /// decides, told that this process never started the step on it.
    pub fn take(
        &self,
        message: MessageId,
        (run_id, seq): (&RunId, i32),
        (lease, redelivered): (Duration, bool),
    ) -> Taken {
        let Some(held) = self.lock().by_message.remove(&message) else {
            return Taken::Nothing;
        };
        let age = held.since.elapsed();
        if held.run_id != *run_id || held.seq != seq {
            return Taken::Nothing;
        }
        if age >= lease || redelivered {
            return Taken::Unstarted;
        }
        let mut claim = held.claim;
        claim.age_secs += age.as_secs_f64();
        Taken::Claim(claim)
    }

    /// Empties the table: (run, fence, position) of every pre-claim no delivery took.
    pub fn drain(&self) -> Vec<(RunId, Fence, i32)> {
        let mut table = self.lock();
        (table.by_message.drain())
            .map(|(_, h)| (h.run_id, h.claim.fence, h.seq))
            .collect()
    }
}

/// The claim a commit that pre-claimed the next position hands its holder: the committer's
/// claim one fence and one position on, with what the commit counted there.
pub(crate) fn next_claim(current: &Claim, next: NextClaim) -> Claim {
    Claim {
        fence: Fence(current.fence.0 + 1),
        attempt: next.attempt,
        journaled: next.journaled,
        age_secs: next.age_secs,
        took_over: false,
        preclaimed: true,
        ..current.clone()
    }
}
