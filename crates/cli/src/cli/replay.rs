//! `trailmark replay-check FILE...` and `trailmark run export ID --history`: recorded run
//! histories, and their replay against the workflows of this binary before it is deployed.
//! The replay itself is `trailmark::replay`; this file reads files and prints.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;

use trailmark::config::Settings;
use trailmark::failpoint::Failpoints;
use trailmark::replay::{self, ExportError, History, Report};
use trailmark::store;
use trailmark::workflow::Registry;

/// `replay-check` options.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// History files (`trailmark run export ID --history`), or directories whose `*.json`
    /// files are histories (searched below them too).
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// Print JSON: one entry per file, with its report or why it could not be read.
    #[arg(long)]
    pub json: bool,
}

/// One file's outcome.
#[derive(Serialize)]
struct Checked {
    file: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    report: Option<Report>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl Checked {
    fn ok(&self) -> bool {
        self.report.as_ref().is_some_and(Report::is_ok)
    }
}

/// Replays every history named (needs no database and no broker); fails when one differs or
/// cannot be read.
pub async fn check(args: ReplayArgs) -> anyhow::Result<()> {
    let mut registry = trailmark_reference::registry_from_env().map_err(anyhow::Error::msg)?;
    remote(&mut registry).await?;
    // Failpoints, as `serve` reads them: a test stands for a changed build with them.
    let failpoints = Failpoints::from_env().map_err(anyhow::Error::msg)?;
    let files = history_files(&args.files)?;
    let mut all = Vec::with_capacity(files.len());
    for file in &files {
        let checked = check_one(&registry, &failpoints, file).await;
        if !args.json {
            print!("{}", said(&checked));
        }
        all.push(checked);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&all)?);
    }
    let failed = all.iter().filter(|c| !c.ok()).count();
    if failed > 0 {
        anyhow::bail!(
            "{failed} of {} histories do not replay on the workflows of this binary: a run in flight on them would take another path or call outside systems otherwise after the deploy. Keep the old code path (a new workflow version, or `ctx.patched`) until no such run is in flight",
            all.len()
        );
    }
    Ok(())
}

/// With `remote.endpoints` set, the endpoints' workflows are replayed too: their steps are
/// called as a worker calls them, and their callbacks served from the history.
async fn remote(registry: &mut Registry) -> anyhow::Result<()> {
    let mut settings = Settings::load()?;
    if settings.remote.endpoints.is_empty() {
        return Ok(());
    }
    trailmark::remote::register(&settings, registry, false).await?;
    // A listener of its own on this machine: the configured callback address is a worker's.
    settings.remote.callback_listen = "127.0.0.1:0".into();
    settings.remote.callback_url = String::new();
    trailmark::remote::listen(&settings.remote).await?;
    Ok(())
}

async fn check_one(registry: &Registry, failpoints: &Failpoints, file: &Path) -> Checked {
    let name = file.display().to_string();
    let read = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot be read: {e}"))
        .and_then(|text| History::parse(&text).map_err(|e| e.to_string()));
    let outcome = match read {
        Ok(history) => replay::check_with(registry, &history, failpoints.clone())
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e),
    };
    match outcome {
        Ok(report) => Checked {
            file: name,
            report: Some(report),
            error: None,
        },
        Err(error) => Checked {
            file: name,
            report: None,
            error: Some(error),
        },
    }
}

/// One file's outcome, for a person: `ok`, or each difference on a line of its own.
fn said(c: &Checked) -> String {
    let Some(r) = &c.report else {
        return format!(
            "{}: {}\n",
            c.file,
            c.error.as_deref().unwrap_or("unreadable")
        );
    };
    let head = format!(
        "{}: run {} ({} v{})",
        c.file, r.run_id, r.workflow, r.version
    );
    let mut out = if r.is_ok() {
        format!(
            "{head}: ok, {} of {} positions replayed\n",
            r.replayed, r.positions
        )
    } else {
        format!("{head}: {} differences\n", r.differences.len())
    };
    for d in &r.differences {
        out.push_str(&format!("  {d}\n"));
    }
    for n in &r.notes {
        out.push_str(&format!(
            "  note: position {} {}: {}\n",
            n.seq, n.step, n.what
        ));
    }
    out
}

/// The files named, with each directory's `*.json` files below it, sorted.
fn history_files(named: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in named {
        if path.is_dir() {
            let before = files.len();
            json_below(path, &mut files)
                .with_context(|| format!("reading directory {}", path.display()))?;
            files[before..].sort();
            if files.len() == before {
                anyhow::bail!("{} holds no *.json history files", path.display());
            }
        } else {
            files.push(path.clone());
        }
    }
    Ok(files)
}

fn json_below(dir: &Path, found: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            json_below(&path, found)?;
        } else if path.extension().is_some_and(|e| e == "json") {
            found.push(path);
        }
    }
    Ok(())
}

/// `run export ID --history`: the run's history (`trailmark.history/1`), on stdout or in
/// `output`.
pub async fn export(
    settings: &Settings,
    run_id: &str,
    output: Option<&Path>,
) -> anyhow::Result<()> {
    let pool = store::connect(&settings.database).await?;
    let history = match replay::export(&pool, run_id).await {
        Ok(history) => history,
        Err(ExportError::NotFound { .. }) => {
            anyhow::bail!("{}", super::run::not_found(settings, run_id).await)
        }
        Err(e) => return Err(e.into()),
    };
    write_json(&serde_json::to_value(&history)?, output)
}

/// Writes `doc` pretty-printed to `output` (through a temporary file renamed into place, so a
/// file that exists is whole), or to stdout.
pub fn write_json(doc: &serde_json::Value, output: Option<&Path>) -> anyhow::Result<()> {
    let text = format!("{}\n", serde_json::to_string_pretty(doc)?);
    let Some(path) = output else {
        print!("{text}");
        return Ok(());
    };
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .with_context(|| format!("writing {}", path.display()))
}
