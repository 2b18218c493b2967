//! Events for the drill's waiting runs. When the target's input makes each run wait for an event
//! after a step (`chain`'s `"wait": {"at": P, "event": NAME, "timeout_secs": T}`), the drill
//! sends each run its event over AMQP (to `<prefix>.runs` with routing key `run.event`), as an
//! upstream service would, whatever faults are going on: a share before the run reaches its
//! wait (kept for the wait), the others once it waits; a share sent twice (the same id and
//! payload: one event), a share again with the same id and another payload (which must be
//! refused as `event_conflict`). Then it checks every wait was resumed once by its own event,
//! no event was lost, and no run was woken twice.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{Value, json};
use sqlx::PgPool;

use super::report::Invariant;
use super::schedule::Rng;
use super::{Faults, Result};
use trailmark::broker::{self, Outgoing, Publisher, Topology};
use trailmark::config::BrokerSettings;
use trailmark::domain::InboundEvent;
use trailmark::inspect;

/// What was sent and what came of it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EventFigures {
    /// The event name the runs wait for.
    pub name: String,
    /// Runs sent their event (the control run excluded).
    pub runs: u32,
    /// Of those, sent before the run reached its wait.
    pub early: u32,
    /// Sent a second time with the same id and payload.
    pub twice: u32,
    /// Sent again with the same id and another payload.
    pub conflicting: u32,
    /// Events recorded as consumed by exactly one run.
    pub consumed_once: u32,
    /// Conflicting copies found in the DLQ as `event_conflict`.
    pub conflicts_refused: u32,
    /// Publishes that failed (a broker fault) and were made again.
    pub publish_retries: u32,
}

/// One run's event and what is left to send of it.
#[derive(Debug, Clone)]
struct Todo {
    /// Sent before the run waits.
    early: bool,
    /// The first copy is confirmed.
    sent: bool,
    /// A repeat still to send.
    twice: bool,
    /// A conflicting copy still to send.
    conflict: bool,
    /// A conflicting copy was planned.
    conflicting: bool,
}

/// The drill's events, run by run.
pub struct Events {
    name: String,
    topology: Topology,
    broker: BrokerSettings,
    todo: BTreeMap<String, Todo>,
    /// The drill's runs (the control run is sent its event, and not counted).
    counted: Vec<String>,
    figures: EventFigures,
}

/// The id of `run`'s event.
pub fn event_id(run: &str) -> String {
    format!("{run}.event")
}

impl Events {
    /// The events of a drill whose runs get `input`, or `None` when they wait for no event.
    pub fn new(input: &Value, broker: &BrokerSettings, topology: Topology) -> Option<Self> {
        let name = input.get("wait")?.get("event")?.as_str()?.to_owned();
        Some(Self {
            figures: EventFigures {
                name: name.clone(),
                ..EventFigures::default()
            },
            name,
            topology,
            broker: broker.clone(),
            todo: BTreeMap::new(),
            counted: Vec::new(),
        })
    }

    /// Plans the events of `ids`: which go early, twice, or again with another payload
    /// (`faults`' shares); `counted`: whether they are the drill's runs (not the control run).
    pub fn add(&mut self, ids: &[String], rng: &mut Rng, faults: &Faults, counted: bool) {
        for id in ids {
            let pick = |rng: &mut Rng, share: f64| counted && rng.unit() < share;
            let (early, twice) = (
                pick(rng, faults.events_early),
                pick(rng, faults.events_twice),
            );
            let conflict = pick(rng, faults.events_conflict);
            let todo = Todo {
                early,
                sent: false,
                twice,
                conflict,
                conflicting: conflict,
            };
            if counted {
                let f = &mut self.figures;
                f.runs += 1;
                f.early += u32::from(todo.early);
                f.twice += u32::from(todo.twice);
                f.conflicting += u32::from(todo.conflict);
                self.counted.push(id.clone());
            }
            self.todo.insert(id.clone(), todo);
        }
    }

    /// The event of `run`, with the payload of its `copy` (`first`, or `other` for a conflict).
    fn message(&self, run: &str, copy: &str) -> Outgoing {
        let payload = json!({ "run": run, "copy": copy });
        let event = InboundEvent::new(&self.name, run, Some(&event_id(run)), payload, 1 << 20)
            .expect("the drill's events are well formed");
        self.topology.send_event(&event)
    }

    /// Sends what is due: first copies of early runs and of runs that wait now, then the
    /// repeats and conflicting copies of runs whose first copy went out. A publish that fails
    /// (a broker fault) is made again on the next call.
    pub async fn tick(&mut self, pool: &PgPool) -> Result<()> {
        let unsent: Vec<String> = self
            .todo
            .iter()
            .filter(|(_, t)| !t.sent)
            .map(|(id, _)| id.clone())
            .collect();
        let waiting = if unsent.is_empty() {
            Vec::new()
        } else {
            inspect::waiting_for_events(pool, &unsent).await?
        };
        // A conflicting copy goes out once the first is recorded: sent at once, a worker could
        // take it first, and then the first copy would be the one refused.
        let to_conflict: Vec<String> = self
            .todo
            .iter()
            .filter(|(_, t)| t.sent && t.conflict)
            .map(|(id, _)| event_id(id))
            .collect();
        let recorded: Vec<String> = if to_conflict.is_empty() {
            Vec::new()
        } else {
            let states = inspect::signal_states(pool, &to_conflict).await?;
            states.into_iter().map(|(id, _, _)| id).collect()
        };
        let mut out: Vec<(String, &str, Outgoing)> = Vec::new();
        for (id, t) in &self.todo {
            if !t.sent && (t.early || waiting.contains(id)) {
                out.push((id.clone(), "first", self.message(id, "first")));
            } else if t.sent && t.twice {
                out.push((id.clone(), "twice", self.message(id, "first")));
            } else if t.sent && t.conflict && recorded.contains(&event_id(id)) {
                out.push((id.clone(), "other", self.message(id, "other")));
            }
        }
        if out.is_empty() {
            return Ok(());
        }
        let messages: Vec<Outgoing> = out.iter().map(|(_, _, m)| m.clone()).collect();
        let confirmed = self.publish(&messages).await;
        for ((id, what, _), ok) in out.iter().zip(confirmed) {
            let Some(t) = self.todo.get_mut(id) else {
                continue;
            };
            if !ok {
                self.figures.publish_retries += 1;
                continue;
            }
            match *what {
                "first" => t.sent = true,
                "twice" => t.twice = false,
                _ => t.conflict = false,
            }
        }
        Ok(())
    }

    /// Publishes with confirms on a connection of its own (the drill's faults close
    /// connections); which were confirmed.
    async fn publish(&self, messages: &[Outgoing]) -> Vec<bool> {
        let failed = || vec![false; messages.len()];
        let Ok(conn) = broker::connect(&self.broker, "drill-events").await else {
            return failed();
        };
        let timeout = std::time::Duration::from_millis(self.broker.confirm_timeout_ms);
        let confirmed = match Publisher::open(&conn, timeout).await {
            Ok(p) => p
                .publish_all(messages)
                .await
                .iter()
                .map(|r| r.is_ok())
                .collect(),
            Err(_) => failed(),
        };
        let _ = conn.close(200, "sent".into()).await;
        confirmed
    }

    /// Once the runs have settled: sends what is still due, then waits (at most a minute) until
    /// every conflicting copy sent has been refused into the DLQ: a run settles as soon as its
    /// event resumed it, and a copy sent after that may still be on its way.
    pub async fn settle(&mut self, pool: &PgPool) -> Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while std::time::Instant::now() < deadline {
            self.tick(pool).await?;
            let sent = self.conflicts();
            let dlq = trailmark::dlq::Dlq::connect(&self.broker).await?;
            let listing = dlq
                .list(&trailmark::dlq::Page::all(), &trailmark::dlq::quiet)
                .await;
            dlq.close().await;
            let refused = crate::check::refused_conflicts(&listing?.letters, &sent);
            if refused >= sent.len()
                && self
                    .todo
                    .values()
                    .all(|t| !t.sent || (!t.twice && !t.conflict))
            {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
        Ok(())
    }

    /// The runs among `reached` some planned copy of whose event has not gone out.
    fn unsent(&self, reached: &[&str]) -> Vec<String> {
        reached
            .iter()
            .filter(|id| {
                self.todo
                    .get(**id)
                    .is_some_and(|t| !t.sent || t.twice || t.conflict)
            })
            .map(|id| id.to_string())
            .collect()
    }

    /// The ids of the events sent again with another payload: the DLQ must hold each as
    /// `event_conflict`, and nothing else of them.
    pub fn conflicts(&self) -> Vec<String> {
        self.counted
            .iter()
            .filter(|id| {
                self.todo
                    .get(*id)
                    .is_some_and(|t| t.conflicting && !t.conflict)
            })
            .map(|id| event_id(id))
            .collect()
    }

    /// The figures and the invariants of the events, once the runs settled; `refused`: the
    /// conflicting copies found in the DLQ as `event_conflict`.
    pub async fn check(
        &mut self,
        pool: &PgPool,
        refused: u32,
    ) -> Result<(EventFigures, Vec<Invariant>)> {
        let ids = &self.counted;
        let outcomes = inspect::wait_outcomes(pool, ids).await?;
        let event_ids: Vec<String> = ids.iter().map(|id| event_id(id)).collect();
        let states = inspect::signal_states(pool, &event_ids).await?;
        let mut by_run: BTreeMap<&str, Vec<&inspect::WaitOutcome>> = BTreeMap::new();
        for o in &outcomes {
            by_run.entry(o.0.as_str()).or_default().push(o);
        }
        let mut not_once = Vec::new();
        let mut lost = Vec::new();
        let mut woken_twice = Vec::new();
        for id in ids {
            let waited = by_run.get(id.as_str()).cloned().unwrap_or_default();
            let state = states.iter().find(|s| s.0 == event_id(id));
            match waited.as_slice() {
                [] => {}
                [(_, _, Some(how), Some(signal), payload)] if how == "event" => {
                    if *signal != event_id(id) {
                        not_once.push(format!("{id} was resumed by {signal}"));
                    }
                    if payload.as_ref().and_then(|p| p.get("copy")) != Some(&json!("first")) {
                        woken_twice.push(format!("{id} read the conflicting copy"));
                    }
                }
                [(_, seq, how, _, _)] => {
                    not_once.push(format!("{id}'s wait at position {seq} ended as {how:?}"))
                }
                many => not_once.push(format!("{id} has {} waits", many.len())),
            }
            // Its run reached its wait: the event is consumed, by that run alone.
            if !waited.is_empty() {
                match state {
                    Some((_, s, 1)) if s == "consumed" => self.figures.consumed_once += 1,
                    Some((_, s, n)) if s == "consumed" => {
                        woken_twice.push(format!("{} resumed {n} runs", event_id(id)))
                    }
                    Some((_, s, _)) => lost.push(format!("{} is {s}", event_id(id))),
                    None => lost.push(format!("{} was never recorded", event_id(id))),
                }
            }
        }
        self.figures.conflicts_refused = refused;
        let conflicts = self.conflicts().len() as u32;
        // A run that stopped in review before its wait was never sent its event, rightly.
        let reached: Vec<&str> = by_run.keys().copied().collect();
        let unsent = self.unsent(&reached);
        let examples = |v: &[String]| v.iter().take(5).cloned().collect::<Vec<_>>().join("; ");
        let invariants = vec![
            Invariant {
                name: "every wait resumed once, by its own event".into(),
                ok: not_once.is_empty(),
                detail: format!("{} waits otherwise {}", not_once.len(), examples(&not_once)),
            },
            Invariant {
                name: "no event lost".into(),
                ok: lost.is_empty() && unsent.is_empty(),
                detail: format!(
                    "{} of the events of runs that reached their wait not consumed {}; {} such runs not sent every planned copy {}",
                    lost.len(),
                    examples(&lost),
                    unsent.len(),
                    examples(&unsent)
                ),
            },
            Invariant {
                name: "no run woken twice, every conflicting copy refused".into(),
                // `refused` counts distinct ids: a copy dead-lettered twice (redelivered after a
                // broker fault cut its first ack) is one refusal.
                ok: woken_twice.is_empty() && refused == conflicts,
                detail: format!(
                    "{} woken twice {}; {refused} of {conflicts} conflicting copies dead-lettered as event_conflict",
                    woken_twice.len(),
                    examples(&woken_twice)
                ),
            },
        ];
        Ok((self.figures.clone(), invariants))
    }
}
