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
/// disturb), oldest first.
pub fn plan(counts: &[(Fault, u32)], rng: &mut Rng) -> Vec<Planned> {
    let mut plan: Vec<Planned> = counts
        .iter()
        .flat_map(|&(fault, n)| (0..n).map(move |_| fault))
        .map(|fault| Planned {
            fault,
            at: 0.05 + 0.80 * rng.unit(),
        })
        .collect();
    plan.sort_by(|a, b| a.at.total_cmp(&b.at));
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_seed_gives_one_plan_and_every_fault_is_in_it() {
        let counts = [(Fault::Kill, 5), (Fault::Pause, 2), (Fault::Poison, 3)];
        let a = plan(&counts, &mut Rng::new(42));
        let b = plan(&counts, &mut Rng::new(42));
        assert_eq!(a, b);
        assert_eq!(a.len(), 10);
        assert_eq!(a.iter().filter(|p| p.fault == Fault::Pause).count(), 2);
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(a.iter().all(|p| (0.05..0.85).contains(&p.at)));
        assert_ne!(a, plan(&counts, &mut Rng::new(43)));
    }
}
