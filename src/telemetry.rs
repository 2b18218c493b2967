//! Logging that can never stall or kill a worker: human-readable lines by default, JSON lines
//! with `TRAILMARK_LOG_FORMAT=json`, on stderr so that command output on stdout stays
//! machine-readable.
//!
//! A log line is handed to a bounded queue and written by a thread of its own. A step, the
//! signal handler or any task that logs never waits for the sink and never sees its failures:
//! when the queue is full (a slow sink) or a write fails (a closed pipe), the line is dropped and
//! counted ([`lines_lost`]). Colour codes are used only when stderr is a terminal.

use std::io::{IsTerminal, Write};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// Lines the queue holds before new ones are dropped.
const QUEUE_LINES: usize = 8192;

/// Lines queued, written, and lost (queue full, writer gone, or the write failed).
static QUEUED: AtomicU64 = AtomicU64::new(0);
static WRITTEN: AtomicU64 = AtomicU64::new(0);
static LOST: AtomicU64 = AtomicU64::new(0);

static QUEUE: OnceLock<SyncSender<Vec<u8>>> = OnceLock::new();

/// Installs the global subscriber; `RUST_LOG` sets the filter (default: run lifecycle at INFO,
/// per-step lines at DEBUG; the AMQP driver's own lines and the broker's certificate checker's
/// off, since trailmark logs every broker failure it meets once, where it handles it, saying
/// which certificate check failed). Safe to call more than once; later calls change nothing.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new("info,lapin=off,sqlx=warn,rustls_platform_verifier=off")
    });
    let json = std::env::var("TRAILMARK_LOG_FORMAT").is_ok_and(|f| f == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        // The subscriber would otherwise report a failed write with `eprintln!`, which panics
        // when stderr itself is what failed.
        .log_internal_errors(false)
        .with_writer(Queued);
    let installed = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    if installed.is_ok() {
        start_writer();
    }
}

/// Log lines dropped so far because the sink was too slow or failing.
pub fn lines_lost() -> u64 {
    LOST.load(Ordering::Relaxed)
}

/// Waits (at most `within`) until the lines queued so far are written or lost: for a process
/// about to exit, so that its last lines are not cut off.
pub fn flush(within: Duration) {
    let deadline = Instant::now() + within;
    let queued = QUEUED.load(Ordering::Relaxed);
    while WRITTEN.load(Ordering::Relaxed) + LOST.load(Ordering::Relaxed) < queued
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn start_writer() {
    let (tx, rx) = sync_channel(QUEUE_LINES);
    let spawned = std::thread::Builder::new()
        .name("trailmark-log".into())
        .spawn(move || write_lines(rx));
    if spawned.is_ok() {
        let _ = QUEUE.set(tx);
    }
}

/// The writer thread: writes each line to stderr, counting the ones that fail; it never panics.
fn write_lines(lines: Receiver<Vec<u8>>) {
    let mut stderr = std::io::stderr();
    for line in lines {
        match stderr.write_all(&line) {
            Ok(()) => WRITTEN.fetch_add(1, Ordering::Relaxed),
            Err(_) => LOST.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// The subscriber's writer: each event arrives in one `write` call and is queued whole.
struct Queued;

impl<'a> MakeWriter<'a> for Queued {
    type Writer = Queued;
    fn make_writer(&'a self) -> Self::Writer {
        Queued
    }
}

impl Write for Queued {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        QUEUED.fetch_add(1, Ordering::Relaxed);
        let sent = match QUEUE.get() {
            Some(tx) => tx.try_send(buf.to_vec()),
            None => Err(TrySendError::Disconnected(Vec::new())),
        };
        if sent.is_err() {
            LOST.fetch_add(1, Ordering::Relaxed);
        }
        // Always "written": a log sink's trouble is never the caller's.
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
