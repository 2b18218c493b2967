//! What the bench reads from the machine: whole-machine CPU time (`/proc/stat`), one process's
//! CPU time (`/proc/PID/stat`) and peak RSS (`VmHWM` in `/proc/PID/status`), the fsync latency
//! of the disk Postgres writes to, and the summaries every figure is reported with.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use super::{Error, Result};

/// Busy CPU time of the whole machine (all cores), in milliseconds since boot: user, nice,
/// system, irq, softirq and steal; idle and iowait are not work.
pub fn machine_busy_ms() -> Result<f64> {
    let stat = read("/proc/stat")?;
    let line = stat
        .lines()
        .find(|l| l.starts_with("cpu "))
        .ok_or_else(|| Error::Failed("/proc/stat has no `cpu` line; is /proc mounted?".into()))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|t| t.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is already inside user).
    let busy: u64 = [0, 1, 2, 5, 6, 7]
        .iter()
        .map(|i| ticks.get(*i).copied().unwrap_or(0))
        .sum();
    Ok(ticks_to_ms(busy))
}

/// CPU time (user + system) a process has used so far, in milliseconds.
pub fn process_cpu_ms(pid: u32) -> Result<f64> {
    let stat = read(&format!("/proc/{pid}/stat"))?;
    // The command name may contain spaces and parentheses; fields resume after the last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(0) ... utime(11) stime(12).
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Ok(ticks_to_ms(field(11) + field(12)))
}

/// A process's peak resident set size so far (`VmHWM`), in KiB.
pub fn peak_rss_kib(pid: u32) -> Result<u64> {
    let status = read(&format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| Error::Failed(format!("/proc/{pid}/status has no VmHWM line")))
}

/// The pid of the local RabbitMQ node (`beam.smp`), if it runs on this machine.
pub fn broker_pid() -> Option<u32> {
    let entries = std::fs::read_dir("/proc").ok()?;
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "beam.smp")
        })
}

fn ticks_to_ms(ticks: u64) -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ticks as f64 * 1000.0 / if hz > 0 { hz as f64 } else { 100.0 }
}

fn read(path: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::io(format!("reading {path}"), e))
}

/// The fsync latency of one disk: absolute figures depend on it, so it is printed first.
#[derive(Debug, Clone, Serialize)]
pub struct FsyncProbe {
    /// Directory the probe file was written in.
    pub dir: String,
    /// Why that directory (same filesystem as the data directory, or a fallback).
    pub why: String,
    /// Writes timed, each 8 KiB (one WAL page) followed by `fdatasync`.
    pub samples: usize,
    /// Median write+fdatasync latency.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Slowest.
    pub max_ms: f64,
}

/// Times `samples` 8 KiB writes, each followed by `fdatasync` (Postgres' default
/// `wal_sync_method`), in a file on the same filesystem as `data_dir` when that is visible here.
pub fn probe_fsync(data_dir: Option<&str>, samples: usize) -> Result<FsyncProbe> {
    let (dir, why) = probe_dir(data_dir);
    let path = dir.join(format!(".trailmark-bench-fsync-{}", std::process::id()));
    let timed = time_syncs(&path, samples.max(1));
    let _ = std::fs::remove_file(&path);
    let mut lat = timed.map_err(|e| Error::io(format!("fsync probe in {}", dir.display()), e))?;
    lat.sort_by(f64::total_cmp);
    Ok(FsyncProbe {
        dir: dir.display().to_string(),
        why,
        samples: lat.len(),
        p50_ms: percentile(&lat, 0.5),
        p99_ms: percentile(&lat, 0.99),
        max_ms: lat.last().copied().unwrap_or(0.0),
    })
}

/// A writable directory on the data directory's filesystem, without writing inside the data
/// directory itself: its parent, else the temp dir if it shares the device.
fn probe_dir(data_dir: Option<&str>) -> (PathBuf, String) {
    let tmp = std::env::temp_dir();
    let Some(data) = data_dir.map(Path::new) else {
        return (
            tmp,
            "temp dir (Postgres did not tell its data directory)".into(),
        );
    };
    let Ok(dev) = std::fs::metadata(data).map(|m| m.dev()) else {
        let why = format!(
            "temp dir ({} is not visible from this process)",
            data.display()
        );
        return (tmp, why);
    };
    let same = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.dev() == dev)
            .unwrap_or(false)
    };
    let candidates = data
        .parent()
        .into_iter()
        .map(Path::to_path_buf)
        .chain([tmp.clone()]);
    for dir in candidates {
        if same(&dir) && writable(&dir) {
            let why = format!(
                "same filesystem as the Postgres data directory {}",
                data.display()
            );
            return (dir, why);
        }
    }
    let why = format!(
        "temp dir (no writable directory shares a filesystem with {})",
        data.display()
    );
    (tmp, why)
}

fn writable(dir: &Path) -> bool {
    let probe = dir.join(format!(".trailmark-bench-w-{}", std::process::id()));
    let ok = File::create(&probe).is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

fn time_syncs(path: &Path, samples: usize) -> std::io::Result<Vec<f64>> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(path)?;
    let page = vec![0x5a_u8; 8192];
    // Preallocate, so the timed writes measure the sync and not the file growing.
    file.set_len((page.len() * samples) as u64)?;
    file.sync_all()?;
    let mut lat = Vec::with_capacity(samples);
    for i in 0..samples {
        let started = Instant::now();
        file.write_at(&page, (i * page.len()) as u64)?;
        file.sync_data()?;
        lat.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(lat)
}

/// The `q` quantile (0..=1) of sorted values, nearest rank; 0 for no values.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Median and range of one figure over the repetitions.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Spread {
    /// Median over the repetitions.
    pub median: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

impl Spread {
    /// Summarises values (any order); all zero when there are none.
    pub fn of(values: &[f64]) -> Self {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        let Some((&min, &max)) = v.first().zip(v.last()) else {
            return Self::default();
        };
        let mid = v.len() / 2;
        let median = if v.len() % 2 == 1 {
            v[mid]
        } else {
            (v[mid - 1] + v[mid]) / 2.0
        };
        Self { median, min, max }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn spread_has_median_and_range() {
        let s = Spread::of(&[5.0, 1.0, 3.0, 9.0, 2.0]);
        assert_eq!((s.median, s.min, s.max), (3.0, 1.0, 9.0));
        assert_eq!(Spread::of(&[1.0, 3.0]).median, 2.0);
    }

    #[test]
    fn this_process_is_visible_in_proc() {
        let pid = std::process::id();
        assert!(peak_rss_kib(pid).unwrap() > 0);
        assert!(process_cpu_ms(pid).unwrap() >= 0.0);
        assert!(machine_busy_ms().unwrap() > 0.0);
    }
}
