//! Tracing setup: human-readable by default, JSON lines with `TRAILMARK_LOG_FORMAT=json`.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; `RUST_LOG` sets the filter (default `info`). Logs go to
/// stderr so that command output on stdout stays machine-readable.
pub fn init() {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,lapin=warn,sqlx=warn"));
    let json = std::env::var("TRAILMARK_LOG_FORMAT").is_ok_and(|f| f == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
