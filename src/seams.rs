//! Drill seams: faults a drill switches on around `ctx.model` and `ctx.effect` of any workflow,
//! so that a team drills its real workflows without writing fault code, and the call log the
//! drill reads its counts from (`TRAILMARK_DRILL="seed=7;dir=/tmp/d;model_500=0.05"`).
//!
//! Each seam fires on the first attempt of a chosen position only: which positions is a pure
//! function of the seed, the seam and the run's position, so a replayed drill chooses the same
//! ones and the second attempt always gets through. Off (and free) unless configured.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use crate::domain::RunId;

/// The environment variable a drill sets on the processes it owns.
pub const ENV: &str = "TRAILMARK_DRILL";

/// A fault the engine injects at a seam of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seam {
    /// The model answers 500 on attempt 1 (a temporary error), and succeeds on attempt 2.
    Model500,
    /// The tool makes its write but answers after the client gave up: the outcome is unknown
    /// to the step, which is retried under the same key.
    LateTool,
    /// The step stops in `needs_review` on attempt 1; the drill resumes it.
    Review,
}

impl Seam {
    /// Every seam, in the order the settings name them.
    pub const ALL: [Seam; 3] = [Seam::Model500, Seam::LateTool, Seam::Review];

    /// The name in `TRAILMARK_DRILL` and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Model500 => "model_500",
            Self::LateTool => "late_tool",
            Self::Review => "review",
        }
    }

    /// The marker in the error a fired seam gives, which the drill looks for in handover notes.
    pub fn marker(self) -> String {
        format!("drill seam {}", self.name())
    }
}

/// The seams of one process: their rates, the seed, and where calls are logged.
#[derive(Debug, Default)]
pub struct Seams {
    seed: u64,
    rates: [f64; 3],
    log: Option<Mutex<File>>,
}

impl Seams {
    /// Reads [`ENV`]; `None` when it is unset (the normal case).
    pub fn from_env() -> Result<Option<Self>, String> {
        match std::env::var(ENV) {
            Ok(spec) => Self::parse(&spec).map(Some),
            Err(_) => Ok(None),
        }
    }

    /// Parses `seed=N;dir=PATH;model_500=R;late_tool=R;review=R` (rates from 0 to 1).
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut seams = Self::default();
        let mut dir = None;
        for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| format!("{ENV} part {part:?}: expected name=value"))?;
            match name {
                "seed" => {
                    seams.seed = value
                        .parse()
                        .map_err(|_| format!("{ENV}: seed {value:?} is not a number"))?
                }
                "dir" => dir = Some(PathBuf::from(value)),
                other => {
                    let seam = Seam::ALL
                        .into_iter()
                        .find(|s| s.name() == other)
                        .ok_or_else(|| {
                            format!(
                                "{ENV}: unknown seam {other:?} (seed, dir, model_500, late_tool, review)"
                            )
                        })?;
                    let rate: f64 = value
                        .parse()
                        .ok()
                        .filter(|r| (0.0..=1.0).contains(r))
                        .ok_or_else(|| {
                            format!("{ENV}: rate of {other} must be from 0 to 1, got {value:?}")
                        })?;
                    seams.rates[seam as usize] = rate;
                }
            }
        }
        if let Some(dir) = dir {
            let path = dir.join(format!("calls-{}.log", std::process::id()));
            let file = File::options()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|e| format!("{ENV}: cannot open the call log {}: {e}", path.display()))?;
            seams.log = Some(Mutex::new(file));
        }
        Ok(seams)
    }

    /// Whether `seam` fires at this position on this attempt.
    pub fn fires(&self, seam: Seam, run: &RunId, seq: i32, attempt: i32) -> bool {
        let rate = self.rates[seam as usize];
        attempt == 1 && rate > 0.0 && chosen(self.seed, seam, run.as_str(), seq) < rate
    }

    /// Appends one line to the call log. One `write` per line on an append-only file: a line is
    /// whole or absent after a `kill -9`, and what was written survives it (the page cache).
    pub fn log(&self, line: std::fmt::Arguments<'_>) {
        if let Some(file) = &self.log {
            let text = format!("{line}\n");
            let mut file = file.lock().expect("call log lock");
            if let Err(e) = file.write_all(text.as_bytes()) {
                tracing::warn!(error = %e, "drill call log write failed; the drill's counts will miss this call");
            }
        }
    }
}

/// A number in [0, 1) from the seed and the position (FNV-1a, then a splitmix64 finaliser):
/// stable across processes and builds, unlike the standard library's hasher.
pub fn chosen(seed: u64, seam: Seam, run: &str, seq: i32) -> f64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in run.bytes().chain(seq.to_le_bytes()).chain([seam as u8 + 1]) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    (h >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seam_fires_on_its_share_of_positions_and_only_on_attempt_one() {
        let seams = Seams::parse("seed=9;model_500=0.25").unwrap();
        let run = RunId::parse("r-1").unwrap();
        let fired = (0..4000)
            .filter(|&seq| seams.fires(Seam::Model500, &run, seq, 1))
            .count();
        assert!((800..1200).contains(&fired), "fired {fired} of 4000");
        assert!((0..4000).all(|seq| !seams.fires(Seam::Model500, &run, seq, 2)));
        assert!((0..4000).all(|seq| !seams.fires(Seam::Review, &run, seq, 1)));
    }

    #[test]
    fn bad_specs_name_the_part() {
        assert!(
            Seams::parse("model_500=2")
                .unwrap_err()
                .contains("model_500")
        );
        assert!(Seams::parse("explode=0.1").unwrap_err().contains("explode"));
        assert!(Seams::parse("seed=x").unwrap_err().contains("seed"));
    }
}
