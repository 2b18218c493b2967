//! The archive: each removed run as one JSON file (the `trailmark run export` document) under
//! `retention.archive_dir/<YYYY-MM-DD>/` (the day it was removed), written to a temporary name,
//! fsynced, renamed and the directory fsynced, so a file that exists is whole.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::Error;

/// The file name of a run's archive: its id with every character outside `A-Z a-z 0-9 . _ -`
/// percent-encoded (a run id may hold `:` and `/`), then `.json`.
pub fn file_name(run_id: &str) -> String {
    let mut name = String::with_capacity(run_id.len() + 5);
    for b in run_id.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-' => name.push(b as char),
            _ => name.push_str(&format!("%{b:02X}")),
        }
    }
    name.push_str(".json");
    name
}

/// Writes each run's document; returns the path written per run id. The first failure stops
/// the batch (its runs stay in the database).
pub(super) async fn write(
    dir: &Path,
    docs: Vec<(String, Value)>,
) -> Result<HashMap<String, String>, Error> {
    let day = dir.join(chrono::Utc::now().format("%Y-%m-%d").to_string());
    tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&day).map_err(|e| failed(docs.first(), &day, e))?;
        let mut written = HashMap::with_capacity(docs.len());
        for (run_id, doc) in &docs {
            let path = day.join(file_name(run_id));
            write_one(&path, doc).map_err(|e| Error::Archive {
                run_id: run_id.clone(),
                path: path.display().to_string(),
                source: e,
            })?;
            written.insert(run_id.clone(), path.display().to_string());
        }
        std::fs::File::open(&day)
            .and_then(|d| d.sync_all())
            .map_err(|e| failed(docs.first(), &day, e))?;
        Ok(written)
    })
    .await
    .expect("the archive writer does not panic")
}

fn write_one(path: &PathBuf, doc: &Value) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let mut file = std::fs::File::create(&tmp)?;
    serde_json::to_writer_pretty(&mut file, doc)?;
    file.write_all(b"\n")?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

fn failed(first: Option<&(String, Value)>, dir: &Path, source: std::io::Error) -> Error {
    Error::Archive {
        run_id: first.map(|d| d.0.clone()).unwrap_or_default(),
        path: dir.display().to_string(),
        source,
    }
}
