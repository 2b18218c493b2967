//! The processes a drill owns: workers, relays and supervisors, each started from the drill's
//! program, restarted when it dies, and (after a kill) replaced by one armed to kill itself at a
//! named seam, so that crashes also land at the moments that matter most.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;

use trailmark_bench::env::{BenchEnv, Proc};

use super::Result;
use super::schedule::Rng;

/// The seams a worker's replacement may be armed at: inside a model call (answer paid, not yet
/// journaled), inside a tool call (write made, result not recorded), between the step's commit
/// and its publish, between the publish and the ack.
pub const WORKER_SEAMS: [&str; 4] = [
    "model.after_answer",
    "effect.after_call",
    "step.after_commit",
    "step.before_ack",
];

/// The relay's seam: between the broker's confirm and marking the row published.
pub const RELAY_SEAMS: [&str; 1] = ["relay.after_confirm"];

/// What a process does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Consumes step messages.
    Worker,
    /// Publishes the outbox.
    Relay,
    /// Re-queues runs whose lease expired.
    Supervisor,
}

impl Role {
    fn command(self) -> &'static str {
        match self {
            Self::Worker => "worker",
            Self::Relay => "relay",
            Self::Supervisor => "supervisor",
        }
    }
}

struct Slot {
    role: Role,
    index: usize,
    generation: u32,
    armed: Option<String>,
    proc: Proc,
}

/// The drill's processes.
pub struct Fleet {
    slots: Vec<Slot>,
    /// Workers at odd slots stand for the old build (`chain` v1 only), the others for the new
    /// one (v1 and v2): a rolling deploy for the whole drill.
    mixed: bool,
    next_seam: usize,
    kills: usize,
    /// Self-kills at a seam, by seam.
    pub seam_kills: BTreeMap<String, u32>,
    /// Exits the drill did not cause (neither its kill nor an armed seam), with their status.
    pub unexpected_exits: Vec<String>,
    /// Every process started, by pid: its name (the call logs are named by pid).
    pub names: std::collections::HashMap<u32, String>,
}

impl Fleet {
    /// Starts `workers` workers, `relays` relays and `supervisors` supervisors; with `mixed`,
    /// the workers carry two builds of `chain` (see [`Fleet::mixed`]).
    pub fn start(
        env: &BenchEnv,
        (workers, relays, supervisors): (usize, usize, usize),
        mixed: bool,
    ) -> Result<Self> {
        let roles = std::iter::repeat_n(Role::Worker, workers)
            .chain(std::iter::repeat_n(Role::Relay, relays))
            .chain(std::iter::repeat_n(Role::Supervisor, supervisors));
        let mut fleet = Self {
            slots: Vec::new(),
            mixed,
            next_seam: 0,
            kills: 0,
            seam_kills: BTreeMap::new(),
            unexpected_exits: Vec::new(),
            names: Default::default(),
        };
        for (index, role) in roles.enumerate() {
            let proc = spawn(env, role, (index, fleet.mixed), 0, None)?;
            fleet.names.insert(proc.pid(), proc.name.clone());
            fleet.slots.push(Slot {
                role,
                index,
                generation: 0,
                armed: None,
                proc,
            });
        }
        Ok(fleet)
    }

    /// Restarts every process that has exited; returns the seams that fired since last time.
    pub fn check(&mut self, env: &BenchEnv) -> Result<Vec<String>> {
        let mut fired = Vec::new();
        for slot in &mut self.slots {
            let Some(status) = slot.proc.exited() else {
                continue;
            };
            match (slot.armed.take(), status.signal()) {
                (Some(seam), Some(9)) => {
                    *self.seam_kills.entry(seam.clone()).or_default() += 1;
                    fired.push(seam);
                }
                (_, _) => self.unexpected_exits.push(format!(
                    "{} exited on its own ({status}); see its log in {}",
                    slot.proc.name,
                    env.log_dir.display()
                )),
            }
            slot.generation += 1;
            slot.proc = spawn(
                env,
                slot.role,
                (slot.index, self.mixed),
                slot.generation,
                None,
            )?;
            self.names.insert(slot.proc.pid(), slot.proc.name.clone());
        }
        Ok(fired)
    }

    /// `kill -9` of one process (a worker four times in five, or with `in_turn` every process
    /// in turn), replaced by one armed at the next seam of its role, `@k` hits later.
    pub fn kill(&mut self, env: &BenchEnv, rng: &mut Rng, in_turn: bool) -> Result<String> {
        let workers: Vec<usize> = self.indices(Role::Worker);
        let others: Vec<usize> = (0..self.slots.len())
            .filter(|i| !workers.contains(i))
            .collect();
        self.kills += 1;
        let pick = if in_turn {
            (self.kills - 1) % self.slots.len()
        } else if rng.unit() < 0.8 || others.is_empty() {
            workers[rng.range(0, workers.len() as u64) as usize]
        } else {
            others[rng.range(0, others.len() as u64) as usize]
        };
        let seams: &[&str] = match self.slots[pick].role {
            Role::Worker => &WORKER_SEAMS,
            Role::Relay => &RELAY_SEAMS,
            Role::Supervisor => &[],
        };
        let armed = (!seams.is_empty()).then(|| {
            self.next_seam += 1;
            format!(
                "{}=kill@{}",
                seams[self.next_seam % seams.len()],
                rng.range(1, 20)
            )
        });
        let slot = &mut self.slots[pick];
        let killed = slot.proc.name.clone();
        slot.proc.kill9();
        slot.generation += 1;
        slot.proc = spawn(
            env,
            slot.role,
            (slot.index, self.mixed),
            slot.generation,
            armed.as_deref(),
        )?;
        self.names.insert(slot.proc.pid(), slot.proc.name.clone());
        slot.armed = armed.map(|a| a.split('=').next().unwrap_or_default().to_owned());
        Ok(killed)
    }

    /// SIGSTOP of a random worker; returns its slot for [`Fleet::thaw`].
    pub fn freeze(&mut self, rng: &mut Rng) -> usize {
        let workers = self.indices(Role::Worker);
        let pick = workers[rng.range(0, workers.len() as u64) as usize];
        self.slots[pick].proc.freeze();
        pick
    }

    /// SIGCONT of the process in `slot` (if it is still the one frozen, or any replacement).
    pub fn thaw(&mut self, slot: usize) {
        self.slots[slot].proc.thaw();
    }

    /// Stops every process with SIGTERM (SIGKILL after `grace`).
    pub async fn stop(&mut self, grace: std::time::Duration) {
        for slot in &mut self.slots {
            slot.proc.thaw();
            slot.proc.stop(grace).await;
        }
    }

    fn indices(&self, role: Role) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| self.slots[i].role == role)
            .collect()
    }
}

fn spawn(
    env: &BenchEnv,
    role: Role,
    (index, mixed): (usize, bool),
    generation: u32,
    failpoints: Option<&str>,
) -> Result<Proc> {
    let name = format!("{}-{index}.{generation}", role.command());
    let mut extra: Vec<(String, String)> = failpoints
        .map(|fp| ("TRAILMARK_FAILPOINTS".to_owned(), fp.to_owned()))
        .into_iter()
        .collect();
    if mixed && role == Role::Worker {
        let build = if index % 2 == 1 { "1" } else { "1,2" };
        extra.push((
            trailmark_testkit::CHAIN_VERSIONS.to_owned(),
            build.to_owned(),
        ));
    }
    Ok(env.spawn_with(&name, &[role.command()], &extra)?)
}
