//! The seeded schedule: which faults, in which order, at which share of the expected work. One
//! seed gives the same plan, the same poison bodies and the same duplicated share, so a failed
//! drill can be run again as it was.

use serde::Serialize;

/// A small seeded generator (splitmix64): enough for a fault schedule, and the same on every
/// platform and build, which a crate's default generator does not promise.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A number in `lo..hi` (`lo` when the range is empty).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo)
    }

    /// Shuffles `items` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.range(0, i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// A fault the drill injects from outside the processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// `kill -9` of a worker, relay or supervisor; its replacement may be armed at a seam.
    Kill,
    /// SIGSTOP of a worker past its lease, then SIGCONT.
    Pause,
    /// RabbitMQ closes the drill's connections, or restarts.
    Broker,
    /// Postgres ends the drill's backends, or stops at once and starts again.
    Postgres,
    /// Malformed messages published beside the healthy ones.
    Poison,
    /// Delay on every byte to Postgres and RabbitMQ for a while, then every connection cut.
    Latency,
    /// SIGKILL of the Python step endpoint from outside (a drill of `pychain`), started again.
    PythonKill,
    /// A command of the user's (`--hook`), the nth given: a node of a cluster killed, a
    /// failover forced.
    Hook(u16),
}

impl Fault {
    /// Name in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kill => "kill",
            Self::Pause => "pause",
            Self::Broker => "broker",
            Self::Postgres => "postgres",
            Self::Poison => "poison",
            Self::Latency => "latency",
            Self::PythonKill => "python kill",
            Self::Hook(_) => "hook",
        }
    }
}

/// One planned fault: what, and at which share of the expected steps it fires.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Planned {
    /// The fault.
    pub fault: Fault,
    /// Fires once this share (0..1) of the expected steps has been committed.
    pub at: f64,
}

/// The faults of a drill, spread over 5%..85% of the work (so the last ones still meet work to
/// disturb), with the hooks at the shares they were given, oldest first.
pub fn plan(counts: &[(Fault, u32)], hooks: &[Hook], rng: &mut Rng) -> Vec<Planned> {
    let mut plan: Vec<Planned> = counts
        .iter()
        .flat_map(|&(fault, n)| (0..n).map(move |_| fault))
        .map(|fault| Planned {
            fault,
            at: 0.05 + 0.80 * rng.unit(),
        })
        .collect();
    plan.extend(hooks.iter().enumerate().map(|(i, h)| Planned {
        fault: Fault::Hook(i as u16),
        at: h.at,
    }));
    plan.sort_by(|a, b| a.at.total_cmp(&b.at));
    plan
}

/// A command the drill runs at a chosen share of the work, measured like its own faults: how a
/// team drills what only it can break (a cluster node, a database failover).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Hook {
    /// Share (0..1) of the expected steps committed when it runs.
    pub at: f64,
    /// Its name in the report.
    pub name: String,
    /// Run with `sh -c`; the drill waits for it and fails when it fails.
    pub command: String,
}

impl Hook {
    /// Reads `AT:NAME=COMMAND` (`0.3:leader-killed=scripts/cluster-drill kill leader`).
    pub fn parse(spec: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "--hook {spec:?} is not AT:NAME=COMMAND (for example 0.3:leader-killed='kill -9 1234'), AT a share of the work from 0 to 1"
            )
        };
        let (head, command) = spec.split_once('=').ok_or_else(bad)?;
        let (at, name) = head.split_once(':').ok_or_else(bad)?;
        let at: f64 = at.trim().parse().map_err(|_| bad())?;
        if !(0.0..=1.0).contains(&at) || name.trim().is_empty() || command.trim().is_empty() {
            return Err(bad());
        }
        Ok(Self {
            at,
            name: name.trim().to_owned(),
            command: command.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_seed_gives_one_plan_and_every_fault_is_in_it() {
        let counts = [(Fault::Kill, 5), (Fault::Pause, 2), (Fault::Poison, 3)];
        let a = plan(&counts, &[], &mut Rng::new(42));
        let b = plan(&counts, &[], &mut Rng::new(42));
        assert_eq!(a, b);
        assert_eq!(a.len(), 10);
        assert_eq!(a.iter().filter(|p| p.fault == Fault::Pause).count(), 2);
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(a.iter().all(|p| (0.05..0.85).contains(&p.at)));
        assert_ne!(a, plan(&counts, &[], &mut Rng::new(43)));
    }

    #[test]
    fn a_hook_is_read_from_its_spec_and_planned_at_its_share() {
        let hook = Hook::parse("0.9:leader=kill -9 $(cat pid) && echo a=b").unwrap();
        assert_eq!(hook.name, "leader");
        assert_eq!(hook.command, "kill -9 $(cat pid) && echo a=b");
        let p = plan(&[(Fault::Kill, 3)], &[hook], &mut Rng::new(1));
        assert_eq!(p.last().map(|p| p.fault), Some(Fault::Hook(0)));
        assert_eq!(p.last().map(|p| p.at), Some(0.9));
        for bad in [
            "kill",
            "0.3=kill",
            "1.5:x=kill",
            "0.3:=kill",
            "0.3:x=",
            "x:y=z",
        ] {
            assert!(Hook::parse(bad).is_err(), "{bad} was accepted");
        }
    }
}
